"""The state of one generation while it runs: the committed tokens of the live rows, each row's
output so far, and the settings and limits of the call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SamplingConfig
from ..grammar.masks import GrammarState
from ..models import CausalLM, Padding
from ..sampling import Warper
from ..select.rows import RowRates
from .penalties import Adjuster
from .results import GenerationResult, GenerationStats, TokenLogprob


@dataclass
class Row:
    """One prompt's output so far."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    streamed: int = 0  # characters of ``text`` already streamed
    finish: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked


@dataclass
class Generation:
    """A generation in progress (the engine runs one at a time)."""

    tokens: torch.Tensor  # (live rows, L) committed tokens, right-aligned (left padded)
    padding: Padding
    live: list[int]  # batch index of each live row
    rows: list[Row]
    prompt_length: int  # width of the prompt matrix the generation started from
    max_new_tokens: list[int]  # per batch row
    limit: int | None
    eos: frozenset[int]
    stops: list[tuple[str, ...]]  # per batch row
    decode: Callable[[list[int]], str] | None
    live_text: bool  # decode every round (streaming, stop strings) rather than once at the end
    generator: torch.Generator | None
    sampling: SamplingConfig
    warper: Warper
    drafted_by: set[int] = field(default_factory=set)  # drafters that have run this generation
    cancelled: set[int] = field(default_factory=set)  # batch rows; filled by TokenStream.cancel
    stats: GenerationStats = field(default_factory=GenerationStats)
    pad_id: int = 0  # filler of padding columns (masked; any id would do)
    shiftable: bool = False  # every cache can move rows along the columns (set by the engine)
    ragged: bool = False  # rows commit their own counts (shiftable and config.batching)
    joining: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, prompt ids)
    finished: bool = False  # the round loop has ended
    seeded: bool = False  # a seed fixes the random draws (the call's or the config's)
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    grammar: GrammarState | None = None  # the rows' grammar matchers (structured output)
    adjusters: list[Adjuster] = field(default_factory=list)  # this round's logit changes
    row_rates: RowRates = field(default_factory=RowRates)  # per-row acceptance (draft caps)


def generation_result(gen: Generation, target: CausalLM) -> GenerationResult:
    """What ``gen`` returns once its rounds have ended (the target's replay counters too)."""
    gen.stats.replays = target.replays
    gen.stats.replayed_tokens = target.replayed_tokens
    gen.stats.time_replay = target.replay_seconds
    width = max((len(row.tokens) for row in gen.rows), default=0)
    output = torch.full((len(gen.rows), width), -1, dtype=torch.int64)
    for i, row in enumerate(gen.rows):
        if row.tokens:
            output[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.int64)
    texts = None
    if gen.decode is not None:
        if not gen.live_text:
            for row in gen.rows:
                row.text = gen.decode(row.tokens)
        texts = [row.text for row in gen.rows]
    return GenerationResult(
        output_ids=output,
        tokens=[list(row.tokens) for row in gen.rows],
        texts=texts,
        finish_reasons=[row.finish or "length" for row in gen.rows],
        stats=gen.stats,
        logprobs=None if gen.logprobs is None else [list(row.logprobs) for row in gen.rows],
    )
