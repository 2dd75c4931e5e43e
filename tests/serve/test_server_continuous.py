"""Continuous batching in ``flashspec serve`` (issue 24): requests join the running batch.

Every server here is a tiny one (``tests.helpers.server.serve_tiny``: 2-layer Llama, character
tokenizer). A ``before_round`` hook slows the engine's rounds where a test needs a request to
still be running when the next one arrives, and ``Recorder`` wraps ``engine.stream`` to see
which requests shared an engine stream. Greedy outputs are compared with batch-1
``engine.generate`` on an engine of its own.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flashspec.serve import ServerThread, server_metrics
from flashspec.serve.worker import EngineWorker, Event, Job
from tests.helpers.server import (
    Served,
    five_xx,
    metric,
    open_stream,
    read_stream_text,
    request,
    serve_tiny,
    tiny_engine,
    wait_for,
)

# Greedy on the tiny engine, this prompt reaches no EOS within 200 new tokens (checked against
# the reference in every test that relies on it), so it keeps its row for many rounds.
LONG_PROMPT = "x = 1\n"
# Per-round pause where a request must outlast the arrival of the next one.
ROUND_PAUSE_S = 0.01


def completion(server: ServerThread, body: dict[str, Any]) -> dict[str, Any]:
    status, _, answer = request(server, "POST", "/v1/completions", body)
    assert status == 200, answer
    return dict(answer)


class Recorder:
    """Wraps ``engine.stream``: each stream's settings and the prompts it started with or
    took in later (``joined``), and the rows of each round (from a ``before_round`` hook)."""

    def __init__(self, engine: Any, pause_s: float = 0.0) -> None:
        self.streams: list[dict[str, Any]] = []
        self.rounds: list[int] = []
        original = engine.stream

        def stream(prompts: list[list[int]], *args: Any, **kwargs: Any) -> Any:
            record: dict[str, Any] = {
                "prompts": [list(p) for p in prompts],
                "joined": [],
                "seeds": list(kwargs["seed"]),
                "temperatures": [s.temperature for s in kwargs["sampling"]],
            }
            self.streams.append(record)
            return RecordingStream(original(prompts, *args, **kwargs), record)

        def hook(view: Any) -> None:
            self.rounds.append(int(view.tokens.shape[0]))
            if pause_s:
                time.sleep(pause_s)

        engine.stream = stream
        engine.before_round.append(hook)


class RecordingStream:
    """A ``TokenStream`` that notes the prompts joining it."""

    def __init__(self, stream: Any, record: dict[str, Any]) -> None:
        self._stream = stream
        self._record = record

    @property
    def joinable(self) -> bool:
        return bool(self._stream.joinable)

    @property
    def result(self) -> Any:
        return self._stream.result

    def join(self, prompt: list[int], max_new_tokens: int, **kwargs: Any) -> int:
        row = int(self._stream.join(prompt, max_new_tokens, **kwargs))
        self._record["joined"].append(list(prompt))
        self._record["seeds"].append(kwargs.get("seed"))
        self._record["temperatures"].append(kwargs["sampling"].temperature)
        return row

    def cancel(self, row: int) -> None:
        self._stream.cancel(row)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._stream)


def served_with_recorder(pause_s: float = 0.0, **settings: Any) -> tuple[Served, Recorder]:
    served = serve_tiny(**settings)
    return served, Recorder(served.app.state.service.engine, pause_s)


def read_stream(response: Any, first: bytes = b"") -> tuple[str, str | None]:
    """The text and finish reason of a streamed completion, read to its end (``first``: its
    first line, if already read)."""
    pieces: list[str] = []
    finish = None
    for line in [first, *response]:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[len(b"data: ") :])
        assert "error" not in event, event
        for choice in event["choices"]:
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
    return "".join(pieces), finish


# ------------------------------------------------------------ 1. a late request joins at once


@pytest.mark.parametrize("mode", ["continuous", "static", "continuous, unjoinable model"])
def test_a_late_request_is_answered_before_a_long_one_ends(
    mode: str, reference: Callable[..., Any]
) -> None:
    """A short request sent while a long one streams: with continuous batching it joins the
    running batch and is answered while the long one still runs; with static batching, or a
    model whose caches cannot take rows in, it waits for the long one to end."""
    long_tokens, short_tokens = 160, 4
    want_long = reference(LONG_PROMPT, long_tokens)
    assert want_long.finish_reasons == ["length"], "the long prompt must not end early"
    batching = "static" if mode == "static" else "continuous"
    served, recorder = served_with_recorder(ROUND_PAUSE_S, batching=batching)
    if mode.endswith("unjoinable model"):
        # What a sliding-window or recurrent target reports: its batches cannot take rows.
        served.app.state.service.engine.target.shiftable = False
    server = served.server
    ended: dict[str, float] = {}
    try:
        connection, response = open_stream(
            server, {"prompt": LONG_PROMPT, "max_tokens": long_tokens, "temperature": 0}
        )
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: ")  # the long one is running
        long_text: dict[str, Any] = {}

        def read_long() -> None:
            long_text["got"] = read_stream(response, first)
            ended["long"] = time.monotonic()

        reader = threading.Thread(target=read_long)
        reader.start()
        short = completion(server, {"prompt": "abc", "max_tokens": short_tokens, "temperature": 0})
        ended["short"] = time.monotonic()
        reader.join(60)
        connection.close()
    finally:
        server.stop()
    assert short["choices"][0]["text"] == reference("abc", short_tokens).texts[0]
    assert long_text["got"] == (want_long.texts[0], "length")
    if mode == "continuous":
        assert ended["short"] < ended["long"], "the short request should not wait"
        assert len(recorder.streams) == 1 and len(recorder.streams[0]["joined"]) == 1
        assert max(recorder.rounds) == 2, "the two rows should share rounds"
    else:
        assert ended["short"] > ended["long"], "a static batch takes no rows"
        assert len(recorder.streams) == 2 and not any(s["joined"] for s in recorder.streams)
        assert max(recorder.rounds) == 1


# ------------------------------------------------------- 2. joined rows equal batch-1 output


def test_staggered_greedy_requests_each_equal_their_unbatched_output(
    reference: Callable[..., Any],
) -> None:
    """Greedy requests of prompt lengths from 1 to 200 tokens, streamed or not, sent a little
    apart so that most join a running batch of at most 4 rows: each equals batch 1."""
    served, recorder = served_with_recorder(ROUND_PAUSE_S, batching="continuous", max_batch=4)
    server = served.server
    lengths = [1, 2, 5, 11, 23, 40, 64, 97, 130, 170, 200, 33, 7, 150]
    jobs: list[tuple[list[int], int, bool]] = []
    for i, length in enumerate(lengths):
        ids = [4 + (j * 5 + i * 3) % 54 for j in range(length)]
        jobs.append((ids, 6 + (i * 7) % 19, i % 3 == 0))

    def run(index: int) -> tuple[str, int]:
        time.sleep(0.03 * index)
        ids, max_tokens, stream = jobs[index]
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        if not stream:
            answer = completion(server, body)
            return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
        connection, response = open_stream(
            server, {**body, "stream_options": {"include_usage": True}}
        )
        try:
            assert response.status == 200
            return read_stream_text(response)
        finally:
            connection.close()

    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, range(len(jobs)), timeout=120))
        assert wait_for(lambda: metric(server, "flashspec_running_rows") == 0)
        assert not five_xx(server)
    finally:
        server.stop()
    mismatches = []
    for (ids, max_tokens, _), got in zip(jobs, results, strict=True):
        want = reference(ids, max_tokens)
        if got != (want.texts[0], len(want.tokens[0])):
            mismatches.append(f"prompt of {len(ids)}: got {got}, batch 1 gives {want.texts[0]!r}")
    assert not mismatches, "\n".join(mismatches)
    joined = sum(len(s["joined"]) for s in recorder.streams)
    assert joined > 0, "requests sent while others ran should have joined them"
    assert sum(len(s["prompts"]) for s in recorder.streams) + joined == len(jobs)
    assert max(recorder.rounds) <= 4, "never more rows than max_batch"


# ----------------------------------------------------- 3. rows that leave; the others go on


def test_disconnected_rows_leave_and_the_others_continue(reference: Callable[..., Any]) -> None:
    """Two requests join a long one; one client leaves mid-stream, the other's request goes
    on, and so does the long one; a request sent afterwards joins the same stream."""
    long_tokens = 200
    want_long = reference(LONG_PROMPT, long_tokens)
    assert want_long.finish_reasons == ["length"]
    served, recorder = served_with_recorder(ROUND_PAUSE_S, batching="continuous")
    server = served.server
    before = metric(server, "flashspec_cancelled_total", reason="disconnect", stage="running")
    try:
        long_connection, long_response = open_stream(
            server, {"prompt": LONG_PROMPT, "max_tokens": long_tokens, "temperature": 0}
        )
        first = long_response.readline()
        assert first.startswith(b"data: ")
        leaver, leaver_response = open_stream(
            server, {"prompt": "for i in range(10):", "max_tokens": 150, "temperature": 0}
        )
        assert leaver_response.readline().startswith(b"data: ")  # it joined and runs
        assert wait_for(lambda: metric(server, "flashspec_running_rows") == 2)
        leaver.close()
        assert wait_for(
            lambda: (
                metric(server, "flashspec_cancelled_total", reason="disconnect", stage="running")
                == before + 1
            )
        ), "the row of the client that left should be cancelled"
        assert wait_for(lambda: metric(server, "flashspec_running_rows") == 1)
        after = completion(server, {"prompt": "abc", "max_tokens": 8, "temperature": 0})
        long_answer = read_stream(long_response, first)
        long_connection.close()
    finally:
        server.stop()
    assert after["choices"][0]["text"] == reference("abc", 8).texts[0]
    assert long_answer == (want_long.texts[0], "length")
    assert len(recorder.streams) == 1 and len(recorder.streams[0]["joined"]) == 2


def test_a_row_cancelled_on_its_way_into_the_stream_leaves(
    reference: Callable[..., Any],
) -> None:
    """A job cancelled after it left the queue but before the engine read it in: its row
    ends "cancelled" (counted as running), and the rows around it finish unchanged."""
    engine = tiny_engine()
    metrics = server_metrics()
    worker = EngineWorker(engine, max_batch=4, max_queue=8, metrics=metrics)
    tokenizer = engine.tokenizer
    events: dict[str, list[Event]] = {"long": [], "late": [], "cancelled": []}
    done = threading.Event()

    def job(name: str, text: str, max_tokens: int) -> Job:
        def deliver(event: Event) -> None:
            events[name].append(event)
            if name == "long" and len(events["long"]) == 1:
                # From the worker thread, between chunks: both are queued, and one is
                # cancelled once the worker has moved it into the stream (see join below).
                worker.submit([victim, late])
            if all(e and e[-1].last for e in events.values()):
                done.set()

        return Job(
            prompt_ids=[int(t) for t in tokenizer(text)["input_ids"]],
            max_tokens=max_tokens,
            stop=(),
            sampling=None,
            seed=None,
            group=("greedy",),
            deliver=deliver,
        )

    long_job = job("long", LONG_PROMPT, 40)
    victim = job("cancelled", "abc", 8)
    late = job("late", "for i in range(10):", 12)
    original = engine.stream

    def stream(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)
        real_join = inner.join

        def join(prompt: list[int], max_new_tokens: int, **options: Any) -> int:
            row = int(real_join(prompt, max_new_tokens, **options))
            if prompt == victim.prompt_ids:
                worker.cancel(victim, "disconnect")
            return row

        inner.join = join
        return inner

    engine.stream = stream
    worker.start()
    try:
        worker.submit([long_job])
        assert done.wait(60), events
    finally:
        worker.stop()
    # One event, no tokens: the row left before the engine read its prompt in.
    assert [(e.finish_reason, e.tokens) for e in events["cancelled"]] == [("cancelled", 0)]
    assert metrics.value("cancelled_total", reason="disconnect", stage="running") == 1
    for name, text, max_tokens in (("long", LONG_PROMPT, 40), ("late", "for i in range(10):", 12)):
        got = "".join(e.text for e in events[name])
        assert got == reference(text, max_tokens).texts[0], name
        assert events[name][-1].finish_reason == "length"
    assert metrics.value("running_rows") == 0


def test_a_full_stream_takes_waiting_jobs_in_groups(reference: Callable[..., Any]) -> None:
    """While more jobs wait than a full stream has room for, they join ``join_group`` at a
    time (one prefill for the group, not one a round as rows finish); when every waiting
    job fits, it joins at once; every row is still its prompt's own output."""
    engine = tiny_engine()
    worker = EngineWorker(engine, max_batch=4, max_queue=16, metrics=server_metrics(),
                          join_group=2)  # fmt: skip
    tokenizer = engine.tokenizer
    texts = ["x = 1\n", "def f(a):", "import os", "class A:", "y = [1, 2]", "for i in r", "z = 0"]
    lengths = [3, 5, 8, 11, 6, 6, 6]  # the first four finish one at a time
    events: dict[int, list[Event]] = {i: [] for i in range(len(texts))}
    chunks = [0]
    done = threading.Event()

    def job(index: int) -> Job:
        def deliver(event: Event) -> None:
            chunks[0] += 1
            events[index].append(event)
            if index == 0 and len(events[0]) == 1:
                worker.submit([waiting[0], waiting[1], waiting[2]])
            if all(e and e[-1].last for e in events.values()):
                done.set()

        return Job(
            prompt_ids=[int(t) for t in tokenizer(texts[index])["input_ids"]],
            max_tokens=lengths[index],
            stop=(),
            sampling=None,
            seed=None,
            group=("greedy",),
            deliver=deliver,
        )

    first = [job(i) for i in range(4)]
    waiting = [job(i) for i in range(4, 7)]
    joined_at: list[int] = []  # the chunk count when each job joined
    original = engine.stream

    def stream(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)
        real_join = inner.join

        def join(prompt: list[int], max_new_tokens: int, **options: Any) -> int:
            joined_at.append(chunks[0])
            return int(real_join(prompt, max_new_tokens, **options))

        inner.join = join
        return inner

    engine.stream = stream  # type: ignore[method-assign]
    worker.start()
    try:
        worker.submit(first)
        assert done.wait(60), events
    finally:
        worker.stop()
    assert len(joined_at) == 3
    # Two free rows for three waiting jobs: two join together; the last one fits and joins.
    assert joined_at[0] == joined_at[1] < joined_at[2], joined_at
    for index, text in enumerate(texts):
        got = "".join(e.text for e in events[index])
        assert got == reference(text, lengths[index]).texts[0], index


