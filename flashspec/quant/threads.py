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


def share_cores(model: torch.nn.Module, fused: bool = False) -> None:
    """Make ``model``'s forward run torch's ops on one thread when it multiplies few rows, or
    (``fused``: its layers run in one C call, ``flashspec.quant.decoder``) any single row."""
    if os.environ.get(ENV, "").lower() == "keep":
        return
    forward = model.forward

    @functools.wraps(forward)
    def run(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        rows, batch = _rows(args, kwargs)
        few = rows <= DENSE_ROWS or (fused and batch == 1)
        if torch.compiler.is_compiling() or not few:
            return forward(*args, **kwargs)
        with torch_threads(1):
            return forward(*args, **kwargs)

    model.forward = types.MethodType(run, model)
