"""Cores for the quantized kernels during a forward: torch's own ops run on one thread.

The kernels (``flashspec._quant``) split each product over their own small thread pool, and
torch splits its elementwise ops over its OpenMP threads, which keep spinning for a while after
each op. On a machine with few cores the two sets of threads take each other's cores in turn
and a decoding step slows several-fold (docs/quantized.md), while the ops of such a step are
small: the products are where its time goes. So a quantized model's forward runs torch at one
thread for few-token calls and gives the rest back after; a prompt's prefill (more rows than the
kernels take: dense BLAS products) keeps torch's threads.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

from .ops import DENSE_ROWS

ENV = "FLASHSPEC_QUANT_TORCH_THREADS"
"""Set to ``keep`` to leave torch's thread count alone during a quantized forward."""


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` while inside, restored after."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """Token positions in a forward call (batch x length of its ids or embeddings), and its
    batch size."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]) * int(value.shape[1]), int(value.shape[0])
    return 1, 1


_SINGLE_ROW_ROUNDS = "_flashspec_single_row_rounds"
_SHARES_CORES = "_flashspec_shares_cores"  # set by share_cores: whether its layers are fused


def _few(rows: int, batch: int, fused: bool) -> bool:
    return rows <= DENSE_ROWS or (fused and batch == 1)


def share_cores(model: torch.nn.Module, fused: bool = False) -> None:
    """Make ``model``'s forward run torch's ops on one thread when it multiplies few rows, or
    (``fused``: its layers run in one C call, ``flashspec.quant.decoder``) any single row;
    with ``fused``, ``round_threads`` also keeps a whole one-row engine round on one thread."""
    if os.environ.get(ENV, "").lower() == "keep":
        return
    forward = model.forward
    if fused:
        model.__dict__[_SINGLE_ROW_ROUNDS] = True
    model.__dict__[_SHARES_CORES] = fused

    @functools.wraps(forward)
    def run(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        rows, batch = _rows(args, kwargs)
        if torch.compiler.is_compiling() or not _few(rows, batch, fused):
            return forward(*args, **kwargs)
        with torch_threads(1):
            return forward(*args, **kwargs)

    model.forward = types.MethodType(run, model)


def forward_threads(model: Any, rows: int, batch: int) -> contextlib.AbstractContextManager[None]:
    """What ``share_cores``' forward does around a call of ``rows`` positions in ``batch``
    rows, for a caller that runs the model's parts itself (``flashspec._lean.lean_logits``):
    torch at one thread, or nothing."""
    fused = getattr(model, "__dict__", {}).get(_SHARES_CORES)
    if fused is None or not _few(rows, batch, fused):
        return contextlib.nullcontext()
    return torch_threads(1)


def round_threads(model: Any, rows: int) -> contextlib.AbstractContextManager[None]:
    """torch at one thread for an engine round of one row whose target ``share_cores`` marked
    fused, else nothing. A drafter's own torch forward between the target's calls leaves
    torch's OpenMP threads spinning on the cores the kernels' pool needs next: measured on
    SmolLM2 with its shipped draft, a verification of 3 rows took 13.4 ms after a draft run
    on 2 torch threads and 7.7 ms on one (the fused step alone: 7.9 ms)."""
    if rows == 1 and getattr(model, "__dict__", {}).get(_SINGLE_ROW_ROUNDS, False):
        return torch_threads(1)
    return contextlib.nullcontext()
