"""``EngineReplica``: one Ray Serve replica, holding an engine, its worker and the flashspec app.

The ingress hands it whole requests (``Forwarded``); it runs each through the same FastAPI app
``flashspec serve`` runs in one process, in-process (``call_app``), and streams the answer back.
So every check, error shape, batch and stream behaves as in the single-process server, and the
answers carry ``x-flashspec-replica``. Every ``REPORT_EVERY_S`` it reports its health and
metrics to the board the ingress reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from .board import REPORT_EVERY_S, Board, Report
from .forward import Forwarded, Head, Lifespan, call_app
from .settings import ClusterSettings

logger = logging.getLogger("flashspec.cluster")

BOARD_NAMESPACE = "flashspec"


def board_name(app_name: str) -> str:
    """The named actor holding the board of application ``app_name``."""
    return f"flashspec-board-{app_name}"


def board_actor(app_name: str) -> Any:
    """The board's actor, created by whoever asks first (detached: it outlives any replica)."""
    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(Board)
    return actor_class.options(
        name=board_name(app_name),
        namespace=BOARD_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
    ).remote()


class EngineReplica:
    """A replica: the engine ``settings.engine`` describes, served by the flashspec app."""

    # Ray actors may have an async constructor; mypy wants __init__ to return None.
    async def __init__(self, settings: ClusterSettings) -> None:  # type: ignore[misc]
        import torch

        from ..serve.app import create_app

        torch.set_num_threads(settings.threads)
        self.replica: str = serve.get_replica_context().replica_tag
        self.settings = settings
        engine = settings.engine.build(long_lived=True)
        if engine.compiled.on:
            seconds = await asyncio.to_thread(engine.warm_up, settings.max_batch, freeze=True)
            logger.info("replica %s compiled its steps in %.0f s", self.replica, seconds)
        self.app = create_app(
            engine,
            model_name=settings.model_name,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue,
            timeout_s=settings.timeout_s,
            api_key=settings.api_key,
            batching=settings.batching,  # type: ignore[arg-type]  # checked by ClusterSettings
        )
        self.service = self.app.state.service
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        self.board = board_actor(settings.app_name)
        self.reporter = asyncio.ensure_future(self._report_forever())

    def report(self) -> Report:
        """This replica's health and metrics now."""
        return Report(self.replica, bool(self.service.worker.alive), self.service.metrics.render())

    async def _report_forever(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.report())
            except Exception as exc:  # the board restarts (max_restarts); keep serving
                logger.warning("replica %s could not report: %r", self.replica, exc)
            await asyncio.sleep(REPORT_EVERY_S)

    async def handle(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        """Answer ``request``: its ``Head``, then its body in pieces (a streaming call)."""
        async with contextlib.aclosing(call_app(self.app, request, self.replica)) as parts:
            async for part in parts:
                yield part

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine worker died is replaced.

        Raises:
            RuntimeError: the worker thread is not running.
        """
        if not self.service.worker.alive:
            raise RuntimeError(f"replica {self.replica}: the engine worker is not running")

    async def __del__(self) -> None:
        self.reporter.cancel()
        with contextlib.suppress(Exception):
            await self.board.drop.remote(self.replica)
        with contextlib.suppress(Exception):
            await self.lifespan.shutdown()
