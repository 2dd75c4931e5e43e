"""The state of one generation while it runs: the committed tokens of the live rows, each row's
output so far, and the settings and limits of the call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SamplingConfig
from ..grammar.masks import GrammarState
from ..models import Padding
from ..sampling import Warper
from ..select.rows import RowRates
from .penalties import Adjuster
from .results import GenerationStats, TokenLogprob


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
