"""``POST /v1/completions``: a request's prompts to prepared jobs, their choices to the answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import responses
from .generation import Generation, Prepared
from .protocol import ApiError, CompletionRequest, invalid, parse_body, prompt_items, stop_strings
from .responses import Envelope
from .service import Service

ENDPOINT = "/v1/completions"
# OpenAI's default for /v1/completions (chat defaults to the rest of the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def prepare(service: Service, request: CompletionRequest) -> Prepared:
    """Prompts, limits and sampling of a /v1/completions request."""
    service.check_model(request.model)
    stops = stop_strings(request.stop)
    items = prompt_items(request.prompt)
    if len(items) > service.worker.max_queue:
        raise invalid(
            f"prompt holds {len(items)} prompts but this server queues at most "
            f"{service.worker.max_queue}; send fewer per request",
            param="prompt",
        )
    # Every check that needs no tokenizer first: a request refused anyway costs no
    # tokenizing.
    for item in items:
        if isinstance(item, str):
            service.check_chars(len(item), "prompt")
        else:
            service.check_ids(item, "prompt")
    prompts = [
        service.encode(item, special=True) if isinstance(item, str) else item for item in items
    ]
    max_tokens = [
        service.max_tokens_for(
            len(ids), request.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
        )
        for ids in prompts
    ]
    sampling, seed, group = service.sampling_for(request)
    return Prepared(
        prompts=prompts,
        stops=[stops] * len(prompts),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        group=group,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )


def prepare_body(service: Service, raw: bytes) -> Prepared:
    """Parse, check and tokenize a raw request body (on the service's preparing thread)."""
    return prepare(service, parse_body(raw, CompletionRequest))


async def create(service: Service, request: Request) -> Response:
    """Answer one /v1/completions request, whole or as server-sent events."""
    arrived = time.perf_counter()
    service.authorize(request)
    raw = await service.read_body(request)
    loop = asyncio.get_running_loop()
    prepared = await loop.run_in_executor(service.preparer, prepare_body, service, raw)
    envelope = Envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), service.model_name)
    generation = Generation(service, prepared, ENDPOINT, arrived)
    if not prepared.stream:
        if not await generation.complete(request):
            # The client left: nobody reads this; 499 is what the metrics record.
            return Response(status_code=499)
        return JSONResponse(responses.completion(envelope, generation.choices, generation.usage()))
    return responses.EventStream(
        _events(generation, envelope), lambda: generation.cancel("disconnect")
    )


async def _events(generation: Generation, envelope: Envelope) -> AsyncIterator[str]:
    include_usage = generation.prepared.include_usage
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            if isinstance(delta, ApiError):
                yield responses.sse(delta.body())
                return
            yield responses.sse(responses.completion_chunk(envelope, delta, include_usage))
    if include_usage:
        yield responses.sse(responses.completion_usage_chunk(envelope, generation.usage()))
    yield responses.SSE_DONE
    generation.observe_latency()
