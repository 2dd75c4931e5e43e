"""``flashspec serve --replicas``: two replicas of the demo pair on a local Ray head bound to
loopback, started and stopped here, every wait bounded.

References: a single-process server over the same engine (its greedy answers), OpenAI's error
shape, prometheus_client's parser. Marked ``ray`` (about two minutes on 2 cores): CI runs it;
``pytest -m "not ray"`` leaves it out.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from flashspec.cluster import REPLICA_HEADER, Cluster, ClusterSettings
from flashspec.cluster.launch import check_fits
from flashspec.options import EngineOptions, UserError
from flashspec.serve import ServerThread, create_app
from tests.helpers.server import assert_error, open_stream, request, wait_for

pytestmark = pytest.mark.ray

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = EngineOptions(target="demo", compile="off")
PROMPTS = [
    "def add(a, b):",
    "def fib(n):",
    "class Stack:",
    "import os\n",
    "def is_prime(n):",
    "for i in range(",
    "def reverse(s):",
    "x = [",
]
# Long enough that requests are still running when a replica is killed.
LONG = 160
# A replica is ready when its engine is built: on a loaded 2-core machine, allow minutes.
READY_S = 240.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    settings = ClusterSettings(
        engine=ENGINE,
        replicas=2,
        replica_cpus=1,
        model_name="demo",
        max_batch=4,
        max_queue=32,
        timeout_s=60.0,
        api_key=KEY,
        retries=2,
        app_name="flashspec-test",
    )
    os.environ.pop("RAY_ADDRESS", None)
    running = Cluster(settings, host="127.0.0.1", port=0, num_cpus=2, log_to_driver=False)
    try:
        running.start()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def reference() -> Iterator[ServerThread]:
    """The same engine in one process, without Ray."""
    app = create_app(ENGINE.build(), model_name="demo", api_key=KEY)
    with ServerThread(app) as server:
        yield server


def body(prompt: str, max_tokens: int = 24) -> dict[str, Any]:
    return {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def completion(server: Any, prompt: str, max_tokens: int = 24) -> tuple[int, dict[str, str], Any]:
    return request(server, "POST", "/v1/completions", body(prompt, max_tokens), AUTH, timeout=120)


def streamed(server: Any, prompt: str, max_tokens: int = 24) -> tuple[int, str, str | None, str]:
    """(status, text, replica header, how it ended) of a streamed completion: ``"done"``
    ([DONE]), ``"error"`` (an error event in OpenAI's shape) or ``"cut"`` (neither)."""
    connection, response = open_stream(server, body(prompt, max_tokens), AUTH)
    try:
        replica = response.getheader(REPLICA_HEADER)
        text: list[str] = []
        for line in response:
            if line.strip() == b"data: [DONE]":
                return response.status, "".join(text), replica, "done"
            if line.startswith(b"data: "):
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    assert_error(event, 503)
                    return response.status, "".join(text), replica, "error"
                text.extend(c["text"] for c in event["choices"])
        return response.status, "".join(text), replica, "cut"
    finally:
        connection.close()


def running_rows(cluster: Cluster, replica: str) -> float:
    """The replica's running rows, as its last report to the ingress says (0 if none)."""
    text = request(cluster, "GET", "/metrics", headers=AUTH)[2]
    for line in text.splitlines():
        if line.startswith(f'flashspec_running_rows{{replica="{replica}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_concurrent_requests_equal_one_process_and_use_both_replicas(
    cluster: Cluster, reference: ServerThread
) -> None:
    expected = {}
    for prompt in PROMPTS:
        status, _, answer = completion(reference, prompt)
        assert status == 200, answer
        expected[prompt] = answer["choices"][0]["text"]
    jobs = [(prompt, i % 2 == 1) for i in range(2) for prompt in PROMPTS]  # 16, half streamed
    with concurrent.futures.ThreadPoolExecutor(16) as pool:

        def run(job: tuple[str, bool]) -> tuple[str, str, str | None]:
            prompt, stream = job
            if stream:
                status, text, replica, end = streamed(cluster, prompt)
                assert status == 200 and end == "done"
                return prompt, text, replica
            status, headers, answer = completion(cluster, prompt)
            assert status == 200, answer
            return prompt, answer["choices"][0]["text"], headers.get(REPLICA_HEADER)

        results = list(pool.map(run, jobs, timeout=180))
    assert len(results) == 16
    for prompt, text, _ in results:
        assert text == expected[prompt], prompt
    replicas = {replica for _, _, replica in results}
    assert replicas == set(cluster.replicas()) and len(replicas) == 2, replicas


def test_health_and_metrics_cover_every_replica(cluster: Cluster) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    ids = set(cluster.replicas())
    status, headers, health = request(cluster, "GET", "/health")  # no key needed
    assert status == 200 and health["status"] == "ok", health
    assert set(health["replicas"]) == ids and headers[REPLICA_HEADER] == "ingress"
    status, _, answer = request(cluster, "GET", "/metrics")
    assert status == 401
    assert_error(answer, 401)
    # Reports arrive every second: wait until both replicas' counts include a request.
    for prompt in PROMPTS[:4]:
        assert completion(cluster, prompt, 4)[0] == 200
    deadline = time.monotonic() + 30
    while True:
        status, _, text = request(cluster, "GET", "/metrics", headers=AUTH)
        assert status == 200
        families = {f.name: f for f in parser.text_string_to_metric_families(text)}
        seen = {
            s.labels["replica"]
            for s in families["flashspec_requests"].samples
            if s.labels.get("endpoint") == "/v1/completions"
        }
        if seen == ids or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == ids
    healthy = families["flashspec_replicas_healthy"].samples[0].value
    assert healthy == 2


def test_errors_from_a_replica_keep_openai_shape(cluster: Cluster) -> None:
    status, headers, answer = request(cluster, "POST", "/v1/completions", body("x"))  # no key
    assert status == 401 and headers[REPLICA_HEADER] in cluster.replicas()
    assert_error(answer, 401)
    status, _, answer = request(
        cluster, "POST", "/v1/completions", {**body("x"), "max_tokens": -1}, AUTH
    )
    assert status == 400
    assert_error(answer, 400, param="max_tokens")


def test_framing_limits_hold_behind_the_proxy(cluster: Cluster) -> None:
    """Issue 38 through Ray's proxy: no redirect for a trailing slash, 415 for a body that is
    not JSON (from the ingress, before forwarding), HEAD probes answered."""
    evil = {**AUTH, "Host": "evil.example:666"}
    status, headers, answer = request(cluster, "POST", "/v1/completions/", body("x"), evil)
    assert status == 404 and "location" not in headers, (status, headers)
    assert_error(answer, 404)
    plain = {**AUTH, "Content-Type": "text/plain"}
    status, headers, answer = request(cluster, "POST", "/v1/completions", body("x"), plain)
    assert status == 415 and headers[REPLICA_HEADER] == "ingress", answer
    assert assert_error(answer, 415)["code"] == "unsupported_media_type"
    for path in ("/health", "/metrics"):
        status, _, answer = request(cluster, "HEAD", path, headers=AUTH)
        assert status == 200 and answer == "", (path, status, answer)


def cancelled_running(cluster: Cluster) -> float:
    """Rows cancelled mid-generation because their client left, over every replica."""
    text = request(cluster, "GET", "/metrics", headers=AUTH)[2]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("flashspec_cancelled_total{")
        and 'reason="disconnect"' in line
        and 'stage="running"' in line
    )


