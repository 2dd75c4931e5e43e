"""``POST /v1/completions``: a request's prompts to prepared jobs, their choices to the answer."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from . import responses
from .answer import Shapes, answer
from .generation import Prepared
from .protocol import CompletionRequest, invalid, parse_body, prompt_items, stop_strings
from .service import Service

ENDPOINT = "/v1/completions"
# OpenAI's default for /v1/completions (chat defaults to the rest of the context).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def prepare(service: Service, request: CompletionRequest) -> Prepared:
    """Prompts, limits and sampling of a /v1/completions request."""
    service.check_model(request.model)
    stops = stop_strings(request.stop)
    items = prompt_items(request.prompt)
    n = request.n or 1
    best_of = request.best_of or n
    if best_of < n:
        raise invalid(
            f"best_of ({best_of}) must be at least n ({n}): the best n of best_of candidates "
            "are returned",
            param="best_of",
        )
    if best_of > n and request.stream:
        raise invalid(
            "best_of above n cannot be streamed (the best candidates are known only at the "
            "end); send stream=false, or leave best_of out",
            param="best_of",
        )
    if len(items) * best_of > service.worker.max_queue:
        raise invalid(
            f"prompt holds {len(items)} prompts, {len(items) * best_of} generations with "
            f"n={n} and best_of={best_of}, but this server queues at most "
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
        service.start_token(
            service.encode(item, special=True) if isinstance(item, str) else item,
            "prompt",
            "prompt" if len(items) == 1 else f"prompt {i}",
        )
        for i, item in enumerate(items)
    ]
    max_tokens = [
        service.max_tokens_for(
            len(ids), request.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
        )
        for ids in prompts
    ]
    sampling, seed, group = service.sampling_for(request)
    grammar = service.grammar_for(request)
    return Prepared(
        prompts=prompts,
        stops=[stops] * len(prompts),
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed,
        group=group,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        n=n,
        best_of=best_of,
        echoes=[
            item if isinstance(item, str) else str(service.tokenizer.decode(item)) for item in items
        ]
        if request.echo
        else None,
        logprobs=request.logprobs,
        grammar=grammar,
    )


def prepare_body(service: Service, raw: bytes) -> Prepared:
    """Parse, check and tokenize a raw request body (on the service's preparing thread)."""
    return prepare(service, parse_body(raw, CompletionRequest))


SHAPES = Shapes(
    endpoint=ENDPOINT,
    prefix="cmpl",
    prepare_body=prepare_body,
    whole=responses.completion,
    chunk=responses.completion_chunk,
    usage_chunk=responses.completion_usage_chunk,
)


async def create(service: Service, request: Request) -> Response:
    """Answer one /v1/completions request, whole or as server-sent events."""
    return await answer(service, request, SHAPES)
