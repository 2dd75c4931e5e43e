"""Answering a request: parse and tokenize it off the event loop, run it, and answer whole or
as server-sent events. The two endpoints differ only in their ``Shapes``."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import responses
from .framing import check_content_type
from .generation import Choice, Delta, Generation, Prepared
from .protocol import ApiError
from .responses import Envelope
from .service import Service


@dataclass(frozen=True)
class Shapes:
    """An endpoint's response shapes (see ``responses``).

    Attributes:
        endpoint: its path (for metrics).
        prefix: the start of its response ids (``cmpl``, ``chatcmpl``).
        prepare_body: the raw body to a prepared job (runs on the service's preparing thread).
        whole: the non-streaming response.
        chunk: one stream chunk of a delta.
        usage_chunk: the stream's last chunk with the usage, when asked for.
        opening: the stream's first chunk of each choice, if the endpoint has one.
    """

    endpoint: str
    prefix: str
    prepare_body: Callable[[Service, bytes], Prepared]
    whole: Callable[[Envelope, list[Choice], dict[str, int]], dict[str, Any]]
    chunk: Callable[[Envelope, Delta, bool], dict[str, Any]]
    usage_chunk: Callable[[Envelope, dict[str, int]], dict[str, Any]]
    opening: Callable[[Envelope, int, bool], dict[str, Any]] | None = None


async def answer(service: Service, request: Request, shapes: Shapes) -> Response:
    """Answer one request to ``shapes.endpoint``, whole or as server-sent events."""
    arrived = time.perf_counter()
    service.authorize(request)
    service.check_admitting()
    check_content_type(request.scope["headers"])
    raw = await service.read_body(request)
    prepared = await service.prepare(shapes.prepare_body, raw, arrived)
    envelope = Envelope(f"{shapes.prefix}-{uuid.uuid4().hex}", int(time.time()), service.model_name)
    generation = Generation(service, prepared, shapes.endpoint, arrived)
    if not prepared.stream:
        if not await generation.complete(request):
            # The client left: nobody reads this; 499 is what the metrics record.
            return Response(status_code=499)
        return JSONResponse(shapes.whole(envelope, generation.answered(), generation.usage()))
    return responses.EventStream(
        _events(generation, envelope, shapes), lambda: generation.cancel("disconnect")
    )


async def _events(generation: Generation, envelope: Envelope, shapes: Shapes) -> AsyncIterator[str]:
    include_usage = generation.prepared.include_usage
    if shapes.opening is not None:
        for index in range(len(generation.choices)):
            yield responses.sse(shapes.opening(envelope, index, include_usage))
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            if isinstance(delta, ApiError):
                yield responses.sse(delta.body())
                return
            yield responses.sse(shapes.chunk(envelope, delta, include_usage))
    if include_usage:
        yield responses.sse(shapes.usage_chunk(envelope, generation.usage()))
    yield responses.SSE_DONE
    generation.observe_latency()
