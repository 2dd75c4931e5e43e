"""The engine worker of ``flashspec serve``: one thread that owns the engine and batches requests.

Batching is continuous by default: jobs that arrive while a batch runs join it between rounds
(``TokenStream.join``). ``batching="static"``, and models whose caches cannot take rows into a
running batch, keep static batching: such jobs wait for the next batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from .logprobs import TokenInfo, describe, token_info
from .metrics import Metrics

if TYPE_CHECKING:
    from ..config import SamplingConfig
    from ..engine import SpeculativeEngine, TokenStream
    from ..grammar import Grammar

logger = logging.getLogger("flashspec.server")

Batching = Literal["continuous", "static"]
BATCHING_MODES: tuple[Batching, ...] = get_args(Batching)
# How long running jobs may go on once the server's shutdown begins (``drain`` to ``end``).
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0

# Rows one continuous stream takes in its lifetime, per ``max_batch`` row. The engine keeps
# every finished row's output until its stream ends, and reports the stream's draft counters
# only then, so a stream fed forever would grow without bound and leave the acceptance metrics
# stale. Past this many rows it takes no more joins, drains, and the next batch starts afresh.
STREAM_ROWS_PER_SLOT = 64

# An engine runs one generation at a time and is not thread-safe, so exactly one thread touches it.
# HTTP handlers (on the event loop) turn each prompt into a ``Job`` and ``submit`` it to a bounded
# queue; the worker takes the oldest waiting job plus up to ``max_batch - 1`` more of the same
# group (``Job.group``: the settings a stream's rows share; each row brings its own temperature,
# top-p, top-k and seed), runs them as one ``engine.stream``, and hands every ``StreamChunk`` to
# its job's ``deliver`` callback (which the server points at the request's asyncio queue).
#
# Continuous batching: after every chunk, while the stream has fewer than ``max_batch`` live
# rows, waiting jobs of the stream's group join it (the engine reads them in before its next
# round). Only the queue's head may join, so a job of another group at the head stops the
# joining: the stream drains, ends, and that job starts the next one. A job therefore never
# waits behind a younger one it cannot share a stream with, and no group starves another.
# Rows that finish, or whose request was cancelled (client gone, timeout), leave before the
# engine's next round (``TokenStream.cancel``).
#
# A join reads the new rows' prompts in forwards of their own (the target's and each
# drafter's) and copies the batch's caches to take them in: costs one row pays about as much
# as several (docs/server-api.md). So while more jobs wait than the stream has room for (the
# stream stays full either way), they join in groups of at least ``join_group`` rows rather
# than one a round as rows finish; when every waiting job fits, they join at once.
JOIN_GROUP_SHARE = 4
"""``join_group``'s default: a quarter of ``max_batch`` (at least 1)."""


@dataclass(frozen=True)
class Event:
    """What the worker tells a job: new output, its end, or a failure.

    Attributes:
        text: new text since the previous event (may be empty).
        tokens: how many tokens this event adds.
        finish_reason: the engine's reason on the job's last event ("eos", "stop", "length",
            "context_limit", "cancelled"); None before.
        error: set (with no other content) when the generation failed on the server's side.
    """

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenInfo] | None = None  # the event's tokens', when the job asked
    echo: bool = False  # the job's prompt (text, and its tokens' logprobs), sent first

    @property
    def last(self) -> bool:
        """True on the job's final event."""
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Job:
    """One prompt to generate for, as the worker sees it.

    Attributes:
        prompt_ids: the prompt's token ids (already checked against vocabulary and context).
        max_tokens: new tokens at most.
        stop: stop strings (the engine keeps them in its output; the server trims them).
        sampling: per-call ``SamplingConfig`` for ``engine.stream``; None: the engine's own.
        seed: the row's own seed (its draws then come from a generator of its own).
        group: batch compatibility key; jobs batch together only when their groups are equal.
        deliver: called from the worker thread with each ``Event``; must be thread-safe and
            must not block.
        cancel_reason: set by ``EngineWorker.cancel``; the worker drops the job's row.
        logprobs: report each token's logprob and this many alternatives (None: none).
        grammar: the structure the output must follow (None: free text).
        echo: the prompt's text, sent as the job's first event (with ``logprobs``, with its
            tokens' logprobs: the first token's none), before any generated text; None: no
            echo.
    """

    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingConfig | None
    seed: int | None
    group: Hashable
    deliver: Callable[[Event], None]
    cancel_reason: str | None = None
    queued: bool = field(default=False, repr=False)
    logprobs: int | None = None
    grammar: Grammar | None = None
    echo: str | None = None


