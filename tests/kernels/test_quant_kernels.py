"""``flashspec._quant`` from Python: exact matmuls over GGUF blocks, every format and backend.

The reference is independent of the kernels: gguf-py's own ``gguf.quants.dequantize`` of the
same bytes, multiplied in float64 by NumPy. Blocks come from gguf-py's quantizer where it has
one (Q8_0, Q4_0, Q4_1) and from ``tests.helpers.gguf.quantize_blocks`` (Q4_K, Q6_K), plus
random bytes with small scales of either sign (values no quantizer picks) for the products and
random bytes with any fp16 scale (inf, nan, subnormal) for bit-for-bit dequantization. The C/asm
calling convention is checked by tests/kernels/test_quant_abi.py; this file checks what Python sees:
values, determinism (a row's result never depends on its batch, the weight rows beside it or
the thread split), and that bad arguments raise an exception naming them instead of crashing.

numpy and gguf only (no torch), like the other kernel tests, so it runs against a bare wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

gguf = pytest.importorskip("gguf")
Q: Any = pytest.importorskip("flashspec._quant")

from tests.helpers.gguf import quantize_blocks  # noqa: E402  (after the importorskips)

# GGML type ids (ext/quant.h) under gguf-py's names, and flashspec's repacked K layouts.
GGML_FORMATS = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14}
REPACKED = {"Q4_KR": ("Q4_K", 268, 24), "Q6_KR": ("Q6_K", 270, 40)}  # source, id, block bytes
FORMATS = {**GGML_FORMATS, **{name: qtype for name, (_, qtype, _) in REPACKED.items()}}
# What ``repack`` turns each source format into (Q5_0 goes into Q8_0 itself, though loads now
# keep Q5_0's own blocks: AVX2 and AVX-512 have kernels for them, checked with every format).
REPACK_PAIRS = {"Q4_K": "Q4_KR", "Q6_K": "Q6_KR", "Q5_0": "Q8_0"}
BACKENDS = list(Q.available_backends())
# Blocks per row: odd counts, one block and enough to cross the asm's block loop several times.
BLOCKS_32 = (1, 3, 7, 33)
BLOCKS_256 = (1, 3)
# Weight rows: 1; fewer than one asm tile (up to 8 rows); a tile plus a single-row tail; and
# several tiles plus a tail for every tile height the kernels use (8, 7, 5, 4, 3, 2).
ROWS_N = (1, 7, 15, 33)
# float32 products and sums against a float64 reference: the error of a sum of K products
# split into lanes is at most about (K / lanes + log2(lanes)) * 2^-24 of sum |x| |w|. K here
# is at most 33 * 32 (8 lanes: 135 * 2^-24 = 8e-6), so 1e-5 of that sum bounds it, while one
# wrong weight (a dropped min, a swapped nibble) moves a result by far more
# (test_reference_has_power).
TOL = 1e-5


def fmt_elems(name: str) -> int:
    """Weights a row is a multiple of: 256 for the K formats and their repacked layouts
    (made from K super-blocks), 32 for the rest."""
    return 256 if name.endswith("_K") or name in REPACKED else 32


def repacked(make: Any) -> Any:
    """A block maker for the repacked layouts too: the source K format's blocks, repacked."""

    def made(name: str, n: int, k: int, seed: int) -> npt.NDArray[np.uint8]:
        if name not in REPACKED:
            return make(name, n, k, seed)
        source, _, _ = REPACKED[name]
        blocks = make(source, n, k, seed)
        out: npt.NDArray[np.uint8] = Q.repack(blocks, GGML_FORMATS[source], n, k)
        return out

    made.__name__ = make.__name__
    return made


def block_counts(name: str) -> tuple[int, ...]:
    return BLOCKS_256 if fmt_elems(name) == 256 else BLOCKS_32


