"""flashspec._residual against an independent float64 NumPy reference, on every backend.

Needs only numpy, pytest and hypothesis (no torch), so it also runs against an
installed wheel from outside the source tree.
"""

from __future__ import annotations

import array
import os
import platform
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flashspec import _residual as R

ALL_BACKENDS = ["scalar", "avx2", "avx512"]
F = np.float32
BIG_V = [1024, 4096, 32000, 128256, 152064, 256000]

# Upper 1% points of the chi-squared distribution, chi2.ppf(0.99, df), df = index.
CHI2_99 = [
    float("nan"), 6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475, 20.090, 21.666,
    23.209, 24.725, 26.217, 27.688, 29.141, 30.578, 32.000, 33.409, 34.805, 36.191, 37.566,
]


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    if name not in R.available_backends():
        pytest.skip(f"backend {name} not available on this CPU/build")
    before = R.backend()
    R.set_backend(name)
    try:
        yield name
    finally:
        R.set_backend(before)


def ref_dist(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """float64 reference, row-wise, including the zero-residual limit."""
    p64, q64 = np.atleast_2d(p).astype(np.float64), np.atleast_2d(q).astype(np.float64)
    d = np.maximum(p64 - q64, 0.0)
    s = d.sum(axis=1, keepdims=True)
    pp = np.maximum(p64, 0.0)
    out = np.where(s > 0, d / np.where(s > 0, s, 1.0), pp / pp.sum(axis=1, keepdims=True))
    return out.reshape(np.shape(p))


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float = 1.0) -> np.ndarray:
    v = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    x = rng.dirichlet(np.full(v, alpha), size=rows).astype(np.float32)
    return x.reshape(shape)


def check_against_ref(p: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    ref = ref_dist(p, q)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
    sums = np.atleast_2d(out).astype(np.float64).sum(axis=1)
    assert np.all(np.abs(sums - 1.0) <= 1e-5), sums
    assert np.all(out >= 0)
    has_residual = (np.atleast_2d(p).astype(np.float64) > np.atleast_2d(q)).any(axis=1)
    zero_where = np.atleast_2d(q) >= np.atleast_2d(p)
    o2 = np.atleast_2d(out)
    for r in range(o2.shape[0]):
        if has_residual[r]:
            assert np.all(o2[r][zero_where[r]] == 0.0)


# ----------------------------------------------------------------- dispatch


def test_backend_names_and_features() -> None:
    avail = R.available_backends()
    assert avail[0] == "scalar"
    assert R.backend() == avail[-1], "import picks the fastest backend unless forced"
    feats = R.cpu_features()
    assert set(feats) >= {"osxsave", "avx", "avx2", "avx512f", "ymm_state", "zmm_state"}
    assert isinstance(R.abi_version(), int) and R.abi_version() >= 1
    with pytest.raises(ValueError, match="unknown kernel backend 'sse9'"):
        R.set_backend("sse9")
    with pytest.raises(TypeError):
        R.set_backend(3)  # type: ignore[arg-type]


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"))
    or os.environ.get("FLASHSPEC_NO_ASM", "") not in ("", "0"),
    reason="assembly kernels are built for x86-64 Linux only, unless FLASHSPEC_NO_ASM",
)
def test_asm_backends_present_when_cpu_has_them() -> None:
    """A build that silently dropped the asm would still pass every other test."""
    feats = R.cpu_features()
    avail = R.available_backends()
    if feats["avx2"] and feats["avx"] and feats["osxsave"] and feats["ymm_state"]:
        assert "avx2" in avail
    if "avx2" in avail and feats["avx512f"] and feats["zmm_state"]:
        assert "avx512" in avail


# ------------------------------------------------------------- correctness


@pytest.mark.parametrize("v", list(range(1, 131)))
def test_small_v_every_length(backend: str, v: int) -> None:
    rng = np.random.default_rng(v)
    p, q = dirichlet(rng, (v,)), dirichlet(rng, (v,))
    check_against_ref(p, q, R.residual_dist(p, q))


