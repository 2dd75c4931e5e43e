"""A round's commit step: the emitted tokens appended to the token matrix, every cache cut to the
rows' valid prefixes, and the columns that are padding in every row cut away."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .generation import Generation

if TYPE_CHECKING:
    from .loop import SpeculativeEngine

COMPACT_COLUMNS = 16
"""Leading columns of the token matrix that are padding in every row, at which they are cut.
Rows that fall behind in a ragged batch gain left padding, and so do the rest when a longer row
finishes."""


def append(
    tokens: torch.Tensor,
    drafts: torch.Tensor,
    token: torch.Tensor,
    counts: list[int],
    shifts: list[int],
) -> torch.Tensor:
    """The committed token matrix after a round: row b gains its first ``counts[b]`` drafts and
    ``token[b]`` and moves ``shifts[b]`` columns right, so that every row ends in the last column
    (the columns it moved over are padding; they repeat its first token)."""
    width = tokens.shape[1]
    if drafts.shape[1] == 0:  # a plain round: one token a row, no row moves
        return torch.cat([tokens, token.unsqueeze(1)], dim=1)
    device = tokens.device
    both = torch.cat([tokens, drafts, token.unsqueeze(1)], dim=1)
    ends = torch.tensor(counts, device=device).unsqueeze(1) + width
    both.scatter_(1, ends, token.unsqueeze(1))  # each row's token right after its drafts
    if not any(shifts):
        return both[:, : width + counts[0] + 1]
    columns = torch.arange(width + max(counts) + 1, device=device).unsqueeze(0)
    source = (columns - torch.tensor(shifts, device=device).unsqueeze(1)).clamp_min(0)
    return both.gather(1, source)


def commit(engine: SpeculativeEngine, gen: Generation) -> None:
    """Every cache keeps the committed tokens but the newest (which none has read yet)."""
    engine.target.commit(gen.tokens, gen.padding)
    lengths = [gen.tokens.shape[1] - 1 - left for left in gen.padding.lefts]
    for drafter in engine.drafters:
        drafter.keep(lengths, gen.padding)


def compact(gen: Generation) -> None:
    """Cut the token matrix's leading columns that are padding in every row once there are
    enough (the caches of ragged batches keep their own layout, ``flashspec.kv.layout``)."""
    count = gen.padding.min_left
    if gen.shiftable and count >= COMPACT_COLUMNS and gen.live:
        gen.tokens = gen.tokens[:, count:]
        gen.padding = gen.padding.dropped(count)
