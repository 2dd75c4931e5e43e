"""Running the app: ``serve`` until interrupted, ``ServerThread`` in the background, and the
socket (``bind``) and uvicorn settings (``uvicorn_config``) both use; ``loopback`` says whether
a host is this machine only (``flashspec serve`` and the Ray launcher both ask).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import TYPE_CHECKING

try:
    import uvicorn
    from starlette.types import ASGIApp
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        f"flashspec.server needs FastAPI and uvicorn ({exc}); "
        "install them with: pip install 'flashspec[serve]'"
    ) from exc

from .app import create_app
from .http import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES, guarded_protocol
from .service import Service, resolve_api_key
from .worker import DEFAULT_SHUTDOWN_TIMEOUT_S, Batching

if TYPE_CHECKING:
    from ..engine import SpeculativeEngine

LISTEN_BACKLOG = 2048  # uvicorn's default
KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn's default: an idle keep-alive connection closes after it
# Past the grace, running rows end at the engine's next round and their answers go out; a
# connection still open this much later (a body still arriving, a client not reading its
# stream) is cut, so the process exits within about grace + this + one round.
SHUTDOWN_BACKSTOP_S = 2.0


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one), for uvicorn to listen on.

    Binding here rather than in uvicorn turns "address in use" into an ``OSError`` the caller
    can report, and lets ``port=0`` be read back before the server starts.

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission).
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening now (uvicorn's own listen() later only resizes the backlog) means a client
        # that connects as soon as the address is printed waits in the backlog while the app
        # starts, instead of being refused.
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    engine: SpeculativeEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    model_name: str = "flashspec",
    max_batch: int = 8,
    max_queue: int = 64,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    batching: Batching = "continuous",
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Serve ``engine`` until interrupted (see ``create_app`` for the settings).

    Listens on ``sock`` if given (see ``bind``), else on ``host:port``. ``api_key`` None
    falls back to ``$FLASHSPEC_API_KEY``. A connection's request headers must arrive within
    ``header_timeout_s`` (408 otherwise; see ``uvicorn_config``). On SIGTERM or Ctrl-C,
    running generations get ``shutdown_timeout_s`` seconds to finish (see ``GracefulServer``).
    """
    app = create_app(
        engine,
        model_name=model_name,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout_s=timeout_s,
        api_key=resolve_api_key(api_key),
        batching=batching,
    )
    listener = sock if sock is not None else bind(host, port)
    config = uvicorn_config(
        app,
        log_level=log_level,
        header_timeout_s=header_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
    )
    server = GracefulServer(config, shutdown_timeout_s)
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


def uvicorn_config(
    app: ASGIApp,
    *,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> uvicorn.Config:
    """uvicorn's settings for the app: h11 with a header deadline, no WebSocket upgrades, and
    connections cut ``SHUTDOWN_BACKSTOP_S`` after a shutdown's grace of ``shutdown_timeout_s``.

    The HTTP protocol is always ``flashspec.serve.http``'s (h11), even where httptools is
    installed, so the limits hold whatever uvicorn would pick.

    Raises:
        ValueError: ``shutdown_timeout_s`` is negative (or a header limit is not positive).
    """
    if not shutdown_timeout_s >= 0:
        raise ValueError(f"shutdown_timeout_s must be >= 0 seconds, got {shutdown_timeout_s!r}")
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(header_timeout_s, max_header_bytes),
        ws="none",
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
        timeout_graceful_shutdown=int(shutdown_timeout_s + SHUTDOWN_BACKSTOP_S + 0.999),
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a bounded shutdown for a flashspec app.

    uvicorn's own shutdown stops listening and closes idle connections, then waits for every
    running request: a queue of long generations would keep the process for as long as they
    take. Here, as the shutdown begins, the app stops admitting generations and ends the queued
    ones (503 ``shutting_down``); running ones get ``shutdown_timeout_s`` seconds to finish and
    are then ended too (a 503, or an error event that ends a stream without ``[DONE]``).
    ``uvicorn_config`` cuts what is left ``SHUTDOWN_BACKSTOP_S`` later.

    Args:
        config: from ``uvicorn_config``; its app, when a ``create_app`` one, is drained.
        shutdown_timeout_s: the grace for running generations, in seconds.
    """

    def __init__(self, config: uvicorn.Config, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        state = getattr(config.app, "state", None)
        service = getattr(state, "service", None)
        self.service = service if isinstance(service, Service) else None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain the app (see the class docstring), then shut down as uvicorn does."""
        if self.service is not None:
            self.service.begin_shutdown(self.shutdown_timeout_s)
        await super().shutdown(sockets)


class ServerThread:
    """Run an app with uvicorn in a background thread, on a port bound up front.

    ``port=0`` picks a free port (no race: the socket is bound here and handed to uvicorn).
    Use as a context manager, or ``start()``/``stop()``.
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        config = uvicorn_config(
            app,
            log_level="warning",
            header_timeout_s=header_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
        )
        self._socket = bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._server = GracefulServer(config, shutdown_timeout_s)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="flashspec-uvicorn",
            daemon=True,
        )

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving; return once the server accepts connections.

        Raises:
            RuntimeError: the server did not start within ``timeout`` seconds.
        """
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down as on SIGTERM (see ``GracefulServer``) and wait for the thread at most
        ``timeout`` seconds."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
