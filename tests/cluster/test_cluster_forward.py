"""The pieces of the replicated server that need no Ray: a request carried to a replica and run
through the flashspec app in-process (``call_app``, ``Lifespan``), and the merge of the
replicas' health and metrics (``Board``, ``merge_metrics``).

References: the same app answering over real HTTP (uvicorn), and prometheus_client's own
parser of the exposition format.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flashspec.cluster.board import Board, Report, labelled, merge_metrics
from flashspec.cluster.forward import REPLICA_HEADER, Forwarded, Head, Lifespan, call_app
from flashspec.serve import create_app
from tests.helpers.server import request, serve_tiny, tiny_engine, wait_for

BODY = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0}


def forwarded(body: dict[str, Any] | None, path: str = "/v1/completions") -> Forwarded:
    data = json.dumps(body).encode() if body is not None else b""
    return Forwarded(
        method="POST" if body is not None else "GET",
        path=path,
        headers=(
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ),
        body=data,
    )


async def collect(parts: AsyncIterator[Head | bytes]) -> tuple[Head, bytes]:
    head: Head | None = None
    chunks = []
    async for part in parts:
        if isinstance(part, Head):
            assert head is None, "two heads"
            head = part
        else:
            assert head is not None, "a body before the head"
            chunks.append(part)
    assert head is not None
    return head, b"".join(chunks)


def run_in_app(
    app: Any, body: dict[str, Any] | None, path: str = "/v1/completions"
) -> tuple[Head, bytes]:
    async def main() -> tuple[Head, bytes]:
        lifespan = Lifespan(app)
        await lifespan.startup()
        try:
            return await collect(call_app(app, forwarded(body, path), "r1"))
        finally:
            await lifespan.shutdown()

    return asyncio.run(main())


def test_forwarded_answers_equal_the_http_server() -> None:
    served = serve_tiny()
    try:
        status, headers, over_http = request(served.server, "POST", "/v1/completions", BODY)
    finally:
        served.server.stop()
    assert status == 200 and REPLICA_HEADER not in headers
    app = create_app(tiny_engine(), model_name="tiny")
    head, raw = run_in_app(app, BODY)
    assert head.status == 200 and not head.streamed
    assert head.header(REPLICA_HEADER) == "r1"
    assert head.header("content-type") == "application/json"
    answer = json.loads(raw)
    assert answer["choices"][0]["text"] == over_http["choices"][0]["text"]
    assert answer["usage"] == over_http["usage"]


def test_forwarded_stream_is_relayed_as_events() -> None:
    app = create_app(tiny_engine(), model_name="tiny")
    head, raw = run_in_app(app, {**BODY, "stream": True})
    assert head.status == 200 and head.streamed
    assert head.header(REPLICA_HEADER) == "r1"
    events = [line for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    text = "".join(
        c["text"] for e in events[:-1] for c in json.loads(e[len("data: ") :])["choices"]
    )
    _, raw_whole = run_in_app(create_app(tiny_engine(), model_name="tiny"), BODY)
    assert text == json.loads(raw_whole)["choices"][0]["text"]


def test_forwarded_errors_keep_openai_shape_and_the_header() -> None:
    app = create_app(tiny_engine(), model_name="tiny")
    head, raw = run_in_app(app, None, path="/nowhere")
    assert head.status == 404 and head.header(REPLICA_HEADER) == "r1"
    assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    head, raw = run_in_app(create_app(tiny_engine(), model_name="tiny"), {**BODY, "max_tokens": -1})
    assert head.status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_closing_mid_stream_cancels_the_row() -> None:
    """The ingress's client leaving (the iterator closed) reaches the app as a disconnect."""
    app = create_app(tiny_engine(), model_name="tiny", timeout_s=60)
    metrics = app.state.service.metrics
    long = {**BODY, "max_tokens": 200, "stream": True}

    async def main() -> None:
        lifespan = Lifespan(app)
        await lifespan.startup()
        try:
            parts = call_app(app, forwarded(long), "r1")
            head = await anext(parts)
            assert isinstance(head, Head) and head.streamed
            await anext(parts)  # the first event: the row is running
            await parts.aclose()
            await asyncio.to_thread(
                wait_for,
                lambda: metrics.value("cancelled_total", reason="disconnect", stage="running") == 1,
                15.0,
            )
        finally:
            await lifespan.shutdown()

    asyncio.run(main())
    assert metrics.value("cancelled_total", reason="disconnect", stage="running") == 1
    assert metrics.value("running_rows") == 0


