"""A target's linear layers on the CPU, each taking a few rows in the faster of two forms.

A verification multiplies every weight by a few rows (gamma + 1 tokens a row of the batch).
In float32 on a CPU, torch's ``x @ W.T`` for 2 to 10 rows can cost as much per row as one row
does, while the same product taken as ``(W @ x.T).T`` costs little more than one row: which
form is faster depends on the BLAS and the CPU (docs/engine.md, "Linear layers on the CPU"), so
``tune_linears`` times both once per weight shape and row count when a target loads, and a
layer takes the transposed form only for the row counts where it measured clearly faster. One
row (plain decoding) and long inputs (prompts) always take torch's own form.

The two forms sum in different orders, so logits differ within float32 rounding, as they do
between a one-token step and a batched verification already; greedy identity is checked with
ties at that rounding counted as equal (``flashspec._greedy``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from .._lean import hf_forward

logger = logging.getLogger("flashspec")

TUNED_ROWS = range(2, 11)
"""Row counts timed: a verification of gamma + 1 <= 10 tokens for one row, or of a few rows."""
MIN_WEIGHT = 1 << 18
"""Weights with fewer elements are left as they are: their products take microseconds, too
little to time apart reliably or to matter next to a round."""
MIN_GAIN = 1.1
"""The transposed form is taken for a row count only where torch's form took this many times
as long (medians): less is within the timing noise of a loaded machine."""
REPEATS = 3
ALTERNATIONS = 3
"""Each form is timed this many times, alternately, ``REPEATS`` calls each time."""
DISABLE_ENV = "FLASHSPEC_TUNE_LINEAR"
"""Set to ``0`` to leave every linear layer as torch has it."""

Timer = Callable[[Callable[[], object]], float]


class TunedLinear(torch.nn.Linear):
    """``nn.Linear`` whose product for ``transposed_rows`` rows is taken as ``(W @ x.T).T``."""

    transposed_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        if rows not in self.transposed_rows:
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ x.reshape(rows, width).T).T
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def median_seconds(call: Callable[[], object]) -> float:
    """``call``'s median wall time over ``REPEATS`` runs after one untimed run."""
    call()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def faster_rows(
    weight: torch.Tensor, rows: Iterable[int] = TUNED_ROWS, timer: Timer = median_seconds
) -> frozenset[int]:
    """The row counts for which ``(W @ x.T).T`` measured ``MIN_GAIN`` times faster than
    ``F.linear`` on ``weight``."""
    chosen: set[int] = set()
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
            plain: list[float] = []
            transposed: list[float] = []
            for _ in range(ALTERNATIONS):  # alternated: a load that comes and goes hits both
                plain.append(timer(lambda: F.linear(x, weight)))  # noqa: B023  (x is current)
                transposed.append(timer(lambda: (weight @ x.T).T))  # noqa: B023
            if statistics.median(plain) >= MIN_GAIN * statistics.median(transposed):
                chosen.add(n)
    return frozenset(chosen)


def tune_linears(
    model: torch.nn.Module,
    *,
    min_weight: int = MIN_WEIGHT,
    rows: Iterable[int] = TUNED_ROWS,
    timer: Timer = median_seconds,
) -> int:
    """Give ``model``'s float32 CPU linear layers of at least ``min_weight`` elements the faster
    form per row count (timed once per weight shape); returns how many layers changed."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return 0
    layers = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and m.weight.numel() >= min_weight
    ]
    if not layers:
        return 0
    start = time.perf_counter()
    counts = list(rows)
    by_shape: dict[tuple[int, int], frozenset[int]] = {}
    changed = 0
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        if shape not in by_shape:
            by_shape[shape] = faster_rows(layer.weight.detach(), counts, timer)
        if by_shape[shape]:
            layer.__class__ = TunedLinear
            setattr(layer, "transposed_rows", by_shape[shape])  # noqa: B010  (its class changed)
            changed += 1
    logger.info(
        "flashspec: %d of %d float32 linear layers take (W @ x.T).T for some row counts "
        "(timed per shape at load in %.1f s: %s); %s=0 turns this off",
        changed,
        len(layers),
        time.perf_counter() - start,
        ", ".join(f"{s[0]}x{s[1]}: {sorted(r) or 'none'}" for s, r in by_shape.items()),
        DISABLE_ENV,
    )
    return changed


@contextlib.contextmanager
def untuned(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with torch's own linear layers and transformers' own decoder forward
    (``flashspec._lean``) while inside (benchmarks run HF's ``generate`` on a target's weights
    as HF has them), tuned again after."""
    tuned: list[torch.nn.Module] = [m for m in model.modules() if type(m) is TunedLinear]
    for layer in tuned:
        layer.__class__ = torch.nn.Linear
    try:
        with hf_forward(model):
            yield model
    finally:
        for layer in tuned:
            layer.__class__ = TunedLinear
