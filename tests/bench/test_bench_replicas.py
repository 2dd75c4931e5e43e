"""``benchmarks/load_replicas.py``'s docs section: a small synthetic ``replicas.json`` renders
into a table with the command, the machine and one row per mode (no Ray, no engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.bench import MACHINE, load_renderer, needs_renderer


def summary(mode: str, replicas: int, tokens_per_s: float, **extra: Any) -> dict[str, Any]:
    """One mode's medians, as ``load_replicas.summarise`` writes them."""
    return {
        "mode": mode,
        "replicas": replicas,
        "torch_threads": 2 if replicas == 0 else 1,
        "rounds": 1,
        "tokens_per_s": tokens_per_s,
        "requests_per_s": tokens_per_s / 64,
        "latency_s": {"p50": 1.25, "p90": 1.5, "p99": 1.75},
        "ttft_s": {"p50": 0.125, "p99": 0.25},
        "startup_s": 3.0 if replicas == 0 else 20.0,
        "requests": 64,
        "error_count": 0,
        "errors": [],
        "replicas_seen": {f"r{i}": 64 // replicas for i in range(replicas)},
        **extra,
    }


DATA: dict[str, Any] = {
    "benchmark": "replicas",
    "machine": {**MACHINE, "ray": "2.60.0", "loadavg_start": [0.5], "loadavg_end": [1.5]},
    "settings": {
        "command": "python benchmarks/load_replicas.py --repeats 2",
        "target": "demo",
        "compile": "off",
        "clients": 16,
        "requests": 4,
        "max_tokens": [64],
        "max_batch": 8,
        "modes": ["process", "replicas-1", "replicas-2"],
        "repeats": 2,
        "replica_cpus": 1,
        "process_threads": 2,
    },
    "modes": [
        summary("process", 0, 400.0, vs_process=1.0, vs_replicas_1=2.0),
        summary("replicas-1", 1, 200.0, vs_process=0.5, vs_replicas_1=1.0),
        summary("replicas-2", 2, 300.0, vs_process=0.75, vs_replicas_1=1.5, error_count=3),
    ],
}


@needs_renderer
def test_docs_section_renders() -> None:
    render = load_renderer()
    body = render.replicas_section(DATA)
    assert render.PAGES["REPLICAS-BENCH"].name == "benchmarks.md"
    assert "`python benchmarks/load_replicas.py --repeats 2`" in body
    assert "test cpu, 2 cores" in body and "Ray 2.60.0" in body and "0123456789" in body
    assert "2 rounds of every mode" in body
    rows = [line for line in body.splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| process", "| replicas-1", "| replicas-2"]
    process, one, two = (row.split(" | ") for row in rows)
    # The baseline's own ratio cell stays empty; the others read tokens/s over it.
    assert process[1:6] == ["(one process)", "3.0", "400.0", "", "2.00x"]
    assert one[1:6] == ["1", "20.0", "200.0", "0.50x", ""]
    assert two[1:6] == ["2", "20.0", "300.0", "0.75x", "1.50x"]
    assert two[7] == "1.25 / 1.50 / 1.75" and two[8] == "0.12 / 0.25"
    assert two[9] == "3 |"


@needs_renderer
def test_missing_file_leaves_the_section(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    render = load_renderer()
    monkeypatch.setattr(render, "REPLICAS_JSON", tmp_path / "replicas.json")
    assert "REPLICAS-BENCH" not in render.sections()
    (tmp_path / "replicas.json").write_text(json.dumps(DATA))
    body = render.sections()["REPLICAS-BENCH"]
    page = render.PAGES["REPLICAS-BENCH"].read_text()
    rendered = render.replace_between(page, "REPLICAS-BENCH", body)
    assert body in rendered and rendered.count("<!-- REPLICAS-BENCH:START -->") == 1
