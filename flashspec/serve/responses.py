"""OpenAI's response bodies and stream chunks, built from a request's choices, and the SSE wire.

Plain functions of plain values: the endpoints pick the shapes, ``Generation`` never sees them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .logprobs import TokenInfo, chat_logprobs, completion_logprobs

if TYPE_CHECKING:
    from .generation import Choice, Delta

# The last event of every stream that ends normally.
SSE_DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Envelope:
    """The fields every body and chunk of one response repeats."""

    id: str
    created: int
    model: str

    def wrap(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A body of ``object`` type ``kind`` around ``choices``."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


def model_card(model: str, created: int) -> dict[str, Any]:
    """The served model as ``GET /v1/models`` lists it."""
    return {"id": model, "object": "model", "created": created, "owned_by": "flashspec"}


# -- /v1/completions -------------------------------------------------------------------------


def completion(
    envelope: Envelope, choices: Sequence[Choice], usage: dict[str, int]
) -> dict[str, Any]:
    """A whole ``text_completion``."""
    top = any(info.top for c in choices for info in c.logprobs or ())
    rows = [
        {
            "index": i,
            "text": c.text,
            "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs, top),
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(choices)
    ]
    return {**envelope.wrap("text_completion", rows), "usage": usage}


def completion_chunk(envelope: Envelope, delta: Delta, include_usage: bool) -> dict[str, Any]:
    """One streamed piece of a ``text_completion`` (``usage`` null when usage comes last)."""
    infos = delta.logprobs
    row = {
        "index": delta.index,
        "text": delta.text,
        "logprobs": None
        if infos is None
        else completion_logprobs(infos, any(info.top for info in infos)),
        "finish_reason": delta.finish_reason,
    }
    usage_field = {"usage": None} if include_usage else {}
    return {**envelope.wrap("text_completion", [row]), **usage_field}


def completion_usage_chunk(envelope: Envelope, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a completion stream with ``include_usage``: no choices, the usage."""
    return {**envelope.wrap("text_completion", []), "usage": usage}


# -- /v1/chat/completions --------------------------------------------------------------------


def chat_completion(
    envelope: Envelope, choices: Sequence[Choice], usage: dict[str, int]
) -> dict[str, Any]:
    """A whole ``chat.completion``."""
    rows = [
        {
            "index": i,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(choices)
    ]
    return {**envelope.wrap("chat.completion", rows), "usage": usage}


def _chat_delta(
    envelope: Envelope,
    index: int,
    delta: dict[str, str],
    finish_reason: str | None,
    include_usage: bool,
    logprobs: Sequence[TokenInfo] | None = None,
) -> dict[str, Any]:
    row = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else chat_logprobs(logprobs),
        "finish_reason": finish_reason,
    }
    usage_field = {"usage": None} if include_usage else {}
    return {**envelope.wrap("chat.completion.chunk", [row]), **usage_field}


def chat_opening_chunk(envelope: Envelope, index: int, include_usage: bool) -> dict[str, Any]:
    """The first chunk of a choice in a chat stream: the assistant's role, no text yet."""
    return _chat_delta(envelope, index, {"role": "assistant", "content": ""}, None, include_usage)


def chat_chunk(envelope: Envelope, delta: Delta, include_usage: bool) -> dict[str, Any]:
    """One streamed piece of a ``chat.completion`` (an empty delta when only finishing)."""
    content = {"content": delta.text} if delta.text else {}
    return _chat_delta(
        envelope, delta.index, content, delta.finish_reason, include_usage, delta.logprobs
    )


def chat_usage_chunk(envelope: Envelope, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a chat stream with ``include_usage``: no choices, the usage."""
    return {**envelope.wrap("chat.completion.chunk", []), "usage": usage}


# -- server-sent events ----------------------------------------------------------------------


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that run ``on_close`` however the response ends.

    The events' generator cancels its jobs when closed, but only once it has started: a client
    that leaves before the first event would leave them queued with nobody to read them.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
