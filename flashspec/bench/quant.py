"""``flashspec bench quant``: the quantized matmul kernels (``flashspec._quant``) per GGUF format,
backend and row count, against this machine's measured read bandwidth and against torch's dense
float32 and bfloat16 matmuls of the same shape (``quant.json``).

Shapes are SmolLM2-135M's: the attention and feed-forward projections (576 x 576, 1536 x 576,
576 x 1536) and the tied 49,152 x 576 head. Weights are random blocks quantized by gguf-py, so
every byte a kernel reads is a real block of its format. Times are medians of alternating
repeats after a warm-up; GB/s counts the weight bytes one call reads (the rows of x and y are
small beside them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .common import machine_info, progress, quiet_timing, write_json

SHAPES: tuple[tuple[str, int, int], ...] = (
    ("attn 576x576", 576, 576),
    ("ffn up 1536x576", 1536, 576),
    ("ffn down 576x1536", 576, 1536),
    ("head 49152x576", 49152, 576),
)
QUICK_SHAPES = SHAPES[1:2] + SHAPES[3:]
ROWS = (1, 2, 3, 5, 8, 16)
QUICK_ROWS = (1, 5, 16)
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_0>Q8_0", "Q4_K", "Q6_K", "Q4_KR", "Q6_KR")
"""Q5_0 runs its own SIMD kernels over the file's 22-byte blocks (what a load keeps);
``Q5_0>Q8_0`` is the same weights repacked into Q8_0 (34 bytes a block, what loads ran before),
measured beside it."""
REPACKED_FROM = {"Q4_KR": "Q4_K", "Q6_KR": "Q6_K", "Q5_0>Q8_0": "Q5_0"}
"""flashspec's repacked layouts (``flashspec.quant.ops.REPACK_LAYOUTS``) and the GGML format
each is made from: measured on blocks repacked from that format's."""
LAYOUT = {"Q5_0>Q8_0": "Q8_0"}
"""Rows named apart from the layout they run (the kernel and block size of the layout's)."""
BANDWIDTH_BYTES = 512 << 20


def read_bandwidth(repeats: int = 7) -> float:
    """GB/s of a torch sum over a 512 MiB float32 tensor (torch's threads), the best of
    ``repeats``: what streaming the weights once could reach on this machine."""
    import torch

    big = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    big.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best / 1e9