def test_a_client_that_leaves_frees_its_row(cluster: Cluster) -> None:
    """Leaving mid-stream reaches the replica through the proxy and the ingress: the row is
    cancelled there, as in one process."""
    before = cancelled_running(cluster)
    connection, response = open_stream(cluster, body(PROMPTS[1], 400), AUTH)
    for line in response:
        if line.startswith(b"data: ") and b'"text"' in line:
            break  # generating
    response.close()
    connection.close()
    assert wait_for(lambda: cancelled_running(cluster) >= before + 1, 30.0)


def ingress_counts(cluster: Cluster) -> dict[str, float]:
    """The ingress's retries and failures so far (by reason)."""
    text = request(cluster, "GET", "/metrics", headers=AUTH)[2]
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("flashspec_ingress_retries_total", "flashspec_ingress_failures_total")):
            name, _, value = line.rpartition(" ")
            counts[name] = float(value)
    return counts


def wait_for_replacement(cluster: Cluster, victim: str) -> set[str]:
    """The replicas once Ray Serve has replaced ``victim`` (two again, without it)."""
    assert wait_for(lambda: len(set(cluster.replicas()) - {victim}) == 2, READY_S), (
        cluster.replicas()
    )
    return set(cluster.replicas())


def kill_under_load(
    cluster: Cluster, victim: str, stream: bool, expected: dict[str, str]
) -> list[str]:
    """32 concurrent requests (all streamed or all whole: four batches for each replica, so the
    victim still has work queued when it dies); ``victim`` is killed once it runs rows of them.
    Each request's outcome: ``"ok"`` (equal to the reference) or ``"failed-clean"`` (a 5xx in
    OpenAI's shape, or a stream cut by an error event after correct text). A hang
    fails the test at the futures' timeout."""

    def run(prompt: str) -> str:
        if stream:
            status, text, _, end = streamed(cluster, prompt, LONG)
            assert status == 200 and end != "cut", (status, end)
            if end == "done":
                assert text == expected[prompt]
                return "ok"
            assert expected[prompt].startswith(text)  # what came before the error was right
            return "failed-clean"
        status, _, answer = completion(cluster, prompt, LONG)
        if status == 200:
            assert answer["choices"][0]["text"] == expected[prompt]
            return "ok"
        assert 500 <= status < 600, (status, answer)
        assert_error(answer, status)
        return "failed-clean"

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, prompt) for prompt in PROMPTS * 4]
        # Mid-generation: the victim's last report shows rows of the load running. Not a full
        # batch: a report comes once a second, and on a faster machine a full batch of the demo
        # pair can start and finish between two reports.
        assert wait_for(lambda: running_rows(cluster, victim) >= 2, 60.0)
        cluster.kill_replica(victim)
        return [future.result(timeout=180) for future in futures]


