"""``flashspec bench kernel``: the residual kernel's backends against NumPy, torch and two C
baselines, over vocabulary sizes (``kernel.json``, ``kernel.png``)."""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .common import machine_info, progress, pyplot, write_json

VS = [1024, 4096, 32000, 128256, 152064, 256000]
QUICK_VS = [1024, 32000, 128256]

# Lines stay within the linter's width: this is C, compiled at run time.
C_BASELINES = r"""
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* Naive: one running float sum in source order, which IEEE rules keep scalar. */
void naive(const float *p, const float *q, float *out, size_t n) {
    float s = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = p[i] - q[i];
        d = d > 0.0f ? d : 0.0f;
        out[i] = d;
        s += d;
    }
    float inv = 1.0f / s;
    for (size_t i = 0; i < n; i++) out[i] *= inv;
}

#define DIFF(k) _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p + i + (k)), \
                                            _mm256_loadu_ps(q + i + (k))), z)

/* AVX2 intrinsics, four independent accumulators. */
void intrin(const float *p, const float *q, float *out, size_t n) {
    __m256 z = _mm256_setzero_ps(), a0 = z, a1 = z, a2 = z, a3 = z;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 d0 = DIFF(0), d1 = DIFF(8), d2 = DIFF(16), d3 = DIFF(24);
        _mm256_storeu_ps(out + i, d0);
        _mm256_storeu_ps(out + i + 8, d1);
        _mm256_storeu_ps(out + i + 16, d2);
        _mm256_storeu_ps(out + i + 24, d3);
        a0 = _mm256_add_ps(a0, d0);
        a1 = _mm256_add_ps(a1, d1);
        a2 = _mm256_add_ps(a2, d2);
        a3 = _mm256_add_ps(a3, d3);
    }
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float lanes[8];
    _mm256_storeu_ps(lanes, a);
    float s = 0.0f;
    for (int k = 0; k < 8; k++) s += lanes[k];
    for (; i < n; i++) {
        float d = p[i] - q[i];
        d = d > 0.0f ? d : 0.0f;
        out[i] = d;
        s += d;
    }
    __m256 inv = _mm256_set1_ps(1.0f / s);
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), inv));
    }
    for (; j < n; j++) out[j] *= 1.0f / s;
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median over `samples` batches of `inner` calls, in ns per call. */
double bench(int which, const float *p, const float *q, float *out, size_t n,
             int samples, int inner) {
    void (*f)(const float *, const float *, float *, size_t) = which ? intrin : naive;
    double *t = malloc(sizeof(double) * samples);
    for (int s = 0; s < samples; s++) {
        double t0 = now_ns();
        for (int k = 0; k < inner; k++) f(p, q, out, n);
        t[s] = (now_ns() - t0) / inner;
    }
    qsort(t, samples, sizeof(double), cmp);
    double m = t[samples / 2];
    free(t);
    return m;
}
"""

Array = npt.NDArray[np.float32]


def build_c_baselines(tmp: Path) -> Any:
    """Compile the C baselines into a shared library; None without a C compiler or AVX2."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        print("no C compiler: C baselines skipped", file=sys.stderr)
        return None
    src, lib = tmp / "baselines.c", tmp / "baselines.so"
    src.write_text(C_BASELINES)
    try:
        subprocess.run(
            [cc, "-O3", "-march=native", "-shared", "-fPIC", str(src), "-o", str(lib)],
            check=True,
        )
    except subprocess.CalledProcessError:
        # e.g. a CPU without AVX2, where the intrinsics baseline cannot compile.
        print("C baselines failed to compile: skipped", file=sys.stderr)
        return None
    dll = ctypes.CDLL(str(lib))
    dll.bench.restype = ctypes.c_double
    dll.bench.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return dll


def inner_for(v: int) -> int:
    """Calls per timed batch: enough that one batch lasts well above timer resolution."""
    return max(1, 200_000 // v)


def time_py(fn: Callable[[], object], v: int, samples: int) -> float:
    """Median ns per call of ``fn`` over ``samples`` batches (one untimed batch first)."""
    inner = inner_for(v)
    for _ in range(inner):
        fn()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter_ns() - t0) / inner)
    return statistics.median(times)


def run(quick: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Time every implementation at every V; the result dict is what kernel.json holds.

    One process, the same Dirichlet inputs (seed 0) for every implementation, medians of many
    timed batches. The C baselines are compiled here, at run time, with -O3 -march=native (they
    are yardsticks, not shipped code) and timed inside C so that no FFI overhead is charged to
    them; flashspec is timed through its Python API, so its figures include the whole Python
    call.
    """
    from .. import _residual

    # Any: the stubs accept Buffer, which numpy's ndarray type does not declare.
    R: Any = _residual

    samples = 15 if quick else 61
    vs = QUICK_VS if quick else VS
    torch: Any
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None

    rng = np.random.default_rng(0)
    dll = build_c_baselines(Path(tempfile.mkdtemp(prefix="flashspec-bench-")))
    backends: list[str] = list(R.available_backends())
    rows: list[dict[str, Any]] = []
    for v in progress(vs, desc="kernel", unit="V", disable=not show_progress):
        p: Array = rng.dirichlet(np.ones(v)).astype(np.float32)
        q: Array = rng.dirichlet(np.ones(v)).astype(np.float32)
        o: Array = np.empty_like(p)
        res: dict[str, float] = {}

        def np_resid(p: Array = p, q: Array = q, o: Array = o) -> None:
            np.subtract(p, q, out=o)
            np.maximum(o, 0, out=o)
            o *= 1.0 / o.sum()

        def floor(p: Array = p, q: Array = q, o: Array = o) -> None:
            np.subtract(p, q, out=o)

        res["numpy"] = time_py(np_resid, v, samples)
        res["floor: np.subtract"] = time_py(floor, v, samples)
        if torch is not None:
            tp, tq, to = torch.from_numpy(p), torch.from_numpy(q), torch.from_numpy(o)

            def torch_resid(tp: Any = tp, tq: Any = tq, to: Any = to) -> None:
                torch.sub(tp, tq, out=to).clamp_min_(0)
                to.div_(to.sum())

            res["torch (1 thread)"] = time_py(torch_resid, v, samples)
        if dll is not None:
            ptr = [a.ctypes.data for a in (p, q, o)]
            res["C naive -O3"] = dll.bench(0, *ptr, v, samples, inner_for(v))
            res["C AVX2 intrinsics x4"] = dll.bench(1, *ptr, v, samples, inner_for(v))
        for b in backends:
            R.set_backend(b)

            def dist(p: Array = p, q: Array = q, o: Array = o) -> None:
                R.residual_dist(p, q, o)

            def sample(p: Array = p, q: Array = q) -> None:
                R.residual_sample(p, q, 0.5)

            res[f"flashspec {b}"] = time_py(dist, v, samples)
            res[f"flashspec {b} sample"] = time_py(sample, v, samples)
        R.set_backend(backends[-1])
        rows.append({"V": v, "ns": res})

    best = backends[-1]
    return {
        "kind": "kernel",
        "quick": quick,
        "samples": samples,
        "rows": rows,
        "summary": summarise(rows, best),
    }