@repacked
def make_blocks(name: str, n: int, k: int, seed: int) -> npt.NDArray[np.uint8]:
    """(n, row bytes) blocks of realistic weights (scales as a quantizer chooses them)."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    return np.ascontiguousarray(quantize_blocks(weights, name), dtype=np.uint8)


# Byte offsets of each format's fp16 fields (scales and mins) inside its block.
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2),
               "Q6_K": (208,)}  # fmt: skip


@repacked
def random_blocks(name: str, n: int, k: int, seed: int) -> npt.NDArray[np.uint8]:
    """Random bytes, with every fp16 field a small finite value of either sign (|v| about
    0.002-0.03): quants and sub-block scales a quantizer would never choose (negative Q6_K
    scales, all 64 Q4_K scale and min values), weights of a sane size."""
    blocks = wild_blocks(name, n, k, seed)
    elems, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    view = blocks.reshape(n, k // elems, size)
    rng = np.random.default_rng(seed + 1)
    for offset in HALF_FIELDS[name]:
        values = rng.uniform(0.002, 0.03, size=view.shape[:2]) * rng.choice(
            [-1.0, 1.0], view.shape[:2]
        )
        view[:, :, offset : offset + 2] = (
            values.astype("<f2").view(np.uint8).reshape(*view.shape[:2], 2)
        )
    return blocks


@repacked
def wild_blocks(name: str, n: int, k: int, seed: int) -> npt.NDArray[np.uint8]:
    """Random bytes: every fp16 scale and min any bit pattern (subnormals, negatives, inf and
    nan included), every quant any value: what a dequantizer must still read as gguf-py does."""
    elems, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, k // elems * size), dtype=np.uint8)


def reference_weights(blocks: npt.NDArray[np.uint8], name: str) -> npt.NDArray[np.float32]:
    """gguf-py's dequantization: the values transformers' GGUF load gives the weights (for
    the repacked layouts, their definition in ext/quant.h, in float64 and rounded once)."""
    if name in REPACKED:
        return repacked_reference(blocks, name)
    with np.errstate(all="ignore"):  # random bytes hold inf and nan scales: expected here
        out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name])
    return np.asarray(out, dtype=np.float32)


def repacked_reference(blocks: npt.NDArray[np.uint8], name: str) -> npt.NDArray[np.float32]:
    """Q4_KR: w = D * q + M (fp32 D, M; 16 nibble bytes, byte b = element b | element b + 16
    << 4); Q6_KR: w = D_h * q (fp32 D_0, D_1 for elements 0-15, 16-31; int8 q). Formed in
    float64, where D * q is exact, and rounded to float32 once, as the kernels must."""
    _, _, size = REPACKED[name]
    n = blocks.shape[0]
    view = np.ascontiguousarray(blocks).reshape(n, -1, size)
    scales = view[:, :, :8].copy().view("<f4").astype(np.float64)  # (n, blocks, 2)
    if name == "Q4_KR":
        nib = view[:, :, 8:]
        q = np.concatenate([nib & 0x0F, nib >> 4], axis=2).astype(np.float64)
        with np.errstate(all="ignore"):
            w = scales[:, :, :1] * q + scales[:, :, 1:]
    else:
        q = view[:, :, 8:].view(np.int8).astype(np.float64)
        with np.errstate(all="ignore"):
            w = np.repeat(scales, 16, axis=2) * q
    with np.errstate(all="ignore"):
        return w.astype(np.float32).reshape(n, -1)


def assert_close_to_reference(
    y: npt.NDArray[np.float32], x: npt.NDArray[np.float32], w: npt.NDArray[np.float32], what: str
) -> None:
    """|y - x @ w.T| <= TOL * (|x| @ |w|.T), the reference in float64."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    expected = x64 @ w64.T
    bound = TOL * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    err = np.abs(y.astype(np.float64) - expected)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (
        f"{what}: |y - ref| = {err[worst]:.3g} at {worst} exceeds {bound[worst]:.3g} "
        f"(y {y[worst]!r}, ref {expected[worst]!r})"
    )


