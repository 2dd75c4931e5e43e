"""``flashspec serve`` against hostile input (issue 28): no 5xx from anything a client sends, no
request changing another's output, no connection held without bound.

A tiny engine (2-layer Llama, character tokenizer, context 256) keeps every test fast; greedy
outputs are compared with batch-1 ``engine.generate`` on an engine of their own. Stalled and
broken uploads are sent over raw sockets on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashspec.serve import FALLBACK_CHAT_STOP, ServerThread
from tests.helpers.server import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    SLACK_S,
    TINY_CONTEXT,
    Served,
    assert_error,
    check_reference_request,
    five_xx,
    metric,
    open_stream,
    parse_response,
    raw_connection,
    read_stream_text,
    read_until_closed,
    request,
    serve_tiny,
    wait_for,
)


def completion(server: ServerThread, body: dict[str, Any] | bytes) -> tuple[int, Any]:
    status, _, answer = request(server, "POST", "/v1/completions", body)
    return status, answer


def chat(server: ServerThread, body: dict[str, Any] | bytes) -> tuple[int, Any]:
    status, _, answer = request(server, "POST", "/v1/chat/completions", body)
    return status, answer


# ------------------------------------------------------------------------ 2. deep nesting


DEEP = 100_000


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 1000 + b"]" * 1000,
        b"{" + b'"a":{' * 5000 + b"}" * 5001,
        b'{"prompt": "x", "user": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        b'{"prompt": "x", "metadata": ' + b'{"k": ' * DEEP + b"1" + b"}" * DEEP + b"}",
        b'{"messages": [{"role": "user", "content": ' + b"[" * DEEP + b"]" * DEEP + b"}]}",
    ],
    ids=["array", "object", "in-ignored-user", "in-ignored-metadata", "in-content"],
)
def test_deeply_nested_json_is_a_400(tiny: Served, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _, answer = request(tiny.server, "POST", path, body)
        assert status == 400, answer
        assert assert_error(answer, status)["code"] == "invalid_json"


def test_nesting_that_parses_stays_a_4xx_or_is_ignored(tiny: Served) -> None:
    nested = json.loads("[" * 400 + "]" * 400)
    status, answer = completion(
        tiny.server, {"prompt": "x", "max_tokens": 1, "temperature": 0, "user": nested}
    )
    assert status == 200, answer  # a harmless field, ignored whatever it holds
    status, answer = completion(tiny.server, {"prompt": "x", "max_tokens": 1, "stop": nested})
    assert status == 400
    assert_error(answer, status, "stop")
    status, answer = completion(tiny.server, {"prompt": nested})
    assert status == 400
    assert_error(answer, status, "prompt")


# ------------------------------------------------------------------------ 3. lone surrogates


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt.1"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/completions", b'{"prompt": "x", "model": "\\ude00"}', "model"),
        ("/v1/completions", b'{"prompt": "x", "user": "\\ud800\\ud800"}', "user"),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', None),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(
    tiny: Served, path: str, body: bytes, param: str | None
) -> None:
    status, _, answer = request(tiny.server, "POST", path, body)
    assert status == 400, answer
    error = assert_error(answer, status, param)
    assert error["code"] == "invalid_unicode" and "surrogate" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a\xed\xa0\x80b"}',  # CESU-8: U+D800 encoded as if it were a character
        b'{"prompt": "\xed\xa0\xbd\xed\xb8\x80"}',  # CESU-8 of a surrogate pair
        b'{"prompt": "\xff"}',
    ],
)
def test_bytes_that_are_not_utf8_are_a_400(tiny: Served, body: bytes) -> None:
    status, answer = completion(tiny.server, body)
    assert status == 400, answer
    assert "UTF-8" in assert_error(answer, status)["message"]


def test_surrogate_pairs_and_unknown_characters_are_fine(
    tiny: Served, reference: Callable[..., Any]
) -> None:
    body = b'{"prompt": "\\ud83d\\ude00 \xc3\xa9", "max_tokens": 4, "temperature": 0}'
    status, answer = completion(tiny.server, body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference("\U0001f600 é", 4).texts[0]


# ------------------------------------------------------------------------ 4. tiny temperatures


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_tiny_temperature_is_greedy(
    tiny: Served, reference: Callable[..., Any], temperature: float
) -> None:
    prompt = "def quicksort(arr):"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": temperature}
    status, answer = completion(tiny.server, body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference(prompt, 12).texts[0]


# ------------------------------------------------------------------------ 5. tokenizing


def test_health_answers_while_huge_prompts_are_refused(tiny: Served) -> None:
    huge = {"prompt": "ab " * (1024 * 1024), "max_tokens": 1}  # 3 MiB
    answers: list[tuple[int, Any]] = []

    def send() -> None:
        answers.append(completion(tiny.server, huge))

    senders = [threading.Thread(target=send) for _ in range(4)]
    for sender in senders:
        sender.start()
    worst = 0.0
    give_up = time.monotonic() + 60
    try:
        while any(sender.is_alive() for sender in senders) and time.monotonic() < give_up:
            start = time.monotonic()
            status, _, _ = request(tiny.server, "GET", "/health", timeout=10)
            worst = max(worst, time.monotonic() - start)
            assert status == 200
            time.sleep(0.02)
    finally:
        for sender in senders:
            sender.join(60)
    assert worst < 1.0, f"/health took {worst:.2f} s while big prompts were refused"
    for status, answer in answers:
        assert status == 400, answer
        error = assert_error(answer, status, "prompt")
        assert error["code"] == "context_length_exceeded"
        assert "refused before tokenizing" in error["message"]


def test_chat_text_beyond_the_context_is_refused_before_tokenizing(tiny: Served) -> None:
    body = {"messages": [{"role": "user", "content": "x" * (TINY_CONTEXT * 5)}]}
    status, answer = chat(tiny.server, body)
    assert status == 400, answer
    error = assert_error(answer, status, "messages")
    assert "refused before tokenizing" in error["message"]
    # Just over the context in tokens, under the character bound: tokenized, then refused.
    body = {"messages": [{"role": "user", "content": "x" * TINY_CONTEXT}]}
    status, answer = chat(tiny.server, body)
    assert status == 400, answer
    assert assert_error(answer, status, "messages")["code"] == "context_length_exceeded"


class SlowTokenizer:
    """The tiny tokenizer, taking ``delay`` seconds per encode (a big prompt, a slow one)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokenizing_runs_off_the_event_loop(
    tiny: Served, reference: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = tiny.app.state.service
    monkeypatch.setattr(service, "tokenizer", SlowTokenizer(service.tokenizer, 1.5))
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            completion, tiny.server, {"prompt": "x = 1", "max_tokens": 4, "temperature": 0}
        )
        time.sleep(0.3)  # the slow request is tokenizing now
        start = time.monotonic()
        status, _, _ = request(tiny.server, "GET", "/health", timeout=10)
        took = time.monotonic() - start
        assert status == 200
        assert took < 0.5, f"/health waited {took:.2f} s for a tokenizer"
        status, answer = slow.result(timeout=30)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference("x = 1", 4).texts[0]