def test_a_replica_killed_mid_load(cluster: Cluster, reference: ServerThread) -> None:
    """Its in-flight requests are retried or fail cleanly; the rest finish; a new replica comes
    up and serves; nothing hangs. Once with streams (cut by an error event: they cannot be
    retried once text went out), once with whole answers (retried on the other replica)."""
    expected = {p: completion(reference, p, LONG)[2]["choices"][0]["text"] for p in PROMPTS}
    first = sorted(cluster.replicas())[0]
    before = ingress_counts(cluster)
    outcomes = kill_under_load(cluster, first, True, expected)
    # The streams the victim held when it died (up to a batch: how many depends on when its last
    # report came) each end with an error event, counted once; the others finish.
    failed = outcomes.count("failed-clean")
    assert 1 <= failed <= 4 and outcomes.count("ok") == len(outcomes) - failed, outcomes
    after = ingress_counts(cluster)
    gone = 'flashspec_ingress_failures_total{replica="ingress",reason="replica_gone"}'
    assert after.get(gone, 0) - before.get(gone, 0) == failed, after

    second = sorted(wait_for_replacement(cluster, first) - {first})[0]
    retries = 'flashspec_ingress_retries_total{replica="ingress"}'
    before = ingress_counts(cluster)
    outcomes = kill_under_load(cluster, second, False, expected)
    # Whole answers had sent nothing: the victim's are retried (a retry that reaches the dead
    # replica before the router knows counts again) and succeed.
    assert outcomes == ["ok"] * len(outcomes), outcomes
    after = ingress_counts(cluster)
    assert after.get(retries, 0) - before.get(retries, 0) >= 1, after
    assert after.get(gone, 0) == before.get(gone, 0), after

    now = wait_for_replacement(cluster, second)
    seen: set[str] = set()
    assert wait_for(lambda: _served_by(cluster, expected, seen) == now, 60.0), (seen, now)


def _served_by(cluster: Cluster, expected: dict[str, str], seen: set[str]) -> set[str]:
    status, headers, answer = completion(cluster, PROMPTS[0], LONG)
    assert status == 200 and answer["choices"][0]["text"] == expected[PROMPTS[0]]
    seen.add(headers[REPLICA_HEADER])
    return seen


def test_settings_refuse_bad_values_by_name() -> None:
    with pytest.raises(UserError, match="max_replicas"):
        ClusterSettings(replicas=3, max_replicas=2)
    with pytest.raises(UserError, match="replicas"):
        ClusterSettings(replicas=0)
    with pytest.raises(UserError, match=r"unknown setting.*bogus"):
        ClusterSettings.from_dict({"target": "demo", "bogus": 1})
    settings = ClusterSettings.from_dict({"target": "smollm2", "replicas": 1, "max_replicas": 3})
    assert settings.engine.target == "smollm2"
    assert settings.autoscaling == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 8.0,
    }


def test_deployment_options_follow_the_settings() -> None:
    from flashspec.cluster.app import replica_options

    fixed = replica_options(ClusterSettings(replicas=2, replica_cpus=1.5, max_batch=6))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.5}
    assert fixed["max_ongoing_requests"] == 6  # a batch's worth; the rest wait in Ray's queue
    scaled = replica_options(ClusterSettings(replicas=1, max_replicas=4, target_ongoing=3))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"]["max_replicas"] == 4
    assert scaled["autoscaling_config"]["target_ongoing_requests"] == 3
    assert ClusterSettings(replicas=2, max_replicas=2).autoscaling is None


def test_a_local_head_too_small_is_refused_before_starting() -> None:
    settings = ClusterSettings(engine=ENGINE, replicas=3)
    with pytest.raises(UserError, match=r"--replicas 3.*needs 3 CPUs.*has 2"):
        check_fits(settings, 2)
    check_fits(ClusterSettings(engine=ENGINE, replicas=2), 2)