def bits(a: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32], what: str) -> None:
    assert a.shape == b.shape, f"{what}: shapes {a.shape} != {b.shape}"
    differ = bits(a) != bits(b)
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} of {a.size} values differ in their bits, first at "
        f"{np.argwhere(differ)[0].tolist()}"
    )


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every backend this build and CPU have, forced for one test and restored after."""
    before = Q.backend()
    Q.set_backend(request.param)
    try:
        yield request.param
    finally:
        Q.set_backend(before)


@pytest.fixture()
def restore_threads() -> Iterator[None]:
    before = Q.threads()
    try:
        yield
    finally:
        Q.set_threads(before)


# -------------------------------------------------------------------------------- metadata


def test_formats_match_gguf_block_geometry() -> None:
    """The module's table agrees with gguf-py's (block elements, block bytes) for each id."""
    table = Q.formats()
    assert sorted(table) == sorted(FORMATS.values())
    for name, (_, qtype, size) in REPACKED.items():
        assert table[qtype] == (name, 32, size)
    for name, qtype in GGML_FORMATS.items():
        elems, size = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert int(gguf.GGMLQuantizationType[name]) == qtype
        assert table[qtype] == (name, elems, size)
    assert BACKENDS[0] == "scalar" and Q.backend() in BACKENDS


@pytest.mark.parametrize(
    ("value", "expected"), [("scalar", "scalar"), ("avx2", "avx2"), ("auto", None)]
)
def test_env_forces_backend_at_import(value: str, expected: str | None) -> None:
    """FLASHSPEC_QUANT_KERNEL picks the backend at import (a fresh interpreter each time)."""
    if expected is not None and expected not in BACKENDS:
        pytest.skip(f"{expected} not available here")
    env = {**os.environ, "FLASHSPEC_QUANT_KERNEL": value}
    code = "import flashspec._quant as Q; print(Q.backend())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (expected or BACKENDS[-1])


@pytest.mark.parametrize(
    ("name", "value"),
    [("FLASHSPEC_QUANT_KERNEL", "avx9000"), ("FLASHSPEC_QUANT_THREADS", "0")],
)
def test_bad_env_is_an_import_error_naming_it(name: str, value: str) -> None:
    env = {**os.environ, name: value}
    code = "import flashspec._quant"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 1  # a Python exception, not a signal
    assert "ImportError" in out.stderr and name in out.stderr


# -------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_is_gguf_bit_for_bit(name: str) -> None:
    """``dequantize`` and ``dequantize_rows`` give gguf-py's float32 values exactly, for
    quantizer-made blocks and for random bytes (any scale, subnormal and non-finite ones too)."""
    qtype, elems = FORMATS[name], fmt_elems(name)
    sets = [(make_blocks(name, 9, 3 * elems, 1), 9, 3 * elems),
            (wild_blocks(name, 64, 5 * elems, 2), 64, 5 * elems)]  # fmt: skip
    for seed, (blocks, n, k) in enumerate(sets):
        expected = reference_weights(blocks, name)
        got = Q.dequantize(blocks, qtype, n, k)
        assert got.dtype == np.float32 and got.shape == (n, k)
        finite = ~np.isnan(expected)
        assert np.array_equal(np.isnan(got), ~finite), f"{name} set {seed}: nan positions"
        assert_bitwise(got[finite], expected[finite], f"{name} set {seed}")
        rows = np.array([n - 1, 0, 3, 3, n // 2], dtype=np.int64)  # any order, repeats
        picked = Q.dequantize_rows(blocks, qtype, k, rows)
        assert_bitwise(np.nan_to_num(picked), np.nan_to_num(got[rows]), f"{name} rows")
        out = np.full((n, k), 7.0, dtype=np.float32)
        assert Q.dequantize(blocks, qtype, n, k, out) is out
        assert_bitwise(np.nan_to_num(out), np.nan_to_num(got), f"{name} out=")


@pytest.mark.parametrize("source", list(REPACK_PAIRS))
def test_repack_keeps_gguf_values_bit_for_bit(source: str) -> None:
    """``repack`` of Q4_K/Q6_K/Q5_0 blocks dequantizes to gguf-py's values of the source
    blocks bit for bit (quantizer-made blocks, random ones with small scales of either sign,
    and random bytes with any fp16 scale: nan where gguf-py has nan), and the target layout
    means what ext/quant.h says (its independent reference agrees too)."""
    name = REPACK_PAIRS[source]
    qtype, elems = FORMATS[name], fmt_elems(source)
    size = Q.formats()[qtype][2]
    k = 3 * elems
    for make in (make_blocks, random_blocks, wild_blocks):
        blocks = make(source, 11, k, 3)
        packed = Q.repack(blocks, GGML_FORMATS[source], 11, k)
        assert packed.dtype == np.uint8 and packed.shape == (11, k // 32 * size)
        expected = reference_weights(blocks, source)
        finite = ~np.isnan(expected)
        for got in (Q.dequantize(packed, qtype, 11, k), reference_weights(packed, name)):
            assert np.array_equal(np.isnan(got), ~finite), f"{source} {make.__name__}: nan"
            assert_bitwise(got[finite], expected[finite], f"{source} {make.__name__}")
    with pytest.raises(ValueError, match=r"qtype 8 \(Q8_0\) has no repacked layout"):
        Q.repack(make_blocks("Q8_0", 2, 64, 1), 8, 2, 64)
    with pytest.raises(ValueError, match="w holds"):
        Q.repack(np.zeros(10, np.uint8), GGML_FORMATS[source], 2, elems)
    with pytest.raises(ValueError, match=rf"k must be a positive multiple of {elems}\b"):
        Q.repack(np.zeros(144, np.uint8), GGML_FORMATS[source], 1, elems + 16)


# ------------------------------------------------------------------------------- qmatmul


@pytest.mark.parametrize("name", list(FORMATS))
def test_qmatmul_matches_float64_reference(name: str, backend: str) -> None:
    """Every M in 1..16, odd N and odd block counts, blocks from a quantizer and random ones:
    y = x @ W.T within float32 rounding of the float64 product of gguf-py's weights."""
    qtype, elems = FORMATS[name], fmt_elems(name)
    rng = np.random.default_rng(7)
    sources = [(make, kb) for make in (make_blocks, random_blocks) for kb in block_counts(name)]
    for make, kb in sources:
        k = kb * elems
        blocks_all = make(name, max(ROWS_N), k, kb)
        weights_all = reference_weights(blocks_all, name)
        assert np.isfinite(weights_all).all()
        x_all = rng.standard_normal((16, k)).astype(np.float32)
        for n in ROWS_N:
            blocks, weights = np.ascontiguousarray(blocks_all[:n]), weights_all[:n]
            for m in range(1, 17):
                x = np.ascontiguousarray(x_all[:m])
                y = Q.qmatmul(x, blocks, qtype, n, k)
                assert y.dtype == np.float32 and y.shape == (m, n)
                where = f"{name}/{backend} {make.__name__} m={m} n={n} k={k}"
                assert_close_to_reference(y, x, weights, where)
        # A 1-D x is one row, and gives a 1-D y.
        y1 = Q.qmatmul(x_all[0], blocks_all, qtype, max(ROWS_N), k)
        assert y1.shape == (max(ROWS_N),)
        assert_close_to_reference(y1[None], x_all[:1], weights_all, f"{name}/{backend} 1-D")


