"""The state of one generation while it runs: the committed tokens of the live rows, each row's
output so far, and the settings and limits of the call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import SamplingConfig
from ..grammar.masks import GrammarState
from ..models import CausalLM, Padding
from ..row_random import RowRandom
from ..sampling import RowWarper, Warper
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


@dataclass(frozen=True)
class RowSampling:
    """One row's own sampling settings (``generate(sampling=[...])``, ``TokenStream.join``).

    Attributes:
        temperature, top_k, top_p: as in ``SamplingConfig``; temperature 0 decodes greedily.
        generator: the row's own random source (a seed of its own); None: it draws from the
            generation's shared one.
        seeded: a seed fixes the row's draws (its own, or the call's shared one).
        penalties: the row's penalties and logit bias (its ``SamplingConfig``, whose
            ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and
            ``logit_bias`` apply to it alone); None: none.
    """

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None = None
    seeded: bool = False
    penalties: SamplingConfig | None = None

    @property
    def warp(self) -> tuple[float, int, float]:
        return self.temperature, self.top_k, self.top_p


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
    generator: torch.Generator | None  # what rows without a generator of their own draw from
    sampling: SamplingConfig  # the settings every row shares (all but ``RowSampling``'s)
    warper: Warper  # this round's: ``round_warper()`` of the live rows
    row_sampling: list[RowSampling]  # per batch row
    drafted_by: set[int] = field(default_factory=set)  # drafters that have run this generation
    cancelled: set[int] = field(default_factory=set)  # batch rows; filled by TokenStream.cancel
    stats: GenerationStats = field(default_factory=GenerationStats)
    pad_id: int = 0  # filler of padding columns (masked; any id would do)
    shiftable: bool = False  # every cache can move rows along the columns (set by the engine)
    ragged: bool = False  # rows commit their own counts (shiftable and config.batching)
    joining: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, prompt ids)
    finished: bool = False  # the round loop has ended
    typical: bool | None = None  # sampling rows accept typically (lossy); None: none samples
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    grammar: GrammarState | None = None  # the rows' grammar matchers (structured output)
    adjusters: list[Adjuster] = field(default_factory=list)  # this round's logit changes
    row_rates: RowRates = field(default_factory=RowRates)  # per-row acceptance (draft caps)
    warpers: dict[tuple[float, int, float], Warper] = field(default_factory=dict)  # by setting

    def _live_sampling(self) -> list[RowSampling]:
        return [self.row_sampling[i] for i in self.live]

    def round_warper(self) -> Warper:
        """The live rows' warp: one ``Warper`` when they share their settings (the one
        batch-wide warp of a plain batch), else a ``RowWarper`` with each row's."""
        rows = self._live_sampling()
        first = rows[0].warp
        if all(row.warp == first for row in rows):
            warper = self.warpers.get(first)
            if warper is None:
                warper = self.warpers[first] = Warper(*first)
            return warper
        return RowWarper(
            temperatures=tuple(row.temperature for row in rows),
            top_ks=tuple(row.top_k for row in rows),
            top_ps=tuple(row.top_p for row in rows),
        )

    def random(self, caps: list[int] | None = None) -> torch.Generator | RowRandom | None:
        """The live rows' random source: the shared generator when none has its own, else
        each row's (``RowRandom``; ``caps``: the rows' draft lengths this round)."""
        rows = self._live_sampling()
        if all(row.generator is None for row in rows):
            return self.generator
        return RowRandom(
            [row.generator or self.generator for row in rows],
            [row.generator is not None for row in rows],
            caps,
        )

    def row_generator(self, position: int) -> torch.Generator | None:
        """What live row ``position`` draws from."""
        return self.row_sampling[self.live[position]].generator or self.generator

    def seeded_sampling(self) -> bool:
        """Whether a seed fixes the draws of a live row that samples (``BanditConfig.seeded``
        then keeps the first arm: a policy's choices follow measured times, and with them
        which draws a round takes)."""
        return any(row.seeded and row.temperature > 0 for row in self._live_sampling())

    def own_seeded(self) -> list[bool]:
        """Per live row: it samples from a seeded generator of its own."""
        return [
            row.seeded and row.temperature > 0 and row.generator is not None
            for row in self._live_sampling()
        ]


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