# ------------------------------------------------------------------------ 6. uploads


HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    "Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
)


def test_client_that_leaves_mid_body_is_no_5xx(tiny: Served) -> None:
    before_5xx = five_xx(tiny.server)
    before = metric(
        tiny.server, "flashspec_requests_total", endpoint="/v1/completions", status="499"
    )
    for _ in range(3):
        with raw_connection(tiny.server) as sock:
            sock.sendall(HEAD.format(length=1000).encode() + b'{"prompt": "')
            time.sleep(0.2)  # the app is reading the body now
    assert wait_for(
        lambda: (
            metric(
                tiny.server, "flashspec_requests_total", endpoint="/v1/completions", status="499"
            )
            == before + 3
        )
    ), "a client that leaves mid-body is counted as 499"
    assert five_xx(tiny.server) == before_5xx


def test_stalled_body_is_answered_408(tiny: Served, reference: Callable[..., Any]) -> None:
    with raw_connection(tiny.server) as sock:
        start = time.monotonic()
        sock.sendall(HEAD.format(length=100).encode() + b'{"prompt": "x", ')
        raw = read_until_closed(sock, timeout=BODY_TIMEOUT_S + SLACK_S)
        took = time.monotonic() - start
    assert raw, "the server should answer a stalled body, then close"
    status, headers, answer = parse_response(raw)
    assert status == 408, raw
    assert assert_error(answer, status)["code"] == "body_timeout"
    assert headers.get("connection") == "close"
    assert BODY_TIMEOUT_S * 0.9 <= took < BODY_TIMEOUT_S + SLACK_S
    check_reference_request(tiny.server, reference)


