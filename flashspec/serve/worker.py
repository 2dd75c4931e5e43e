"""The engine worker of ``flashspec serve``: one thread that owns the engine and batches requests.

Batching is static: jobs that arrive while a batch runs wait for the next one.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .metrics import Metrics

if TYPE_CHECKING:
    from ..config import SamplingConfig
    from ..engine import SpeculativeEngine

logger = logging.getLogger("flashspec.server")

# An engine runs one generation at a time and is not thread-safe, so exactly one thread touches it.
# HTTP handlers (on the event loop) turn each prompt into a ``Job`` and ``submit`` it to a bounded
# queue; the worker takes the oldest waiting job plus up to ``max_batch - 1`` more with the same
# sampling settings (``Job.group``: one ``SamplingConfig`` serves a whole batch), runs them as one
# ``engine.stream`` batch, and hands every ``StreamChunk`` to its job's ``deliver`` callback (which
# the server points at the request's asyncio queue).
#
# There is no continuous batching. Rows that finish, or whose request was cancelled (client gone,
# timeout), leave the running batch before its next round (``TokenStream.cancel``), so the batch
# only shrinks.


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
        seed: seed for the batch's generator (only jobs of one group share a batch).
        group: batch compatibility key; jobs batch together only when their groups are equal.
        deliver: called from the worker thread with each ``Event``; must be thread-safe and
            must not block.
        cancel_reason: set by ``EngineWorker.cancel``; the worker drops the job's row.
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


class QueueFull(Exception):
    """``EngineWorker.submit`` found no room for the jobs."""


class EngineWorker:
    """The thread that owns the engine (see the module docstring).

    Args:
        engine: a ``SpeculativeEngine``; nothing else may use it while the worker runs.
        max_batch: rows per engine batch at most.
        max_queue: jobs waiting for the engine at most; ``submit`` refuses beyond it.
        metrics: where queue depth, batch sizes, tokens and cancellations are counted.
    """

    def __init__(
        self, engine: SpeculativeEngine, *, max_batch: int, max_queue: int, metrics: Metrics
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        self._pending: collections.deque[Job] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_batch_s = 1.0

    # -- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="flashspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job, finish the thread, and wait for it at most ``timeout`` seconds."""
        with self._wake:
            self._stopping = True
            dropped = list(self._pending)
            self._pending.clear()
            for job in dropped:
                job.queued = False
            self._set_depth()
            self._wake.notify_all()
        for job in dropped:
            self._count_cancel("shutdown", "queued")
            job.deliver(Event(finish_reason="cancelled"))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The worker thread is running."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue ``jobs`` (all or none: one request's prompts are never split by a full queue).

        Raises:
            QueueFull: fewer than ``len(jobs)`` places are free, or the worker is stopping.
        """
        with self._wake:
            if self._stopping or len(self._pending) + len(jobs) > self.max_queue:
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
        """A Retry-After estimate for a refused request: about one batch's duration."""
        return max(1, min(60, math.ceil(self._last_batch_s)))

    # -- the worker thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            started = time.perf_counter()
            try:
                self._run_batch(batch)
            except Exception:
                logger.exception("engine batch failed")
            self._last_batch_s = time.perf_counter() - started

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
            for job in self._pending:
                if len(batch) < self.max_batch and job.group == head.group:
                    batch.append(job)
                else:
                    rest.append(job)
            self._pending = collections.deque(rest)
            for job in batch:
                job.queued = False
            self._set_depth()
        return batch

    def _run_batch(self, batch: list[Job]) -> None:
        metrics = self.metrics
        metrics.observe("batch_size", len(batch))
        metrics.set("running_rows", len(batch))
        head = batch[0]
        try:
            stream = self.engine.stream(
                [job.prompt_ids for job in batch],
                max_new_tokens=[job.max_tokens for job in batch],
                stop=[list(job.stop) or None for job in batch],
                seed=head.seed,
                sampling=head.sampling,
            )
        except Exception as exc:
            logger.exception("engine.stream refused a batch")
            for job in batch:
                job.deliver(Event(error=f"generation failed: {exc}"))
            metrics.set("running_rows", 0)
            return
        live = dict(enumerate(batch))
        requested: set[int] = set()

        def drop_cancelled() -> None:
            for row, job in live.items():
                if row not in requested and (job.cancel_reason or self._stopping):
                    requested.add(row)
                    stream.cancel(row)

        generated = 0
        try:
            drop_cancelled()  # cancelled between leaving the queue and now
            for chunk in stream:
                owner = live.get(chunk.row)
                if owner is None:
                    continue
                generated += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    del live[chunk.row]
                    metrics.set("running_rows", len(live))
                    if chunk.finish_reason == "cancelled":
                        self._count_cancel(owner.cancel_reason or "shutdown", "running")
                owner.deliver(Event(chunk.text, len(chunk.token_ids), chunk.finish_reason))
                drop_cancelled()
        except Exception as exc:
            logger.exception("engine batch failed while streaming")
            for job in live.values():
                job.deliver(Event(error=f"generation failed: {exc}"))
        finally:
            metrics.set("running_rows", 0)
            metrics.inc("generated_tokens_total", generated)
            result = getattr(stream, "result", None)
            if result is not None:
                metrics.inc("draft_tokens_total", result.stats.drafted)
                metrics.inc("accepted_draft_tokens_total", result.stats.accepted)
                drafted = metrics.value("draft_tokens_total")
                accepted = metrics.value("accepted_draft_tokens_total")
                metrics.set("acceptance_rate", accepted / drafted if drafted else 0.0)

    # -- helpers ---------------------------------------------------------------------------

    def _set_depth(self) -> None:
        self.metrics.set("queue_depth", len(self._pending))

    def _count_cancel(self, reason: str, stage: str) -> None:
        self.metrics.inc("cancelled_total", reason=reason, stage=stage)