@pytest.mark.parametrize("name", list(FORMATS))
def test_row_result_independent_of_batch_and_weight_rows(name: str, backend: str) -> None:
    """For one backend, y[i, j] depends only on x row i and weight row j: the same bits
    alone (m = 1), inside any batch of m rows, for any subset of weight rows, through ``out``,
    and at any (mis)alignment of the buffers (quant.h's determinism promise)."""
    qtype, elems = FORMATS[name], fmt_elems(name)
    kb = block_counts(name)[-1]
    k, n = kb * elems, 33
    blocks = make_blocks(name, n, k, seed=3)
    x = np.random.default_rng(11).standard_normal((16, k)).astype(np.float32)
    full = Q.qmatmul(x, blocks, qtype, n, k)
    for i in range(16):
        assert_bitwise(Q.qmatmul(x[i : i + 1], blocks, qtype, n, k)[0], full[i], f"row {i}")
        assert_bitwise(Q.qmatmul(x[i], blocks, qtype, n, k), full[i], f"1-D row {i}")
    for m in range(1, 17):
        for start in (0, 16 - m):
            got = Q.qmatmul(np.ascontiguousarray(x[start : start + m]), blocks, qtype, n, k)
            assert_bitwise(got, full[start : start + m], f"m={m} from row {start}")
    row_bytes = blocks.shape[1]
    for lo, hi in ((0, 1), (5, 6), (0, 8), (3, 17), (9, 33), (32, 33)):
        part = np.ascontiguousarray(blocks[lo:hi])
        assert_bitwise(Q.qmatmul(x, part, qtype, hi - lo, k), full[:, lo:hi], f"rows {lo}:{hi}")
    # Misaligned views (offset by 1..3 bytes) of the same x, w and out.
    for shift in (1, 2, 3):
        xb = np.zeros(x.nbytes + shift, dtype=np.uint8)
        xs = np.frombuffer(xb, dtype=np.float32, count=x.size, offset=shift).reshape(x.shape)
        xs[...] = x
        wb = np.zeros(blocks.nbytes + shift, dtype=np.uint8)
        ws = wb[shift:].reshape(n, row_bytes)
        ws[...] = blocks
        ob = np.zeros(full.nbytes + shift, dtype=np.uint8)
        out = np.frombuffer(ob, dtype=np.float32, count=full.size, offset=shift).reshape(16, n)
        assert Q.qmatmul(xs, ws, qtype, n, k, out) is out
        assert_bitwise(out, full, f"misaligned by {shift}")


