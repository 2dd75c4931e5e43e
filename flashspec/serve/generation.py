"""One request's generations on the engine worker: from a prepared request to its choices.

The worker's events fold into per-prompt ``Choice`` state; timeout, error or departure end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import AsyncGenerator, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

from ..grammar import Grammar
from .logprobs import TokenInfo
from .protocol import ApiError
from .service import shutting_down
from .stops import StopTrimmer as StopTrimmer
from .worker import Event, Job, QueueFull, ShuttingDown

if TYPE_CHECKING:
    from ..config import SamplingConfig
    from .service import Service

# How often a non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context_limit": "length"}


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of a request's ``index``-th generation (prompt by prompt, choice by choice):
    the request's own for the first, a hash of both for the others. Each row draws from a
    generator of its own, so one seed for all would make a prompt's ``n`` choices equal."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # within torch.Generator.manual_seed's range


@dataclass
class Prepared:
    """A request reduced to what the worker needs."""

    prompts: list[list[int]]
    stops: list[tuple[str, ...]]
    max_tokens: list[int]
    sampling: SamplingConfig
    seed: int | None
    group: Hashable
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's j-th
    best_of: int | None = None  # candidates per prompt (None: n), the best n returned
    echoes: list[str] | None = None  # per prompt, its text to put before each choice's
    logprobs: int | None = None  # report logprobs with this many alternatives
    grammar: Grammar | None = None  # the structure every choice's text must follow

    def __post_init__(self) -> None:
        # A batch's rows share one grammar, and whether they report logprobs (a stream that
        # does computes the most alternatives any request may ask, and each job keeps its own).
        self.group = (self.group, self.job_logprobs is not None, self.grammar)

    @property
    def candidates(self) -> int:
        """Generations per prompt: ``best_of``, or ``n``."""
        return max(self.best_of or self.n, self.n)

    @property
    def job_logprobs(self) -> int | None:
        """The logprobs the jobs compute: those asked for, or at least each token's own when
        candidates are ranked by them (``best_of`` above ``n``)."""
        if self.candidates > self.n and self.logprobs is None:
            return 0
        return self.logprobs


@dataclass
class Choice:
    """Per-prompt state of one request."""

    job: Job
    trimmer: StopTrimmer
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    done: bool = False
    logprobs: list[TokenInfo] | None = None  # one per token, when the request asked
    echoed: int = 0  # the prompt's entries at the front of logprobs (echo)


@dataclass(frozen=True)
class Delta:
    """New text of one choice, as a stream sends it (``finish_reason`` set on its last)."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenInfo] | None = None  # the tokens' since the last delta, if asked


