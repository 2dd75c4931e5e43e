"""Chi-squared goodness of fit with a fixed critical value (alpha = 0.01), shared by the tests of
sampled output: a test that draws tokens compares their counts with exact probabilities."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flashspec import SpeculativeEngine

# Upper 1% points of chi-squared, chi2.ppf(0.99, df) for df = index (df 0 unused).
CHI2_99 = [
    float("nan"), 6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475, 20.090, 21.666, 23.209,
    24.725, 26.217, 27.688, 29.141, 30.578, 32.000, 33.409, 34.805, 36.191, 37.566,
    38.932, 40.289, 41.638, 42.980, 44.314, 45.642, 46.963, 48.278, 49.588, 50.892,
]  # fmt: skip


def chi_squared(counts: Counter[int], expected_p: torch.Tensor) -> tuple[float, float]:
    """(statistic, 1% critical value). Cells expected below 5 are merged, smallest first, so
    every cell tested has an expected count of at least 5."""
    n = sum(counts.values())
    for token in range(len(expected_p)):
        if expected_p[token] == 0:
            assert counts[token] == 0, f"token {token} has probability 0 but was emitted"
    ascending = sorted(
        (n * float(expected_p[t]), counts[t]) for t in range(len(expected_p)) if expected_p[t] > 0
    )
    cells: list[tuple[float, int]] = []
    pending_e, pending_o = 0.0, 0
    for e, o in ascending:
        pending_e, pending_o = pending_e + e, pending_o + o
        if pending_e >= 5.0:
            cells.append((pending_e, pending_o))
            pending_e, pending_o = 0.0, 0
    if pending_e > 0:  # leftovers join the last (largest) cell
        e, o = cells.pop()
        cells.append((e + pending_e, o + pending_o))
    assert len(cells) >= 2 and all(e >= 5.0 for e, _ in cells)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return stat, CHI2_99[len(cells) - 1]


def first_two_counts(
    engine: SpeculativeEngine,
    prompt: Any,
    batch: int,
    calls: int,
    seed: int,
    max_new_tokens: int | None = None,
    neighbour: Any = None,
) -> tuple[Counter[int], Counter[int]]:
    """Counts of the first and second emitted tokens over ``calls`` streams of ``batch`` copies
    of ``prompt`` (the prompt alone when ``batch`` is 1), call i seeded ``seed + i``. With
    ``neighbour``, every odd row has that prompt instead and is not counted.

    ``max_new_tokens`` defaults to gamma + 1, which leaves room for a full first round of gamma
    drafts; a stream is left once every row has two tokens, so later rounds are never
    computed."""
    if max_new_tokens is None:
        max_new_tokens = engine.config.sampling.gamma + 1
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(calls):
        rowwise = [prompt if neighbour is None or b % 2 == 0 else neighbour for b in range(batch)]
        prompts: Any = prompt if batch == 1 else rowwise
        stream = engine.stream(
            prompts, max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed + call
        )
        rows: list[list[int]] = [[] for _ in range(batch)]
        for chunk in stream:
            rows[chunk.row].extend(chunk.token_ids)
            if min(len(r) for r in rows) >= 2:
                break
        for b, tokens in enumerate(rows):
            if neighbour is None or b % 2 == 0:
                first[tokens[0]] += 1
                second[tokens[1]] += 1
    return first, second


def assert_first_two_follow(
    first: Counter[int], second: Counter[int], p_first: torch.Tensor, p_second: torch.Tensor
) -> None:
    """The counts of the first and second emitted tokens pass chi-squared against their exact
    distributions."""
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"