@pytest.mark.parametrize(
    "partial",
    [b"POST /v1/comp", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"],
    ids=["request-line", "headers"],
)
def test_stalled_headers_are_answered_408(tiny: Served, partial: bytes) -> None:
    with raw_connection(tiny.server) as sock:
        start = time.monotonic()
        sock.sendall(partial)
        raw = read_until_closed(sock, timeout=HEADER_TIMEOUT_S + SLACK_S)
        took = time.monotonic() - start
    assert raw, "the server should answer stalled headers, then close"
    status, headers, answer = parse_response(raw)
    assert status == 408, raw
    assert assert_error(answer, status)["code"] == "header_timeout"
    assert headers.get("connection") == "close"
    assert took < HEADER_TIMEOUT_S + SLACK_S


def test_trickled_headers_do_not_extend_the_deadline(tiny: Served) -> None:
    with raw_connection(tiny.server) as sock:
        start = time.monotonic()
        closed_at = None
        for byte in b"POST /v1/completions HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic()
                break
            time.sleep(0.1)
            if time.monotonic() - start > HEADER_TIMEOUT_S + SLACK_S:
                break
        raw = read_until_closed(sock, timeout=SLACK_S)
        closed_at = closed_at or time.monotonic()
    assert closed_at - start < HEADER_TIMEOUT_S + SLACK_S + 0.5
    assert not raw or parse_response(raw)[0] == 408


def test_idle_connections_are_closed(tiny: Served) -> None:
    with raw_connection(tiny.server) as sock:
        start = time.monotonic()
        assert read_until_closed(sock, timeout=HEADER_TIMEOUT_S + SLACK_S) == b""
        assert time.monotonic() - start < HEADER_TIMEOUT_S + SLACK_S
    # Keep-alive: after one answer, the next request's headers get the same deadline.
    with raw_connection(tiny.server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /hea")
        raw = read_until_closed(sock, timeout=HEADER_TIMEOUT_S + SLACK_S + 5)
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), raw
    assert b"HTTP/1.1 408" in rest, raw


def test_oversized_and_malformed_headers_get_openai_errors(
    tiny: Served, reference: Callable[..., Any]
) -> None:
    with raw_connection(tiny.server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
        status, _, answer = parse_response(read_until_closed(sock))
    assert status == 431
    assert "headers" in assert_error(answer, status)["message"]
    with raw_connection(tiny.server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
        status, _, answer = parse_response(read_until_closed(sock))
    assert status == 431
    for bad in (b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", b"\x16\x03\x01\x02\x00\r\n\r\n"):
        with raw_connection(tiny.server) as sock:
            sock.sendall(bad)
            status, _, answer = parse_response(read_until_closed(sock))
        assert status == 400
        assert assert_error(answer, status)["code"] == "invalid_http"
    check_reference_request(tiny.server, reference)


# ------------------------------------------------------------------------ minor


def test_a_field_named_empty_is_named(tiny: Served) -> None:
    status, answer = completion(tiny.server, {"prompt": "x", "": 1})
    assert status == 400
    error = assert_error(answer, status, "")
    assert "''" in error["message"] and "None" not in error["message"]


def test_tool_messages_are_accepted(tiny: Served, reference: Callable[..., Any]) -> None:
    messages = [
        {"role": "user", "content": "what is 2 + 2?"},
        {"role": "assistant", "content": "add(2, 2)"},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
    ]
    status, answer = chat(tiny.server, {"messages": messages, "max_tokens": 8, "temperature": 0})
    assert status == 200, answer
    prompt = "user: what is 2 + 2?\nassistant: add(2, 2)\ntool: 4\nassistant:"
    want = reference(prompt, 8, FALLBACK_CHAT_STOP).texts[0].split(FALLBACK_CHAT_STOP)[0]
    assert answer["choices"][0]["message"]["content"] == want
    bad = [{"role": "tool", "tool_call_id": 5, "content": "4"}]
    status, answer = chat(tiny.server, {"messages": bad})
    assert status == 400
    assert_error(answer, status, "messages.0.tool_call_id")


def test_tool_messages_reach_the_chat_template(
    tiny: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = tiny.app.state.service
    seen: list[Any] = []

    class Templated(SlowTokenizer):
        chat_template = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}"

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            seen.append(conversation)
            return "".join(f"{m['role']}={m['content']};" for m in conversation)

    monkeypatch.setattr(service, "tokenizer", Templated(service.tokenizer, 0.0))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "call_9", "content": "ok"},
    ]
    status, answer = chat(tiny.server, {"messages": messages, "max_tokens": 2, "temperature": 0})
    assert status == 200, answer
    assert seen[-1][1] == {"role": "tool", "content": "ok", "tool_call_id": "call_9"}


# ------------------------------------------------------------------------ 1. rows are independent


def test_a_long_prompt_does_not_cut_a_short_one(reference: Callable[..., Any]) -> None:
    """The issue's defect-1 repro, scaled to the tiny context (1024 there, 256 here).

    8 prompts of 900/1024 of the context with max_tokens 16, then one 4 tokens short of the
    context with max_tokens 4, then a short prompt with max_tokens 16: the last two share a
    batch, and the short one must still get its 16 tokens. A gate on ``engine.stream`` holds
    the first batch until the other two are queued, so they batch together every time
    (static batching: continuous batching would let them join the first batch instead).
    """
    served = serve_tiny(batching="static")
    engine = served.app.state.service.engine
    gate = threading.Event()
    batches: list[int] = []
    original = engine.stream

    def gated(*args: Any, **kwargs: Any) -> Any:
        batches.append(len(args[0]))
        gate.wait(30)
        return original(*args, **kwargs)

    engine.stream = gated
    long_ids = TINY_CONTEXT * 900 // 1024
    bodies = [
        {"prompt": [[7] * long_ids] * 8, "max_tokens": 16, "temperature": 0},
        {"prompt": [5] * (TINY_CONTEXT - 4), "max_tokens": 4, "temperature": 0},
        {"prompt": "def quicksort(arr):", "max_tokens": 16, "temperature": 0},
    ]
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(completion, served.server, bodies[0])
            assert wait_for(lambda: batches == [8], 10)
            second = pool.submit(completion, served.server, bodies[1])
            assert wait_for(lambda: metric(served.server, "flashspec_queue_depth") == 1, 10)
            third = pool.submit(completion, served.server, bodies[2])
            assert wait_for(lambda: metric(served.server, "flashspec_queue_depth") == 2, 10)
            gate.set()
            answers = [future.result(timeout=60) for future in (first, second, third)]
    finally:
        gate.set()
        served.server.stop()
    assert batches == [8, 2], batches
    for (status, answer), body in zip(answers, bodies, strict=True):
        assert status == 200, answer
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        for choice, prompt in zip(answer["choices"], prompts, strict=True):
            want = reference(prompt, body["max_tokens"])
            assert choice["text"] == want.texts[0], (prompt[:8], choice)
    short = answers[2][1]
    assert short["usage"]["completion_tokens"] == 16, short
    assert short["choices"][0]["finish_reason"] == "length"


def test_mixed_load_each_output_equals_its_unbatched_output(
    tiny: Served, reference: Callable[..., Any]
) -> None:
    """Greedy requests of prompt lengths from 1 to the edge of the context, streamed or not,
    some cancelled, some read slowly, all at once: each finished one equals batch 1."""
    server = tiny.server
    lengths = [1, 3, 9, 27, 60, 110, 170, 220, TINY_CONTEXT - 16, TINY_CONTEXT - 9]
    jobs: list[tuple[str, str | list[int], int]] = []
    for i, length in enumerate(lengths):
        text = ("def f(x):\n    return x * " + str(i) + "\n") * (length // 20 + 1)
        prompt: str | list[int] = text[:length]
        max_tokens = min(16, TINY_CONTEXT - length - 1)
        for kind in ("plain", "stream", "slow", "ids", "cancel-stream", "cancel"):
            ids = [4 + (j * 7 + i) % 54 for j in range(length)]
            jobs.append((kind, ids if kind == "ids" else prompt, max_tokens))

    def run(kind: str, prompt: str | list[int], max_tokens: int) -> tuple[str, int] | None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if kind in ("plain", "ids"):
            status, answer = completion(server, body)
            assert status == 200, answer
            return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
        if kind == "cancel":
            with raw_connection(server) as sock:
                data = json.dumps(body).encode()
                sock.sendall(HEAD.format(length=len(data)).encode() + data)
                time.sleep(0.05)
            return None
        connection, response = open_stream(
            server, {**body, "stream_options": {"include_usage": True}}
        )
        try:
            assert response.status == 200
            if kind == "cancel-stream":
                response.readline()
                return None
            return read_stream_text(
                response, (lambda: time.sleep(0.02)) if kind == "slow" else None
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, *job) for job in jobs]
        results = [future.result(timeout=120) for future in futures]
    mismatches = []
    for (kind, prompt, max_tokens), got in zip(jobs, results, strict=True):
        if got is None:
            continue
        want = reference(prompt, max_tokens)
        if got != (want.texts[0], len(want.tokens[0])):
            size = len(prompt)
            mismatches.append(
                f"{kind} prompt of {size}: got {got}, batch 1 gives "
                f"{(want.texts[0], len(want.tokens[0]))}"
            )
    assert not mismatches, "\n".join(mismatches)
    assert wait_for(lambda: metric(server, "flashspec_running_rows") == 0)
    assert metric(server, "flashspec_queue_depth") == 0
    assert not five_xx(server)