def test_join_group_is_checked() -> None:
    for bad in (0, 5):
        with pytest.raises(ValueError, match=r"join_group must be in 1\.\.max_batch"):
            EngineWorker(tiny_engine(), max_batch=4, max_queue=1, metrics=server_metrics(),
                         join_group=bad)  # fmt: skip
    assert EngineWorker(tiny_engine(), max_batch=16, max_queue=1,
                        metrics=server_metrics()).join_group == 4  # fmt: skip


# ------------------------------------------------ 4. sampling groups; fairness; seeded runs


def test_other_settings_and_penalties_share_a_stream_and_other_logprobs_wait_their_turn() -> None:
    """Requests that differ in temperature, top_p, top_k and penalties join one stream: while a
    long T=0.7 request runs, a greedy, a T=1.3, a top_p=0.5 and a presence-penalized request
    join it. A request that asks for logprobs (a setting a stream's rows share) then waits for
    a stream of its own, and a T=0.9 one sent after it does not overtake it by joining (the
    fairness rule)."""
    served, recorder = served_with_recorder(ROUND_PAUSE_S, batching="continuous")
    server = served.server

    # top_k 1 makes sampling pick the argmax: outputs are fixed, so the long one stays long.
    def body(prompt: str, max_tokens: int, **settings: Any) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": max_tokens, "top_k": 1, **settings}

    order: list[str] = []
    try:
        connection, response = open_stream(server, body(LONG_PROMPT, 200, temperature=0.7))
        assert response.readline().startswith(b"data: ")
        with ThreadPoolExecutor(3) as pool:

            def send(name: str, **settings: Any) -> None:
                completion(server, body("abc", 4, **settings))
                order.append(name)

            for name, settings in (
                ("greedy", {"temperature": 0}),
                ("hot", {"temperature": 1.3, "top_k": 0}),
                ("nucleus", {"temperature": 1.0, "top_p": 0.5, "top_k": 0}),
                ("penalized", {"temperature": 0.7, "presence_penalty": 1.0,
                               "frequency_penalty": 0.5, "logit_bias": {"5": 3}}),
            ):  # fmt: skip
                pool.submit(send, name, **settings).result(60)  # joined: answered meanwhile
                assert wait_for(lambda: metric(server, "flashspec_running_rows") == 1)
            other = pool.submit(send, "logprobs", temperature=0.7, logprobs=1)
            assert wait_for(lambda: metric(server, "flashspec_queue_depth") == 1)
            late = pool.submit(send, "late", temperature=0.9)
            assert wait_for(lambda: metric(server, "flashspec_queue_depth") == 2)
            _, finish = read_stream(response)
            other.result(60)
            late.result(60)
        connection.close()
    finally:
        server.stop()
    assert finish == "length"
    assert order == ["greedy", "hot", "nucleus", "penalized", "logprobs", "late"]
    assert [(s["temperatures"], len(s["joined"])) for s in recorder.streams] == [
        ([0.7, 0.0, 1.3, 1.0, 0.7], 4),
        ([0.7], 0),
        ([0.9], 0),
    ]


