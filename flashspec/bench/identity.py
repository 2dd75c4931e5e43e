"""Greedy identity: whether a benchmark's greedy output is the target's own, under the tie rule.

``compare_greedy`` (with its result, ``GreedyComparison``) is the rule itself: an output that
differs from the target's own greedy decoding is still right where, at the first difference,
the target rounds to either token (one forward over k tokens and k forwards over one round
differently). The rest turn its verdicts into what result files record, per row and per prompt.
The research scripts in ``benchmarks/`` check their outputs with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._greedy import GreedyComparison as GreedyComparison
from .._greedy import compare_greedy as compare_greedy
from .pair import Pair

__all__ = [
    "STATUSES",
    "GreedyComparison",
    "compare_greedy",
    "count_statuses",
    "row_statuses",
    "worst",
    "worst_verdict",
]

STATUSES = ("mismatch", "tie", "identical")
"""The verdicts, worst first: a prompt's verdict over the repeats is the worst of its runs."""


def row_statuses(
    pair: Pair,
    prompts: Sequence[Sequence[int]],
    got: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
) -> list[dict[str, Any]]:
    """Each row's verdict against the reference's row: ``identical``, or (under the greedy
    tie rule, ``compare_greedy``) ``tie`` or ``mismatch`` with where and by what gap."""
    out: list[dict[str, Any]] = []
    for ids, row, ref in zip(prompts, got, reference, strict=True):
        if list(row) == list(ref):
            out.append({"status": "identical"})
            continue
        # The tie check runs one full forward; only rows that differ pay for it.
        verdict = compare_greedy(pair.target, ids, row, ref)
        out.append({"status": verdict.status, "at": verdict.at, "gap": verdict.gap})
    return out


def worst(statuses: Sequence[str]) -> str:
    """The worst of a prompt's verdicts over the repeats."""
    return min(statuses, key=STATUSES.index)


def worst_verdict(verdicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worst of a prompt's verdicts (``row_statuses`` entries) over the repeats."""
    ranked: dict[str, Any] = min(verdicts, key=lambda v: STATUSES.index(v["status"]))
    return ranked


def count_statuses(statuses: Sequence[str]) -> dict[str, int]:
    """How many rows are identical, ties and mismatches."""
    return {s: sum(x == s for x in statuses) for s in ("identical", "tie", "mismatch")}
