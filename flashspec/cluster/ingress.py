"""``Ingress``: the HTTP entry of a replicated server; Ray Serve routes its calls to replicas.

Every request but ``/health`` and ``/metrics`` goes, body read in full, to one
``EngineReplica`` through a Ray Serve handle (Ray's router picks the replica with the shorter
queue of two). The replica's answer comes back as it is made: whole answers whole, server-sent
events as they come.

When a replica dies:
- before any byte of its answer reached the client, the request is retried on another replica
  (``ClusterSettings.retries`` times), then answered 503 in OpenAI's error shape;
- mid-stream, the stream ends with an error event in OpenAI's shape (no ``[DONE]``), as the
  single-process server ends a stream that fails.

``/health`` and ``/metrics`` are the ingress's own: every replica's health, and every replica's
metrics labelled ``replica="<id>"`` plus the ingress's counters (see ``board``).

The single-process server's checks on a request's framing apply here too, before a body is
read or forwarded: request line and headers over 16 KiB (431), Content-Length together with
Transfer-Encoding (400, connection closed), and an authorized generation request without a
JSON Content-Type (415). Ray Serve's proxy, not flashspec's, parses the HTTP, so the header
deadline of ``flashspec.serve.http`` does not apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..serve.framing import (
    DEFAULT_MAX_HEADER_BYTES,
    ambiguous_length,
    check_content_type,
    header_bytes,
    headers_too_large,
)
from ..serve.metrics import Metrics
from ..serve.protocol import ApiError
from ..serve.responses import sse
from ..serve.service import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, authorize, read_body
from .board import merge_metrics
from .forward import REPLICA_HEADER, Forwarded, Head, end_to_end
from .replica import board_actor
from .settings import ClusterSettings

logger = logging.getLogger("flashspec.cluster")

INGRESS = "ingress"  # the x-flashspec-replica value of answers the ingress gives itself
# Past the request's own limit (the replica answers 504 itself at timeout_s), so this only
# fires when a replica stopped answering altogether.
DEADLINE_SLACK_S = 10.0
# Errors meaning the replica (not the request) failed: the request may go to another one.
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
# The endpoints whose bodies the ingress checks before reading them (the replica checks again).
GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions"})


def ingress_metrics() -> Metrics:
    """The ingress's own metrics, declared."""
    metrics = Metrics()
    metrics.gauge("replicas_healthy", "Replicas whose engine worker is alive (as last reported).")
    metrics.counter(
        "ingress_retries_total", "Requests sent to another replica after theirs stopped."
    )
    metrics.counter(
        "ingress_failures_total",
        "Requests the ingress answered with an error itself, by reason (replica_gone, "
        "backpressure, deadline, internal).",
    )
    return metrics


def _error(error: ApiError) -> Response:
    headers = {**error.headers, REPLICA_HEADER: INGRESS}
    return Response(
        json.dumps(error.body()),
        status_code=error.status,
        headers=headers,
        media_type="application/json",
    )


def _gone(exc: BaseException, retried: int) -> ApiError:
    return ApiError(
        503,
        f"the replica serving this request stopped ({type(exc).__name__}) after "
        f"{retried + 1} attempt(s); retry the request",
        type="server_error",
        code="replica_unavailable",
        headers={"Retry-After": "1"},
    )


