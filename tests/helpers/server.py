"""Shared helpers of the server tests: HTTP on 127.0.0.1, metrics, OpenAI error shape, and a
tiny engine (seeded 2-layer Llama, character tokenizer) for tests that need a fast one.

Imported by tests/serve/test_server*.py; every wait here is bounded in time.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashspec.serve import ServerThread, create_app
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

# The tiny target's context (build_llama's max_position_embeddings).
TINY_CONTEXT = 256
# Header and body read limits of the tiny servers: short enough to test, long enough for a
# loaded 2-core machine to send a request in time.
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
# How long past a deadline a server may take to act on it.
SLACK_S = 3.0


def request(
    server: ServerThread,
    method: str,
    path: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> tuple[int, dict[str, str], Any]:
    """One HTTP request; returns (status, lower-cased headers, JSON body or text)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.request(
            method,
            path,
            body=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        response = connection.getresponse()
        raw = response.read().decode()
        got = {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()
    try:
        return response.status, got, json.loads(raw)
    except ValueError:
        return response.status, got, raw


def open_stream(
    server: ServerThread,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> tuple[Any, Any]:
    """Start a streaming request; returns (connection, response) with headers read."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    connection.request(
        "POST",
        path,
        body=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return connection, connection.getresponse()


def read_stream_text(response: Any, each_line: Callable[[], None] | None = None) -> tuple[str, int]:
    """A streamed completion's text and its usage count, asserting no error event arrived;
    ``each_line`` runs before each line is read on (a slow client)."""
    pieces: list[str] = []
    usage = 0
    for line in response:
        if each_line is not None:
            each_line()
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: ") :])
        assert "error" not in event, event
        pieces.extend(c["text"] for c in event["choices"])
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
    return "".join(pieces), usage


def metric(
    server: ServerThread, name: str, headers: dict[str, str] | None = None, **labels: str
) -> float:
    """A counter or gauge from /metrics (0 when absent)."""
    status, _, text = request(server, "GET", "/metrics", headers=headers)
    assert status == 200
    want = (
        name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        if labels
        else name
    )
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def metric_lines(
    server: ServerThread, prefix: str, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """Every sample of /metrics whose name starts with ``prefix``: {name{labels}: value}."""
    status, _, text = request(server, "GET", "/metrics", headers=headers)
    assert status == 200
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def interrupt(process: Any, timeout: float) -> int:
    """Ctrl-C a server subprocess and return its exit code (killed, and the wait's error
    raised, if it does not exit within ``timeout`` seconds)."""
    process.send_signal(signal.SIGINT)
    try:
        return int(process.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def assert_error(body: Any, status: int, param: str | None = None) -> dict[str, Any]:
    """``body`` is OpenAI's error shape; when ``param`` is given, it names that field."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0] in error["message"], error
    return dict(error)


# ------------------------------------------------------------------------------------ raw HTTP


def raw_connection(server: ServerThread, timeout: float = 10.0) -> socket.socket:
    """A plain TCP connection to the server (for partial, stalled or broken requests)."""
    return socket.create_connection((server.host, server.port), timeout=timeout)


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout`` passes)."""
    sock.settimeout(timeout)
    end = time.monotonic() + timeout
    chunks: list[bytes] = []
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, JSON body or text) of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = body[: int(headers["content-length"])]
    try:
        return status, headers, json.loads(body)
    except ValueError:
        return status, headers, body.decode("latin-1")


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One raw response: its headers and Content-Length bytes of body, or what came before the
    server closed the connection (or ``timeout`` passed)."""
    sock.settimeout(timeout)
    end = time.monotonic() + timeout
    data = b""
    while time.monotonic() < end:
        head, found, body = data.partition(b"\r\n\r\n")
        if found:
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(body) >= length:
                return data
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


# ------------------------------------------------------------------------------------ engine


@dataclass
class Served:
    """A running server and its app (``app.state.service`` for tests that reach inside)."""

    server: ServerThread
    app: Any


def serve_tiny(**settings: Any) -> Served:
    """A started server over a fresh ``tiny_engine()`` (call ``server.stop()``), with short
    header and body deadlines; ``settings`` override ``create_app``'s."""
    options: dict[str, Any] = {
        "model_name": "tiny",
        "max_batch": 8,
        "max_queue": 64,
        "timeout_s": 30.0,
        "body_timeout_s": BODY_TIMEOUT_S,
        **settings,
    }
    app = create_app(tiny_engine(), **options)
    return Served(ServerThread(app, header_timeout_s=HEADER_TIMEOUT_S).start(), app)


def tiny_reference() -> Callable[..., Any]:
    """Batch-1 greedy generation on a tiny engine of its own, memoised:
    ``generate(prompt text or ids, max_tokens, stop=None)`` -> GenerationResult."""
    engine = tiny_engine()
    cache: dict[tuple[Any, ...], Any] = {}

    def generate(prompt: str | list[int], max_tokens: int, stop: str | None = None) -> Any:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, stop)
        if key not in cache:
            batch = prompt if isinstance(prompt, str) else [prompt]
            cache[key] = engine.generate(batch, max_new_tokens=max_tokens, stop=stop)
        return cache[key]

    return generate


def five_xx(server: ServerThread) -> dict[str, float]:
    """The requests_total samples of /metrics with a 5xx status (the server's own count)."""
    samples = metric_lines(server, "flashspec_requests_total{")
    return {k: v for k, v in samples.items() if 'status="5' in k}


def check_reference_request(server: ServerThread, reference: Callable[..., Any]) -> None:
    """The tiny server still answers a greedy completion exactly as batch 1 does."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    status, _, answer = request(server, "POST", "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference("def f(x):", 8).texts[0]


def tiny_engine(gamma: int = 3) -> Any:
    """A fast engine: a seeded 2-layer Llama (context TINY_CONTEXT) over the character
    tokenizer, drafted by a perturbed copy of itself. Equal calls give equal engines."""
    from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
    from flashspec.drafters import ModelDrafter

    target = build_llama(0, init_range=0.3, max_positions=TINY_CONTEXT)
    return SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=gamma)),
        [ModelDrafter(perturbed_copy(target, 0.02, seed=1), name="draft")],
        TargetModel("tiny", model=target, tokenizer=build_char_tokenizer()),
    )
