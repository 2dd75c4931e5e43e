"""The oracle of ``benchmarks/adaptive_headroom.py``: its bound is only as good as its search."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "adaptive_headroom.py"


@pytest.fixture(scope="module")
def headroom() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adaptive_headroom", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["adaptive_headroom"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_expected_tokens_are_the_bonus_plus_each_reach(headroom: ModuleType) -> None:
    assert headroom.tokens_by_length([1.0, 1.0, 0.5])[3] == pytest.approx(3.5)
    assert headroom.tokens_by_length([0.5, 0.5])[2] == pytest.approx(1.75)
    assert headroom.tokens_by_length([0.5, 0.5])[1] == pytest.approx(1.5)
    assert headroom.tokens_by_length([0.9])[0] == 1.0
    assert headroom.tokens_by_length([]) == [1.0]  # prompt lookup without a match


def test_the_oracle_maximises_the_total_rate_not_each_groups_own(headroom: ModuleType) -> None:
    # Group 0's arm 1 has the better rate of its own (3 > 2), but its 10 seconds dilute group
    # 1's rate of 10: the total is best with arm 0 there (102 / 11 against 130 / 20).
    tokens = np.array([[2.0, 30.0], [100.0, 100.0]])
    seconds = np.array([[1.0, 10.0], [10.0, 10.0]])
    rate, choice = headroom.oracle(tokens, seconds, ["a", "b"])
    assert rate == pytest.approx(102 / 11)
    assert choice["a"] == 0


def test_the_oracle_matches_a_brute_force_search(headroom: ModuleType) -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        rounds, arms = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        tokens = rng.uniform(1, 5, size=(rounds, arms))
        seconds = rng.uniform(0.5, 3, size=(rounds, arms))
        groups = [int(g) for g in rng.integers(0, 3, size=rounds)]
        rate, choice = headroom.oracle(tokens, seconds, groups)
        members = sorted(set(groups))
        best = 0.0
        for picks in itertools.product(range(arms), repeat=len(members)):
            arm = dict(zip(members, picks, strict=True))
            columns = [arm[g] for g in groups]
            t = sum(tokens[r, c] for r, c in enumerate(columns))
            s = sum(seconds[r, c] for r, c in enumerate(columns))
            best = max(best, t / s)
        assert rate == pytest.approx(best, rel=1e-9)
        columns = [choice[g] for g in groups]
        achieved = sum(tokens[r, c] for r, c in enumerate(columns)) / sum(
            seconds[r, c] for r, c in enumerate(columns)
        )
        assert achieved == pytest.approx(rate, rel=1e-9)