class Ingress:
    """The HTTP ingress deployment: forwards to ``engines``, answers health and metrics."""

    def __init__(self, engines: Any, settings: ClusterSettings) -> None:
        self.engines = engines.options(stream=True)
        self.settings = settings
        self.board = board_actor(settings.app_name)
        self.metrics = ingress_metrics()

    def __serve_build_asgi_app__(self) -> Any:
        """Ray Serve's hook: the ASGI app this deployment serves."""
        return _Asgi(self)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        response: Response
        try:
            check_framing(scope)
            if scope["path"] == "/health" and request.method in ("GET", "HEAD"):
                response = await self.health()
            elif scope["path"] == "/metrics" and request.method in ("GET", "HEAD"):
                authorize(request, self.settings.api_key)
                response = await self.render_metrics()
            else:
                response = await self.forward(request)
        except ApiError as exc:
            response = _error(exc)
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception:
            logger.exception("ingress: %s %s failed", request.method, scope["path"])
            self.metrics.inc("ingress_failures_total", reason="internal")
            response = _error(ApiError(500, "internal server error", type="server_error"))
        await response(scope, receive, send)

    async def health(self) -> Response:
        """200 while any replica is healthy; every replica's state either way."""
        replicas = await self.board.health.remote()
        healthy = sum(replicas.values())
        self.metrics.set("replicas_healthy", healthy)
        body = {
            "status": "ok" if healthy else "unavailable",
            "model": self.settings.model_name,
            "replicas": {r: "ok" if ok else "unavailable" for r, ok in replicas.items()},
        }
        return Response(
            json.dumps(body),
            status_code=200 if healthy else 503,
            headers={REPLICA_HEADER: INGRESS},
            media_type="application/json",
        )

    async def render_metrics(self) -> Response:
        """Every replica's metrics (labelled by replica) and the ingress's own."""
        replicas = await self.board.health.remote()
        self.metrics.set("replicas_healthy", sum(replicas.values()))
        merged = await self.board.metrics.remote()
        own = merge_metrics({INGRESS: self.metrics.render()})
        return Response(
            merged + own,
            headers={REPLICA_HEADER: INGRESS},
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    async def forward(self, request: Request) -> Response:
        """``request`` answered by a replica (retried on another if its replica dies first)."""
        if (
            request.method == "POST"
            and request.scope["path"] in GENERATION_ENDPOINTS
            and self._authorized(request)
        ):
            # The replica's app would refuse a body that is not JSON, after the API key: so
            # refuse it here before reading the body (a request without the key goes on to
            # the replica, which answers its 401).
            check_content_type(request.scope["headers"])
        body = await read_body(request, DEFAULT_MAX_BODY_BYTES, DEFAULT_BODY_TIMEOUT_S)
        client = request.scope.get("client")
        forwarded = Forwarded(
            method=request.method,
            path=request.scope["path"],
            query=request.scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in request.scope["headers"]),
            body=body,
            client=(str(client[0]), int(client[1])) if client else None,
        )
        deadline = time.monotonic() + self.settings.timeout_s + DEADLINE_SLACK_S
        retried = 0
        while True:
            parts = self.engines.handle.remote(forwarded)
            try:
                head = await asyncio.wait_for(anext(parts), deadline - time.monotonic())
                if not isinstance(head, Head):
                    raise RuntimeError(f"a replica answered {type(head).__name__} first")
                if head.streamed:
                    return self._relay(head, parts)
                chunks: list[bytes] = []
                async for chunk in parts:  # whole answers: nothing is sent until the end
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return _whole(head, b"".join(chunks))
            except BackPressureError as exc:
                parts.cancel()
                self.metrics.inc("ingress_failures_total", reason="backpressure")
                raise ApiError(
                    503,
                    f"every replica is busy and {self.settings.max_queue} requests are "
                    "waiting; retry later",
                    type="server_error",
                    code="overloaded",
                    headers={"Retry-After": str(int(exc.retry_after_s or 1))},
                ) from None
            except TimeoutError:
                parts.cancel()
                self.metrics.inc("ingress_failures_total", reason="deadline")
                raise ApiError(
                    504,
                    f"no replica answered within {self.settings.timeout_s:g} s "
                    f"(+{DEADLINE_SLACK_S:g} s)",
                    type="timeout_error",
                    code="timeout",
                ) from None
            except REPLICA_GONE as exc:
                parts.cancel()
                if retried >= self.settings.retries:
                    self.metrics.inc("ingress_failures_total", reason="replica_gone")
                    raise _gone(exc, retried) from None
                retried += 1
                self.metrics.inc("ingress_retries_total")
                logger.warning("ingress: replica stopped (%r); retry %d", exc, retried)
            except BaseException:
                parts.cancel()  # the client left (cancelled) or the call failed: stop the replica
                raise

    def _authorized(self, request: Request) -> bool:
        """Whether ``request`` carries the API key (when one is set)."""
        try:
            authorize(request, self.settings.api_key)
        except ApiError:
            return False
        return True

    def _relay(self, head: Head, parts: Any) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in parts:
                    yield chunk
            except REPLICA_GONE as exc:
                self.metrics.inc("ingress_failures_total", reason="replica_gone")
                yield sse(_gone(exc, 0).body()).encode()
            finally:
                with contextlib.suppress(Exception):
                    parts.cancel()

        response = StreamingResponse(body(), status_code=head.status)
        response.raw_headers = end_to_end(head.headers)
        return response


def check_framing(scope: Scope) -> None:
    """The single-process server's connection-level refusals, on an ASGI request.

    Raises:
        ApiError: 431 for a request line and headers over ``DEFAULT_MAX_HEADER_BYTES`` (as
            sent: ASGI gives the parsed headers); 400 with ``Connection: close`` for
            Content-Length with Transfer-Encoding.
    """
    headers = scope["headers"]
    query = scope.get("query_string", b"")
    target = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    target = target + b"?" + query if query else target
    if header_bytes(scope["method"], target, headers) > DEFAULT_MAX_HEADER_BYTES:
        raise headers_too_large(DEFAULT_MAX_HEADER_BYTES)
    refusal = ambiguous_length(headers)
    if refusal is not None:
        raise refusal


class _Asgi:
    """The ingress as an ASGI 3 app object (uvicorn, under Ray, takes a bound method for an
    ASGI 2 app)."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._ingress._app(scope, receive, send)


def _whole(head: Head, content: bytes) -> Response:
    response = Response(content, status_code=head.status)
    response.raw_headers = [
        *end_to_end(head.headers),
        (b"content-length", str(len(content)).encode()),
    ]
    return response


def deployment_options(settings: ClusterSettings) -> dict[str, Any]:
    """``serve.deployment`` options of the ingress: one light replica, no CPU reserved."""
    return {
        "name": "Ingress",
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        # Each open request is an await on a replica; let many wait here.
        "max_ongoing_requests": max(1000, settings.max_queue * 4),
    }
