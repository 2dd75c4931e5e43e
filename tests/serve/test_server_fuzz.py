"""Fuzzing ``flashspec serve`` with hypothesis: whatever a client sends, the server answers
with no 5xx, every 4xx comes in OpenAI's error shape, and afterwards the server still answers a
reference request exactly as batch-1 generation does.

Bodies mix valid and invalid values for every field of both endpoints (lone surrogates, tiny
temperatures, huge numbers, deep nesting, unknown fields), sent as JSON, as CESU-8 and as
raw bytes; the HTTP layer gets junk request lines and headers. A tiny engine and small
``max_examples`` keep the file within seconds (``deadline=None``: a shared machine's timing
varies); every request has a timeout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.server import (
    HEADER_TIMEOUT_S,
    SLACK_S,
    Served,
    assert_error,
    check_reference_request,
    five_xx,
    metric,
    parse_response,
    raw_connection,
    read_response,
    request,
    serve_tiny,
    tiny_reference,
    wait_for,
)

FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------------------------ values

# Strings a client could send, including what breaks careless code: lone surrogates, NUL,
# special-token text, characters the tokenizer does not know.
nasty_text = st.sampled_from(
    ["", "x", "\ud800", "a\udfffb", "\ud83d\ude00", "\x00", "<s>", "</s>", "é", "\n\n", " " * 40]
)
text = st.one_of(nasty_text, st.text(st.characters(), max_size=12))
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 0.0, -0.0, 1e-300, 5e-324, 1e-38, 2.0, 2.0000001, 2**63, 2**64]),
)
# Any JSON value at all.
json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=10,
)
# Text every tokenizer accepts (no lone surrogates); it may still hold special-token text.
clean_text = st.one_of(
    st.sampled_from(
        ["x", "def f(x):", "<s>", "</s>", "é", "\n\n", " " * 40, "\x00", "\ud83d\ude00"]
    ),
    st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12),
)
clean_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), clean_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(clean_text, inner, max_size=3)
    ),
    max_leaves=6,
)
small_ids = st.lists(st.integers(0, 57), min_size=1, max_size=40)
# Text that reaches the tokenizer: mostly clean, sometimes nasty (a lone surrogate...).
prompt_text = st.one_of(clean_text, clean_text, clean_text, nasty_text)

# Valid values of every field: bodies built from them reach the engine (short generations,
# so examples stay fast), and ``mutated`` sets one field to anything at all to probe its
# checks.
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1.0, 1e-300, 5e-324, 1e-38, 2.0]),
    "top_p": st.floats(1e-6, 1.0),
    "top_k": st.integers(0, 100),
    "stop": st.one_of(clean_text, st.lists(clean_text, min_size=1, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 2),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.sampled_from([0, 0.0, 0.5, -2]),
    "logit_bias": st.dictionaries(st.integers(0, 50).map(str), st.floats(-100, 100), max_size=3),
    "user": clean_json,
    "metadata": clean_json,
}
COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **COMMON,
    "echo": st.just(False),
    "suffix": st.just(""),
    "best_of": st.just(1),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
}
prompt = st.one_of(
    prompt_text,
    st.lists(prompt_text, min_size=1, max_size=3),
    small_ids,
    st.lists(small_ids, min_size=1, max_size=3),
)
part = st.fixed_dictionaries({"type": st.just("text"), "text": prompt_text})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
        "content": st.one_of(prompt_text, st.none(), st.lists(part, max_size=3)),
    },
    optional={"name": clean_text, "tool_call_id": clean_text},
)
CHAT: dict[str, st.SearchStrategy[Any]] = {
    **COMMON,
    "max_completion_tokens": st.integers(1, 6),
    "tools": st.just([]),
    "tool_choice": st.just("none"),
    "response_format": st.just({"type": "text"}),
    "logprobs": st.booleans(),
}
# Names of fields the API does not have, to put anything in.
odd_names = st.one_of(st.sampled_from(["max_token", "", "prompt ", "\ud800"]), text)


@st.composite
def mutated(
    draw: st.DrawFn,
    required: dict[str, st.SearchStrategy[Any]],
    optional: dict[str, st.SearchStrategy[Any]],
) -> dict[str, Any]:
    """A valid body; half the time with one field (the API's or not) holding any JSON value."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.booleans()):
        name = draw(st.one_of(st.sampled_from(sorted({*required, *optional})), odd_names))
        body[name] = draw(json_value)
    return body


completion_body = mutated({"prompt": prompt}, COMPLETION)
chat_body = mutated({"messages": st.lists(message, min_size=1, max_size=3)}, CHAT)


@st.composite
def encoded(draw: st.DrawFn, bodies: st.SearchStrategy[dict[str, Any]]) -> bytes:
    """A body as bytes: JSON (ASCII-escaped, or UTF-8 with surrogates as CESU-8), cut short,
    nested deep, or random bytes."""
    kind = draw(st.sampled_from(["ascii", "ascii", "utf8", "utf8", "cut", "deep", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    body = draw(bodies)
    data = json.dumps(body, ensure_ascii=kind == "ascii").encode("utf-8", "surrogatepass")
    if kind == "cut":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    if kind == "deep":
        depth = draw(st.sampled_from([50, 900, 5000, 100_000]))
        nest = b"[" * depth + b"]" * depth
        return data[:-1] + (b", " if len(data) > 2 else b"") + b'"user": ' + nest + b"}"
    return data


# ------------------------------------------------------------------------------------ checks


def check_answer(status: int, headers: dict[str, str], answer: Any) -> None:
    """No 5xx; a 4xx in OpenAI's shape; a 200 well formed (JSON, or events that end well)."""
    event(f"status {status}")  # --hypothesis-show-statistics: how often each answer came
    assert status < 500, (status, answer)
    if status >= 400:
        assert_error(answer, status)
        return
    assert status == 200
    if headers.get("content-type", "").startswith("text/event-stream"):
        assert isinstance(answer, str) and answer.rstrip().endswith("data: [DONE]"), answer
        for line in answer.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
        return
    assert isinstance(answer, dict) and "choices" in answer, answer


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Served]:
    served = serve_tiny(timeout_s=20.0)
    try:
        yield served
    finally:
        served.server.stop()


@FUZZ
@given(body=encoded(completion_body))
def test_completion_bodies(fuzzed: Served, body: bytes) -> None:
    check_answer(*request(fuzzed.server, "POST", "/v1/completions", body, timeout=30))


@FUZZ
@given(body=encoded(chat_body))
def test_chat_bodies(fuzzed: Served, body: bytes) -> None:
    check_answer(*request(fuzzed.server, "POST", "/v1/chat/completions", body, timeout=30))


header_name = st.text(st.characters(codec="latin-1"), max_size=12)
header_value = st.text(st.characters(codec="latin-1"), max_size=40)


@settings(FUZZ, max_examples=40)
@given(
    line=st.one_of(
        st.sampled_from(
            [
                b"GET /health HTTP/1.1",
                b"POST /v1/completions HTTP/1.1",
                b"GET /health HTTP/1.0",
                b"BREW /pot HTCPCP/1.0",
                b"GET  HTTP/1.1",
                b"GET /\x00 HTTP/1.1",
            ]
        ),
        st.binary(max_size=40).filter(lambda b: b"\r\n" not in b),
    ),
    headers=st.lists(st.tuples(header_name, header_value), max_size=4),
    body=st.binary(max_size=32),
)
def test_raw_http(fuzzed: Served, line: bytes, headers: list[tuple[str, str]], body: bytes) -> None:
    head = b"".join(
        f"{name}: {value}\r\n".encode("latin-1") for name, value in [("Host", "x"), *headers]
    )
    with raw_connection(fuzzed.server) as sock:
        sock.sendall(line + b"\r\n" + head + b"Connection: close\r\n\r\n" + body)
        raw = read_response(sock, timeout=HEADER_TIMEOUT_S + SLACK_S + 2)
    if not raw:
        return  # closed without an answer: an incomplete request that timed out
    status, got, answer = parse_response(raw)
    assert status < 500, raw
    if status >= 400 and got.get("content-type", "").startswith("application/json"):
        assert_error(answer, status)
    # uvicorn's own 4xx (none expected) would be plain text; every one here is JSON.
    assert status < 400 or got.get("content-type", "").startswith("application/json"), raw


def test_after_fuzzing_the_server_is_well(fuzzed: Served) -> None:
    check_reference_request(fuzzed.server, tiny_reference())
    assert not five_xx(fuzzed.server), five_xx(fuzzed.server)
    assert wait_for(lambda: metric(fuzzed.server, "flashspec_running_rows") == 0)
    assert metric(fuzzed.server, "flashspec_queue_depth") == 0
