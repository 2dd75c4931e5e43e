"""``flashspec serve``: work a request can cost before it is refused (issue 38, items 2 and 7,
and the minor findings): chat bodies of many empty messages, the preparing threads under a
flood, stop strings that would cost quadratic time, empty prompts, huge ``top_k``.

A tiny engine (2-layer Llama, character tokenizer, context 256) keeps every test fast.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashspec.serve import StopTrimmer
from flashspec.serve import chat as chat_module
from flashspec.serve.protocol import CompletionRequest
from tests.helpers.server import (
    TINY_CONTEXT,
    Served,
    assert_error,
    five_xx,
    request,
    serve_tiny,
)


def chat(served: Served, body: dict[str, Any] | bytes, timeout: float = 60) -> tuple[int, Any]:
    status, _, answer = request(
        served.server, "POST", "/v1/chat/completions", body, timeout=timeout
    )
    return status, answer


def completion(served: Served, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    status, _, answer = request(served.server, "POST", "/v1/completions", body, timeout=timeout)
    return status, answer


class Counted:
    """A callable that counts its calls and passes them on."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


class CountingTokenizer:
    """The tiny tokenizer, counting its encodes (``__call__``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encodes = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.encodes += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def flood_body(count: int, message: dict[str, Any]) -> bytes:
    """A chat body of ``count`` copies of ``message``, compact (the issue's 4 MiB body)."""
    return json.dumps({"messages": [message] * count}, separators=(",", ":")).encode()


# ------------------------------------------------------------------------ 2. chat bodies


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (260_000, {"role": "user"}),
        (110_000, {"role": "assistant", "content": ""}),
        (100_000, {"role": "system", "content": []}),
        (TINY_CONTEXT, {"role": "user", "content": None}),
    ],
    ids=["issue", "empty-strings", "empty-parts", "context-many"],
)
def test_more_messages_than_the_context_are_refused_before_rendering(
    tiny: Served, monkeypatch: pytest.MonkeyPatch, count: int, message: dict[str, Any]
) -> None:
    service = tiny.app.state.service
    tokenizer = CountingTokenizer(service.tokenizer)
    renders = Counted(chat_module.render)
    monkeypatch.setattr(service, "tokenizer", tokenizer)
    monkeypatch.setattr(chat_module, "render", renders)
    status, answer = chat(tiny, flood_body(count, message))
    assert status == 400, answer
    error = assert_error(answer, status, "messages")
    assert error["code"] == "context_length_exceeded"
    assert f"{count} messages" in error["message"] and "before rendering" in error["message"]
    assert renders.calls == 0 and tokenizer.encodes == 0


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}] * (TINY_CONTEXT - 1),
        [{"role": "assistant", "content": "x"}] * 200,
        [{"role": "developer", "content": "ab"}] * 180,
    ],
    ids=["empty", "one-char", "two-chars"],
)
def test_a_conversation_that_renders_too_long_is_refused_before_tokenizing(
    tiny: Served, monkeypatch: pytest.MonkeyPatch, messages: list[dict[str, Any]]
) -> None:
    # Under the message bound and with little content, but each message adds its role and a
    # newline: the rendered text is over the character bound, so it is never tokenized.
    service = tiny.app.state.service
    tokenizer = CountingTokenizer(service.tokenizer)
    monkeypatch.setattr(service, "tokenizer", tokenizer)
    status, answer = chat(tiny, {"messages": messages})
    assert status == 400, answer
    error = assert_error(answer, status, "messages")
    assert error["code"] == "context_length_exceeded"
    assert "chat-formatted" in error["message"] and "refused before tokenizing" in error["message"]
    assert tokenizer.encodes == 0


