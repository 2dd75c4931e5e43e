"""``flashspec bench quant``: the multiply-add peak and each product's floor at that peak."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")
Q = pytest.importorskip("flashspec._quant")

from flashspec.bench import quant as bench  # noqa: E402


def test_fma_peak_is_a_rate_and_keeps_the_backend() -> None:
    before = Q.backend()
    peak = bench.fma_peak(repeats=2, seconds=0.01)
    assert peak > 1e8  # multiply-adds per second: any x86-64 core does far more than this
    assert Q.backend() == before


def test_every_row_has_its_floor_and_the_summary_its_ratios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each measured product carries m * n * k multiply-adds at the given peak, and the
    summary divides 5 rows' floor by the measured one row and by one row at the read
    bandwidth."""
    monkeypatch.setattr(bench, "QUICK_SHAPES", (("tiny 64x64", 64, 64),))
    monkeypatch.setattr(bench, "QUICK_ROWS", (1, 5))
    monkeypatch.setattr(bench, "FORMATS", ("Q8_0",))
    peak = 64 * 64 * 1e3  # one row: exactly 1 ms of multiply-adds
    rows = bench.measure(quick=True, show_progress=False, peak=peak)
    assert {row["rows"] for row in rows} == {1, 5}
    for row in rows:
        assert row["fma_floor_ms"] == row["rows"]
        assert row["weight_bytes"] == 64 * 2 * 34  # two Q8_0 blocks a row of 64
    bandwidth = 10.0
    summary = bench.summarise(rows, bandwidth)
    for key, entry in summary.items():
        backend = key.split("/")[1]
        one = next(r for r in rows if r["backend"] == backend and r["rows"] == 1)
        five = next(r for r in rows if r["backend"] == backend and r["rows"] == 5)
        assert entry["rows_5_floor_over_1"] == pytest.approx(
            five["fma_floor_ms"] / one["ms"], rel=1e-2
        )
        read_ms = one["weight_bytes"] / bandwidth / 1e6
        assert entry["rows_5_floor_over_read"] == pytest.approx(
            five["fma_floor_ms"] / read_ms, rel=1e-2
        )
