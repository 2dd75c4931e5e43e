"""Check an *installed* flashspec._residual against a float64 NumPy reference.

Meant for a wheel installed into a fresh environment: run it with that environment's
interpreter, from a directory outside the checkout, isolated from the current directory
and PYTHONPATH::

    cd "$(mktemp -d)" && /path/to/venv/bin/python -I check_kernel.py --source-tree /path/to/checkout

It needs NumPy only (no torch, no pytest). It checks that

* ``import flashspec._residual`` works without torch, from the environment's own
  site-packages, never from the source tree;
* on x86-64 Linux the assembly backends are present whenever the CPU and OS support them
  (a build that silently lost its asm would otherwise pass), unless FLASHSPEC_NO_ASM is set;
* for every backend in ``available_backends()``, ``residual_dist`` and ``residual_sample``
  agree with a float64 reference on random Dirichlet inputs, 1-D and 2-D, aligned and not;
* bad input raises instead of crashing.

Every failure is printed; the exit status is 0 only when all checks pass.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

# (shape, Dirichlet alpha): lengths around every vector width and block size, real vocabularies.
CASES: list[tuple[tuple[int, ...], float]] = [
    ((1,), 1.0),
    ((2,), 1.0),
    ((7,), 1.0),
    ((8,), 1.0),
    ((15,), 1.0),
    ((16,), 1.0),
    ((17,), 1.0),
    ((33,), 1.0),
    ((63,), 1.0),
    ((64,), 1.0),
    ((65,), 1.0),
    ((255,), 1.0),
    ((1000,), 0.5),
    ((4095,), 0.5),
    ((4097,), 0.5),
    ((32000,), 0.3),
    ((128256,), 0.3),
    ((3, 5), 1.0),
    ((4, 1031), 0.5),
    ((2, 32000), 0.3),
    ((5, 8193), 1.0),
]
SAMPLE_US = [0.0, 1e-9, 0.25, 0.5, 0.75, 0.999999]


class Checker:
    def __init__(self) -> None:
        self.passed = 0
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
            print(f"FAIL: {what}", flush=True)

    def run(self, what: str, fn: Callable[[], None]) -> None:
        """Run fn, counting an AssertionError or any exception as a failure of `what`."""
        try:
            fn()
        except Exception as e:  # every failure is reported; none stops the run
            self.check(False, f"{what}: {type(e).__name__}: {e}")
        else:
            self.check(True, what)


# Type id -> (block bytes, bytes before the quants): the 32-weight formats the asm takes.
# Q8_0, Q4_0, Q4_1, Q5_0 (as the file stores it: fp16 d, le32 high bits, nibbles), and the
# layouts a load repacks Q4_K and Q6_K into (float32 scales).
QUANT_BLOCKS = {8: (34, 2), 2: (18, 2), 3: (20, 4), 6: (22, 6), 268: (24, 8), 270: (40, 8)}
REPACKED_TYPES = (268, 270)
# fp16 fields at the start of a block (d, and Q4_1's m); Q5_0's other 4 bytes are its qh.
HALF_FIELDS = {8: 1, 2: 1, 3: 2, 6: 1}


def quant_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """(n, row bytes) random blocks of GGML type ``qtype`` with small finite fp16 scales."""
    size, head = QUANT_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    if qtype in REPACKED_TYPES:  # float32 scales as a repack makes them: fp16 x 6 bits
        half = (rng.standard_normal((n, k // 32, 2)) * 0.002).astype(np.float16)
        scales = half.astype(np.float32) * rng.integers(-63, 64, size=half.shape)
        raw[..., :head] = scales.astype("<f4").view(np.uint8).reshape(n, k // 32, head)
        return raw.reshape(n, -1)
    halves = HALF_FIELDS[qtype]
    scales = (rng.standard_normal((n, k // 32, halves)) * 0.02).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // 32, 2 * halves)
    return raw.reshape(n, -1)


def quant_reference(blocks: npt.NDArray[np.uint8], qtype: int, k: int) -> F64:
    """The weights of ``blocks`` as the GGUF formats define them, in float32, widened."""
    size, head = QUANT_BLOCKS[qtype]
    b = blocks.reshape(blocks.shape[0], k // 32, size)
    if qtype in REPACKED_TYPES:  # formed in float64 (D * q exact) and rounded once
        f = b[..., :8].copy().view("<f4").astype(np.float64)
        if qtype == 268:
            qs = b[..., head:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float64)
            w64 = f[..., :1] * q + f[..., 1:]
        else:
            w64 = np.repeat(f, 16, axis=-1) * b[..., head:].view(np.int8).astype(np.float64)
        return w64.astype(np.float32).reshape(blocks.shape[0], k).astype(np.float64)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
    if qtype == 8:
        w = d * b[..., 2:].view(np.int8).astype(np.float32)
    elif qtype == 6:  # q = nibble | bit e of qh << 4; w = d * (q - 16), exact
        qh = b[..., 2:6].copy().view("<u4")
        qs = b[..., head:]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
        high = (qh.astype(np.int64) >> np.arange(32)) & 1
        w = d * ((nibbles | high << 4) - 16).astype(np.float32)
    else:
        qs = b[..., head:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        if qtype == 2:
            w = d * (q - 8)
        else:
            m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
            w = d * q + m  # d*q is exact: one rounding, as the kernels' fma
    return w.reshape(blocks.shape[0], k).astype(np.float64)


def check_quant(ck: Checker, want_asm: bool, rng: np.random.Generator) -> None:
    """flashspec._quant: imports with NumPy alone, has its asm where the CPU does, and every
    backend's product matches a float64 one of the formats' weights."""
    try:
        import flashspec._quant as Q
    except ImportError as e:
        ck.check(False, f"import flashspec._quant: {type(e).__name__}: {e}")
        return
    avail = list(Q.available_backends())
    feats = Q.cpu_features()
    print(f"flashspec._quant backends: {avail}; in use: {Q.backend()}")
    if want_asm:
        ck.check(
            not (feats["avx2"] and feats["fma"] and feats["f16c"]) or "avx2" in avail,
            "CPU supports AVX2+FMA+F16C but the quantized avx2 backend is missing",
        )
        ck.check(
            not feats["avx512f"] or "avx512" in avail,
            "CPU supports AVX-512F but the quantized avx512 backend is missing",
        )
    start = Q.backend()
    try:
        for name in avail:
            Q.set_backend(name)
            for qtype in QUANT_BLOCKS:
                for m, n, k in ((1, 7, 96), (5, 33, 256), (16, 9, 64)):
                    blocks = quant_blocks(qtype, n, k, rng)
                    x = rng.standard_normal((m, k)).astype(np.float32)
                    weights = quant_reference(blocks, qtype, k)
                    ref = x.astype(np.float64) @ weights.T
                    got = Q.qmatmul(x, blocks, qtype, n, k)
                    scale = np.abs(x).astype(np.float64) @ np.abs(weights).T
                    err = float(np.max(np.abs(got - ref) / (scale + 1e-30)))
                    ck.check(
                        err < 1e-5,
                        f"_quant[{name}] qtype {qtype} m={m} n={n} k={k}: relative error {err:.2e}",
                    )
            if hasattr(Q, "decoder_step"):
                check_decoder(ck, Q, name, rng)
            else:
                ck.check(False, "flashspec._quant has no decoder_step (built from old sources?)")
    finally:
        Q.set_backend(start)


# The shape of the decoder checked: (dim, heads, kv heads, head size, feed-forward, layers).
DECODER_SHAPE = (64, 4, 2, 16, 96, 2)
DECODER_EPS = 1e-5


def decoder_case(
    rng: np.random.Generator, qtype: int, shape: tuple[int, ...] = DECODER_SHAPE
) -> tuple[list[tuple[Any, ...]], list[dict[str, F64]]]:
    """Random layers for ``decoder_plan`` (blocks of ``qtype``) and the same layers as float64
    weights for ``decoder_reference``."""
    dim, heads, kv_heads, hd, ffn, count = shape
    sizes = {
        "q": (heads * hd, dim),
        "k": (kv_heads * hd, dim),
        "v": (kv_heads * hd, dim),
        "o": (dim, heads * hd),
        "gate": (ffn, dim),
        "up": (ffn, dim),
        "down": (dim, ffn),
    }
    plan, dense = [], []
    for _ in range(count):
        norms = [(1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32) for _ in range(2)]
        row: list[Any] = list(norms)
        weights: dict[str, F64] = {
            "in_norm": norms[0].astype(np.float64),
            "post_norm": norms[1].astype(np.float64),
        }
        for name, (n, k) in sizes.items():
            blocks = quant_blocks(qtype, n, k, rng)
            row += [blocks, qtype]
            weights[name] = quant_reference(blocks, qtype, k)
        plan.append(tuple(row))
        dense.append(weights)
    return plan, dense


def decoder_reference(
    layers: list[dict[str, F64]],
    hidden: F32,
    cos: F32,
    sin: F32,
    kv: F32,
    past: int,
    heads: int,
    eps: float,
    scaling: float,
    mask: Any = None,
) -> tuple[F64, F64]:
    """A Llama decoder step of one row in float64 (the contract of ext/quant_step.h): the
    hidden states after every layer and the cache with positions past .. past + m - 1
    written. ``mask``: None, the row's visible key columns (nonzero: visible), or (m, columns)
    those of each position (a token tree's); a query that sees none gets zeros from attention,
    and a position whose own column is hidden (a dead one) keeps its input row and gets zeros
    in the cache.

    A batch, kv (layers, 2, B, kv_heads, cap, head_dim) with hidden (B * m, dim), cos/sin
    (B * m, head_dim) and mask None, (B, >= past + m) or (B, m, >= past + m), is each row's
    step on its own."""
    if kv.ndim == 6:
        rows = kv.shape[2]
        n = hidden.shape[0] // rows
        out_h, out_kv = [], []
        for b in range(rows):
            span = slice(b * n, (b + 1) * n)
            row_h, row_kv = decoder_reference(
                layers, hidden[span], cos[span], sin[span], kv[:, :, b], past, heads, eps, scaling,
                None if mask is None else mask[b],
            )  # fmt: skip
            out_h.append(row_h)
            out_kv.append(row_kv)
        return np.concatenate(out_h), np.stack(out_kv, axis=2)
    h = hidden.astype(np.float64)
    cache = kv.astype(np.float64)
    m, hd = cos.shape
    kv_heads = cache.shape[2]
    c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    # One mask row per position: the row's own repeated, or the position's.
    rows = None if mask is None else np.broadcast_to(np.asarray(mask), (m, np.shape(mask)[-1]))

    def rms(x: F64, w: F64) -> F64:
        return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))

    def rope(x: F64) -> F64:
        rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * c + rotated * s

    for index, w in enumerate(layers):
        x = rms(h, w["in_norm"])
        q = rope((x @ w["q"].T).reshape(m, heads, hd))
        cache[index, 0, :, past : past + m] = rope(
            (x @ w["k"].T).reshape(m, kv_heads, hd)
        ).transpose(1, 0, 2)
        cache[index, 1, :, past : past + m] = (
            (x @ w["v"].T).reshape(m, kv_heads, hd).transpose(1, 0, 2)
        )
        out = np.empty((m, heads, hd))
        for i in range(m):
            for head in range(heads):
                group = head // (heads // kv_heads)
                seen = np.arange(past + i + 1)
                if rows is not None:
                    seen = seen[rows[i, : past + i + 1] != 0]
                if seen.size == 0:
                    out[i, head] = 0.0
                    continue
                keys = cache[index, 0, group, seen]
                values = cache[index, 1, group, seen]
                scores = keys @ q[i, head] * scaling
                p = np.exp(scores - scores.max())
                out[i, head] = (p / p.sum()) @ values
        h = h + out.reshape(m, -1) @ w["o"].T
        x = rms(h, w["post_norm"])
        gate, up = x @ w["gate"].T, x @ w["up"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w["down"].T
    if rows is not None:
        dead = np.flatnonzero(rows[np.arange(m), past + np.arange(m)] == 0)
        h[dead] = hidden[dead]
        cache[:, :, :, past + dead] = 0.0
    return h, cache


def batch_mask(rows: int, width: int, past: int) -> Any:
    """A (rows, width) mask with what the ragged layout makes: row 0 sees every column; row
    1 has dead columns among its cached ones and its first new column dead; the last row
    (from 3 rows) has every cached column and its first new column dead, so that query sees
    nothing at all."""
    mask = np.ones((rows, width), dtype=np.uint8)
    if rows > 1:
        mask[1, 1:past:2] = 0
        mask[1, past] = 0
    if rows > 2:
        mask[rows - 1, : past + 1] = 0
    return mask


def tree_mask(rows: int, width: int, past: int) -> Any:
    """A (rows, 4, width) per-query mask of token trees of 4 nodes after ``past`` columns:
    node i sees the committed columns, its ancestors and itself; row 0 a chain, row 1 two
    roots with a child each, the last row (from 3 rows) one root with three children."""
    trees = [[-1, 0, 1, 2], [-1, -1, 0, 1], [-1, 0, 0, 0]]
    mask = np.zeros((rows, 4, width), dtype=np.uint8)
    mask[:, :, :past] = 1
    for r in range(rows):
        parents = trees[0] if r == 0 else trees[1] if r < rows - 1 else trees[2]
        for i, parent in enumerate(parents):
            if parent >= 0:
                mask[r, i] = mask[r, parent]
            mask[r, i, past + i] = 1
    return mask


def check_step(
    ck: Checker,
    Q: ModuleType,
    plan: Any,
    dense: list[dict[str, F64]],
    rng: np.random.Generator,
    m: int,
    past: int,
    what: str,
    mask: Any = None,
) -> None:
    """One ``decoder_step`` of ``m`` positions after ``past`` cached ones on random inputs,
    against the float64 reference: one row when ``mask`` is None, else a batch of
    ``mask.shape[0]`` rows stepping with that mask ((rows, columns), or (rows, m, columns): a
    row per position). ``what`` names the check in its message."""
    dim, heads, kv_heads, hd, _, count = DECODER_SHAPE
    scaling = hd**-0.5
    batch = () if mask is None else (mask.shape[0],)
    n = m if mask is None else m * mask.shape[0]
    kv = (0.5 * rng.standard_normal((count, 2, *batch, kv_heads, 16, hd))).astype(np.float32)
    hidden = rng.standard_normal((n, dim)).astype(np.float32)
    angles = rng.uniform(0.0, 6.0, (n, hd)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    want_h, want_kv = decoder_reference(
        dense, hidden, cos, sin, kv, past, heads, DECODER_EPS, scaling, mask
    )
    got_h, got_kv = hidden.copy(), kv.copy()
    # A per-query mask (rows, m, columns) goes to the C step flat, a row per position.
    flat = () if mask is None else (mask.reshape(-1, mask.shape[-1]),)
    Q.decoder_step(plan, got_h, cos, sin, got_kv, past, *flat)
    err_h = float(np.abs(got_h - want_h).max() / np.abs(want_h).max())
    err_kv = float(np.abs(got_kv - want_kv).max() / np.abs(want_kv).max())
    ck.check(
        err_h < 1e-4 and err_kv < 1e-4,
        f"{what}: relative error {err_h:.2e} (hidden), {err_kv:.2e} (cache)",
    )


def check_decoder(ck: Checker, Q: ModuleType, name: str, rng: np.random.Generator) -> None:
    """``decoder_step`` of backend ``name`` against ``decoder_reference``: a step of 1 and of 7
    positions after 5 cached ones, then a batch of 3 rows with dead columns (``batch_mask``)
    stepping 1 and 4 positions and one verifying token trees (``tree_mask``), Q8_0, Q4_1 and
    Q5_0 layers."""
    dim, heads, kv_heads, hd, ffn, _ = DECODER_SHAPE
    for qtype in (8, 3, 6):
        layers, dense = decoder_case(rng, qtype)
        plan = Q.decoder_plan(layers, dim, heads, kv_heads, hd, ffn, DECODER_EPS, hd**-0.5)
        what = f"_quant[{name}] decoder_step qtype {qtype}"
        for m, past in ((1, 5), (7, 5)):
            check_step(ck, Q, plan, dense, rng, m, past, f"{what} m={m} past={past}")
        for m in (1, 4):
            rows, past = 3, 5
            mask = batch_mask(rows, past + m, past)
            check_step(ck, Q, plan, dense, rng, m, past, f"{what} batch {rows} m={m} masked", mask)
        mask = tree_mask(3, 5 + 4, 5)
        check_step(ck, Q, plan, dense, rng, 4, 5, f"{what} batch 3 trees of 4", mask)


def ref_dist(p: F32, q: F32) -> F64:
    """Row-wise max(0, p - q) / sum, in float64; where the residual is zero, p renormalised."""
    p2 = np.atleast_2d(p).astype(np.float64)
    q2 = np.atleast_2d(q).astype(np.float64)
    d = np.maximum(p2 - q2, 0.0)
    s = d.sum(axis=1, keepdims=True)
    pp = np.maximum(p2, 0.0)
    out = np.where(s > 0, d / np.where(s > 0, s, 1.0), pp / pp.sum(axis=1, keepdims=True))
    return out.reshape(np.shape(p))


def ref_weights(p: F32, q: F32) -> F64:
    """The unnormalised weights residual_sample draws from, for one row."""
    d = np.maximum(p.astype(np.float64) - q.astype(np.float64), 0.0)
    return d if d.sum() > 0 else np.maximum(p.astype(np.float64), 0.0)


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float) -> F32:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    x = rng.dirichlet(np.full(shape[-1], alpha), size=rows).astype(np.float32)
    return x.reshape(shape)


def unaligned_copy(a: F32) -> F32:
    """A C-contiguous copy of `a` that starts 4 bytes past a 64-byte boundary."""
    raw = np.empty(a.size + 32, dtype=np.float32)
    skip = (-raw.ctypes.data % 64) // 4 + 1
    out = raw[skip : skip + a.size].reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == 4 and out.flags.c_contiguous
    return out


def assert_dist(p: F32, q: F32, out: object) -> None:
    assert isinstance(out, np.ndarray), f"returned {type(out).__name__}, expected ndarray"
    assert out.dtype == np.float32 and out.shape == p.shape, f"{out.dtype} {out.shape}"
    ref = ref_dist(p, q)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=1e-9)
    sums = np.atleast_2d(out).astype(np.float64).sum(axis=1)
    assert np.all(np.abs(sums - 1.0) <= 1e-5), f"row sums {sums}"
    assert np.all(out >= 0), "negative probabilities"
    # Where a row has residual mass, every index with q >= p must be exactly zero.
    p2, q2, o2 = np.atleast_2d(p), np.atleast_2d(q), np.atleast_2d(out)
    for r in range(p2.shape[0]):
        if np.any(p2[r] > q2[r]):
            assert np.all(o2[r][q2[r] >= p2[r]] == 0.0), f"row {r}: mass where q >= p"


def assert_sample(w: F64, u: float, idx: int) -> None:
    """idx must be an inverse-CDF draw for u from weights w, up to float32 summation error."""
    n = w.shape[0]
    assert 0 <= idx < n, f"index {idx} out of range for V={n}"
    assert w[idx] > 0, f"index {idx} has zero weight"
    c = np.cumsum(w)
    total = float(c[-1])
    target = u * total
    tol = 1e-5 * total
    before = float(c[idx - 1]) if idx > 0 else 0.0
    assert before <= target + tol and float(c[idx]) > target - tol, (
        f"u={u}: index {idx} has CDF [{before}, {float(c[idx])}) not around {target}"
    )


def check_backend(ck: Checker, R: ModuleType, name: str, rng: np.random.Generator) -> None:
    """Every case of CASES through the current backend `name` of the module R."""
    for shape, alpha in CASES:
        p, q = dirichlet(rng, shape, alpha), dirichlet(rng, shape, alpha)
        tag = f"[{name}] shape={shape}"

        def dist_default(p: F32 = p, q: F32 = q) -> None:
            assert_dist(p, q, R.residual_dist(p, q))

        def dist_out(p: F32 = p, q: F32 = q) -> None:
            out = unaligned_copy(np.full(p.shape, np.nan, dtype=np.float32))
            got = R.residual_dist(unaligned_copy(p), unaligned_copy(q), out=out)
            assert got is out, "out= was not returned"
            assert_dist(p, q, out)
            assert np.array_equal(out, R.residual_dist(p, q)), "unaligned differs from aligned"

        def sample(p: F32 = p, q: F32 = q) -> None:
            p2, q2 = np.atleast_2d(p), np.atleast_2d(q)
            us = [*SAMPLE_US, *rng.random(8).tolist()]
            for row in range(p2.shape[0]):
                w = ref_weights(p2[row], q2[row])
                for u in us:
                    idx = R.residual_sample(p2[row], q2[row], float(u))
                    assert isinstance(idx, int), f"returned {type(idx).__name__}, expected int"
                    assert_sample(w, float(u), idx)
            if p.ndim == 2:
                ub: F64 = rng.random(int(p.shape[0]))
                got = R.residual_sample(p, q, ub)
                assert isinstance(got, np.ndarray) and got.dtype == np.int64, repr(got)
                for row in range(p.shape[0]):
                    assert_sample(ref_weights(p[row], q[row]), float(ub[row]), int(got[row]))

        ck.run(f"{tag} residual_dist", dist_default)
        ck.run(f"{tag} residual_dist(out=, unaligned)", dist_out)
        ck.run(f"{tag} residual_sample", sample)

    def zero_residual() -> None:
        p = dirichlet(rng, (1000,), 1.0)
        assert_dist(p, p.copy(), R.residual_dist(p, p.copy()))
        assert_sample(ref_weights(p, p), 0.3, R.residual_sample(p, p.copy(), 0.3))

    def bad_input() -> None:
        p = dirichlet(rng, (64,), 1.0)
        bad = p.copy()
        bad[5] = np.nan
        for args, exc in (
            ((bad, p), ValueError),
            ((p, bad), ValueError),
            ((p.astype(np.float64), p), TypeError),
            ((p, p[:32]), ValueError),
            ((p[::2], p[::2]), ValueError),
        ):
            try:
                R.residual_dist(*args)
            except exc:
                pass
            else:
                raise AssertionError(f"no {exc.__name__} for {[a.dtype for a in args]}")

    ck.run(f"[{name}] zero residual is p renormalised", zero_residual)
    ck.run(f"[{name}] bad input raises", bad_input)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--source-tree",
        type=Path,
        help="the checkout; the module must not be imported from it",
    )
    ap.add_argument(
        "--allow-no-asm",
        action="store_true",
        help="do not require the asm backends (implied by FLASHSPEC_NO_ASM=1)",
    )
    ap.add_argument("--seed", type=int, default=20240607)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ck = Checker()
    print(
        f"python {sys.version.split()[0]} at {sys.executable}; numpy {np.__version__}; "
        f"cwd {os.getcwd()}; seed {args.seed}"
    )

    try:
        import flashspec
        import flashspec._residual as R
    except ImportError as e:
        print(f"FAIL: import flashspec._residual: {type(e).__name__}: {e}")
        if getattr(e, "name", None) in ("torch", "transformers"):
            print(
                f"      flashspec/__init__.py (or a module it imports) imports {e.name} "
                "eagerly; the kernel must import with numpy alone (lazy re-exports)"
            )
        print("check_kernel: FAILED at import")
        return 1

    mod = Path(R.__file__ or "").resolve()
    prefix = Path(sys.prefix).resolve()
    print(f"flashspec._residual: {mod}")
    ck.check("torch" not in sys.modules, "importing flashspec._residual imported torch")
    ck.check(sys.prefix != sys.base_prefix, f"not running inside a virtual environment ({prefix})")
    ck.check(prefix in mod.parents, f"module {mod} is not inside the environment {prefix}")
    pkg = Path(flashspec.__file__ or "").resolve().parent
    ck.check(pkg == mod.parent, f"flashspec package {pkg} and its extension {mod} differ")
    if args.source_tree is not None:
        src = args.source_tree.resolve()
        ck.check(
            src not in mod.parents or prefix in src.parents,
            f"module {mod} was imported from the source tree {src}",
        )
        ck.check(
            not Path.cwd().resolve().is_relative_to(src),
            f"run from {Path.cwd()}, inside the source tree {src}",
        )

    avail = list(R.available_backends())
    feats = R.cpu_features()
    print(
        f"backends available: {avail}; in use: {R.backend()}; cpu: "
        + ", ".join(f"{k}={v}" for k, v in feats.items())
    )
    ck.check(bool(avail) and avail[0] == "scalar", f"available_backends() = {avail}")
    forced = os.environ.get("FLASHSPEC_KERNEL", "")
    if forced in ("", "auto"):
        ck.check(R.backend() == avail[-1], f"default backend {R.backend()} is not {avail[-1]}")

    no_asm = args.allow_no_asm or os.environ.get("FLASHSPEC_NO_ASM", "") not in ("", "0")
    is_x86_linux = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
    if is_x86_linux and not no_asm:
        ymm = all(feats[k] for k in ("osxsave", "avx", "avx2", "ymm_state"))
        ck.check(
            not ymm or "avx2" in avail,
            "CPU/OS support AVX2 but the avx2 backend is missing "
            "(was the wheel built without nasm / with FLASHSPEC_NO_ASM?)",
        )
        zmm = ymm and bool(feats["avx512f"]) and bool(feats["zmm_state"])
        ck.check(
            not zmm or "avx512" in avail,
            "CPU/OS support AVX-512F but the avx512 backend is missing",
        )
    elif is_x86_linux:
        print("FLASHSPEC_NO_ASM set: not requiring the assembly backends")

    start = R.backend()
    rng = np.random.default_rng(args.seed)
    try:
        for name in avail:
            R.set_backend(name)
            check_backend(ck, R, name, rng)
    finally:
        R.set_backend(start)

    check_quant(ck, is_x86_linux and not no_asm, rng)

    dt = time.perf_counter() - t0
    if ck.failures:
        print(
            f"check_kernel: FAILED {len(ck.failures)} of {ck.passed + len(ck.failures)} "
            f"checks ({dt:.1f} s)"
        )
        return 1
    print(f"check_kernel: OK, {ck.passed} checks on backends {', '.join(avail)} ({dt:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