@pytest.mark.parametrize("name", list(FORMATS))
def test_large_m_is_split_and_stays_exact(name: str, backend: str) -> None:
    """More rows than one kernel call takes (16): the glue splits them into passes; each row
    still equals its one-row result and the float64 reference."""
    qtype, elems = FORMATS[name], fmt_elems(name)
    k, n = 3 * elems, 15
    blocks = make_blocks(name, n, k, seed=5)
    weights = reference_weights(blocks, name)
    x = np.random.default_rng(13).standard_normal((40, k)).astype(np.float32)
    for m in (17, 33, 40):
        y = Q.qmatmul(np.ascontiguousarray(x[:m]), blocks, qtype, n, k)
        assert_close_to_reference(y, x[:m], weights, f"{name}/{backend} m={m}")
        for i in (0, 15, 16, m - 1):
            assert_bitwise(y[i], Q.qmatmul(x[i], blocks, qtype, n, k), f"m={m} row {i}")


@pytest.mark.parametrize("name", list(FORMATS))
def test_threads_give_the_same_bits(name: str, backend: str, restore_threads: None) -> None:
    """Shapes large enough for the thread pool (m * n * k >= 2^17): 1 and 2 threads give the
    same bits (the split of weight rows between threads does not reach the sums)."""
    qtype = FORMATS[name]
    k, n = 2 * 256, 301  # n not a multiple of a thread's 16-row share
    blocks = make_blocks(name, n, k, seed=17)
    x = np.random.default_rng(19).standard_normal((16, k)).astype(np.float32)
    results = {}
    for threads in (1, 2):
        Q.set_threads(threads)
        assert Q.threads() == threads
        results[threads] = [
            Q.qmatmul(np.ascontiguousarray(x[:m]), blocks, qtype, n, k) for m in (1, 5, 16)
        ]
    for m, one, two in zip((1, 5, 16), results[1], results[2], strict=True):
        assert_bitwise(two, one, f"{name}/{backend} m={m}: 2 threads vs 1")
    assert_close_to_reference(results[2][-1], x, reference_weights(blocks, name), name)


