"""One HTTP request carried across processes: what the ingress sends a replica, and the replica's
side, which runs it through the flashspec app in-process (``call_app``) and yields its answer.

Plain ASGI (no Ray, no FastAPI), so the round trip is testable without a cluster. The pieces are
small picklable values: Ray Serve carries them between the ingress and the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

REPLICA_HEADER = "x-flashspec-replica"
# An app that keeps running after its caller left (a disconnect it ignores) is cancelled after
# this many seconds, so a replica never accumulates abandoned requests.
DISCONNECT_GRACE_S = 5.0
# Headers that describe one connection, not the message (RFC 9110 7.6.1); the ingress and the
# replica each answer on their own connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "content-length",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress received it, body read in full.

    Attributes:
        method: ``GET``, ``POST``...
        path: the URL path (``/v1/completions``).
        query: the raw query string, without ``?``.
        headers: the request headers, names lower-case, as bytes.
        body: the whole body.
        client: the client's (host, port) as the ingress saw it, if known.
    """

    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class Head:
    """The start of a response: status and headers (names lower-case)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...] = field(default_factory=tuple)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (lower-case), decoded as Latin-1."""
        key = name.encode("latin-1")
        for k, v in self.headers:
            if k == key:
                return v.decode("latin-1")
        return None

    @property
    def streamed(self) -> bool:
        """Whether the body is server-sent events (relayed as it comes, never buffered)."""
        return (self.header("content-type") or "").startswith("text/event-stream")


def end_to_end(headers: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """``headers`` without the hop-by-hop ones (each side sets its own framing)."""
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]


def _scope(request: Forwarded) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("utf-8", "surrogateescape"),
        "query_string": request.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": request.client,
        "server": None,
        "state": {},
    }


async def call_app(
    app: App, request: Forwarded, replica: str
) -> AsyncGenerator[Head | bytes, None]:
    """Run ``request`` through ``app``; yield its ``Head``, then its body in pieces.

    Every response carries ``x-flashspec-replica: replica``. Closing the iterator early (the
    ingress's client left, or Ray cancelled the call) tells the app the client disconnected, as
    uvicorn would, and waits up to ``DISCONNECT_GRACE_S`` for it to finish before cancelling it.

    Raises:
        RuntimeError: the app ended without starting a response.
    """
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client disconnected")  # as uvicorn does, so the app stops
        await sent.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    getter: asyncio.Future[Message] | None = None
    finished = False
    try:
        started = False
        while True:
            if sent.empty():
                if task.done():
                    task.result()  # the app's own error, if it raised one
                    raise RuntimeError(
                        f"the app ended {request.method} {request.path} without a complete response"
                    )
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                message = getter.result()
            else:
                message = sent.get_nowait()
            if message["type"] == "http.response.start":
                headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
                headers.append((REPLICA_HEADER.encode(), replica.encode("latin-1", "replace")))
                started = True
                yield Head(int(message["status"]), tuple(headers))
            elif message["type"] == "http.response.body":
                if not started:
                    raise RuntimeError("the app sent a body before its response start")
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        if not task.done():
            if not finished:
                gone.set()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


class Lifespan:
    """An ASGI app's lifespan (startup, then shutdown), driven as a server would drive it."""

    def __init__(self, app: App) -> None:
        self._app = app
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Future[None] | None = None

    async def _receive(self) -> Message:
        return await self._to_app.get()

    async def _send(self, message: Message) -> None:
        await self._from_app.put(message)

    async def _expect(self, kind: str) -> None:
        assert self._task is not None
        getter = asyncio.ensure_future(self._from_app.get())
        waiting: set[asyncio.Future[Any]] = {getter, self._task}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
            error = self._task.exception()
            raise RuntimeError(f"the app's lifespan ended before {kind}: {error!r}")
        message = getter.result()
        if message["type"] != f"{kind}.complete":
            raise RuntimeError(f"the app's lifespan {kind} failed: {message.get('message', '')}")

    async def startup(self) -> None:
        """Start the app (its worker thread); return when it says it is ready."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self._app(scope, self._receive, self._send))
        await self._to_app.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup")

    async def shutdown(self) -> None:
        """Stop the app; return when it has."""
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown")
