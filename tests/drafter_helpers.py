"""A drafter for tests of per-row draft lengths (``Proposal.lengths``)."""

from __future__ import annotations

import torch

from flashspec.drafters import DraftContext, Drafter, PromptLookupDrafter, Proposal


class CutLookup(Drafter):
    """Prompt lookup with each row's proposal cut to ``(row + round) % (gamma + 1)`` drafts
    (at most what lookup found); the filler after a row's length is ``filler`` (default: the
    row's last token)."""

    name = "cut_lookup"

    def __init__(self, filler: int | None = None) -> None:
        self.inner = PromptLookupDrafter()
        self.filler = filler
        self.round = 0
        self.lengths: list[list[int]] = []

    def reset(self) -> None:
        self.round = 0

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        full = self.inner.propose(ctx, gamma)
        rows, g = full.tokens.shape
        found = full.lengths or [g] * rows
        lengths = [min(n, (row + self.round) % (gamma + 1)) for row, n in enumerate(found)]
        self.round += 1
        if g == 0:
            return full
        self.lengths.append(lengths)
        columns = torch.arange(g).unsqueeze(0)
        filler = (
            ctx.tokens[:, -1:]
            if self.filler is None
            else ctx.tokens.new_full((rows, 1), self.filler)
        )
        filler = filler.expand(-1, g)
        tokens = torch.where(columns < torch.tensor(lengths).unsqueeze(1), full.tokens, filler)
        return Proposal(tokens, lengths=lengths)