def test_requests_asking_different_logprobs_share_a_stream_each_with_its_own() -> None:
    """While a long request with logprobs=5 runs, one asking logprobs=1 joins it and gets one
    alternative per token, the same numbers it gets alone, and one asking logprobs=0 gets
    none: a stream computes the most alternatives and each job keeps its own."""
    served, recorder = served_with_recorder(ROUND_PAUSE_S, batching="continuous")
    server = served.server

    def body(max_tokens: int, logprobs: int, **extra: Any) -> dict[str, Any]:
        return {"prompt": "abc", "max_tokens": max_tokens, "temperature": 0, "logprobs": logprobs,
                **extra}  # fmt: skip

    try:
        alone = {k: completion(server, body(4, k)) for k in (1, 0)}
        connection, response = open_stream(server, {**body(200, 5), "prompt": LONG_PROMPT})
        assert response.readline().startswith(b"data: ")
        joined = {k: completion(server, body(4, k)) for k in (1, 0)}
        read_stream(response)
        connection.close()
    finally:
        server.stop()
    assert [len(s["joined"]) for s in recorder.streams] == [0, 0, 2]
    for k in (1, 0):
        got, want = joined[k]["choices"][0]["logprobs"], alone[k]["choices"][0]["logprobs"]
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 4
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
        if k == 0:
            assert got["top_logprobs"] is None or all(not t for t in got["top_logprobs"])
        else:
            assert [len(t) for t in got["top_logprobs"]] == [1] * 4
            for mine, theirs in zip(got["top_logprobs"], want["top_logprobs"], strict=True):
                assert list(mine) == list(theirs)  # (a batch's floats differ in the last bits)
                assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)


