"""``benchmarks/smollm2_draft.py``'s arithmetic and its rendering: the acceptance a speedup
needs at a round's measured cost, checked against the closed form of a round's tokens; the
tables keep one method order whatever order a prompt ran them in."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.bench import MACHINE, load_renderer, load_script

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "smollm2_draft.py"
pytestmark = pytest.mark.skipif(not BENCH.is_file(), reason="no benchmarks/ in this tree")


def load_bench() -> Any:
    return load_script(BENCH)


def closed_form(alpha: float, gamma: int) -> float:
    """Tokens a round yields: a geometric series, summed in closed form."""
    return float(gamma + 1) if alpha == 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@pytest.mark.parametrize("gamma", [1, 4, 7])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.65, 1.0])
def test_tokens_per_round_is_the_geometric_series(alpha: float, gamma: int) -> None:
    assert math.isclose(load_bench().tokens_per_round(alpha, gamma), closed_form(alpha, gamma))


@pytest.mark.parametrize(("goal", "cost", "gamma"), [(1.8, 1.37, 4), (1.5, 1.9, 4), (1.2, 1.0, 2)])
def test_needed_acceptance_reaches_the_goal_and_no_less_does(
    goal: float, cost: float, gamma: int
) -> None:
    alpha = load_bench().needed_acceptance(goal, cost, gamma)
    assert alpha is not None and 0.0 < alpha < 1.0
    assert closed_form(alpha, gamma) / cost >= goal - 1e-6
    assert closed_form(alpha - 0.001, gamma) / cost < goal


def test_needed_acceptance_is_none_past_a_perfect_draft() -> None:
    # Five tokens a round at most (gamma 4): a round costing 3 steps cannot reach 1.8x.
    assert load_bench().needed_acceptance(1.8, 3.0, 4) is None


def row(name: str, speedup: float, **extra: Any) -> dict[str, Any]:
    base = "hf_greedy" + ("_bf16" if name.endswith("_bf16") else "")
    return {
        "prompts": 2,
        "baseline": base,
        "speedup_median": speedup,
        "tokens_per_second_median": 10.0 * speedup,
        "new_tokens_mean": 50,
        **extra,
    }


def test_the_section_orders_methods_and_says_what_each_goal_needs() -> None:
    rotated = {  # the order a later prompt ran them in
        "fs_draft": row(
            "fs_draft", 0.9, acceptance_rate=0.2, tokens_per_round=1.6, per_draft_acceptance=0.41
        ),
        "llamacpp": row("llamacpp", 2.3),
        "hf_greedy": row("hf_greedy", 1.0),
    }
    data = {
        "machine": MACHINE,
        "settings": {
            "max_new_tokens": 64,
            "gamma": 4,
            "sampling": {"temperature": 0.7, "top_p": 0.95},
            "notes": {},
        },
        "summary": {"chat": rotated},
        "costs": {
            "float32": {
                "target_step_ms": 50.0,
                "verify_ms": 60.0,
                "draft_step_ms": 4.0,
                "draft_over_target": 0.08,
                "verify_over_target": 1.2,
                "round_over_target": 1.52,
                "needed_acceptance": {"1.5": 0.57, "1.8": None},
            }
        },
    }
    text = load_renderer().smollm2_draft_section(data)
    rows = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    assert rows == ["method", "hf_greedy", "fs_draft", "llamacpp"], rows
    assert "a round of 4 drafts costs 1.52 target steps" in text
    assert "1.5x needs 0.57, 1.8x needs more than 1" in text
    assert "the draft alone reached chat 0.41" in text
