"""``flashspec serve`` against hostile HTTP framing (issue 38, items 1 and 3-6): pipelined
oversized headers, trailing-slash redirects, bodies that are not JSON, HEAD probes, and
Content-Length with Transfer-Encoding.

Every refusal is a 4xx in OpenAI's error shape. Requests go over raw sockets on 127.0.0.1 to a
tiny engine's server, so each test takes well under a second.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashspec.serve import DEFAULT_MAX_HEADER_BYTES, ServerThread
from tests.helpers.server import (
    Served,
    assert_error,
    five_xx,
    parse_response,
    raw_connection,
    read_response,
    read_until_closed,
    request,
)

COMPLETION = {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}


def responses(raw: bytes) -> list[tuple[int, dict[str, str], Any]]:
    """Every response in ``raw`` (a connection's whole output), in order."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        found.append(parse_response(head + b"\r\n\r\n" + rest[:length]))
        raw = rest[length:]
    return found


def post(path: str, body: bytes, headers: str = "Content-Type: application/json\r\n") -> bytes:
    """A raw HTTP/1.1 POST of ``body`` with these extra header lines."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def big_get(size: int) -> bytes:
    """A GET /health whose headers take about ``size`` bytes."""
    return b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"


# ------------------------------------------------------------------------ 1. pipelined headers


@pytest.mark.parametrize("size", [20_000, 60_000, 100_000])
@pytest.mark.parametrize(
    "first",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        post("/v1/completions", json.dumps(COMPLETION).encode()),
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2,
    ],
    ids=["get", "post-with-body", "two-gets"],
)
def test_pipelined_headers_over_the_limit_are_refused(
    tiny: Served, first: bytes, size: int
) -> None:
    with raw_connection(tiny.server) as sock:
        sock.sendall(first + big_get(size))
        answers = responses(read_until_closed(sock))
    *earlier, last = answers
    assert [status for status, _, _ in earlier] == [200] * first.count(b" HTTP/1.1\r\n"), answers
    status, headers, body = last
    assert status == 431, answers
    assert assert_error(body, status)["code"] == "headers_too_large"
    assert headers.get("connection") == "close"


def test_oversized_headers_arriving_while_a_request_runs_are_refused(tiny: Served) -> None:
    long = {**COMPLETION, "max_tokens": 150}
    with raw_connection(tiny.server) as sock:
        sock.sendall(post("/v1/completions", json.dumps(long).encode()))
        time.sleep(0.05)  # the first request is being answered; these bytes wait in h11
        sock.sendall(big_get(40_000))
        answers = responses(read_until_closed(sock))
    assert [status for status, _, _ in answers] == [200, 431], answers


def test_pipelined_headers_within_the_limit_are_answered(tiny: Served) -> None:
    with raw_connection(tiny.server) as sock:
        small = DEFAULT_MAX_HEADER_BYTES - 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + big_get(small)[:-2])
        sock.sendall(b"Connection: close\r\n\r\n")
        answers = responses(read_until_closed(sock))
    assert [status for status, _, _ in answers] == [200, 200], answers


# ------------------------------------------------------------------------ 3. trailing slashes


@pytest.mark.parametrize(
    ("method", "path", "right"),
    [
        ("POST", "/v1/completions/", "/v1/completions"),
        ("POST", "/v1/chat/completions/", "/v1/chat/completions"),
        ("GET", "/health/", "/health"),
        ("GET", "/metrics//", "/metrics"),
        ("GET", "/v1/models/tiny/", None),
    ],
)
def test_a_trailing_slash_is_a_404_never_a_redirect(
    tiny: Served, method: str, path: str, right: str | None
) -> None:
    body = json.dumps(COMPLETION).encode() if method == "POST" else b""
    with raw_connection(tiny.server) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: evil.example:666\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        status, headers, answer = parse_response(read_until_closed(sock))
    assert status == 404, answer
    assert "location" not in headers
    error = assert_error(answer, status)
    assert "evil.example" not in json.dumps(answer)
    if right is not None:
        assert f"did you mean {right}, without the trailing slash" in error["message"]


# ------------------------------------------------------------------------ 4. content types


def send_typed(server: ServerThread, path: str, content_type: str | None) -> tuple[int, Any]:
    body = json.dumps(
        COMPLETION if path == "/v1/completions" else {"messages": [{"role": "user"}]}
    ).encode()
    headers = "" if content_type is None else f"Content-Type: {content_type}\r\n"
    with raw_connection(server) as sock:
        sock.sendall(post(path, body, headers + "Connection: close\r\n"))
        status, _, answer = parse_response(read_until_closed(sock))
    return status, answer


REFUSED_TYPES = [
    None,
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "text/json",
    "application/jsonx",
    "application/json; charset=utf-16",
    'application/json; charset="latin-1"',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", REFUSED_TYPES)
def test_bodies_that_are_not_json_are_a_415(
    tiny: Served, path: str, content_type: str | None
) -> None:
    before = five_xx(tiny.server)
    status, answer = send_typed(tiny.server, path, content_type)
    assert status == 415, answer
    error = assert_error(answer, status)
    assert error["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in error["message"]
    assert five_xx(tiny.server) == before


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "application/json; charset=utf-8", 'Application/JSON;Charset="UTF-8"'],
)
def test_json_bodies_are_read_whatever_the_spelling(tiny: Served, content_type: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, answer = send_typed(tiny.server, path, content_type)
        assert status == 200, answer


def test_a_cors_preflight_is_refused_and_nothing_allows_other_origins(tiny: Served) -> None:
    headers = {
        "Origin": "https://evil.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    status, got, answer = request(tiny.server, "OPTIONS", "/v1/completions", headers=headers)
    assert status == 405, answer
    assert_error(answer, status)
    status, got, _ = request(
        tiny.server, "POST", "/v1/completions", COMPLETION, {"Origin": "https://evil.example"}
    )
    assert status == 200
    assert not any(name.startswith("access-control-") for name in got), got


# ------------------------------------------------------------------------ 5. HEAD


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/models/tiny"])
def test_head_is_answered_like_get_without_a_body(tiny: Served, path: str) -> None:
    connection = http.client.HTTPConnection(tiny.server.host, tiny.server.port, timeout=10)
    try:
        connection.request("HEAD", path)
        response = connection.getresponse()
        assert response.status == 200, path
        assert response.read() == b""
        assert int(response.getheader("content-length") or 0) > 0
        connection.request("GET", path)  # the connection is still good
        assert connection.getresponse().status == 200
    finally:
        connection.close()


# ------------------------------------------------------------------------ 6. request smuggling


CHUNKED = b'9\r\n{"a": 1}\n\r\n0\r\n\r\n'


@pytest.mark.parametrize(
    "framing",
    [
        f"Content-Length: {len(CHUNKED)}\r\nTransfer-Encoding: chunked\r\n",
        f"Transfer-Encoding: chunked\r\nContent-Length: {len(CHUNKED)}\r\n",
        "Content-Length: 0\r\nTransfer-Encoding: chunked\r\n",
        f"content-length: {len(CHUNKED)}\r\ntransfer-encoding: chunked\r\n",
    ],
    ids=["cl-te", "te-cl", "cl-zero", "lower-case"],
)
def test_content_length_with_transfer_encoding_is_refused_and_closed(
    tiny: Served, framing: str
) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing
    )
    with raw_connection(tiny.server) as sock:
        sock.sendall(head.encode() + b"\r\n" + CHUNKED + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = responses(read_until_closed(sock))
    assert len(answers) == 1, answers  # the pipelined GET is never answered: the server closed
    status, headers, body = answers[0]
    assert status == 400, answers
    error = assert_error(body, status)
    assert "Content-Length and Transfer-Encoding" in error["message"]
    assert headers.get("connection") == "close"


def test_a_smuggled_request_is_never_answered(tiny: Served) -> None:
    # A proxy trusting Content-Length would see one request; one trusting Transfer-Encoding
    # two, the second (GET /metrics) hidden in the first's body.
    smuggled = b"0\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(smuggled)}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    with raw_connection(tiny.server) as sock:
        sock.sendall(head.encode() + smuggled)
        raw = read_until_closed(sock)
    assert [status for status, _, _ in responses(raw)] == [400], raw
    assert b"flashspec_" not in raw


def test_a_chunked_body_alone_is_fine(tiny: Served) -> None:
    data = json.dumps(COMPLETION).encode()
    chunked = f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    with raw_connection(tiny.server) as sock:
        sock.sendall(head.encode() + chunked)
        status, _, answer = parse_response(read_response(sock))
    assert status == 200, answer
