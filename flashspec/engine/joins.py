"""Rows entering and leaving a running generation's batch: a row joining (``TokenStream.join``)
is checked and queued, then admitted into every cache before the next round; rows with the same
prompt read it once; finished and cancelled rows are dropped; the caches start empty."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .._validate import is_int
from ..config import SamplingConfig
from ..kv import layout
from ..models import Padding
from .generation import Generation, Row
from .inputs import Stop, per_row_stops, tokenize
from .row_sampling import check_bias_ids, join_sampling

if TYPE_CHECKING:
    from .loop import SpeculativeEngine


def join(
    engine: SpeculativeEngine,
    gen: Generation,
    prompt: str | Sequence[int],
    max_new_tokens: int,
    stop: Stop,
    sampling: SamplingConfig | None = None,
    seed: int | None = None,
) -> int:
    """``TokenStream.join``: check the row and queue it for the next round, with its own
    sampling settings (``row_sampling.join_sampling``)."""
    if not engine.shiftable:
        raise RuntimeError(
            f"rows cannot join a running generation of {engine.target.name!r}: a cache of "
            "its target or drafters cannot move rows along the columns (sliding-window or "
            "recurrent layers, attention windowed otherwise, or rows that cannot be padded); "
            "start a new generation for the prompt instead"
        )
    if gen.finished:
        raise RuntimeError("the generation has ended; start a new one for this prompt")
    if isinstance(prompt, str):
        ids = tokenize(engine.target, [prompt], None)
    elif isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
        ids = tokenize(engine.target, [[int(t) for t in prompt]], None)
    else:
        raise TypeError(
            f"join takes one prompt: a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not is_int(max_new_tokens, minimum=1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stops = per_row_stops(stop, 1)
    if stops[0] and gen.decode is None:
        raise ValueError("stop strings need a tokenizer; pass tokenizer= to TargetModel")
    row = ids[0]
    if gen.limit is not None and len(row) >= gen.limit:
        raise ValueError(
            f"the prompt has {len(row)} tokens but the target's context limit is "
            f"{gen.limit}, leaving no room to generate; shorten the prompt"
        )
    settings = join_sampling(gen, sampling, seed)
    check_bias_ids([settings], engine.target.vocab_size)
    index = len(gen.rows)
    if gen.grammar is not None:
        gen.grammar.add_rows([index])  # the generation's grammar binds every row
    gen.rows.append(Row())
    gen.max_new_tokens.append(max_new_tokens)
    gen.stops.extend(stops)
    gen.row_sampling.append(settings)
    gen.joining.append((index, list(row)))
    return index


def admit(engine: SpeculativeEngine, gen: Generation) -> None:
    """Rows that joined since the last round (``TokenStream.join``) enter the batch: their
    prompts are read into every cache, as far as each holds the rows already running."""
    joining, gen.joining = gen.joining, []
    width = gen.tokens.shape[1]
    longest = max(len(ids) for _, ids in joining)
    total = max(width, longest)
    pad = total - width
    rows = [[gen.pad_id] * (total - len(ids)) + ids for _, ids in joining]
    device = gen.tokens.device
    tokens = torch.tensor(rows, dtype=torch.int64, device=device)
    padding = Padding(torch.tensor([total - len(ids) for _, ids in joining], device=device))
    if not gen.live:
        # Nothing running: the caches start again from the joining rows' prompts.
        gen.tokens, gen.padding = tokens, padding
        gen.live = [index for index, _ in joining]
        reset(engine, gen)
        gen.drafted_by.clear()
        return
    else:
        engine.target.add_rows(tokens, padding)
        for drafter in engine.drafters:
            drafter.add_rows(tokens, padding)
        filler = gen.tokens.new_full((gen.tokens.shape[0], pad), gen.pad_id)
        gen.tokens = torch.cat([torch.cat([filler, gen.tokens], dim=1), tokens])
        gen.padding = Padding.stack([gen.padding.shifted([pad] * len(gen.live)), padding])
    gen.live = [*gen.live, *(index for index, _ in joining)]


def share_prompts(engine: SpeculativeEngine, gen: Generation) -> None:
    """Rows with the same prompt (``n`` choices, ``best_of`` candidates of one prompt)
    read it once: the target reads each distinct prompt but its last token, then every
    row takes its prompt's cache (and hidden states) by row selection. The rounds then
    run as if each row had read its own, so the output is the same; only the repeated
    prefill is saved. Ragged layouts only (the selection is one of rows, not of state)."""
    rows = len(gen.live)
    if rows < 2 or not gen.shiftable or engine.compiled.on or engine.target.cached:
        return
    width = gen.tokens.shape[1]
    lefts = gen.padding.lefts
    if max(lefts) > width - 2:
        return  # a one-token prompt: nothing to read before its last token
    keys = [tuple(row[left:]) for row, left in zip(gen.tokens.tolist(), lefts, strict=True)]
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(key, len(first)) for key in keys]
    if len(first) == rows:
        return
    device = gen.tokens.device
    chosen = torch.tensor([keys.index(key) for key in first], device=device)
    tokens = gen.tokens.index_select(0, chosen)[:, :-1]
    empty = tokens.new_empty((tokens.shape[0], 0))
    engine.target.verify(tokens, empty, gen.padding.select(chosen))
    engine.target.select_rows(torch.tensor(inverse, device=device))


def reset(engine: SpeculativeEngine, gen: Generation) -> None:
    """Empty every cache for ``gen``; on the compiled path, a batch takes a static cache of
    fixed slots (``flashspec.kv.slots``) with room for its longest row, one more
    verification and, with several rows, the dead columns a ragged layout keeps until it
    packs them (``COMPACT_COLUMNS``)."""
    columns = gen.tokens.shape[1] + max(gen.max_new_tokens, default=0) + 1
    rows = len(gen.live)
    if engine.compiled.on:
        columns += max(engine.config.bandit.gammas or [engine.config.sampling.gamma]) + 1
        if rows > 1:
            columns += layout.COMPACT_COLUMNS
    engine.target.reset()
    engine.target.reserve(rows, columns)
    for drafter in engine.drafters:
        drafter.reset()
        if drafter.lm is not None:
            drafter.lm.reserve(rows, columns)


def drop_rows(engine: SpeculativeEngine, gen: Generation, keep: list[int]) -> None:
    """Only the rows at positions ``keep`` of ``gen.live`` go on (tokens, padding, caches)."""
    gen.live = [gen.live[i] for i in keep]
    if not keep:
        return
    index = torch.tensor(keep, dtype=torch.int64, device=gen.tokens.device)
    gen.tokens = gen.tokens.index_select(0, index)
    gen.padding = gen.padding.select(index)
    engine.target.select_rows(index)
    for drafter in engine.drafters:
        drafter.select_rows(index)