def fma_peak(repeats: int = 5, seconds: float = 0.05) -> float:
    """Float32 multiply-adds per second of this machine: the best backend's FMA probe
    (``flashspec._quant.fma_probe``: independent FMAs on zeros, on every kernel thread at
    once), the best of ``repeats`` runs of about ``seconds`` each. No exact kernel can run a
    product of m rows faster than m * n * k multiply-adds at this rate: every x row needs its
    own multiply-add per weight (8-bit dot products would quantize x)."""
    from .. import _quant as Q

    before = Q.backend()
    best = 0.0
    try:
        for backend in Q.available_backends():
            Q.set_backend(backend)
            rounds = 1 << 10
            while True:  # size a run to about ``seconds``
                start = time.perf_counter()
                Q.fma_probe(rounds)
                if time.perf_counter() - start >= seconds / 4 or rounds >= 1 << 34:
                    break
                rounds *= 4
            for _ in range(repeats):
                start = time.perf_counter()
                macs = Q.fma_probe(rounds)
                best = max(best, macs / (time.perf_counter() - start))
    finally:
        Q.set_backend(before)
    return best


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """(n, row bytes) uint8 blocks of format ``name`` holding random weights, quantized by
    gguf-py (or random bytes with finite scales where gguf-py cannot quantize the format; a
    repacked layout from its source format's blocks)."""
    from gguf import GGMLQuantizationType, quants

    if name in REPACKED_FROM:
        from .. import _quant as Q

        source = REPACKED_FROM[name]
        packed: npt.NDArray[np.uint8] = Q.repack(
            random_blocks(source, n, k, seed), int(GGMLQuantizationType[source]), n, k
        )
        return packed

    kind = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    try:
        return np.ascontiguousarray(quants.quantize(weights, kind))
    except (NotImplementedError, quants.QuantError):
        from gguf.constants import GGML_QUANT_SIZES

        elems, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
        # Every fp16 field a small finite value: 0x2000..0x27ff is about 0.008-0.03.
        scale = rng.integers(0x2000, 0x2800, size=(n, k // elems), dtype=np.uint16)
        where = size - 2 if name == "Q6_K" else 0
        raw[..., where : where + 2] = scale.view(np.uint8).reshape(n, k // elems, 2)
        if name == "Q4_K":
            raw[..., 2:4] = scale.view(np.uint8).reshape(n, k // elems, 2)
        return raw.reshape(n, -1)


def _median_seconds(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    fn(*args)
    times = []
    with quiet_timing():
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(quick: bool, show_progress: bool, peak: float) -> list[dict[str, Any]]:
    """One row per (shape, format, backend, rows): the kernel's ms, GB/s and ns per row, beside
    torch's dense float32 and bfloat16 ``x @ W.T`` of the same shape and rows, and the least
    time its multiply-adds take at ``peak`` (multiply-adds per second, ``fma_peak``)."""
    import torch

    from .. import _quant as Q

    backends = list(Q.available_backends())
    shapes = QUICK_SHAPES if quick else SHAPES
    counts = QUICK_ROWS if quick else ROWS
    ids = {name: number for number, (name, _, _) in Q.formats().items()}
    ids.update({name: ids[layout] for name, layout in LAYOUT.items() if layout in ids})
    formats = [f for f in FORMATS if f in ids]
    repeats = 9 if quick else 25
    rows: list[dict[str, Any]] = []
    elems = {name: Q.formats()[number][1] for name, number in ids.items()}
    # A K format's 256-weight blocks do not divide a 576-wide row: such layers cannot exist
    # (nor can the layouts repacked from them).
    elems.update({name: elems[source] for name, source in REPACKED_FROM.items()})
    jobs = [(s, f) for s in shapes for f in formats if s[2] % elems[f] == 0]
    for (label, n, k), fmt in progress(jobs, desc="shapes x formats", disable=not show_progress):
        blocks = random_blocks(fmt, n, k)
        dense = torch.from_numpy(Q.dequantize(blocks, ids[fmt], n, k))
        dense_bf16 = dense.to(torch.bfloat16)
        for m in counts:
            x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
            out = np.empty((m, n), dtype=np.float32)
            xt = torch.from_numpy(x)
            xb = xt.to(torch.bfloat16)
            torch_fp32 = _median_seconds(torch.matmul, (xt, dense.T), repeats)
            torch_bf16 = _median_seconds(torch.matmul, (xb, dense_bf16.T), repeats)
            for backend in backends:
                Q.set_backend(backend)
                seconds = _median_seconds(Q.qmatmul, (x, blocks, ids[fmt], n, k, out), repeats)
                rows.append(
                    {
                        "shape": label, "n": n, "k": k, "format": fmt, "backend": backend,
                        "rows": m, "ms": round(seconds * 1e3, 4),
                        "weight_bytes": int(blocks.nbytes),
                        "weight_gb_per_s": round(blocks.nbytes / seconds / 1e9, 2),
                        "ns_per_row": round(seconds * 1e9 / m, 1),
                        "fma_floor_ms": round(m * n * k / peak * 1e3, 4),
                        "torch_fp32_ms": round(torch_fp32 * 1e3, 4),
                        "torch_bf16_ms": round(torch_bf16 * 1e3, 4),
                    }
                )  # fmt: skip
    Q.set_backend(backends[-1])
    return rows


def summarise(rows: list[dict[str, Any]], bandwidth: float) -> dict[str, Any]:
    """Per format, backend and shape: the fraction of read bandwidth at one row, the cost of
    5 and 16 rows over one, and ``rows_5_floor_over_1``: the least 5-rows-over-1 any exact
    kernel could show against this kernel's one-row time (5 rows' multiply-adds at the
    machine's peak, over the measured one row): above 1.5, no kernel meets a 1.5x target
    without a slower single row; ``rows_5_floor_over_read``: the same against a single row
    that streams its weights at the measured read bandwidth."""
    out: dict[str, Any] = {}
    for row in rows:
        if row["rows"] != 1:
            continue
        key = f"{row['format']}/{row['backend']}/{row['shape']}"
        where = (row["format"], row["backend"], row["shape"])
        same = {
            r["rows"]: r["ms"] for r in rows if (r["format"], r["backend"], r["shape"]) == where
        }
        floors = {
            r["rows"]: r["fma_floor_ms"]
            for r in rows
            if (r["format"], r["backend"], r["shape"]) == where and "fma_floor_ms" in r
        }
        out[key] = {
            "bandwidth_fraction_1_row": round(row["weight_gb_per_s"] / bandwidth, 3),
            "rows_5_over_1": round(same[5] / same[1], 3) if 5 in same else None,
            "rows_16_over_1": round(same[16] / same[1], 3) if 16 in same else None,
            "rows_5_floor_over_1": round(floors[5] / same[1], 3) if 5 in floors else None,
            "rows_5_floor_over_read": (
                round(floors[5] / (row["weight_bytes"] / bandwidth / 1e6), 3)
                if 5 in floors
                else None
            ),
        }
    return out


HELP = "quantized matmul kernels per GGUF format, backend and row count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench quant`` (besides ``--quick``, ``--out-dir`` and
    ``--no-progress``)."""
    parser.add_argument("--name", default="quant", help="result file stem (default quant)")


def main(args: argparse.Namespace) -> int:
    """Run the kernel benchmark and write ``quant.json`` to ``args.out_dir``."""
    try:
        from .. import _quant as Q
    except ImportError as exc:
        print(f"flashspec._quant is not built ({exc})", file=sys.stderr)
        return 2
    machine = machine_info()
    machine["quant_backends"] = list(Q.available_backends())
    machine["quant_threads"] = Q.threads()
    bandwidth = read_bandwidth()
    peak = fma_peak()
    rows = measure(args.quick, not args.no_progress, peak)
    data = {
        "machine": machine,
        "kind": "quant",
        "read_gb_per_s": round(bandwidth, 2),
        "fma_peak_gmacs": round(peak / 1e9, 2),
        "settings": {
            "threads": Q.threads(),
            "note": "median of alternating repeats; GB/s = weight bytes / seconds; "
            "fma_floor_ms = rows * n * k multiply-adds at fma_peak_gmacs",
        },
        "summary": summarise(rows, bandwidth),
        "rows": rows,
    }
    write_json(data, args.out_dir / f"{args.name}.json")
    print(f"read bandwidth {bandwidth:.1f} GB/s, float32 multiply-add peak {peak / 1e9:.1f} G/s")
    for row in rows:
        print(
            f"{row['shape']:18s} {row['format']:9s} {row['backend']:7s} m={row['rows']:2d} "
            f"{row['ms']:8.3f} ms {row['weight_gb_per_s']:6.1f} GB/s "
            f"(torch fp32 {row['torch_fp32_ms']:.3f} ms, bf16 {row['torch_bf16_ms']:.3f} ms)"
        )
    return 0
