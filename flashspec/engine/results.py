"""What a generation returns: its counters and timings, its result, and the stream of
chunks a streaming caller reads as rounds commit."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from .._validate import is_int

if TYPE_CHECKING:
    from ..config import SamplingConfig
    from .generation import Generation


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    ``drafted``/``accepted`` count draft tokens over all rows; ``accepted`` counts drafts that
    were emitted. ``replays``/``replayed_tokens``/``time_replay``: a target with recurrent
    state restores its state and feeds the committed tokens again after a round that rejected
    a draft (``time_replay`` is part of ``time_other``). ``time_compile``: seconds of the
    generation spent compiling on the compiled path (first calls of a shape, inside the draft
    and verify times; 0 once warm). Times are wall-clock seconds spent
    inside rounds (on a GPU, without explicit synchronisation, asynchronous work is billed to
    the step that waits for it).
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    row_rounds: int = 0
    emitted: int = 0
    time_total: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    replays: int = 0
    replayed_tokens: int = 0
    time_replay: float = 0.0
    time_compile: float = 0.0
    arm_rounds: dict[str, int] = field(default_factory=dict)

    def count_round(self, arm: str, rows: int, drafted: int, emitted: int, accepted: int) -> None:
        """Count a round of ``arm`` over ``rows`` rows: ``drafted`` drafts per row, ``emitted``
        tokens committed over all rows (before stopping), ``accepted`` drafts accepted over all
        rows."""
        self.rounds += 1
        self.row_rounds += rows
        self.drafted += drafted * rows
        self.accepted += accepted
        self.emitted += emitted
        self.arm_rounds[arm] = self.arm_rounds.get(arm, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens emitted per row per round (1 means no speculation gain)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens (all rows, after stopping) per second of generation."""
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def time_other(self) -> float:
        """Time in rounds outside draft, verify and accept: commit, stopping, decoding."""
        return max(0.0, self.time_total - self.time_draft - self.time_verify - self.time_accept)

    def as_dict(self) -> dict[str, float]:
        """All counters, derived rates and times as a flat dict."""
        data: dict[str, float] = {
            k: float(v) for k, v in asdict(self).items() if not isinstance(v, dict)
        }
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_tokens_per_round=self.mean_tokens_per_round,
            tokens_per_second=self.tokens_per_second,
            time_other=self.time_other,
        )
        return data

    def __str__(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.rounds} rounds "
            f"({self.mean_tokens_per_round:.2f}/round), "
            f"acceptance {self.acceptance_rate:.1%}, {self.tokens_per_second:.1f} tok/s; "
            f"time draft {self.time_draft:.3f}s verify {self.time_verify:.3f}s "
            f"accept {self.time_accept:.3f}s other {self.time_other:.3f}s"
        )


@dataclass
class GenerationResult:
    """Output of ``SpeculativeEngine.generate``.

    Attributes:
        output_ids: (B, T) int64 new tokens per row (prompt excluded), -1 after a row's end.
        tokens: the same as lists, without the -1 filler.
        texts: decoded new text per row (None without a tokenizer). A row stopped by a stop
            string ends right after it.
        finish_reasons: per row: "eos", "stop", "length" (max_new_tokens), "context_limit" or
            "cancelled" (``TokenStream.cancel``).
        stats: counters and timings.
        logprobs: per row, one ``TokenLogprob`` per token of ``tokens`` (None unless
            ``generate(..., logprobs=k)``).
    """

    output_ids: torch.Tensor
    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: GenerationStats
    logprobs: list[list[TokenLogprob]] | None = None

    @property
    def text(self) -> str:
        """The decoded new text of a single-row generation (use ``texts`` for batches)."""
        if self.texts is None:
            raise ValueError(
                "no text: the engine has no tokenizer; pass tokenizer= to TargetModel "
                "or read output_ids"
            )
        if len(self.texts) != 1:
            raise ValueError(
                f"this result has {len(self.texts)} rows; use .texts for batched generations"
            )
        return self.texts[0]


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token, and of its most likely alternatives.

    Taken from the raw logits of the forward that verified the token: log-softmax before any
    penalty, bias, temperature, top-k or top-p (what OpenAI-compatible servers report).

    Attributes:
        token: the emitted token id.
        logprob: its natural-log probability.
        top: the ``k`` most likely tokens at that position, (id, logprob), most likely first
            (empty unless ``logprobs=k`` with k > 0).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StreamChunk:
    """New output of one row in one round.

    Attributes:
        row: index of the row in the batch.
        token_ids: tokens committed this round (after stopping).
        text: new text since the previous chunk of this row (empty without a tokenizer). Text
            ending in an incomplete character is held back until it completes.
        finish_reason: set on the row's last chunk.
        logprobs: one per token of ``token_ids`` when the generation asked for them.
    """

    row: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


JoinRow = Callable[
    [str | Sequence[int], int, "str | Sequence[str] | None", "SamplingConfig | None", "int | None"],
    int,
]
"""The engine's ``TokenStream.join``: prompt, max_new_tokens, stop, sampling, seed -> row."""


class TokenStream:
    """Iterator over ``StreamChunk`` as rounds commit; ``result`` is set once it is exhausted."""

    def __init__(
        self,
        rounds: Generator[list[StreamChunk], None, GenerationResult],
        generation: Generation,
        join: JoinRow | None = None,
    ) -> None:
        self._rounds = rounds
        self._generation = generation
        self._join = join
        self.result: GenerationResult | None = None

    @property
    def joinable(self) -> bool:
        """Whether rows can join this generation (``join``): its models can move rows along
        the columns (not sliding-window or recurrent ones) and it has not ended."""
        gen = self._generation
        return self._join is not None and not gen.finished and gen.shiftable

    def join(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        *,
        stop: str | Sequence[str] | None = None,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
    ) -> int:
        """Add a prompt to the running generation (continuous batching): it is read into the
        caches before the next round and then advances with the others. Call it from the
        thread that iterates the stream, between chunks.

        Args:
            prompt: a string or a list of token ids.
            max_new_tokens: new tokens at most (>= 1).
            stop: stop string(s) of this row.
            sampling: this row's settings; they may differ from the running rows' in
                temperature, top_k, top_p and seed only (None: the generation's first row's).
            seed: this row's own seed (default ``sampling.seed``; neither: it draws from the
                generation's shared generator).

        Returns:
            the row's index (``StreamChunk.row``, the result's row).

        Raises:
            RuntimeError: the models cannot take rows into a running batch, or the generation
                has ended. TypeError / ValueError: a bad argument, named.
        """
        if self._join is None:
            raise RuntimeError("this stream takes no new rows")
        return self._join(prompt, max_new_tokens, stop, sampling, seed)

    def _decode_at_end(self) -> None:
        # For generate(): nobody reads the text before the end unless a stop string needs it.
        self._generation.live_text = any(self._generation.stops)

    def cancel(self, row: int) -> None:
        """Stop generating for ``row`` (e.g. its client went away).

        May be called from another thread than the one iterating: the row leaves the batch
        before the next round, which frees its share of the work, and its last chunk has
        finish reason ``"cancelled"``. Cancelling a finished row does nothing.
        """
        if not is_int(row):
            raise TypeError(f"row must be an int, got {type(row).__name__}")
        self._generation.cancelled.add(row)

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while True:
                yield from next(self._rounds)
        except StopIteration as done:
            self.result = done.value

    def text(self) -> Iterator[str]:
        """Only the text deltas (for single-row streaming)."""
        for chunk in self:
            if chunk.text:
                yield chunk.text
