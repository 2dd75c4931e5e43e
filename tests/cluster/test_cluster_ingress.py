"""The Ray ingress applies the single-process server's framing limits (issue 38) before it
reads or forwards a body: headers over 16 KiB (431), Content-Length with Transfer-Encoding
(400, closed), a body that is not JSON (415, once the API key checks out).

The ingress's ASGI app runs here without a cluster: a stand-in for the Ray handle records what
would have been forwarded and answers 200. Needs Ray installed (the module imports it), not
running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from flashspec.cluster.forward import REPLICA_HEADER, Forwarded, Head
from flashspec.cluster.ingress import INGRESS, Ingress, ingress_metrics
from flashspec.cluster.settings import ClusterSettings
from tests.helpers.server import assert_error

KEY = "k"
JSON = (b"content-type", b"application/json")
AUTH = (b"authorization", f"Bearer {KEY}".encode())


class Replicas:
    """Stands in for the replicas' Ray handle: records each request, answers 200 ``{}``."""

    def __init__(self) -> None:
        self.forwarded: list[Forwarded] = []
        self.handle = SimpleNamespace(remote=self._remote)

    def _remote(self, forwarded: Forwarded) -> Any:
        self.forwarded.append(forwarded)
        return _Parts([Head(200, (JSON,)), b"{}"])


class _Parts:
    def __init__(self, items: list[Head | bytes]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Head | bytes]:
        return self

    async def __anext__(self) -> Head | bytes:
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.items = []


def ingress(api_key: str | None = KEY) -> tuple[Ingress, Replicas]:
    replicas = Replicas()
    made = Ingress.__new__(Ingress)  # its __init__ reaches the Ray cluster for the board
    made.engines = replicas
    made.settings = ClusterSettings(api_key=api_key, replicas=1)
    made.metrics = ingress_metrics()
    return made, replicas


def call(
    app: Ingress,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"{}",
    path: str = "/v1/completions",
    method: str = "POST",
) -> tuple[int, dict[str, str], Any]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app._app(scope, receive, send))
    start = sent[0]
    got = {bytes(k).decode().lower(): bytes(v).decode() for k, v in start["headers"]}
    raw = b"".join(m.get("body", b"") for m in sent[1:])
    return int(start["status"]), got, json.loads(raw)


def test_a_json_request_is_forwarded() -> None:
    app, replicas = ingress()
    status, _, answer = call(app, [JSON, AUTH, (b"content-length", b"2")])
    assert status == 200 and answer == {}
    assert len(replicas.forwarded) == 1


@pytest.mark.parametrize(
    "content_type", [None, b"text/plain", b"application/x-www-form-urlencoded"]
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_that_is_not_json_is_refused_before_forwarding(
    content_type: bytes | None, path: str
) -> None:
    app, replicas = ingress()
    headers = [AUTH] + ([(b"content-type", content_type)] if content_type else [])
    status, got, answer = call(app, headers, path=path)
    assert status == 415, answer
    assert assert_error(answer, status)["code"] == "unsupported_media_type"
    assert got[REPLICA_HEADER] == INGRESS and not replicas.forwarded


def test_without_the_key_the_replica_answers() -> None:
    app, replicas = ingress()
    status, _, _ = call(app, [(b"content-type", b"text/plain")])
    assert status == 200 and len(replicas.forwarded) == 1  # the stand-in's 200: the replica's 401
    app, replicas = ingress(api_key=None)
    status, _, _ = call(app, [(b"content-type", b"text/plain")])
    assert status == 415 and not replicas.forwarded


@pytest.mark.parametrize(
    "framing",
    [
        [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")],
        [(b"transfer-encoding", b"chunked"), (b"content-length", b"0")],
    ],
)
def test_content_length_with_transfer_encoding_is_refused_and_closed(
    framing: list[tuple[bytes, bytes]],
) -> None:
    app, replicas = ingress()
    status, got, answer = call(app, [JSON, AUTH, *framing])
    assert status == 400, answer
    assert "Content-Length and Transfer-Encoding" in assert_error(answer, status)["message"]
    assert got.get("connection") == "close" and not replicas.forwarded


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_headers_over_the_limit_are_a_431(method: str) -> None:
    app, replicas = ingress()
    big = [(b"x-big-%d" % i, b"a" * 1000) for i in range(17)]
    status, _, answer = call(app, [JSON, AUTH, *big], method=method, path="/v1/models")
    assert status == 431, answer
    assert assert_error(answer, status)["code"] == "headers_too_large"
    assert not replicas.forwarded
    status, _, _ = call(app, [JSON, AUTH, *big[:14]], method=method, path="/v1/models")
    assert status == 200  # under the limit: forwarded
