"""``flashspec serve`` shutting down (issue 38, item 8): on SIGTERM or Ctrl-C the server stops
admitting, ends queued generations at once, lets running ones go on for the grace
(``shutdown_timeout_s``), then ends them with an OpenAI-shaped error and exits.

The engine is the tiny one, slowed by a sleep before each target forward so that generations
outlast the grace, with EOS ignored so that every row runs to its ``max_tokens``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashspec.serve import ServerThread, create_app
from tests.helpers.server import assert_error, metric, open_stream, request, tiny_engine, wait_for

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 1.0
# Seconds a target forward sleeps: a 200-token generation takes several seconds.
DELAY_S = 0.1
LONG = {"prompt": "def f(x):", "max_tokens": 200, "temperature": 0}

# The server in a process of its own, as a process manager runs it: the tiny engine, slowed,
# behind serve(); it prints its port, then serves until a signal.
SERVER = """
import functools, sys, time
sys.path.insert(0, {root!r})
from tests.helpers.server import tiny_engine
from flashspec.serve import bind, serve

engine = tiny_engine()
engine.target.model.register_forward_pre_hook(lambda module, args: time.sleep({delay!r}))
engine.stream = functools.partial(engine.stream, ignore_eos=True)
listener = bind("127.0.0.1", 0)
print(listener.getsockname()[1], flush=True)
serve(
    engine, sock=listener, model_name="tiny", max_batch=8, timeout_s=120.0,
    log_level="warning", shutdown_timeout_s={grace!r},
)
"""


def events(response: Any) -> Iterator[tuple[float, str]]:
    """(arrival time, data) of each server-sent event until the stream ends."""
    for line in response:
        if line.startswith(b"data: "):
            yield time.monotonic(), line[len(b"data: ") :].strip().decode()


def ended_by_shutdown(data: str) -> bool:
    """Whether this event is the error that ends a stream when the server shuts down."""
    if data == "[DONE]":
        return False
    event = json.loads(data)
    if "error" not in event:
        return False
    assert_error(event, 503)
    return bool(event["error"]["code"] == "shutting_down")


@pytest.fixture
def process() -> Iterator[tuple[subprocess.Popen[str], SimpleNamespace]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    script = SERVER.format(root=str(ROOT), delay=DELAY_S, grace=GRACE_S)
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = child.stdout.readline().strip()
        assert port.isdigit(), f"the server did not start: {port!r}"
        yield child, SimpleNamespace(host="127.0.0.1", port=int(port))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_sigterm_with_16_long_requests_exits_within_the_grace(
    process: tuple[subprocess.Popen[str], SimpleNamespace],
) -> None:
    child, server = process
    streams = []
    for i in range(8):
        connection, response = open_stream(server, {**LONG, "prompt": f"def f{i}(x):"})
        assert response.status == 200
        streams.append((connection, response, events(response)))
    for _, _, stream in streams:
        next(stream)  # running in the engine
    with ThreadPoolExecutor(8) as pool:
        queued = [pool.submit(request, server, "POST", "/v1/completions", LONG) for _ in range(8)]
        assert wait_for(lambda: metric(server, "flashspec_queue_depth") == 8, 30)

        signalled = time.monotonic()
        child.send_signal(signal.SIGTERM)
        answers = [future.result(timeout=30) for future in queued]
        refused_after = time.monotonic() - signalled
        ends = []
        for connection, _, stream in streams:
            seen = list(stream)
            connection.close()
            assert seen, "the stream ended without an event"
            after = [at for at, data in seen[:-1] if at > signalled]
            assert after, "a running generation went on during the grace"
            at, last = seen[-1]
            assert ended_by_shutdown(last), seen[-3:]
            assert all(data != "[DONE]" for _, data in seen)
            ends.append(at - signalled)
        code = child.wait(timeout=GRACE_S + 5)
        exited_after = time.monotonic() - signalled
    for status, _, answer in answers:
        assert status == 503, answer
        assert assert_error(answer, status)["code"] == "shutting_down"
    assert refused_after < GRACE_S, f"queued requests waited {refused_after:.2f} s"
    assert min(ends) >= GRACE_S * 0.8, f"streams ended {min(ends):.2f} s into a {GRACE_S} s grace"
    assert exited_after < GRACE_S + 5, f"exited {exited_after:.2f} s after SIGTERM"
    assert code in (0, -signal.SIGTERM), code
    assert child.stderr is not None
    stderr = child.stderr.read()
    assert "Traceback" not in stderr and "Cancel" not in stderr, stderr


def slowed_server(grace_s: float) -> ServerThread:
    engine = tiny_engine()
    engine.target.model.register_forward_pre_hook(lambda module, args: time.sleep(0.05))
    engine.stream = functools.partial(engine.stream, ignore_eos=True)  # type: ignore[method-assign]
    app = create_app(engine, model_name="tiny", max_batch=4, timeout_s=60.0)
    return ServerThread(app, shutdown_timeout_s=grace_s).start()


def test_a_generation_that_finishes_within_the_grace_is_answered_in_full() -> None:
    server = slowed_server(grace_s=20.0)
    body = {"prompt": "def f(x):", "max_tokens": 24, "temperature": 0}
    answers: list[Any] = []
    sender = threading.Thread(
        target=lambda: answers.append(request(server, "POST", "/v1/completions", body))
    )
    sender.start()
    try:
        assert wait_for(lambda: metric(server, "flashspec_running_rows") == 1, 30)
    finally:
        start = time.monotonic()
        server.stop()
        took = time.monotonic() - start
        sender.join(30)
    status, _, answer = answers[0]
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 24
    assert answer["choices"][0]["finish_reason"] == "length"
    assert took < 10, f"stopping took {took:.2f} s: the grace is a bound, not a wait"


def test_no_grace_ends_a_running_stream_at_once() -> None:
    server = slowed_server(grace_s=0.0)
    connection, response = open_stream(server, {**LONG, "max_tokens": 200})
    try:
        assert response.status == 200
        stream = events(response)
        next(stream)
        start = time.monotonic()
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        seen = list(stream)
        took = time.monotonic() - start
        stopper.join(30)
    finally:
        connection.close()
    assert seen and ended_by_shutdown(seen[-1][1]), seen[-3:]
    assert took < 3, f"the stream ended {took:.2f} s after the shutdown began"
