"""The HTTP/1.1 connection of ``flashspec serve``: uvicorn's h11 protocol with a header deadline.

Connection-level errors (malformed HTTP, headers too large, a body length given twice) come in
OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .framing import DEFAULT_MAX_HEADER_BYTES, ambiguous_length, headers_too_large
from .protocol import ApiError

__all__ = ["DEFAULT_HEADER_TIMEOUT_S", "DEFAULT_MAX_HEADER_BYTES", "GuardedH11Protocol"]

logger = logging.getLogger("flashspec.server")

# uvicorn bounds the idle time between two requests of a keep-alive connection
# (``timeout_keep_alive``) but not the time a client takes to send a request's headers: a connection
# that sends half a request line, or nothing at all, is held until shutdown. Here every connection
# must deliver a request's complete headers within ``header_timeout_s`` of opening, or of the
# previous response's end, or it is answered 408 and closed. Once the headers are in, the app bounds
# the body's read time itself (``Service.read_body``).
#
# Errors uvicorn answers before the app sees a request (malformed HTTP, headers over
# ``max_header_bytes``) keep uvicorn's status codes but come in OpenAI's JSON error shape, not as
# plain text. None of them reaches the app, so ``/metrics`` does not count them.

DEFAULT_HEADER_TIMEOUT_S = 10.0

# Where h11 ends a request's headers: the first empty line, with or without its CR.
_BLANK_LINE = re.compile(b"\n\r?\n")


class _Connection(h11.Connection):
    """h11's server connection, holding every request to the header limit and remembering the
    protocol error that ended it.

    uvicorn catches that error and answers 400 without it; ``refusal`` (this class's own
    checks) or the error's status hint (h11's 431) picks the answer instead.
    """

    error: h11.RemoteProtocolError | None = None
    refusal: ApiError | None = None

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        try:
            # h11 measures headers only while they are incomplete, so a block that arrives
            # whole (in one read, or pipelined behind an earlier request and parsed once that
            # one is answered) would pass. Every request starts in IDLE, so measuring here,
            # before h11 parses it, holds each one to the limit however its bytes came.
            if self.their_state is h11.IDLE and self._headers_too_large():
                self._refuse(headers_too_large(self.max_header_bytes))
            event = super().next_event()
            if isinstance(event, h11.Request):
                refusal = ambiguous_length(event.headers)
                if refusal is not None:
                    self._refuse(refusal)
            return event
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise

    def _headers_too_large(self) -> bool:
        pending, _ = self.trailing_data
        limit = self.max_header_bytes
        # The blank line that ends the headers must come within the first ``limit`` bytes
        # (plus its own four).
        return len(pending) > limit and _BLANK_LINE.search(pending, 0, limit + 4) is None

    def _refuse(self, refusal: ApiError) -> None:
        self.refusal = refusal
        raise h11.RemoteProtocolError(refusal.message, error_status_hint=refusal.status)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and errors in OpenAI's shape.

    Configure by subclassing (see ``guarded_protocol``): uvicorn builds one per connection
    from the class alone.
    """

    header_timeout_s: ClassVar[float] = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: ClassVar[int] = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h11 = _Connection(self.max_header_bytes)
        self.conn = self._h11
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers get the same time as the first's.
        self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        if self._h11.refusal is not None:
            self._answer_and_close(self._h11.refusal)
            return
        error = self._h11.error
        if error is not None and error.error_status_hint == 431:
            self._answer_and_close(headers_too_large(self.max_header_bytes))
            return
        detail = f" ({error})" if error is not None and str(error) else ""
        message = f"the request is not valid HTTP/1.1{detail}; send a well-formed request"
        logger.info("refused a malformed HTTP request from %s: %s", self.client, message)
        self._answer_and_close(ApiError(400, message, code="invalid_http"))

    # -- the header deadline ----------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        if self.transport is not None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The app holds a request: its headers arrived in time; the app bounds the body.
            return
        partial, _ = self.conn.trailing_data
        if self.conn.their_state is h11.IDLE and partial:
            self._answer_and_close(
                ApiError(
                    408,
                    f"the request headers did not arrive within {self.header_timeout_s:g} s; "
                    "send the whole request at once",
                    type="timeout_error",
                    code="header_timeout",
                )
            )
            return
        # Nothing sent since the connection opened (or since the last response), or the rest
        # of a body the app did not need: close, as uvicorn does an idle keep-alive connection.
        self.transport.close()

    def _answer_and_close(self, error: ApiError) -> None:
        # Written directly: h11 has no response to send before it has parsed a request.
        body = json.dumps(error.body()).encode()
        phrase = {
            400: "Bad Request",
            408: "Request Timeout",
            431: "Request Header Fields Too Large",
        }
        head = (
            f"HTTP/1.1 {error.status} {phrase.get(error.status, 'Error')}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode()
        self.transport.write(head + body)
        self.transport.close()


def guarded_protocol(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` class with these limits, for ``uvicorn.Config(http=...)``.

    Raises:
        ValueError: a limit is not positive.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0 seconds, got {header_timeout_s!r}")
    if max_header_bytes < 1:
        raise ValueError(f"max_header_bytes must be >= 1, got {max_header_bytes!r}")
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": float(header_timeout_s), "max_header_bytes": int(max_header_bytes)},
    )
