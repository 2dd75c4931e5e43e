"""The HTTP/1.1 connection of ``flashspec serve``: uvicorn's h11 protocol with a header deadline.

Connection-level errors (malformed HTTP, headers too large) come in OpenAI's JSON error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import ApiError

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
# h11's own default: the request line and headers together, in bytes.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024


class _Connection(h11.Connection):
    """h11's server connection, remembering the protocol error that ended it.

    uvicorn catches that error and answers 400 without it; the error's status hint (431 for
    headers too large) picks the status instead.
    """

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error = exc
            raise


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and errors in OpenAI's shape.

    Configure by subclassing (see ``guarded_protocol``): uvicorn builds one per connection
    from the class alone.
    """

    header_timeout_s: ClassVar[float] = DEFAULT_HEADER_TIMEOUT_S
    max_header_bytes: ClassVar[int] = DEFAULT_MAX_HEADER_BYTES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._h11 = _Connection(h11.SERVER, self.max_header_bytes)
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

    def data_received(self, data: bytes) -> None:
        # h11 checks the size of headers only while they are incomplete: a large block that
        # arrives in one read would pass. Counting here holds every request to the limit.
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            self._answer_and_close(self._too_large())
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        error = self._h11.error
        if error is not None and error.error_status_hint == 431:
            self._answer_and_close(self._too_large())
            return
        detail = f" ({error})" if error is not None and str(error) else ""
        message = f"the request is not valid HTTP/1.1{detail}; send a well-formed request"
        logger.info("refused a malformed HTTP request from %s: %s", self.client, message)
        self._answer_and_close(ApiError(400, message, code="invalid_http"))

    def _headers_too_large(self, data: bytes) -> bool:
        limit = self.max_header_bytes
        pending = self.conn.trailing_data[0] + data
        # The blank line that ends the headers must come within the first ``limit`` bytes.
        return len(pending) > limit and pending.find(b"\r\n\r\n", 0, limit + 4) < 0

    def _too_large(self) -> ApiError:
        return ApiError(
            431,
            f"the request line and headers are larger than this server accepts "
            f"({self.max_header_bytes} bytes); send fewer or shorter headers",
            code="headers_too_large",
        )

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
