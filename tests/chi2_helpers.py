"""Chi-squared goodness of fit with a fixed critical value (alpha = 0.01), shared by the tests of
sampled output: a test that draws tokens compares their counts with exact probabilities."""

from __future__ import annotations

from collections import Counter

import torch

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


def assert_first_two_follow(
    first: Counter[int], second: Counter[int], p_first: torch.Tensor, p_second: torch.Tensor
) -> None:
    """The counts of the first and second emitted tokens pass chi-squared against their exact
    distributions."""
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"
