"""``flashspec bench regret`` on a short horizon: result schema, monotone regret, the bound."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from flashspec import bench
from flashspec.bench import regret as R

MEANS = (0.9, 0.7, 0.4)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("regret")
    data = R.run_regret(out, means=MEANS, horizon=400, runs=6, seed=1, plot=False)
    return data, out


def test_result_file_and_schema(result: tuple[dict[str, Any], Path]) -> None:
    data, out = result
    assert json.loads((out / "regret.json").read_text()) == data
    assert {"git_sha", "python", "numpy", "cpu"} <= set(data["machine"])
    assert data["setup"]["means"] == list(MEANS)
    assert (data["setup"]["horizon"], data["setup"]["runs"]) == (400, 6)
    assert set(data["selectors"]) == {"ucb1", "thompson"}
    t = data["curve"]["t"]
    assert t[0] == 1 and t[-1] == 400 and t == sorted(set(t))
    for kind in ("ucb1", "thompson"):
        final = data["selectors"][kind]["final_regret"]
        assert {"mean", "std", "sem", "median", "p5", "p95"} <= set(final)
        assert data["curve"][kind]["mean"][-1] == pytest.approx(final["mean"], abs=1e-3)
        assert sum(data["selectors"][kind]["mean_pulls_per_arm"]) == pytest.approx(
            400, abs=0.2
        )  # rounded to 0.1 per arm


def test_regret_is_monotone_and_below_the_bound(result: tuple[dict[str, Any], Path]) -> None:
    data, _ = result
    curve = data["curve"]
    for kind in ("ucb1", "thompson"):
        mean, p5, p95 = curve[kind]["mean"], curve[kind]["p5"], curve[kind]["p95"]
        assert all(a <= b for a, b in itertools.pairwise(mean)), kind
        assert all(lo <= m <= hi for lo, m, hi in zip(p5, mean, p95, strict=True)), kind
        assert all(m <= b for m, b in zip(mean, curve["bound"], strict=True)), kind
        assert mean[-1] > 0  # a selector that never explores would score 0 only by luck


def test_bound_matches_auer_et_al() -> None:
    # Gaps 0.2 and 0.5 at T = 10,000: 8 ln T (1/0.2 + 1/0.5) + (1 + pi^2/3)(0.7).
    expected = 8 * math.log(10_000) * 7 + (1 + math.pi**2 / 3) * 0.7
    assert R.auer_bound(MEANS, 10_000) == pytest.approx(expected)
    assert expected == pytest.approx(518.78, abs=0.01)
    nearest = R.bound_search(526.0, 10_000)
    assert nearest[0]["gaps"] == [0.2, 0.5] and nearest[0]["bound"] == 518.8


def test_same_seed_same_result() -> None:
    a = R.simulate(MEANS, horizon=200, runs=2, seed=3)
    b = R.simulate(MEANS, horizon=200, runs=2, seed=3)
    for kind in ("ucb1", "thompson"):
        assert (a[kind] == b[kind]).all()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="means must be two or more"):
        R.run_regret(tmp_path, means=(0.5,), horizon=10, runs=1)
    with pytest.raises(ValueError, match="means must be two or more"):
        R.run_regret(tmp_path, means=(0.5, 1.5), horizon=10, runs=1)
    with pytest.raises(ValueError, match="horizon must be an integer >= 1"):
        R.run_regret(tmp_path, horizon=0, runs=1)
    with pytest.raises(SystemExit):
        bench.cli(["regret", "--means", "0.5", "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["regret", "--horizon", "50", "--runs", "2", "--means", "0.6,0.5"]
    status = bench.cli([*argv, "--name", "r", "--out-dir", str(tmp_path), "--no-progress"])
    assert status == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["setup"]["means"] == [0.6, 0.5] and data["setup"]["horizon"] == 50
    assert "ucb1" in capsys.readouterr().out
