"""``POST /v1/chat/completions``: a conversation to one prepared job, its choice to the answer.

The prompt is rendered as everywhere else (``flashspec.engine.chat``): the chat template, or
without one a plain ``role: content`` transcript that ``FALLBACK_CHAT_STOP`` ends.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..engine.chat import FALLBACK_CHAT_STOP as FALLBACK_CHAT_STOP
from ..engine.chat import ChatTemplateError, render
from . import responses
from .answer import Shapes, answer
from .generation import Prepared
from .protocol import ChatRequest, invalid, message_text, parse_body, stop_strings
from .service import Service

ENDPOINT = "/v1/chat/completions"


def prepare(service: Service, request: ChatRequest) -> Prepared:
    """The chat prompt (chat template or the fallback format), limits and sampling."""
    service.check_model(request.model)
    stops = stop_strings(request.stop)
    conversation: list[dict[str, str]] = []
    for i, m in enumerate(request.messages):
        turn = {"role": m.role, "content": message_text(m, i)}
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        conversation.append(turn)
    service.check_chars(sum(len(turn["content"]) for turn in conversation), "messages")
    try:
        chat = render(service.tokenizer, conversation)
    except ChatTemplateError as exc:
        raise invalid(f"messages: {exc}", param="messages") from None
    # The content alone undercounts: each message adds its role and the template's markup, so
    # the text the tokenizer would read is measured too (check_messages bounded its size).
    service.check_chars(len(chat.text), "messages", "conversation (chat-formatted)")
    ids = service.start_token(service.encode(chat.text, special=chat.special), "messages")
    stops = tuple(dict.fromkeys((*stops, *chat.stops)))
    requested = request.max_completion_tokens or request.max_tokens
    if requested != (request.max_tokens or requested):
        raise invalid(
            "max_tokens and max_completion_tokens differ; send only max_completion_tokens",
            param="max_tokens",
        )
    max_tokens = service.max_tokens_for(len(ids), requested, None, "messages")
    sampling, seed, group = service.sampling_for(request)
    grammar = service.grammar_for(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid(
            "top_logprobs needs logprobs: true; send both, or leave top_logprobs out",
            param="top_logprobs",
        )
    return Prepared(
        prompts=[ids],
        stops=[stops],
        max_tokens=[max_tokens],
        sampling=sampling,
        seed=seed,
        group=group,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        n=request.n or 1,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        grammar=grammar,
    )


def check_messages(service: Service, body: dict[str, Any]) -> None:
    """Refuse a conversation of more messages than the context has tokens, before validating
    or rendering any of it.

    Every message takes at least one token once chat-formatted (its role, the template's
    markup), so such a conversation cannot fit; and without this bound a body of empty
    messages would be rendered and tokenized in full before its length was known.

    Raises:
        ApiError: 400 ``context_length_exceeded`` naming ``messages``.
    """
    messages = body.get("messages")
    limit = service.max_context
    if limit is None or not isinstance(messages, list) or len(messages) < limit:
        return
    raise invalid(
        f"messages holds {len(messages)} messages but this model's context is {limit} tokens; "
        "every message takes at least one token once chat-formatted, so the conversation "
        "cannot fit and is refused before rendering it; send fewer messages",
        param="messages",
        code="context_length_exceeded",
    )


def prepare_body(service: Service, raw: bytes) -> Prepared:
    """Parse, check and tokenize a raw request body (on the service's preparing thread)."""
    return prepare(service, parse_body(raw, ChatRequest, partial(check_messages, service)))


SHAPES = Shapes(
    endpoint=ENDPOINT,
    prefix="chatcmpl",
    prepare_body=prepare_body,
    whole=responses.chat_completion,
    chunk=responses.chat_chunk,
    usage_chunk=responses.chat_usage_chunk,
    opening=responses.chat_opening_chunk,
)


async def create(service: Service, request: Request) -> Response:
    """Answer one /v1/chat/completions request, whole or as server-sent events."""
    return await answer(service, request, SHAPES)