def test_concurrent_python_threads(restore_threads: None) -> None:
    """Several Python threads calling at once (one holds the pool, the others run alone with
    the GIL released): every result is the single-threaded one."""
    Q.set_threads(2)
    name, qtype = "Q4_1", FORMATS["Q4_1"]
    k, n = 512, 301
    blocks = make_blocks(name, n, k, seed=23)
    xs = [np.random.default_rng(s).standard_normal((m, k)).astype(np.float32)
          for s, m in enumerate((1, 3, 8, 16))]  # fmt: skip
    expected = [Q.qmatmul(x, blocks, qtype, n, k) for x in xs]
    failures: list[str] = []

    def work(index: int) -> None:
        for _ in range(25):
            x = xs[index]
            got = Q.qmatmul(x, blocks, qtype, n, k)
            if not np.array_equal(bits(got), bits(expected[index])):
                failures.append(f"thread {index}")
                return

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not failures


PROBE_MACS = {"scalar": 8, "avx2": 12 * 8, "avx512": 16 * 16}
"""Multiply-adds one round of each backend's FMA probe does (ext/quant.h: chains x lanes)."""


def test_fma_probe_counts_the_multiply_adds_of_every_thread(
    backend: str, restore_threads: None
) -> None:
    """``fma_probe`` (the bench's multiply-add peak) runs its rounds on each kernel thread and
    says how many multiply-adds that was; bad round counts are refused by name."""
    for threads in (1, 2):
        Q.set_threads(threads)
        for rounds in (1, 7, 1000):
            assert Q.fma_probe(rounds) == threads * rounds * PROBE_MACS[backend]
    for bad in (0, -1, 1 << 41):
        with pytest.raises(ValueError, match="rounds in 1"):
            Q.fma_probe(bad)
    with pytest.raises(TypeError):
        Q.fma_probe("10")  # type: ignore[arg-type]


def test_reference_has_power() -> None:
    """The comparison above catches the kernel bugs it is meant to: a Q4_1 kernel that dropped
    the min, or one that read the nibbles in the other order, would miss the reference by far
    more than TOL (here those kernels are stood in for by their wrong weights)."""
    name, qtype = "Q4_1", FORMATS["Q4_1"]
    k, n = 96, 7
    blocks = make_blocks(name, n, k, seed=29)
    x = np.random.default_rng(31).standard_normal((3, k)).astype(np.float32)
    y = Q.qmatmul(x, blocks, qtype, n, k)
    assert_close_to_reference(y, x, reference_weights(blocks, name), "intact")
    no_min = blocks.reshape(n, -1, 20).copy()
    no_min[:, :, 2:4] = 0  # fp16 m = +0
    swapped = blocks.reshape(n, -1, 20).copy()
    swapped[:, :, 4:] = (swapped[:, :, 4:] >> 4) | (swapped[:, :, 4:] << 4)
    for label, wrong in (("dropped min", no_min), ("swapped nibbles", swapped)):
        with pytest.raises(AssertionError):
            assert_close_to_reference(y, x, reference_weights(wrong.reshape(n, -1), name), label)


# ----------------------------------------------------------------------------- bad input


def _setup() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8], int, int]:
    """(x (3, 64), Q8_0 blocks of 5 rows, n, k): a valid call the bad ones each spoil."""
    k, n = 64, 5
    blocks = make_blocks("Q8_0", n, k, seed=37)
    x = np.random.default_rng(41).standard_normal((3, k)).astype(np.float32)
    return x, blocks, n, k


