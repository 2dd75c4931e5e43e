"""``flashspec serve``: its arguments and its command.

Imports no FastAPI until the command runs, so every other subcommand works without ``[serve]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
from types import FrameType
from typing import Any

from ..cluster.settings import RAY_ADDRESS_ENV  # stdlib only: no Ray
from ..flags import argtypes
from ..flags.options import EngineOptions, UserError, quiet_libraries
from ..serve.worker import BATCHING_MODES, DEFAULT_SHUTDOWN_TIMEOUT_S  # stdlib only: no FastAPI


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    value = argtypes.integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = argtypes.finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def grace_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (0: no grace)."""
    value = argtypes.finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to ``subparsers`` (the parent's ``add_subparsers()`` object)."""
    serve: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (needs pip install 'flashspec[serve]')",
        description=(
            "Serve the target with speculative decoding under OpenAI's API: POST "
            "/v1/completions and /v1/chat/completions (stream: true for server-sent events), "
            "GET /v1/models, /health and /metrics (Prometheus). Concurrent requests are "
            "batched, up to --max-batch rows per engine batch; by default requests join the "
            "running batch between rounds (--batching). Without --target, serves the bundled "
            "demo pair."
        ),
    )
    EngineOptions.add_arguments(serve, sampling=False)
    serve.add_argument(
        "--model-name",
        default=None,
        help="the model id clients send and GET /v1/models lists (default: --target)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: local only)"
    )
    serve.add_argument("--port", type=port, default=8000, help="TCP port (8000)")
    serve.add_argument(
        "--max-batch",
        type=argtypes.positive_int,
        default=8,
        help="rows per engine batch at most; 1 disables batching (8)",
    )
    serve.add_argument(
        "--threads",
        type=argtypes.positive_int,
        default=None,
        help="torch's CPU threads (default on a CPU: one fewer than torch's own, at least 1, "
        "so the server's event loop keeps a core; OMP_NUM_THREADS, when set, is kept)",
    )
    serve.add_argument(
        "--batching",
        choices=BATCHING_MODES,
        default="continuous",
        help="continuous: requests join the running batch between the engine's rounds (static "
        "anyway for sliding-window and recurrent models); static: they wait for the next "
        "batch (continuous)",
    )
    serve.add_argument(
        "--max-queue",
        type=argtypes.positive_int,
        default=64,
        help="generations waiting for the engine at most; more get 503 + Retry-After (64)",
    )
    serve.add_argument(
        "--timeout",
        type=seconds,
        default=60.0,
        help="per-request limit in seconds, queueing included; then 504 (60)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=grace_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM or Ctrl-C, seconds running generations get to finish; queued ones, "
        "and running ones past it, get 503 (10)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $FLASHSPEC_API_KEY; neither: no authentication)",
    )
    replicas = serve.add_argument_group(
        "replicas (Ray Serve; needs pip install 'flashspec[ray]')",
        "Run the server as replicas behind one endpoint on Ray Serve: each replica holds its "
        "own engine; Ray routes each request to the one with the shorter queue. Joins the Ray "
        f"cluster at ${RAY_ADDRESS_ENV} if set, else starts a local one. Every answer names "
        "its replica in the x-flashspec-replica header; /health and /metrics cover every "
        "replica.",
    )
    replicas.add_argument(
        "--replicas",
        type=argtypes.positive_int,
        default=None,
        help="replicas to run (default: none, one process without Ray)",
    )
    replicas.add_argument(
        "--max-replicas",
        type=argtypes.positive_int,
        default=None,
        help="autoscale between --replicas and this many on queue length (default: fixed)",
    )
    replicas.add_argument(
        "--replica-cpus",
        type=argtypes.positive_float,
        default=1.0,
        help="CPUs Ray reserves per replica; torch runs that many threads in each (1)",
    )
    serve.set_defaults(func=cmd_serve)
    return serve