def test_lifespan_starts_and_stops_the_worker() -> None:
    app = create_app(tiny_engine(), model_name="tiny")
    worker = app.state.service.worker

    async def main() -> None:
        lifespan = Lifespan(app)
        await lifespan.startup()
        assert worker.alive
        await lifespan.shutdown()

    assert not worker.alive
    asyncio.run(main())
    assert not worker.alive


def test_an_app_that_never_answers_is_an_error() -> None:
    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await receive()

    async def main() -> None:
        with pytest.raises(RuntimeError, match="without a complete response"):
            await collect(call_app(silent, forwarded(BODY), "r1"))

    asyncio.run(main())


# ------------------------------------------------------------------------------------ board

TEXT_A = """# HELP flashspec_requests_total HTTP requests.
# TYPE flashspec_requests_total counter
flashspec_requests_total{endpoint="/v1/completions",status="200"} 3
# HELP flashspec_queue_depth Waiting.
# TYPE flashspec_queue_depth gauge
flashspec_queue_depth 0
# HELP flashspec_latency_seconds Latency.
# TYPE flashspec_latency_seconds histogram
flashspec_latency_seconds_bucket{le="1"} 2
flashspec_latency_seconds_bucket{le="+Inf"} 3
flashspec_latency_seconds_sum 2.5
flashspec_latency_seconds_count 3
"""


def test_merged_metrics_parse_and_label_every_replica() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    text_b = (
        TEXT_A.replace("} 3\n", "} 5\n")
        .replace("_count 3", "_count 5")
        .replace("flashspec_queue_depth 0", "flashspec_queue_depth 2")
    )
    merged = merge_metrics({"a": TEXT_A, "b": text_b})
    assert merged.count("# HELP flashspec_requests_total") == 1
    families = {f.name: f for f in parser.text_string_to_metric_families(merged)}
    assert set(families) == {
        "flashspec_requests",
        "flashspec_queue_depth",
        "flashspec_latency_seconds",
    }
    requests = {s.labels["replica"]: s.value for s in families["flashspec_requests"].samples}
    assert requests == {"a": 3.0, "b": 5.0}
    depth = {s.labels["replica"]: s.value for s in families["flashspec_queue_depth"].samples}
    assert depth == {"a": 0.0, "b": 2.0}
    counts = {
        s.labels["replica"]: s.value
        for s in families["flashspec_latency_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"a": 3.0, "b": 5.0}
    assert all(
        s.labels.get("endpoint") == "/v1/completions"
        for s in families["flashspec_requests"].samples
    )


def test_labelled_keeps_existing_labels() -> None:
    assert labelled('m{a="1"} 2', 'x"y') == 'm{replica="x\\"y",a="1"} 2'
    assert labelled("m 2", "r") == 'm{replica="r"} 2'
    assert labelled("m{} 2", "r") == 'm{replica="r"} 2'


def test_board_forgets_replicas_that_stop_reporting() -> None:
    board = Board(stale_s=0.2)
    board.put(Report("a", True, TEXT_A))
    board.put(Report("b", False, TEXT_A))
    assert board.health() == {"a": True, "b": False}
    time.sleep(0.3)
    board.put(Report("a", True, TEXT_A))
    assert board.health() == {"a": True}
    assert 'replica="b"' not in board.metrics() and 'replica="a"' in board.metrics()
    board.drop("a")
    assert board.health() == {} and board.metrics() == ""
