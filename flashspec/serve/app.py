"""The FastAPI app: ``create_app`` wires the routes, OpenAI-shaped errors, metrics and lifespan.

The routes are thin: ``completions`` and ``chat`` answer the generation endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        f"flashspec.server needs FastAPI and uvicorn ({exc}); "
        "install them with: pip install 'flashspec[serve]'"
    ) from exc

from . import chat, completions
from .metrics import Metrics, server_metrics
from .protocol import ApiError, invalid
from .responses import model_card
from .service import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, Service
from .worker import Batching

if TYPE_CHECKING:
    from ..engine import SpeculativeEngine

logger = logging.getLogger("flashspec.server")

ENDPOINTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
)


class _CountRequests:
    """ASGI middleware: ``requests_total{endpoint, status}`` for every HTTP response."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            path = str(scope.get("path", ""))
            # Unknown paths share one label, so random URLs cannot grow the metric set.
            if path.startswith("/v1/models/"):
                path = "/v1/models/{model}"
            elif path not in ENDPOINTS:
                path = "other"
            self.metrics.inc("requests_total", endpoint=path, status=str(status))


def create_app(
    engine: SpeculativeEngine,
    *,
    model_name: str = "flashspec",
    max_batch: int = 8,
    max_queue: int = 64,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    metrics: Metrics | None = None,
    batching: Batching = "continuous",
) -> FastAPI:
    """The FastAPI app serving ``engine`` under OpenAI's API.

    Args:
        engine: the engine; from now on only the app's worker thread may use it.
        model_name: the model id clients send as ``model`` and ``GET /v1/models`` lists.
        max_batch: rows per engine batch at most (1: no batching).
        max_queue: generations waiting for the engine at most; more are answered 503.
        timeout_s: per-request limit, arrival to last token, queueing included (504 after).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_body_bytes: larger request bodies are answered 413.
        body_timeout_s: a body that has not fully arrived this long after its headers is
            answered 408 (the headers' own limit is uvicorn's side: see ``serve``).
        metrics: where to count (default: a fresh ``server_metrics()``).
        batching: ``"continuous"``: requests join the running batch between the engine's
            rounds (static anyway for models whose caches cannot take rows in: sliding-window,
            recurrent); ``"static"``: they wait for the next batch.

    The worker thread starts and stops with the app's lifespan (uvicorn runs it).
    """
    service = Service(
        engine,
        model_name=model_name,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout_s=timeout_s,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        metrics=metrics or server_metrics(),
        batching=batching,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            service.shut_down_preparers()
            await asyncio.to_thread(service.worker.stop)

    app = FastAPI(
        title="flashspec",
        summary="OpenAI-compatible speculative decoding server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # Starlette would answer "/v1/completions/" with a redirect to the same path without
        # the slash, on the host the request's Host header names: any host a client picks, and
        # before the API key is checked. A 404 naming the right path instead.
        redirect_slashes=False,
    )
    app.state.service = service
    app.add_middleware(_CountRequests, metrics=service.metrics)
    _add_error_handlers(app)

    # Every GET answers HEAD too (uvicorn sends the headers only): load balancers probe with
    # either.
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        # Open even with an API key, so load balancers can probe without one.
        if service.shutting_down:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if not service.worker.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "model": service.model_name})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus(request: Request) -> Response:
        service.authorize(request)
        return PlainTextResponse(
            service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> Response:
        service.authorize(request)
        card = model_card(service.model_name, service.created)
        return JSONResponse({"object": "list", "data": [card]})

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model: str) -> Response:
        service.authorize(request)
        service.check_model(model)
        return JSONResponse(model_card(service.model_name, service.created))

    @app.post(completions.ENDPOINT)
    async def completion(request: Request) -> Response:
        return await completions.create(service, request)

    @app.post(chat.ENDPOINT)
    async def chat_completion(request: Request) -> Response:
        return await chat.create(service, request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; FastAPI's 422 becomes a 400."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client left mid-body: nobody reads this; 499 (not a 5xx) is what /metrics counts.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) if loc else None
        message = str(first.get("msg", "invalid request"))
        error = invalid(f"{param}: {message}" if param is not None else message, param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            path = request.url.path
            hint = ""
            if path != "/" and path.rstrip("/") in ENDPOINTS:
                hint = f" (did you mean {path.rstrip('/')}, without the trailing slash?)"
            message = (
                f"no endpoint {request.method} {path}{hint}; this server has POST "
                "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
                "GET /metrics"
            )
            code = "not_found"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        error = ApiError(exc.status_code, message, code=code, headers=exc.headers)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error")
        return JSONResponse(error.body(), status_code=500)