def seeded_rows_mix(engine: SpeculativeEngine) -> bool:
    """Whether a seeded row's output is the same beside any rows of ``engine``'s streams: rows
    that commit their own counts (ragged batches; ``flashspec.engine.row_sampling``). In
    lockstep the batch advances by its shortest row, so a row's output follows its neighbours.
    """
    config = getattr(engine, "config", None)
    return bool(getattr(engine, "shiftable", False)) and getattr(config, "batching", "") == "ragged"


class QueueFull(Exception):
    """``EngineWorker.submit`` found no room for the jobs."""


class ShuttingDown(Exception):
    """``EngineWorker.submit`` takes no more jobs: the server is shutting down."""


class EngineWorker:
    """The thread that owns the engine (see the module docstring).

    Args:
        engine: a ``SpeculativeEngine``; nothing else may use it while the worker runs.
        max_batch: rows per engine batch at most (live rows at once, joined ones included).
        max_queue: jobs waiting for the engine at most; ``submit`` refuses beyond it.
        metrics: where queue depth, batch sizes, tokens and cancellations are counted.
        batching: ``"continuous"``: waiting jobs join the running batch between rounds;
            ``"static"``: they wait for the next batch.
        join_group: while more jobs wait than a continuous stream has room for, they join
            once at least this many fit (default ``max(1, max_batch // 4)``; 1 joins each
            one as soon as a row is free).
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        *,
        max_batch: int,
        max_queue: int,
        metrics: Metrics,
        batching: Batching = "continuous",
        join_group: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if join_group is None:
            join_group = max(1, max_batch // JOIN_GROUP_SHARE)
        if not 1 <= join_group <= max_batch:
            raise ValueError(f"join_group must be in 1..max_batch ({max_batch}), got {join_group}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if batching not in BATCHING_MODES:
            raise ValueError(
                f"batching must be one of {', '.join(map(repr, BATCHING_MODES))}, got {batching!r}"
            )
        self.engine = engine
        self._tokenizer = getattr(engine, "tokenizer", None)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self.batching: Batching = batching
        self.join_group = join_group
        self._pending: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        # Draining: no new jobs, the queued ones ended; running rows go on (shutdown's grace).
        self._draining = False
        # Stopping: running rows end too, and the thread exits.
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_run_s = 1.0

    # -- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="flashspec-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Take no more jobs and end the queued ones (``cancelled``); running rows go on.

        The first step of a graceful shutdown: ``end`` or ``stop`` follows.
        """
        with self._wake:
            self._draining = True
            dropped = self._take_pending()
        self._end_dropped(dropped)

    def end(self) -> None:
        """Cancel every job: queued ones now, running rows before the engine's next round; the
        thread exits once its batch has. Returns at once (``stop`` waits)."""
        with self._wake:
            self._draining = self._stopping = True
            dropped = self._take_pending()
            self._wake.notify_all()
        self._end_dropped(dropped)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job, finish the thread, and wait for it at most ``timeout`` seconds."""
        self.end()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The worker thread is running and takes jobs."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and not self._draining
        )

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs`` (all or none: one request's prompts are never split by a full queue).

        Raises:
            ShuttingDown: the worker takes no more jobs (``drain``, ``end``).
            QueueFull: fewer than ``len(jobs)`` places are free.
        """
        with self._wake:
            if self._draining or self._stopping:
                raise ShuttingDown
            if len(self._pending) + len(jobs) > self.max_queue:
                raise QueueFull
            for job in jobs:
                job.queued = True
                self._pending.append(job)
            self._set_depth()
            self._wake.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Stop generating for ``job``: drop it from the queue, or its row from the batch.

        Safe to call more than once and after the job finished (then it does nothing).
        """
        with self._wake:
            if job.cancel_reason is not None:
                return
            job.cancel_reason = reason
            if job.queued:
                job.queued = False
                self._pending.remove(job)
                self._set_depth()
                self._count_cancel(reason, "queued")
        # A running job's row is dropped by the worker before the engine's next round.

    def retry_after_s(self) -> int:
        """A Retry-After estimate for a refused request: about how long the last generation
        ran (a place in the queue frees as running rows finish)."""
        return max(1, min(60, math.ceil(self._last_run_s)))

    # -- the worker thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            except Exception:
                logger.exception("engine batch failed")

    def _next_batch(self) -> list[Job] | None:
        """Wait for work; take the oldest job and compatible ones after it (None: stopping)."""
        with self._wake:
            while not self._pending and not self._stopping:
                self._wake.wait()
            if self._stopping:
                return None
            head = self._pending.popleft()
            batch = [head]
            rest: list[Job] = []
            # Models that cannot batch rows of different lengths take equal-length prompts only.
            same_length = self.engine.padded_batches is not None
            for job in self._pending:
                fits = not same_length or len(job.prompt_ids) == len(head.prompt_ids)
                if len(batch) < self.max_batch and job.group == head.group and fits:
                    batch.append(job)
                else:
                    rest.append(job)
            self._pending = collections.deque(rest)
            for job in batch:
                job.queued = False
            self._set_depth()
        return batch

    def _run_batch(self, batch: list[Job]) -> None:
        from ..engine.logprobs import MAX_TOP  # (the parser imports this module without torch)

        metrics = self.metrics
        metrics.observe("batch_size", len(batch))
        metrics.set("running_rows", len(batch))
        head = batch[0]
        for job in batch:
            self._echo(job)
        try:
            stream = self.engine.stream(
                [job.prompt_ids for job in batch],
                max_new_tokens=[job.max_tokens for job in batch],
                stop=[list(job.stop) or None for job in batch],
                seed=[job.seed for job in batch],
                sampling=[job.sampling for job in batch],
                # Every job of the stream reports logprobs or none does (Job.group); each
                # keeps its own number of alternatives of the most any may ask for.
                logprobs=None if head.logprobs is None else MAX_TOP,
                grammar=head.grammar,
            )
        except Exception as exc:
            logger.exception("engine.stream refused a batch")
            for job in batch:
                job.deliver(Event(error=f"generation failed: {exc}"))
            metrics.set("running_rows", 0)
            return
        run = _Run(stream, head.group, batch)
        # Decided once, before the first round: a stream of models that cannot take rows in
        # (sliding-window, recurrent) runs as a static batch. So does a seeded one where seeded
        # rows do not mix (lockstep): its group is its request's alone, and whether the
        # request's later prompts joined would depend on other requests' timing.
        mixes = head.seed is None or seeded_rows_mix(self.engine)
        if self.batching == "continuous" and mixes and stream.joinable:
            run.joins_left = max(0, self.max_batch * STREAM_ROWS_PER_SLOT - len(batch))
        try:
            self._drop_cancelled(run)  # cancelled between leaving the queue and now
            for chunk in stream:
                owner = run.live.get(chunk.row)
                if owner is None:
                    continue
                metrics.inc("generated_tokens_total", len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    del run.live[chunk.row]
                    started = run.started.pop(chunk.row)
                    metrics.set("running_rows", len(run.live))
                    if chunk.finish_reason == "cancelled":
                        self._count_cancel(owner.cancel_reason or "shutdown", "running")
                    else:
                        self._last_run_s = time.perf_counter() - started
                infos = None
                if chunk.logprobs is not None and owner.logprobs is not None:
                    top = owner.logprobs
                    entries = [dataclasses.replace(e, top=e.top[:top]) for e in chunk.logprobs]
                    infos = describe(self._tokenizer, entries)
                owner.deliver(
                    Event(chunk.text, len(chunk.token_ids), chunk.finish_reason, logprobs=infos)
                )
                self._drop_cancelled(run)
                if run.joins_left > 0:
                    self._join_waiting(run)
        except Exception as exc:
            logger.exception("engine batch failed while streaming")
            for job in run.live.values():
                job.deliver(Event(error=f"generation failed: {exc}"))
            run.live.clear()
        finally:
            metrics.set("running_rows", 0)
            result = getattr(stream, "result", None)
            if result is not None:
                metrics.inc("draft_tokens_total", result.stats.drafted)
                metrics.inc("accepted_draft_tokens_total", result.stats.accepted)
                drafted = metrics.value("draft_tokens_total")
                accepted = metrics.value("accepted_draft_tokens_total")
                metrics.set("acceptance_rate", accepted / drafted if drafted else 0.0)
        if run.live:
            # The engine promises every row a final chunk; without one the request would hang
            # until its timeout, so fail it now.
            logger.error("the engine's stream ended without finishing rows %s", sorted(run.live))
            for job in run.live.values():
                job.deliver(Event(error="generation failed: the engine dropped this row"))

    def _echo(self, job: Job) -> None:
        """Send an echoing job its prompt first (computing its tokens' logprobs if asked)."""
        if job.echo is None:
            return
        infos = None
        if job.logprobs is not None and job.prompt_ids:
            entries = self.engine.prompt_logprobs(job.prompt_ids, job.logprobs)
            first = token_info(self._tokenizer, job.prompt_ids[0])
            infos = [first, *describe(self._tokenizer, entries)]
        job.deliver(Event(job.echo, 0, logprobs=infos, echo=True))
        job.echo = None  # once, also if the job is requeued

    def _drop_cancelled(self, run: _Run) -> None:
        for row, job in run.live.items():
            if row not in run.requested and (job.cancel_reason or self._stopping):
                run.requested.add(row)
                run.stream.cancel(row)

    def _join_waiting(self, run: _Run) -> None:
        """Move waiting jobs of the stream's group from the queue's head into the stream."""
        room = min(self.max_batch - len(run.live), run.joins_left)
        # Unlocked peek, as this runs after every chunk: a job submitted just after it waits for
        # the next chunk, which is still before the next round.
        if room <= 0 or not self._pending:
            return
        if len(self._pending) > room and room < min(self.join_group, run.joins_left):
            return  # saturated: wait until a group's worth of rows is free
        if not run.stream.joinable:  # the generation ended between chunks
            run.joins_left = 0
            return
        with self._wake:
            if self._stopping:
                return
            taken: list[Job] = []
            while self._pending and len(taken) < room and self._pending[0].group == run.group:
                job = self._pending.popleft()
                job.queued = False
                taken.append(job)
            if not taken:
                return
            self._set_depth()
        now = time.perf_counter()
        joined = 0
        for position, job in enumerate(taken):
            self._echo(job)
            try:
                row = run.stream.join(
                    job.prompt_ids,
                    job.max_tokens,
                    stop=list(job.stop) or None,
                    sampling=job.sampling or self.engine.config.sampling,
                    seed=job.seed,
                )
            except RuntimeError:
                # joinable said yes, so this is the engine's fault; the jobs lose nothing:
                # they go back to the queue's head and start the next stream.
                logger.warning("the engine refused a join; the stream takes no more rows")
                run.joins_left = 0
                self._requeue(taken[position:])
                break
            except Exception as exc:
                # The service checked the job, so the engine disagrees about this one only
                # (TypeError / ValueError): fail it, not the stream.
                logger.exception("the engine refused a job's row")
                job.deliver(Event(error=f"generation failed: {exc}"))
                continue
            run.live[row] = job
            run.started[row] = now
            run.joins_left -= 1
            joined += 1
        if joined:
            self.metrics.observe("batch_size", joined)
            self.metrics.set("running_rows", len(run.live))
        # Cancelled while moving from the queue to the stream: its row leaves at once.
        self._drop_cancelled(run)

    def _requeue(self, jobs: list[Job]) -> None:
        """Put jobs taken for a join back at the queue's head, in their order.

        They were in the queue a moment ago, so they go back even past ``max_queue``; during
        a shutdown they end instead, as the queue's other jobs did.
        """
        ended: list[Job] = []
        with self._wake:
            for job in reversed(jobs):
                if job.cancel_reason is not None:
                    self._count_cancel(job.cancel_reason, "queued")
                elif self._draining or self._stopping:
                    ended.append(job)
                else:
                    job.queued = True
                    self._pending.appendleft(job)
            self._set_depth()
            self._wake.notify()
        self._end_dropped(ended[::-1])

    # -- helpers ---------------------------------------------------------------------------

    def _take_pending(self) -> list[Job]:
        """Empty the queue (holding ``_wake``); the jobs it held."""
        dropped = list(self._pending)
        self._pending.clear()
        for job in dropped:
            job.queued = False
        self._set_depth()
        return dropped

    def _end_dropped(self, dropped: list[Job]) -> None:
        """Tell jobs taken from the queue by a shutdown that they end (outside ``_wake``)."""
        for job in dropped:
            self._count_cancel("shutdown", "queued")
            job.deliver(Event(finish_reason="cancelled"))

    def _set_depth(self) -> None:
        self.metrics.set("queue_depth", len(self._pending))

    def _count_cancel(self, reason: str, stage: str) -> None:
        self.metrics.inc("cancelled_total", reason=reason, stage=stage)


class _Run:
    """The stream the worker is reading and the jobs in it.

    Attributes:
        live: the job of each row that has not had its final chunk, by row index.
        started: when each live row entered the stream (``time.perf_counter``).
        requested: rows whose cancellation the engine has been asked for.
        joins_left: rows this stream may still take in (0: a static batch).
    """

    def __init__(self, stream: TokenStream, group: Hashable, batch: list[Job]) -> None:
        self.stream = stream
        self.group = group
        now = time.perf_counter()
        self.live: dict[int, Job] = dict(enumerate(batch))
        self.started: dict[int, float] = dict.fromkeys(self.live, now)
        self.requested: set[int] = set()
        self.joins_left = 0