@pytest.mark.parametrize("v", BIG_V)
def test_large_v(backend: str, v: int) -> None:
    rng = np.random.default_rng(v)
    p, q = dirichlet(rng, (v,), 0.5), dirichlet(rng, (v,), 0.5)
    out = np.empty_like(p)
    assert R.residual_dist(p, q, out) is out
    check_against_ref(p, q, out)


@pytest.mark.parametrize("offset", range(1, 16))
@pytest.mark.parametrize("v", [37, 1024, 32000])
def test_unaligned_buffers(backend: str, v: int, offset: int) -> None:
    rng = np.random.default_rng(offset * 1000 + v)
    pool = np.zeros((3, v + 32), dtype=np.float32)
    p, q, out = pool[0, offset : offset + v], pool[1, offset + 1 : offset + 1 + v], pool[2, offset:]
    out = out[:v]
    p[:], q[:] = dirichlet(rng, (v,)), dirichlet(rng, (v,))
    guard_before = pool[2, :offset].copy()
    guard_after = pool[2, offset + v :].copy()
    R.residual_dist(p, q, out)
    check_against_ref(p, q, out)
    assert np.array_equal(pool[2, :offset], guard_before)
    assert np.array_equal(pool[2, offset + v :], guard_after)


@pytest.mark.parametrize("v", [1, 17, 1000, 32000])
def test_batched_rows_equal_single_rows(backend: str, v: int) -> None:
    rng = np.random.default_rng(7)
    p, q = dirichlet(rng, (5, v)), dirichlet(rng, (5, v))
    q[2] = p[2]  # one zero-residual row in the batch
    batched = R.residual_dist(p, q)
    assert batched.shape == (5, v) and batched.dtype == np.float32
    for r in range(5):
        assert np.array_equal(batched[r], R.residual_dist(p[r], q[r]))
    check_against_ref(p, q, batched)


def test_backends_agree(backend: str) -> None:
    rng = np.random.default_rng(11)
    p, q = dirichlet(rng, (3, 50000)), dirichlet(rng, (3, 50000))
    mine = R.residual_dist(p, q)
    R.set_backend("scalar")
    ref = R.residual_dist(p, q)
    R.set_backend(backend)
    # Same d values bit for bit; only the reciprocal of a differently ordered sum differs.
    np.testing.assert_allclose(mine, ref, rtol=2e-6, atol=0)


def test_empty_batch(backend: str) -> None:
    p = np.zeros((0, 8), dtype=np.float32)
    assert R.residual_dist(p, p.copy()).shape == (0, 8)


