"""``flashspec serve --replicas``: its user errors as one line, and the command end to end in a
subprocess (a local Ray head, two replicas of the demo pair, Ctrl-C stops everything).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from flashspec.cli import main
from flashspec.serve import run as serve_run
from tests.helpers.server import interrupt

# Each replica runs one torch thread (--replica-cpus 1); the driver needs none.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ENV.pop("RAY_ADDRESS", None)
START_S = 300.0  # Ray's head, two replicas building their engines, on a loaded 2-core machine


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith("flashspec serve: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("flashspec: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "two"], "--replicas"),
        (["--replica-cpus", "0"], "--replica-cpus"),
        (["--max-replicas", "-1"], "--max-replicas"),
    ],
)
def test_bad_flag_values_are_usage_errors(
    flags: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err


def test_max_replicas_below_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "3", "--max-replicas", "2", "--port", "0"]) == 2
    line = one_line_error(capsys)
    assert "--max-replicas 2" in line and "--replicas 3" in line


def test_more_replicas_than_this_machine_has(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    many = str((os.cpu_count() or 1) + 1)
    assert main(["serve", "--replicas", many, "--port", "0", "--compile", "off"]) == 2
    line = one_line_error(capsys)
    assert f"--replicas {many}" in line and "RAY_ADDRESS" in line


def test_without_ray_installed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a)
    )
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    assert "pip install 'flashspec[ray]'" in one_line_error(capsys)


def get(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if body else {}
        connection.request("POST" if body else "GET", path, body=data, headers=headers)
        response = connection.getresponse()
        return (
            response.status,
            response.getheader("x-flashspec-replica"),
            json.loads(response.read()),
        )
    finally:
        connection.close()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.ray
def test_serve_replicas_end_to_end() -> None:
    """Two replicas answer, and Ctrl-C stops them, also when the server starts with SIGINT
    ignored (as a shell starts a background job: Python's own KeyboardInterrupt is off)."""
    pytest.importorskip("ray")
    with serve_run.bind("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "flashspec.cli", "serve", "--replicas", "2", "--port", str(port),
         "--compile", "off", "--max-batch", "4"],
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=_ignore_sigint,
    )  # fmt: skip
    assert process.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        ready = f"on http://127.0.0.1:{port}/v1"
        end = time.monotonic() + START_S
        while not any(ready in line for line in lines):
            if process.poll() is not None or time.monotonic() > end:
                pytest.fail("".join(lines)[-3000:])
            time.sleep(0.2)
        status, replica, health = get(port, "/health")
        assert status == 200 and replica == "ingress" and len(health["replicas"]) == 2, health
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
        status, replica, answer = get(port, "/v1/completions", body)
        assert status == 200 and replica in health["replicas"], answer
        assert answer["choices"][0]["text"]
    finally:
        rc = interrupt(process, 90)
    reader.join(10)
    assert rc == 0, "".join(lines)[-3000:]
    assert "stopping the replicas" in "".join(lines)
    with serve_run.bind("127.0.0.1", port):
        pass  # the port is free again: the proxy went down with Ray


def test_a_cluster_that_cannot_be_joined_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    line = one_line_error(capsys)
    assert "RAY_ADDRESS=10.0.0.9:6379" in line and "cannot join" in line, line


def test_build_takes_the_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray.serve")
    from flashspec.cluster import app as cluster_app

    built: list[Any] = []
    monkeypatch.setattr(cluster_app, "application", built.append)
    monkeypatch.setenv("FLASHSPEC_API_KEY", "from-a-secret")
    cluster_app.build({"target": "demo"})
    cluster_app.build({"target": "demo", "api_key": "in-the-file"})
    assert [s.api_key for s in built] == ["from-a-secret", "in-the-file"]