def cmd_serve(args: argparse.Namespace) -> int:
    """``flashspec serve``: build the engine, then serve it until interrupted."""
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(
            f"flashspec serve needs {' and '.join(missing)}: pip install 'flashspec[serve]'"
        )
    from ..serve.run import bind, loopback, serve
    from ..serve.service import API_KEY_ENV, resolve_api_key

    api_key = resolve_api_key(args.api_key)
    if not loopback(args.host) and api_key is None:
        print(
            f"flashspec serve: warning: listening on {args.host} without an API key; anyone "
            f"who can reach it can use it (set --api-key or {API_KEY_ENV})",
            file=sys.stderr,
        )
    quiet_libraries()
    if args.replicas is not None or args.max_replicas is not None:
        if args.threads is not None:
            raise UserError(
                "--threads sets one process's torch threads; replicas take theirs from "
                "--replica-cpus: drop --threads"
            )
        return _serve_replicas(args, api_key)
    from ..serve.threads import apply_serving_threads

    why = apply_serving_threads(args.threads, str(args.device))
    print(f"flashspec serve: {why}", file=sys.stderr, flush=True)
    engine = EngineOptions.from_args(args).build(long_lived=True)
    if engine.compiled.on:
        print(
            "flashspec serve: compiling the draft and verify steps before listening "
            "(the first time on a machine takes about a minute on a small CPU; --compile off "
            "skips it)",
            file=sys.stderr,
            flush=True,
        )
        seconds = engine.warm_up(args.max_batch, freeze=True)
        buckets = engine.target.frozen_buckets or frozenset({(0, 0)})
        print(
            f"flashspec serve: compiled in {seconds:.0f} s, for batches of up to "
            f"{max(slots for _, slots in buckets)} rows and contexts of up to "
            f"{max(columns for columns, _ in buckets)} columns; larger ones run eager "
            "(nothing compiles while serving)",
            file=sys.stderr,
            flush=True,
        )
    model_name = args.model_name or args.target
    try:
        listener = bind(args.host, args.port)
    except OSError as exc:
        raise UserError(
            f"--host {args.host} --port {args.port}: cannot listen there "
            f"({exc.strerror or exc}); pick another --port or --host"
        ) from None
    print(
        f"flashspec serve: {model_name!r} on http://{args.host}:{listener.getsockname()[1]}/v1 "
        f"(max batch {args.max_batch}, {args.batching} batching, queue {args.max_queue}, "
        f"timeout {args.timeout:g} s, "
        f"API key {'on' if api_key else 'off'}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    try:
        serve(
            engine,
            sock=listener,
            model_name=model_name,
            max_batch=args.max_batch,
            batching=args.batching,
            max_queue=args.max_queue,
            timeout_s=args.timeout,
            api_key=api_key,
            shutdown_timeout_s=args.shutdown_timeout,
        )
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl-C, then re-raises it: the normal way to stop.
        print("flashspec serve: stopped", file=sys.stderr)
    return 0


def _serve_replicas(args: argparse.Namespace, api_key: str | None) -> int:
    """``flashspec serve --replicas N``: the app as replicas on Ray Serve, until interrupted."""
    if importlib.util.find_spec("ray") is None:
        raise UserError("--replicas needs Ray Serve: pip install 'flashspec[ray]'")
    from ..cluster.launch import Cluster
    from ..cluster.settings import ClusterSettings

    replicas = args.replicas or 1
    if args.max_replicas is not None and args.max_replicas < replicas:
        raise UserError(
            f"--max-replicas {args.max_replicas} is below --replicas {replicas}; "
            "autoscaling runs between the two"
        )
    settings = ClusterSettings(
        engine=EngineOptions.from_args(args),
        replicas=replicas,
        max_replicas=args.max_replicas,
        replica_cpus=args.replica_cpus,
        model_name=args.model_name or args.target,
        max_batch=args.max_batch,
        batching=args.batching,
        max_queue=args.max_queue,
        timeout_s=args.timeout,
        api_key=api_key,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    cluster = Cluster(settings, host=args.host, port=args.port)
    where = os.environ.get(RAY_ADDRESS_ENV) or "a local Ray head"
    scaling = (
        f"{replicas}..{args.max_replicas} replicas (autoscaling)"
        if settings.autoscaling
        else f"{replicas} replica(s)"
    )
    print(
        f"flashspec serve: starting {scaling} on {where}; each builds its engine first",
        file=sys.stderr,
        flush=True,
    )
    _stop_on_signals()
    try:
        cluster.start()
        print(
            f"flashspec serve: {settings.model_name!r} on {cluster.url}/v1 ({scaling}, "
            f"{args.replica_cpus:g} CPU each, max batch {args.max_batch}, API key "
            f"{'on' if api_key else 'off'}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        cluster.wait()
    except KeyboardInterrupt:
        print("flashspec serve: stopping the replicas", file=sys.stderr)
    finally:
        cluster.stop()
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM stop the replicas through ``Cluster.stop``, as uvicorn's handlers
    stop the single-process server. Python raises KeyboardInterrupt on SIGINT only when
    SIGINT was not ignored at start, and a shell starts background jobs with it ignored (a
    server launched with ``&`` then never stopped on Ctrl-C); SIGTERM, what ``docker stop``,
    systemd and Kubernetes send, would end the process without taking Ray down."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