@pytest.mark.parametrize("v", [1, 5, 1000, 128256])
def test_point_masses(backend: str, v: int) -> None:
    p = np.zeros(v, dtype=np.float32)
    q = np.zeros(v, dtype=np.float32)
    p[v // 2] = 1.0
    q[0] = 1.0
    out = R.residual_dist(p, q)
    expected = np.zeros(v, dtype=np.float32)
    expected[v // 2] = 1.0
    assert np.array_equal(out, expected)
    assert R.residual_sample(p, q, 0.0) == v // 2
    assert R.residual_sample(p, q, 0.999999) == v // 2


@pytest.mark.parametrize("v", [1, 3, 64, 4097, 256000])
def test_zero_residual_is_p_renormalised(backend: str, v: int) -> None:
    rng = np.random.default_rng(v)
    p = dirichlet(rng, (v,))
    for q in (p.copy(), p * np.float32(1.5)):
        out = R.residual_dist(p, q)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, p / p.astype(np.float64).sum(), rtol=1e-6, atol=1e-12)
        idx = R.residual_sample(p, q, 0.5)
        cdf = np.cumsum(p.astype(np.float64)) / p.astype(np.float64).sum()
        assert idx == int(np.searchsorted(cdf, 0.5, side="right"))


def test_zero_mass_row_is_an_error(backend: str) -> None:
    p = np.zeros(10, dtype=np.float32)
    q = np.full(10, 0.1, dtype=np.float32)
    with pytest.raises(ValueError, match="no positive mass"):
        R.residual_dist(p, q)
    with pytest.raises(ValueError, match="no positive mass"):
        R.residual_sample(p, q, 0.3)


def test_tiny_residual_mass_does_not_overflow(backend: str) -> None:
    # 1/sum would be ~1e40 > FLT_MAX: must be normalised without overflow.
    p = np.full(8, 1e-40, dtype=np.float32)
    q = np.zeros(8, dtype=np.float32)
    out = R.residual_dist(p, q)
    np.testing.assert_allclose(out, np.full(8, 0.125), rtol=1e-3)


def test_huge_finite_values_are_not_reported_as_nonfinite(backend: str) -> None:
    p = np.array([3e38, 3e38, 0.0], dtype=np.float32)
    q = np.array([-3e38, 0.0, 1.0], dtype=np.float32)
    out = R.residual_dist(p, q)
    np.testing.assert_allclose(out, [2 / 3, 1 / 3, 0.0], rtol=1e-6)
    assert R.residual_sample(p, q, 0.9) == 1


@pytest.mark.parametrize("which", ["p", "q"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("pos", [0, 17, 4095, 4096, 9999])
def test_nonfinite_input_names_the_argument(backend: str, which: str, bad: float, pos: int) -> None:
    rng = np.random.default_rng(pos)
    p, q = dirichlet(rng, (10000,)), dirichlet(rng, (10000,))
    (p if which == "p" else q)[pos] = bad
    with pytest.raises(ValueError, match=rf"^{which} contains NaN or infinity at index {pos}"):
        R.residual_dist(p, q)
    with pytest.raises(ValueError, match=rf"^{which} contains NaN or infinity at index {pos}"):
        R.residual_sample(p, q, 0.5)
    p2, q2 = np.stack([p, p]), np.stack([q, q])
    p2[0], q2[0] = dirichlet(rng, (10000,)), dirichlet(rng, (10000,))
    with pytest.raises(ValueError, match=rf"^{which} contains NaN .* row 1, index {pos}"):
        R.residual_dist(p2, q2)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    v=st.integers(1, 300),
    rows=st.integers(1, 3),
)
def test_hypothesis_matches_reference(data: st.DataObject, v: int, rows: int) -> None:
    tiny = st.floats(float(F(1e-30)), float(F(1e-3)), width=32)
    elems = st.one_of(st.just(0.0), st.floats(0, 1, width=32), tiny)
    p = data.draw(hnp.arrays(np.float32, (rows, v), elements=elems))
    q = data.draw(hnp.arrays(np.float32, (rows, v), elements=elems))
    if not np.all(np.maximum(p, 0).sum(axis=1) > 0):
        p[:, 0] = 0.5
    u = data.draw(hnp.arrays(np.float64, (rows,), elements=st.floats(0, 0.999999)))
    for name in R.available_backends():
        R.set_backend(name)
        out = R.residual_dist(p, q)
        ref = ref_dist(p, q)
        np.testing.assert_allclose(out, ref, rtol=3e-5, atol=1e-12)
        idx = R.residual_sample(p, q, u)
        assert idx.dtype == np.int64 and idx.shape == (rows,)
        for r in range(rows):
            assert ref[r, idx[r]] > 0, "sampled an index with zero residual probability"
            check_sample_index(ref[r], float(u[r]), int(idx[r]))
    R.set_backend(R.available_backends()[-1])


def check_sample_index(pmf: np.ndarray, u: float, idx: int) -> None:
    """idx must be searchsorted(cdf, u), unless u sits within rounding of a boundary."""
    cdf = np.cumsum(pmf.astype(np.float64))
    cdf /= cdf[-1]
    expected = min(int(np.searchsorted(cdf, u, side="right")), len(pmf) - 1)
    if idx != expected:
        lo, hi = sorted((idx, expected))
        boundary = cdf[lo:hi]
        assert np.min(np.abs(boundary - u)) < 1e-5, (idx, expected, u)


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize("v", [1, 2, 10, 130, 4097, 32000, 152064])
def test_sample_agrees_with_searchsorted(backend: str, v: int) -> None:
    rng = np.random.default_rng(v)
    p, q = dirichlet(rng, (v,), 0.3), dirichlet(rng, (v,), 0.3)
    pmf = ref_dist(p, q)
    for u in [*list(rng.random(40)), 0.0, 0.5, 1.0 - 2 ** (-30)]:
        idx = R.residual_sample(p, q, float(u))
        assert isinstance(idx, int)
        assert pmf[idx] > 0
        check_sample_index(pmf, float(u), idx)
    p2, q2 = np.stack([p, q, p]), np.stack([q, p, p])
    u2 = rng.random(3)
    got = R.residual_sample(p2, q2, u2)
    assert list(got) == [R.residual_sample(p2[r], q2[r], float(u2[r])) for r in range(3)]
    got32 = R.residual_sample(p2, q2, u2.astype(np.float32))
    assert got32.dtype == np.int64


def chi2_stat(counts: np.ndarray, pmf: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    support = pmf > 0
    expected = n * pmf[support]
    assert np.all(expected >= 5)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def test_sample_frequencies_pass_chi_squared(backend: str) -> None:
    rng = np.random.default_rng(0)
    v = 12
    p, q = dirichlet(rng, (v,), 2.0), dirichlet(rng, (v,), 2.0)
    pmf = ref_dist(p, q)
    n = 20000
    u = rng.random(n)
    rows_p, rows_q = np.broadcast_to(p, (n, v)).copy(), np.broadcast_to(q, (n, v)).copy()
    idx = R.residual_sample(rows_p, rows_q, u)
    counts = np.bincount(idx, minlength=v).astype(np.float64)
    assert np.all(counts[pmf == 0] == 0)
    stat, df = chi2_stat(counts, pmf)
    assert stat < CHI2_99[df], (stat, df)
    # The same check rejects sampling from p instead of the residual: it can fail.
    wrong = np.bincount(
        np.searchsorted(np.cumsum(p / p.sum(dtype=np.float64)), u, side="right").clip(0, v - 1),
        minlength=v,
    ).astype(np.float64)
    wrong_stat = float(((wrong[pmf > 0] - n * pmf[pmf > 0]) ** 2 / (n * pmf[pmf > 0])).sum())
    assert wrong_stat > CHI2_99[df]


# ---------------------------------------------------------------- bad inputs


def test_accepts_other_buffer_exporters(backend: str) -> None:
    p = array.array("f", [0.5, 0.25, 0.25])
    q = array.array("f", [0.25, 0.5, 0.25])
    out = array.array("f", [0.0, 0.0, 0.0])
    assert R.residual_dist(memoryview(p), q, out=memoryview(out)) is not None
    assert list(out) == [1.0, 0.0, 0.0]
    assert R.residual_sample(p, q, 0.3) == 0
    le = np.array([0.5, 0.5], dtype="<f4")
    assert R.residual_dist(le, np.array([0.25, 0.75], dtype="=f4"))[0] == 1.0


def bad(**kw: object) -> dict[str, object]:
    return kw


GOOD = np.array([0.5, 0.5], dtype=F)


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((np.array([0.5, 0.5]), GOOD), TypeError, r"p must hold float32 .* format 'd'"),
        ((GOOD, np.array([1, 0], dtype=np.int32)), TypeError, "q must hold float32"),
        ((np.array([0.5, 0.5], dtype=">f4"), GOOD), TypeError, "p must hold float32"),
        (([0.5, 0.5], GOOD), TypeError, "p must support the buffer protocol"),
        ((GOOD, None), TypeError, "q must support the buffer protocol"),
        ((GOOD, np.ones(3, dtype=F)), ValueError, r"same shape; got p \(2,\) and q \(3,\)"),
        ((np.ones((2, 3), dtype=F), np.ones((3, 2), dtype=F)), ValueError, "same shape"),
        ((np.zeros(0, dtype=F), np.zeros(0, dtype=F)), ValueError, "V = 0"),
        ((np.ones((2, 0), dtype=F), np.ones((2, 0), dtype=F)), ValueError, "V = 0"),
        ((np.ones((1, 1, 2), dtype=F),) * 2, ValueError, "1-D .* or 2-D .*got 3"),
        ((np.array(0.5, dtype=F),) * 2, ValueError, "got 0 dimensions"),
        ((np.ones(8, dtype=F)[::2], np.ones(4, dtype=F)), ValueError, "p must be C-contiguous"),
        ((GOOD, np.ones((2, 2), dtype=F).T[0]), ValueError, "q must be C-contiguous"),
        ((GOOD,), TypeError, "takes p and q positionally"),
    ],
)
def test_bad_inputs_residual_dist(args: tuple[object, ...], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        R.residual_dist(*args)  # type: ignore[arg-type]


def test_bad_out() -> None:
    p, q = GOOD.copy(), np.array([0.25, 0.75], dtype=F)
    ro = np.zeros(2, dtype=F)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        R.residual_dist(p, q, ro)
    with pytest.raises(ValueError, match="out overlaps p or q"):
        R.residual_dist(p, q, p)
    both = np.zeros(3, dtype=F)
    with pytest.raises(ValueError, match="out overlaps p or q"):
        R.residual_dist(both[:2], q, both[1:])
    with pytest.raises(ValueError, match=r"out must have the shape of p and q, \(2,\); got \(3,\)"):
        R.residual_dist(p, q, np.zeros(3, dtype=F))
    with pytest.raises(TypeError, match="out must hold float32"):
        R.residual_dist(p, q, np.zeros(2))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        R.residual_dist(p, q, np.zeros(4, dtype=F)[::2])
    with pytest.raises(TypeError, match="unexpected keyword argument 'output'"):
        R.residual_dist(p, q, output=np.zeros(2, dtype=F))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'out' twice"):
        R.residual_dist(p, q, np.zeros(2, dtype=F), out=np.zeros(2, dtype=F))  # type: ignore[misc]
    assert np.array_equal(p, GOOD), "inputs are never written"


def test_bad_u() -> None:
    p, q = GOOD, np.array([0.25, 0.75], dtype=F)
    for u in (1.0, -0.1, float("nan"), 2):
        with pytest.raises(ValueError, match=r"u must be in \[0, 1\)"):
            R.residual_sample(p, q, u)
    with pytest.raises(TypeError, match="u must be a float"):
        R.residual_sample(p, q, "0.5")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="missing required argument 'u'"):
        R.residual_sample(p, q)  # type: ignore[call-overload]
    p2, q2 = np.stack([p, p]), np.stack([q, q])
    with pytest.raises(TypeError, match=r"u must be an array of shape \(2,\)"):
        R.residual_sample(p2, q2, 0.5)
    with pytest.raises(ValueError, match=r"u must have shape \(2,\)"):
        R.residual_sample(p2, q2, np.zeros(3))
    with pytest.raises(TypeError, match="u must hold float64 or float32"):
        R.residual_sample(p2, q2, np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match=r"u\[1\] must be in \[0, 1\)"):
        R.residual_sample(p2, q2, np.array([0.5, 1.5]))


def test_many_threads_share_the_kernel() -> None:
    """The GIL is released on large inputs: concurrent calls must stay correct."""
    import threading

    rng = np.random.default_rng(5)
    p, q = dirichlet(rng, (4, 40000)), dirichlet(rng, (4, 40000))
    expected = R.residual_dist(p, q)
    errors: list[str] = []

    def work() -> None:
        for _ in range(20):
            if not np.array_equal(R.residual_dist(p, q), expected):
                errors.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