def _overlapping_out_x() -> dict[str, Any]:
    x, _, n, k = _setup()
    shared = np.zeros(3 * k + 3 * n, dtype=np.float32)
    xs = shared[: 3 * k].reshape(3, k)
    xs[...] = x
    return {"x": xs, "out": shared[3 * k - 1 : 3 * k - 1 + 3 * n].reshape(3, n)}  # x's last


def _overlapping_out_w() -> dict[str, Any]:
    _, blocks, n, _ = _setup()
    raw = bytearray(blocks.nbytes + 3 * n * 4)
    w = np.frombuffer(raw, dtype=np.uint8, count=blocks.nbytes)
    w[...] = blocks.reshape(-1)
    out = np.frombuffer(raw, dtype=np.float32, count=3 * n, offset=blocks.nbytes - 4)
    return {"w": w, "out": out.reshape(3, n)}


def _read_only_out() -> dict[str, Any]:
    out = np.zeros((3, 5), dtype=np.float32)
    out.flags.writeable = False
    return {"out": out}


def _qm_cases() -> list[tuple[str, Any, type[Exception], str]]:
    """(label, the arguments to change (or a function making them), exception, words the
    message must hold)."""
    x, blocks, n, k = _setup()
    f32, u8 = np.float32, np.uint8
    contiguous = "must be C-contiguous"
    return [
        ("x float64", {"x": x.astype(np.float64)}, TypeError, "x must hold float32"),
        ("x int32", {"x": x.astype(np.int32)}, TypeError, "x must hold float32"),
        ("x not a buffer", {"x": x.tolist()}, TypeError, "x must support"),
        ("x strided", {"x": np.zeros((3, 2 * k), f32)[:, ::2]}, ValueError, "x " + contiguous),
        ("x column-major", {"x": np.asfortranarray(x)}, ValueError, "x " + contiguous),
        ("x wrong k", {"x": x[:, :32].copy()}, ValueError, "x must have shape"),
        ("x 3-D", {"x": x.reshape(3, 1, k)}, ValueError, "x must have shape"),
        ("x no rows", {"x": x[:0]}, ValueError, "x has no rows"),
        ("k not whole blocks", {"x": x[:, :48].copy(), "k": 48}, ValueError,
         "k must be a positive multiple of 32"),
        ("k zero", {"k": 0}, ValueError, "k must be"),
        ("n zero", {"n": 0}, ValueError, "n must be >= 1"),
        ("n negative", {"n": -3}, ValueError, "n must be >= 1"),
        ("n huge", {"n": 2**62}, ValueError, "too large"),
        ("w short", {"w": blocks.reshape(-1)[:-1]}, ValueError, "w holds"),
        ("w long", {"w": np.zeros(blocks.nbytes + 34, u8)}, ValueError, "w holds"),
        ("w of another qtype", {"qtype": 2}, ValueError, "w holds"),
        ("w float32", {"w": blocks.view(f32)}, TypeError, "w must be a buffer of bytes"),
        ("w strided", {"w": np.zeros((n, 2 * blocks.shape[1]), u8)[:, ::2]}, ValueError,
         "w " + contiguous),
        ("qtype F32", {"qtype": 0}, ValueError, "qtype 0"),
        ("qtype F16", {"qtype": 1}, ValueError, "qtype 1"),
        ("qtype Q5_1", {"qtype": 7}, ValueError, "qtype 7"),
        ("qtype negative", {"qtype": -1}, ValueError, "qtype -1"),
        ("out read-only", _read_only_out, ValueError, "out is read-only"),
        ("out wrong shape", {"out": np.zeros((3, n + 1), f32)}, ValueError, "out must be"),
        ("out 1-D for 2-D x", {"out": np.zeros(3 * n, f32)}, ValueError, "out must be"),
        # Same element count, other shape: filling it in (m, n) order would scramble it.
        ("out transposed", {"out": np.zeros((n, 3), f32)}, ValueError, "out must be"),
        ("out one row", {"out": np.zeros((1, 3 * n), f32)}, ValueError, "out must be"),
        ("out float64", {"out": np.zeros((3, n), np.float64)}, ValueError, "out must be"),
        ("out overlaps x", _overlapping_out_x, ValueError, "out must not overlap"),
        ("out overlaps w", _overlapping_out_w, ValueError, "out must not overlap"),
    ]  # fmt: skip


