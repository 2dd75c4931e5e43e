"""The earlier path of the HTTP server, kept so that old imports work: use ``flashspec.serve``.

Re-exports the public names this module had; needs the ``[serve]`` extra, as it always did.
"""

from __future__ import annotations

from .serve.app import ENDPOINTS, create_app
from .serve.chat import FALLBACK_CHAT_STOP
from .serve.completions import COMPLETION_DEFAULT_MAX_TOKENS
from .serve.generation import DISCONNECT_POLL_S, FINISH_REASONS, StopTrimmer
from .serve.http import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES
from .serve.metrics import Metrics, server_metrics
from .serve.protocol import ApiError
from .serve.run import (
    KEEP_ALIVE_TIMEOUT_S,
    LISTEN_BACKLOG,
    ServerThread,
    bind,
    serve,
    uvicorn_config,
)
from .serve.service import (
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    NORMALIZED_TEXT_SLACK,
    UNBOUNDED_DEFAULT_MAX_TOKENS,
    prompt_char_limit,
    resolve_api_key,
)

__all__ = [
    "API_KEY_ENV",
    "COMPLETION_DEFAULT_MAX_TOKENS",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DISCONNECT_POLL_S",
    "ENDPOINTS",
    "FALLBACK_CHAT_STOP",
    "FINISH_REASONS",
    "KEEP_ALIVE_TIMEOUT_S",
    "LISTEN_BACKLOG",
    "NORMALIZED_TEXT_SLACK",
    "UNBOUNDED_DEFAULT_MAX_TOKENS",
    "ApiError",
    "Metrics",
    "ServerThread",
    "StopTrimmer",
    "bind",
    "create_app",
    "prompt_char_limit",
    "resolve_api_key",
    "serve",
    "server_metrics",
    "uvicorn_config",
]