SEEDED = {"max_tokens": 12, "temperature": 1.0, "seed": 1234}
NOISE = ("abc", "zzzz", "1+1=", "(((", "a", "while true:")


def seeded_runs(prompt: str | list[str]) -> tuple[list[list[str]], Recorder]:
    """The texts of one seeded request sent alone, amid unseeded requests of other
    temperatures (max_batch 2, so rows join one another's streams), and alone again."""
    served, recorder = served_with_recorder(batching="continuous", max_batch=2)
    server = served.server
    body = {**SEEDED, "prompt": prompt}

    def texts(answer: dict[str, Any]) -> list[str]:
        return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]

    try:
        alone = texts(completion(server, body))
        with ThreadPoolExecutor(len(NOISE) + 1) as pool:
            noise = [
                pool.submit(
                    completion,
                    server,
                    {"prompt": p, "max_tokens": 12, "temperature": 0.5 + 0.2 * i},
                )
                for i, p in enumerate(NOISE)
            ]
            amid = texts(pool.submit(completion, server, body).result(60))
            for future in noise:
                future.result(60)
        again = texts(completion(server, body))
    finally:
        server.stop()
    assert any(s["joined"] for s in recorder.streams)
    return [alone, amid, again], recorder


def shared_with_others(recorder: Recorder) -> bool:
    """Whether a seeded row ran in one stream with a row of another temperature."""
    return any(1234 in s["seeds"] and len(set(s["temperatures"])) > 1 for s in recorder.streams)


