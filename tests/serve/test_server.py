"""``flashspec serve``: a live server on 127.0.0.1 (uvicorn in a thread) over the demo pair.

The official ``openai`` client drives completions and chat, streamed and not; greedy outputs
are compared with batch-1 ``engine.generate`` on a separate engine (caches are per engine).
Bad requests go through ``http.client`` so that malformed bodies and early disconnects can be
sent as they are. A second server (max_batch 1, max_queue 1, short timeout) covers the full
queue (503 + Retry-After), disconnects freeing their row, and the timeout (504).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

import openai

from flashspec import SpeculativeEngine
from flashspec.serve import FALLBACK_CHAT_STOP, ServerThread, StopTrimmer, create_app
from tests.helpers import server as server_helpers
from tests.helpers.server import assert_error, interrupt, request, wait_for

API_KEY = "test-key-123"
MODEL = "demo"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SMALL_TIMEOUT_S = 2.0
# A greedy request that runs far longer than SMALL_TIMEOUT_S (the demo target reaches no EOS
# within its 1024-token context from this prompt).
LONG = {"prompt": "def f(x):", "max_tokens": 1000, "temperature": 0}
# 32 distinct prompts of different lengths (so batches are left-padded).
PROMPTS = [
    f"{head}{name}{tail}"
    for head, tail in (
        ("def ", "(arr):"),
        ("class ", ":\n    def __init__(self):"),
        ("import os\n\ndef ", "(path):\n    "),
        ("# helper\ndef ", "(x, y=None):\n    if x is None:"),
    )
    for name in ("quicksort", "parse", "main", "load_config", "run", "Node", "walk", "merge")
]


@pytest.fixture(scope="module")
def engine() -> Any:
    return SpeculativeEngine.from_pretrained()


@pytest.fixture(scope="module")
def reference() -> Callable[..., Any]:
    """Batch-1 greedy generation on an engine of its own, memoised."""
    ref = SpeculativeEngine.from_pretrained()
    cache: dict[tuple[str, int, str | None], Any] = {}

    def generate(prompt: str, max_tokens: int, stop: str | None = None) -> Any:
        key = (prompt, max_tokens, stop)
        if key not in cache:
            cache[key] = ref.generate(prompt, max_new_tokens=max_tokens, stop=stop)
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[ServerThread]:
    app = create_app(
        engine, model_name=MODEL, max_batch=8, max_queue=64, timeout_s=60, api_key=API_KEY
    )
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def small() -> Iterator[ServerThread]:
    # An engine of its own: an engine belongs to one worker thread.
    app = create_app(
        SpeculativeEngine.from_pretrained(),
        model_name=MODEL,
        max_batch=1,
        max_queue=1,
        timeout_s=SMALL_TIMEOUT_S,
    )
    with ServerThread(app) as running:
        yield running


# ------------------------------------------------------------------------------------ helpers


def open_stream(server: ServerThread, body: dict[str, Any]) -> tuple[Any, Any]:
    """Start a streaming completion with the API key; returns (connection, response)."""
    return server_helpers.open_stream(server, body, AUTH)


def metric(server: ServerThread, name: str, **labels: str) -> float:
    """A counter or gauge from /metrics (0 when absent)."""
    return server_helpers.metric(server, name, AUTH, **labels)


# ------------------------------------------------------------------------------------ openai


def test_completion_equals_engine_output(client: Any, reference: Any) -> None:
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    want = reference(PROMPTS[0], 16)
    assert done.object == "text_completion" and done.model == MODEL
    assert done.choices[0].text == want.texts[0]
    assert done.choices[0].finish_reason == (
        "length" if want.finish_reasons[0] == "length" else "stop"
    )
    assert done.usage.completion_tokens == len(want.tokens[0])
    assert done.usage.prompt_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens


def test_completion_stream_equals_non_stream(client: Any, reference: Any) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert len(texts) > 1  # streamed in several rounds, not one piece
    assert "".join(texts) == reference(PROMPTS[1], 16).texts[0]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_stop_string_is_trimmed_streamed_or_not(client: Any, reference: Any) -> None:
    full = reference(PROMPTS[0], 24).texts[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the reference text should have a usable stop string in the middle"
    want = full[: full.find(stop)]
    done = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop]
    )
    assert (done.choices[0].text, done.choices[0].finish_reason) == (want, "stop")
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want


def test_several_prompts_in_one_request(client: Any, reference: Any) -> None:
    done = client.completions.create(model=MODEL, prompt=PROMPTS[2:4], max_tokens=12, temperature=0)
    assert [c.index for c in done.choices] == [0, 1]
    assert [c.text for c in done.choices] == [reference(p, 12).texts[0] for p in PROMPTS[2:4]]


def test_chat_without_template_uses_the_fallback(client: Any, reference: Any) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
    ]
    prompt = "system: You write Python.\nuser: def add(a, b):\nassistant:"
    want = reference(prompt, 16, FALLBACK_CHAT_STOP).texts[0]
    want = want.split(FALLBACK_CHAT_STOP)[0]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == want
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=16, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_repeats(client: Any) -> None:
    def draw() -> str:
        done = client.completions.create(
            model=MODEL, prompt=PROMPTS[5], max_tokens=12, temperature=0.9, top_p=0.95, seed=7
        )
        return str(done.choices[0].text)

    assert draw() == draw()


def test_models_health_metrics(client: Any, server: ServerThread) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = request(server, "GET", "/health")  # no key needed
    assert (status, body["status"]) == (200, "ok")
    status, headers, text = request(server, "GET", "/metrics", headers=AUTH)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in (
        "flashspec_requests_total{",
        "flashspec_generated_tokens_total ",
        "flashspec_acceptance_rate ",
        "flashspec_queue_depth ",
        "flashspec_batch_size_bucket{",
        "flashspec_request_latency_seconds_bucket{",
        "flashspec_time_to_first_token_seconds_count ",
    ):
        assert name in text, name
    assert 0 < metric(server, "flashspec_acceptance_rate") <= 1


def test_32_concurrent_requests_equal_batch_1(
    client: Any, server: ServerThread, reference: Any
) -> None:
    batches_before = metric(server, "flashspec_batch_size_count")

    def one(prompt: str) -> tuple[str, int]:
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        return done.choices[0].text, done.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    want = [reference(p, 12) for p in PROMPTS]
    assert [text for text, _ in got] == [w.texts[0] for w in want]
    assert [n for _, n in got] == [len(w.tokens[0]) for w in want]
    batches = metric(server, "flashspec_batch_size_count") - batches_before
    assert batches < len(PROMPTS), "concurrent requests should share engine batches"


# ------------------------------------------------------------------------------------ bad input

LONG_PROMPT = "x = 1\n" * 600  # well over the demo target's 1024-token context

BAD_COMPLETIONS: list[tuple[bytes | dict[str, Any], int, str | None]] = [
    (b'{"prompt": "x", ', 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": "x", "temperature": NaN}', 400, None),
    (b"\xff\xfe", 400, None),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [99999999]}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "top_k": -1}, 400, "top_k"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 17}, 400, "n"),
    ({"prompt": "x", "n": True}, 400, "n"),
    ({"prompt": "x", "best_of": 0}, 400, "best_of"),
    ({"prompt": "x", "best_of": 17}, 400, "best_of"),
    ({"prompt": "x", "best_of": "3"}, 400, "best_of"),
    ({"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "echo": 1}, 400, "echo"),
    ({"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (b'{"prompt": "x", "presence_penalty": NaN}', 400, None),
    ({"prompt": "x", "regex": "["}, 400, "regex"),
    ({"prompt": "x", "regex": "a", "grammar": "start: x"}, 400, "grammar"),
    ({"prompt": "x", "max_token": 5}, 400, "max_token"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(
    server: ServerThread, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    got, _, answer = request(server, "POST", "/v1/completions", body, AUTH)
    assert got == status, answer  # a 4xx: never a 500 from user input
    assert_error(answer, got, param)


DEEP_SCHEMA: dict[str, Any] = {"type": "string"}
for _ in range(40):
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}

BAD_CHATS: list[tuple[dict[str, Any], int, str | None]] = [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages.0.content",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    (
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}},
        },
        400,
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": DEEP_SCHEMA}},
        },
        400,
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "max_completion_tokens": 6,
        },
        400,
        "max_tokens",
    ),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
def test_bad_chat_requests(
    server: ServerThread, body: dict[str, Any], status: int, param: str | None
) -> None:
    got, _, answer = request(server, "POST", "/v1/chat/completions", body, AUTH)
    assert got == status, answer
    assert_error(answer, got, param)


def test_harmless_fields_are_ignored(server: ServerThread) -> None:
    body = {
        "model": MODEL,
        "prompt": "x = ",
        "max_tokens": 2,
        "temperature": 0,
        "user": "someone",
        "n": 1,
        "echo": False,
        "presence_penalty": 0,
    }
    status, _, answer = request(server, "POST", "/v1/completions", body, AUTH)
    assert status == 200, answer


def test_oversized_body_unknown_route_wrong_method(server: ServerThread) -> None:
    huge = {"prompt": "x" * (5 * 1024 * 1024)}
    status, _, body = request(server, "POST", "/v1/completions", huge, AUTH)
    assert status == 413
    assert_error(body, status)
    status, _, body = request(server, "GET", "/v1/nothing", headers=AUTH)
    assert status == 404 and "/v1/completions" in assert_error(body, status)["message"]
    status, _, body = request(server, "GET", "/v1/completions", headers=AUTH)
    assert status == 405
    assert_error(body, status)
    status, _, body = request(server, "GET", "/v1/models/other", headers=AUTH)
    assert status == 404
    assert_error(body, status)


# ------------------------------------------------------------------------------------ auth


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"X-Api-Key": API_KEY}],
)
def test_api_key_required(server: ServerThread, headers: dict[str, str]) -> None:
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
        body = {"prompt": "x", "max_tokens": 1} if method == "POST" else None
        status, got, answer = request(server, method, path, body, headers)
        assert status == 401, (path, answer)
        assert got.get("www-authenticate") == "Bearer"
        assert assert_error(answer, status)["type"] == "authentication_error"


def test_openai_client_with_a_wrong_key(server: ServerThread) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)


# ------------------------------------------------------------------------------------ limits


def test_full_queue_503_and_disconnects_free_rows(small: ServerThread) -> None:
    running_before = metric(
        small, "flashspec_cancelled_total", reason="disconnect", stage="running"
    )
    queued_before = metric(small, "flashspec_cancelled_total", reason="disconnect", stage="queued")
    first, first_response = open_stream(small, LONG)
    assert first_response.status == 200
    assert first_response.readline().startswith(b"data: ")  # it runs in the engine
    second, second_response = open_stream(small, LONG)
    assert second_response.status == 200  # queued: max_queue=1
    status, headers, answer = request(small, "POST", "/v1/completions", LONG)
    assert status == 503, answer
    assert int(headers["retry-after"]) >= 1
    assert assert_error(answer, status)["code"] == "queue_full"

    first.close()
    second.close()
    assert wait_for(
        lambda: (
            metric(small, "flashspec_cancelled_total", reason="disconnect", stage="running")
            == running_before + 1
        )
    ), "the running row of a disconnected client should be cancelled"
    assert wait_for(
        lambda: (
            metric(small, "flashspec_cancelled_total", reason="disconnect", stage="queued")
            == queued_before + 1
        )
    ), "a queued request whose client left should leave the queue"
    assert wait_for(lambda: metric(small, "flashspec_running_rows") == 0)
    assert metric(small, "flashspec_queue_depth") == 0


def test_timeout_504_cancels_the_row(small: ServerThread) -> None:
    before = metric(small, "flashspec_cancelled_total", reason="timeout", stage="running")
    start = time.monotonic()
    status, _, answer = request(small, "POST", "/v1/completions", LONG)
    assert status == 504, answer
    assert assert_error(answer, status)["type"] == "timeout_error"
    assert time.monotonic() - start < SMALL_TIMEOUT_S + 5
    assert wait_for(
        lambda: (
            metric(small, "flashspec_cancelled_total", reason="timeout", stage="running")
            == before + 1
        )
    )
    # The server is still healthy afterwards.
    status, _, answer = request(small, "POST", "/v1/completions", {**LONG, "max_tokens": 2})
    assert status == 200, answer


def test_non_streaming_client_that_leaves_frees_its_row(small: ServerThread) -> None:
    before = metric(small, "flashspec_cancelled_total", reason="disconnect", stage="running")
    connection = http.client.HTTPConnection(small.host, small.port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        body=json.dumps(LONG).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert wait_for(lambda: metric(small, "flashspec_running_rows") == 1)
    connection.close()
    assert wait_for(
        lambda: (
            metric(small, "flashspec_cancelled_total", reason="disconnect", stage="running")
            == before + 1
        )
    )
    assert wait_for(lambda: metric(small, "flashspec_running_rows") == 0)


def test_streaming_timeout_ends_with_an_error_event(small: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL, stream=True, **LONG)
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="timeout"):
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
    assert pieces, "text streamed before the timeout"


# ------------------------------------------------------------------------------------ units


def test_stop_trimmer_holds_back_a_possible_stop_string() -> None:
    trimmer = StopTrimmer(["\n\n", "END"])
    assert trimmer.feed("abc\n", None) == "abc"  # "\n" may start "\n\n"
    assert trimmer.feed("x E", None) == "\nx "  # "E" may start "END"
    assert trimmer.feed("N", None) == ""
    assert trimmer.feed("D", "stop") == ""  # the stop string never reaches the client
    assert trimmer.text.endswith("END") and trimmer.sent == len("abc\nx ")
    other = StopTrimmer(["\n\n"])
    assert other.feed("a\n", None) == "a"
    assert other.feed("", "length") == "\n"  # the row ended for another reason: send it all


def test_without_fastapi_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    import flashspec.cli.serve as serve_cli
    from flashspec.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails
    monkeypatch.delitem(sys.modules, "flashspec.serve.app")
    with pytest.raises(ImportError, match=re.escape("pip install 'flashspec[serve]'")):
        importlib.import_module("flashspec.serve.app")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        serve_cli.importlib.util,
        "find_spec",
        lambda name, *rest: None if name == "fastapi" else real(name, *rest),
    )
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == (
        "flashspec: error: flashspec serve needs fastapi: pip install 'flashspec[serve]'"
    )


def test_cli_serve_end_to_end() -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "FLASHSPEC_API_KEY": API_KEY,
        "PYTHONUNBUFFERED": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "flashspec.cli", "serve", "--port", "0", "--max-batch", "2"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        banner = ""
        while "/v1" not in banner:
            banner = process.stderr.readline()
            assert banner, "flashspec serve exited before listening"
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
        assert match, banner
        assert "API key on" in banner
        url = f"http://127.0.0.1:{match.group(1)}/v1"
        client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)
        done = client.completions.create(model="demo", prompt="import os", max_tokens=4)
        assert done.usage.completion_tokens >= 1
    finally:
        code = interrupt(process, 30)
    assert code == 0


def test_cli_serve_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    from flashspec.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status = main(["serve", "--port", str(taken.getsockname()[1])])
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flashspec: error: --host 127.0.0.1 --port "), err
    assert "pick another --port" in err[-1]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--timeout", "0"], "--timeout"),
        (["serve", "--max-batch", "0"], "--max-batch"),
        (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
        (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout"),
    ],
)
def test_cli_serve_flag_errors(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flashspec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err