class Generation:
    """A prepared request's jobs, queued on the worker as soon as this is built.

    Raises:
        ApiError: 503 with Retry-After when the worker's queue is full.
    """

    def __init__(self, service: Service, prepared: Prepared, endpoint: str, arrived: float) -> None:
        self.service = service
        self.prepared = prepared
        self.endpoint = endpoint
        self.arrived = arrived
        self.deadline = arrived + service.timeout_s
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def deliverer(index: int) -> Callable[[Event], None]:
            def deliver(event: Event) -> None:
                # From the worker thread: hand over to the loop that owns the queue.
                with contextlib.suppress(RuntimeError):  # the loop closed: server shutdown
                    loop.call_soon_threadsafe(self.events.put_nowait, (index, event))

            return deliver

        per_prompt = prepared.candidates
        self.choices = [
            Choice(
                job=Job(
                    prompt_ids=ids,
                    max_tokens=max_tokens,
                    stop=stops,
                    sampling=prepared.sampling,
                    seed=choice_seed(prepared.seed, i),
                    group=prepared.group,
                    deliver=deliverer(i),
                    logprobs=prepared.job_logprobs,
                    grammar=prepared.grammar,
                    echo=None if prepared.echoes is None else prepared.echoes[i // per_prompt],
                ),
                trimmer=StopTrimmer(stops),
                logprobs=None if prepared.job_logprobs is None else [],
            )
            for i, (ids, stops, max_tokens) in enumerate(
                (ids, stops, max_tokens)
                for ids, stops, max_tokens in zip(
                    prepared.prompts, prepared.stops, prepared.max_tokens, strict=True
                )
                for _ in range(prepared.candidates)
            )
        ]
        worker = service.worker
        try:
            worker.submit([choice.job for choice in self.choices])
        except ShuttingDown:
            raise shutting_down() from None
        except QueueFull:
            retry = worker.retry_after_s()
            raise ApiError(
                503,
                f"the server is busy: {worker.max_queue} generations are already waiting; "
                f"retry in about {retry} s",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            ) from None
        service.metrics.inc("prompt_tokens_total", sum(len(ids) for ids in prepared.prompts))

    def answered(self) -> list[Choice]:
        """The choices the response shows: per prompt, with ``best_of`` above ``n``, the n
        candidates of the highest mean token logprob (the earlier first on a tie), in their
        order; without, every choice. Logprobs only where the request asked for them."""
        prepared = self.prepared
        per_prompt = prepared.candidates
        if per_prompt == prepared.n:
            return list(self.choices)
        shown: list[Choice] = []
        for start in range(0, len(self.choices), per_prompt):
            group = self.choices[start : start + per_prompt]
            ranked = sorted(range(len(group)), key=lambda i: (-_mean_logprob(group[i]), i))
            for i in sorted(ranked[: prepared.n]):
                choice = group[i]
                if prepared.logprobs is None:
                    choice = dataclasses.replace(choice, logprobs=None)
                shown.append(choice)
        return shown

    @property
    def done(self) -> bool:
        """Whether every choice has finished."""
        return all(choice.done for choice in self.choices)

    def cancel(self, reason: str) -> None:
        """Cancel the jobs of the choices that have not finished."""
        for choice in self.choices:
            if not choice.done:
                self.service.worker.cancel(choice.job, reason)

    def usage(self) -> dict[str, int]:
        """OpenAI's usage object (a prompt counts once whatever its ``n``)."""
        prompt = sum(len(ids) for ids in self.prepared.prompts)
        completion = sum(choice.tokens for choice in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def timeout_error(self) -> ApiError:
        """504 for a request that ran past the server's ``timeout_s``."""
        return ApiError(
            504,
            "the generation did not finish within the server's timeout of "
            f"{self.service.timeout_s:g} s (queueing included); lower max_tokens or retry later",
            type="timeout_error",
            code="timeout",
        )

    def observe_first_token(self) -> None:
        """Record the time from the request's arrival to its first text."""
        self.service.metrics.observe(
            "time_to_first_token_seconds", time.perf_counter() - self.arrived
        )

    def observe_latency(self) -> None:
        """Record the time from the request's arrival to its end."""
        self.service.metrics.observe(
            "request_latency_seconds", time.perf_counter() - self.arrived, endpoint=self.endpoint
        )

    @staticmethod
    def apply(choice: Choice, event: Event) -> str:
        """Fold an event into its choice; return the text to send (stop strings trimmed)."""
        if event.error is not None:
            choice.done = True
            raise ApiError(500, event.error, type="server_error", code="generation_failed")
        if event.finish_reason == "cancelled":
            # Not by this request (it would have stopped listening): the server is stopping.
            choice.done = True
            raise shutting_down()
        if event.echo:
            # The prompt itself: never a stop string's match, never trimmed.
            choice.text += event.text
            if choice.logprobs is not None and event.logprobs:
                choice.logprobs += event.logprobs
                choice.echoed += len(event.logprobs)
            return event.text
        text = choice.trimmer.feed(event.text, event.finish_reason)
        choice.text += text
        choice.tokens += event.tokens
        if choice.logprobs is not None and event.logprobs:
            choice.logprobs += event.logprobs
        if event.finish_reason is not None:
            choice.done = True
            choice.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
        return text

    async def complete(self, request: Request) -> bool:
        """Run every choice to its end; False if the client left first (nobody to answer).

        Raises:
            ApiError: 504 past the timeout; 500/503 for a failed generation.
        """
        reason = "disconnect"
        first = True
        next_poll = time.perf_counter() + DISCONNECT_POLL_S
        try:
            while not self.done:
                now = time.perf_counter()
                if now >= self.deadline:
                    reason = "timeout"
                    raise self.timeout_error()
                if now >= next_poll:
                    # Events may arrive every round, so poll on a clock, not on idle time.
                    next_poll = now + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return False
                try:
                    index, event = await asyncio.wait_for(
                        self.events.get(), timeout=min(self.deadline, next_poll) - now
                    )
                except TimeoutError:
                    continue
                if first and event.text:
                    first = False
                    self.observe_first_token()
                try:
                    self.apply(self.choices[index], event)
                except ApiError:
                    reason = "error"
                    raise
        finally:
            self.cancel(reason)
        self.observe_latency()
        return True

    async def deltas(self) -> AsyncGenerator[Delta | ApiError, None]:
        """The choices' new text as it comes, until all finish; an error ends it.

        Closing this early (the client left) cancels the jobs that are still running.
        """
        reason = "disconnect"
        first = True
        try:
            while not self.done:
                left = self.deadline - time.perf_counter()
                if left <= 0:
                    reason = "timeout"
                    yield self.timeout_error()
                    return
                try:
                    index, event = await asyncio.wait_for(self.events.get(), timeout=left)
                except TimeoutError:
                    continue
                choice = self.choices[index]
                try:
                    text = self.apply(choice, event)
                except ApiError as exc:
                    reason = "error"
                    yield exc
                    return
                if first and text:
                    first = False
                    self.observe_first_token()
                if text or choice.done or event.logprobs:
                    yield Delta(index, text, choice.finish_reason, event.logprobs)
        finally:
            # Runs when the client disconnects too: Starlette cancels the stream reading this.
            self.cancel(reason)


def _mean_logprob(choice: Choice) -> float:
    """A candidate's mean token logprob (-inf without tokens), how ``best_of`` ranks them."""
    values = [info.logprob for info in (choice.logprobs or [])[choice.echoed :]]
    numbers = [v for v in values if v is not None]
    return sum(numbers) / len(numbers) if numbers else -math.inf
