"""``flashspec serve``: an OpenAI-compatible HTTP server over a ``SpeculativeEngine``.

Lazy re-exports (PEP 562), so that ``flashspec serve``'s parser (``flashspec.cli.serve``) loads
without the ``[serve]`` extra.
"""

# The modules, one job each; imports go one way, from the top of this list down:
#   run          serve(), ServerThread, GracefulServer, bind(), uvicorn_config(): uvicorn
#   app          create_app(): routes, OpenAI-shaped errors, request metrics, lifespan
#   completions  POST /v1/completions: request -> prepared jobs -> response
#   chat         POST /v1/chat/completions: conversation -> prepared job -> response
#   responses    OpenAI's response bodies and stream chunks; server-sent events
#   generation   one request's jobs on the worker: events, timeouts
#   stops        stop strings held back and trimmed from streamed text
#   http         uvicorn's h11 protocol with a header deadline and header limits
#   framing      HTTP framing checks the app, http and the Ray ingress share (content type...)
#   service      what the routes share (engine facts, worker, metrics, limits) and its checks
#   protocol     request models, their validation, ApiError
#   worker       the engine thread that batches jobs
#   metrics      Prometheus counters, gauges, histograms
#   cli          the earlier path of ``flashspec.cli.serve``, the ``flashspec serve`` command

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "GracefulServer": ".run",
    "ServerThread": ".run",
    "bind": ".run",
    "serve": ".run",
    "uvicorn_config": ".run",
    "create_app": ".app",
    "FALLBACK_CHAT_STOP": ".chat",
    "StopTrimmer": ".stops",
    "API_KEY_ENV": ".service",
    "DEFAULT_BODY_TIMEOUT_S": ".service",
    "DEFAULT_MAX_BODY_BYTES": ".service",
    "resolve_api_key": ".service",
    "ApiError": ".protocol",
    "Metrics": ".metrics",
    "server_metrics": ".metrics",
    "DEFAULT_HEADER_TIMEOUT_S": ".http",
    "DEFAULT_MAX_HEADER_BYTES": ".http",
}

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "FALLBACK_CHAT_STOP",
    "ApiError",
    "GracefulServer",
    "Metrics",
    "ServerThread",
    "StopTrimmer",
    "bind",
    "create_app",
    "resolve_api_key",
    "serve",
    "server_metrics",
    "uvicorn_config",
]

if TYPE_CHECKING:
    from .app import create_app
    from .chat import FALLBACK_CHAT_STOP
    from .http import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES
    from .metrics import Metrics, server_metrics
    from .protocol import ApiError
    from .run import GracefulServer, ServerThread, bind, serve, uvicorn_config
    from .service import (
        API_KEY_ENV,
        DEFAULT_BODY_TIMEOUT_S,
        DEFAULT_MAX_BODY_BYTES,
        resolve_api_key,
    )
    from .stops import StopTrimmer


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