def test_a_conversation_within_the_bounds_is_answered(
    tiny: Served, reference: Callable[..., Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}] * 10
    messages.append({"role": "user", "content": "x = 1"})
    status, answer = chat(tiny, {"messages": messages, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    prompt = "user: hi\nassistant: \n" * 10 + "user: x = 1\nassistant:"
    want = reference(prompt, 4, chat_module.FALLBACK_CHAT_STOP).texts[0]
    assert answer["choices"][0]["message"]["content"] == want.split("\nuser:")[0]


def test_a_small_request_answers_beside_a_flood_of_big_chat_bodies(
    tiny: Served, reference: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = tiny.app.state.service
    real_render = chat_module.render

    def slow_render(*args: Any, **kwargs: Any) -> Any:
        # A big body that passes every bound still costs its preparing thread time.
        time.sleep(0.5)
        return real_render(*args, **kwargs)

    monkeypatch.setattr(chat_module, "render", slow_render)
    before = five_xx(tiny.server)
    flood = flood_body(260_000, {"role": "user"})
    # Within every bound, but large (an ignored field), so they wait with the flood.
    slow = json.dumps(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "user": "u" * 100_000}
    ).encode()
    bodies = [flood] * 8 + [slow] * 4
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(chat, tiny, body) for body in bodies]
        time.sleep(0.5)  # the flood is being read and parsed
        start = time.monotonic()
        status, answer = completion(
            tiny, {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}, timeout=30
        )
        took = time.monotonic() - start
        answers = [future.result(timeout=120) for future in futures]
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference("def f(x):", 4).texts[0]
    assert took < 2.0, f"a 4-token completion took {took:.2f} s beside the flood"
    for status, answer in answers[:8]:
        assert status == 400, answer
        assert assert_error(answer, status, "messages")["code"] == "context_length_exceeded"
    assert [status for status, _ in answers[8:]] == [200] * 4, answers[8:]
    assert five_xx(tiny.server) == before
    assert service.preparer is not service.bulk_preparer


def test_waiting_to_be_prepared_counts_toward_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve_tiny(timeout_s=1.0)
    try:
        service = served.app.state.service
        gate = threading.Event()
        real_render = chat_module.render

        def stuck_render(*args: Any, **kwargs: Any) -> Any:
            gate.wait(10)
            return real_render(*args, **kwargs)

        monkeypatch.setattr(chat_module, "render", stuck_render)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(chat, served, {"messages": [{"role": "user", "content": "a"}]})
            time.sleep(0.3)  # the first request holds the preparing thread
            start = time.monotonic()
            status, answer = chat(served, {"messages": [{"role": "user", "content": "b"}]})
            took = time.monotonic() - start
            gate.set()
            first.result(timeout=30)
        assert status == 504, answer
        assert assert_error(answer, status)["code"] == "timeout"
        assert "parsed and tokenized" in answer["error"]["message"]
        assert took < 2.0, f"the 504 came after {took:.2f} s for a 1 s timeout"
        assert service.worker.alive
    finally:
        served.server.stop()


# ------------------------------------------------------------------------ 7. stop strings


def naive_held(text: str, stops: Sequence[str]) -> int:
    """The longest end of ``text`` that begins some stop string without being all of it."""
    for size in range(min(max(map(len, stops), default=0), len(text)), 0, -1):
        if any(s.startswith(text[-size:]) and len(s) > size for s in stops):
            return size
    return 0


def naive_stream(stops: list[str], deltas: list[str], finish: str) -> list[str]:
    """What StopTrimmer should send for these deltas, by the definition."""
    text, sent, out = "", 0, []
    for delta in deltas:
        text += delta
        end = len(text) - naive_held(text, stops)
        out.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
    end = len(text)
    if finish == "stop":
        end = min((i for s in stops if (i := text.find(s)) >= 0), default=end)
    out.append(text[sent:end] if end > sent else "")
    return out


def test_stop_trimming_equals_its_definition() -> None:
    rng = random.Random(38)
    for trial in range(3000):
        alphabet = "ab" if trial % 2 else "abc"

        def word(low: int, high: int, alphabet: str = alphabet) -> str:
            return "".join(rng.choice(alphabet) for _ in range(rng.randint(low, high)))

        stops = [word(1, 7) for _ in range(rng.randint(1, 4))]
        deltas = [word(0, 5) for _ in range(rng.randint(1, 15))]
        finish = rng.choice(["stop", "length", "eos"])
        trimmer = StopTrimmer(stops)
        got = [trimmer.feed(delta, None) for delta in deltas] + [trimmer.feed("", finish)]
        assert got == naive_stream(stops, deltas, finish), (stops, deltas, finish)


LONG_STOP = 1_000_000


@pytest.mark.parametrize(
    ("stops", "piece", "sent"),
    [
        (["x" * LONG_STOP, "y" * LONG_STOP, "z" * LONG_STOP, "w" * LONG_STOP], "abcd", True),
        (["a" * LONG_STOP + "b"] * 4, "aaaa", False),
        ([("ab" * LONG_STOP)[:LONG_STOP], "ba" * 5, "b" * LONG_STOP, "ab" * 8], "abab", False),
    ],
    ids=["never-matching", "always-matching", "overlapping"],
)
def test_stop_strings_cost_linear_time(stops: list[str], piece: str, sent: bool) -> None:
    """20,000 characters in deltas of 4 beside four 1 M-character stop strings: a few
    microseconds a delta (it took milliseconds, growing with the text)."""
    trimmer = StopTrimmer(stops)
    start = time.perf_counter()
    out = []
    for count in range(5000):
        out.append(trimmer.feed(piece, None))
        if count % 100 == 0:
            assert time.perf_counter() - start < 2.0, f"{count} deltas took over 2 s"
    took = time.perf_counter() - start
    assert took < 1.0, f"5000 deltas took {took:.2f} s"
    assert ("".join(out) == piece * 5000) is sent
    rest = trimmer.feed("!", "length")
    assert "".join(out) + rest == piece * 5000 + "!"


# ------------------------------------------------------------------------ minor findings


@pytest.mark.parametrize(
    ("prompt", "rows"), [([[]], 1), ("", 1), ([], None), (["", "x"], 2), ([[], [5]], 2)]
)
def test_an_empty_prompt_counts_the_bos_token_it_runs(
    tiny: Served, prompt: Any, rows: int | None
) -> None:
    status, answer = completion(tiny, {"prompt": prompt, "max_tokens": 2, "temperature": 0})
    if rows is None:
        assert status == 400
        assert_error(answer, status, "prompt")
        return
    assert status == 200, answer
    assert len(answer["choices"]) == rows
    assert answer["usage"]["prompt_tokens"] == rows  # BOS for each empty one, 1 for "x" or [5]


def test_an_empty_prompt_without_bos_is_a_400(
    tiny: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny.app.state.service, "bos", None)
    before = five_xx(tiny.server)
    for prompt in ([[]], "", [[5], []]):
        status, answer = completion(tiny, {"prompt": prompt, "max_tokens": 2})
        assert status == 400, answer
        assert "no BOS token" in assert_error(answer, status, "prompt")["message"]
    assert five_xx(tiny.server) == before


@pytest.mark.parametrize(
    "top_k", [2**63, 10**4199, 58, 10_000], ids=["2**63", "4200-digits", "vocab", "above"]
)
def test_top_k_beyond_the_vocabulary_keeps_every_token(tiny: Served, top_k: int) -> None:
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    status, plain = completion(tiny, body)
    assert status == 200, plain
    status, clamped = completion(tiny, {**body, "top_k": top_k})
    assert status == 200, clamped
    assert clamped["choices"][0]["text"] == plain["choices"][0]["text"]
    request_ = CompletionRequest.model_validate({"prompt": "x", "top_k": top_k})
    sampling, _, group = tiny.app.state.service.sampling_for(request_)
    plain_request = CompletionRequest.model_validate({"prompt": "x"})
    # (the group is the penalties and bias, equal too: the requests batch together)
    assert sampling.top_k == 0 and group == tiny.app.state.service.sampling_for(plain_request)[2]


def test_an_integer_too_long_to_parse_is_invalid_json(tiny: Served) -> None:
    raw = b'{"prompt": "x", "top_k": ' + b"9" * 5000 + b"}"
    status, _, answer = request(tiny.server, "POST", "/v1/completions", raw)
    assert status == 400, answer
    assert assert_error(answer, status)["code"] == "invalid_json"