QM_CASES = _qm_cases()


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [case[1:] for case in QM_CASES],
    ids=[case[0] for case in QM_CASES],
)
def test_qmatmul_rejects_bad_arguments(
    change: dict[str, Any] | Any, error: type[Exception], words: str
) -> None:
    """A clear exception naming the argument; afterwards the module still works."""
    x, blocks, n, k = _setup()
    args: dict[str, Any] = {"x": x, "w": blocks, "qtype": 8, "n": n, "k": k, "out": None}
    args.update(change() if callable(change) else change)
    with pytest.raises(error, match=words):
        Q.qmatmul(**args)
    assert_close_to_reference(
        Q.qmatmul(x, blocks, 8, n, k), x, reference_weights(blocks, "Q8_0"), "after the error"
    )


def test_dequantize_and_rows_reject_bad_arguments() -> None:
    _, w, n, k = _setup()
    rows_ok = np.array([0, n - 1], dtype=np.int64)
    i64, f32 = np.int64, np.float32
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: Q.dequantize(w, 8, n + 1, k), ValueError, "w holds"),
        (lambda: Q.dequantize(w, 8, n, 48), ValueError, "k must be"),
        (lambda: Q.dequantize(w, 99, n, k), ValueError, "qtype 99"),
        (lambda: Q.dequantize(w, 8, 0, k), ValueError, "n must be"),
        (lambda: Q.dequantize(w, 8, n, k, np.zeros((n, k + 1), f32)), ValueError, "out must be"),
        (lambda: Q.dequantize_rows(w, 8, k, np.array([n], i64)), IndexError, r"rows\[0\] = 5"),
        (lambda: Q.dequantize_rows(w, 8, k, np.array([0, -1], i64)), IndexError, r"rows\[1\]"),
        (lambda: Q.dequantize_rows(w, 8, k, np.array([0, 1], np.int32)), TypeError, "rows must"),
        (lambda: Q.dequantize_rows(w, 8, k, np.zeros((1, 1), i64)), TypeError, "rows must be"),
        (lambda: Q.dequantize_rows(w, 8, k, [0, 1]), TypeError, "rows must support"),
        (lambda: Q.dequantize_rows(w.reshape(-1)[:-2], 8, k, rows_ok), ValueError, "whole rows"),
        (lambda: Q.dequantize_rows(w, 8, 48, rows_ok), ValueError, "k must be"),
        (lambda: Q.dequantize_rows(w, 8, k, rows_ok, np.zeros((3, k), f32)), ValueError, "out "),
        (lambda: Q.set_backend("avx9000"), ValueError, "not available"),
        (lambda: Q.set_backend(2), TypeError, "backend name"),
        (lambda: Q.set_threads(0), ValueError, "set_threads takes 1"),
        (lambda: Q.set_threads(9), ValueError, "set_threads takes 1"),
    ]
    before = (Q.backend(), Q.threads())
    for index, (call, error, words) in enumerate(cases):
        with pytest.raises(error, match=words):
            call()
        assert (Q.backend(), Q.threads()) == before, f"case {index} changed the module's state"
    # An empty row list is a valid lookup of nothing.
    assert Q.dequantize_rows(w, 8, k, np.zeros(0, np.int64)).shape == (0, k)