def summarise(rows: list[dict[str, Any]], best: str) -> dict[str, Any]:
    """Ratios against the kernel issue's targets."""
    by_v = {r["V"]: r["ns"] for r in rows}
    s: dict[str, Any] = {"best_backend": best}
    r32 = by_v.get(32000)
    if r32 is not None:
        b = r32[f"flashspec {best}"]
        if "C naive -O3" in r32:
            s["speedup_vs_naive_C@32000 (target >= 5)"] = round(r32["C naive -O3"] / b, 2)
        s["speedup_vs_numpy@32000 (target >= 7)"] = round(r32["numpy"] / b, 2)
        s["ratio_to_floor@32000 (target <= 2.2)"] = round(b / r32["floor: np.subtract"], 2)
    if rows and "C AVX2 intrinsics x4" in rows[0]["ns"]:
        s["never_slower_than_intrinsics (target true)"] = {
            v: round(by_v[v]["C AVX2 intrinsics x4"] / by_v[v][f"flashspec {best}"], 2)
            for v in by_v
        }
    s["sample_over_dist (target <= 0.75 for V >= 32000)"] = {
        v: round(by_v[v][f"flashspec {best} sample"] / by_v[v][f"flashspec {best}"], 2)
        for v in by_v
    }
    if 1024 in by_v:
        s["python_call_ns@1024 (target <= 400)"] = round(by_v[1024][f"flashspec {best}"], 1)
    return s


def table(data: dict[str, Any]) -> str:
    """Median µs per call, one line per implementation."""
    rows = data["rows"]
    names = list(rows[0]["ns"].keys())
    width = max(len(n) for n in names)
    lines = ["median time per call (us)", " " * width + "".join(f"{r['V']:>11}" for r in rows)]
    for n in names:
        lines.append(n.ljust(width) + "".join(f"{r['ns'][n] / 1000:>11.2f}" for r in rows))
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path, plt: Any) -> None:
    """Time per call against V, one line per implementation, log-log."""
    rows = data["rows"]
    vs = [r["V"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(rows[0]["ns"])
    # tab20: more implementations than the default cycle has colours.
    colours = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        style = "--" if name.startswith(("C ", "floor")) else "-"
        ax.plot(
            vs,
            [r["ns"][name] / 1000 for r in rows],
            style,
            marker="s" if "sample" in name else "o",
            color=colours(i % 20),
            label=name,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("V (vocabulary size)")
    ax.set_ylabel("median µs per call")
    machine = data.get("machine", {})
    ax.set_title(f"residual max(0, p-q)/Σ: time per call\n{machine.get('cpu', '')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HELP = "residual kernel vs NumPy, torch and C"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench kernel`` (besides ``--quick``, ``--out-dir`` and
    ``--no-progress``)."""
    parser.add_argument("--name", default="kernel", help="result file stem (default kernel)")


def main(args: argparse.Namespace) -> int:
    """``flashspec bench kernel``: run, print the table and the ratios, write JSON and plot."""
    data = {"machine": machine_info(), **run(args.quick, not args.no_progress)}
    out = Path(args.out_dir)
    print(table(data))
    print("\nAgainst the kernel issue's targets (ratios in this run):")
    for key, value in data["summary"].items():
        print(f"  {key}: {value}")
    write_json(data, out / f"{args.name}.json")
    plt = pyplot()
    if plt is not None:
        plot(data, out / f"{args.name}.png", plt)
        print(f"wrote {out / f'{args.name}.png'}", file=sys.stderr)
    return 0
