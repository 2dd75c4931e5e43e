"""Static KV caches for the compiled path: preallocated key/value buffers of a fixed width.

A ``CausalLM`` on the compiled path keeps its columns in a transformers ``StaticCache`` whose
layers hold (rows, heads, capacity, head_dim) buffers. The columns in use are the cache's
``RowLayout`` width; a crop only lowers that width (the next forward writes over the columns
after it), so nothing is copied. Columns past the width hold stale keys from earlier forwards
or generations; the attention mask never lets a query see them (``step.attention_mask``).

Capacities come in buckets (``capacity_for``): the buffers, and with them the compiled graphs,
are reused by every generation that fits, instead of one shape per prompt length.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kv.compat import new_cache

MIN_COLUMNS = 256
"""The smallest capacity: short generations share one bucket (and its compiled graphs)."""


def capacity_for(columns: int) -> int:
    """The bucket for a generation that needs ``columns`` columns: the next power of two, at
    least ``MIN_COLUMNS``."""
    capacity = MIN_COLUMNS
    while capacity < columns:
        capacity *= 2
    return capacity


def new_static_cache(model: torch.nn.Module, capacity: int) -> Any:
    """An empty ``StaticCache`` of ``capacity`` columns for ``model`` (its buffers are made by
    the first forward, which the caller runs eager)."""
    from transformers import StaticCache

    config: Any = getattr(model, "config", None)
    return StaticCache(config=config, max_cache_len=capacity)


def static_capacity(cache: Any) -> int | None:
    """The capacity of a ``StaticCache``-like cache (None for any other cache)."""
    layers = getattr(cache, "layers", None)
    # Every layer of a StaticCache has the same capacity (it is built from one max_cache_len);
    # the first tells, which keeps this check off the per-forward path's cost.
    if not layers or not hasattr(layers[0], "max_cache_len"):
        return None
    return int(layers[0].max_cache_len)


def initialized(cache: Any) -> bool:
    """Whether the layers' buffers exist (one forward makes every layer's, the last layer's
    last)."""
    return bool(getattr(cache.layers[-1], "is_initialized", False))


def to_dynamic(cache: Any, width: int, model: torch.nn.Module, rows: int | None = None) -> Any:
    """A dynamic cache holding the first ``width`` columns of static ``cache`` (copied; of its
    first ``rows`` slots, all when None), for the eager operations a static layout has no room
    for (more rows than slots, more columns than its capacity)."""
    dynamic = new_cache(model)
    if width == 0 or not initialized(cache) or rows == 0:
        return dynamic
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys[:rows, :, :width], layer.values[:rows, :, :width]
        dynamic.update(keys.clone(), values.clone(), index)
    return dynamic