def test_a_seeded_request_reproduces_beside_rows_of_other_settings() -> None:
    """A seeded request gives the same completion alone, sharing a stream with unseeded
    requests of other temperatures, and alone again."""
    runs, recorder = seeded_runs("def f(x):")
    assert runs[0] == runs[1] == runs[2]
    assert shared_with_others(recorder)


def test_a_seeded_request_of_several_prompts_reproduces() -> None:
    """Its prompts may be split over streams differently each time (max_batch 2); each row
    still gives the same text, and the rows of one request differ (each its own seed)."""
    runs, recorder = seeded_runs(["def f(x):", "def f(x):", "import os"])
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] != runs[0][1]
    assert shared_with_others(recorder)


# ------------------------------------------------------------------------------ settings


def test_batching_setting_is_checked_and_reaches_the_worker() -> None:
    from flashspec.cli import build_parser

    with pytest.raises(ValueError, match="batching must be one of 'continuous', 'static'"):
        EngineWorker(
            tiny_engine(), max_batch=1, max_queue=1, metrics=server_metrics(), batching="rolling"
        )  # type: ignore[arg-type]
    parser = build_parser()
    assert parser.parse_args(["serve"]).batching == "continuous"
    assert parser.parse_args(["serve", "--batching", "static"]).batching == "static"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--batching", "rolling"])
