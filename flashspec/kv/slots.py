"""A ragged batch's columns in a static cache of fixed slots (the compiled path's batches).

A ``StaticCache`` built for ``slots`` rows holds (slots, heads, capacity, head_dim) buffers that
never change shape, so a compiled graph per (slots, tokens, capacity) serves every batch of up
to ``slots`` rows. The batch's rows sit in slots 0..B-1, in the order of the ``RowLayout``;
slots B..slots-1 are spare (their queries read a spare token, their columns are nobody's). The
layout's bookkeeping is the dynamic cache's (``flashspec.kv.layout``); only the moves of keys
and values differ: each writes into the same buffers instead of building new tensors, so the
buffers' addresses, which the graphs were compiled for, stay the same.

Stale keys and values in columns no row owns stay finite (the buffers start as zeros and are
only ever written with a forward's outputs), so the attention mask can hide them: a masked
score takes no weight, and a finite value times a zero weight adds nothing.
"""

from __future__ import annotations

from typing import Any

import torch

SLOT_BUCKETS = (1, 2, 4, 8)
"""Slot counts a static batch cache is built with: a batch takes the smallest that holds it
(one set of graphs per bucket, not per batch size). A larger batch runs eager, which
``flashspec bench batch`` measured faster than 16- and 32-slot graphs (docs/engine.md)."""


def slot_count(rows: int) -> int | None:
    """The slots of a static cache for a batch of ``rows`` rows, or None: too many rows for
    the compiled path (the batch runs eager)."""
    return next((slots for slots in SLOT_BUCKETS if slots >= rows), None)


def _layers(cache: Any) -> list[Any]:
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]


def gather_slot_columns(cache: Any, source: torch.Tensor) -> None:
    """Row b (slot b) becomes its columns ``source[b]`` (B, width'), in that order, written from
    column 0 of its slot (``layout.gather_columns`` in place)."""
    rows, width = source.shape
    for layer in _layers(cache):
        capacity = layer.keys.shape[-2]
        flat = (source + torch.arange(rows, device=source.device).unsqueeze(1) * capacity).view(-1)
        for x in (layer.keys, layer.values):
            heads, dim = x.shape[1], x.shape[3]
            pairs = x[:rows].transpose(1, 2).reshape(rows * capacity, heads * dim)
            taken = pairs.index_select(0, flat).view(rows, width, heads, dim).transpose(1, 2)
            x[:rows, :, :width] = taken


def select_slots(cache: Any, index: torch.Tensor) -> None:
    """The rows ``index`` (in that order) move to slots 0..len(index)-1; the other slots are
    spare from now on."""
    if index.numel() and torch.equal(index, torch.arange(index.numel(), device=index.device)):
        return  # the first rows stay where they are
    for layer in _layers(cache):
        for x in (layer.keys, layer.values):
            x[: index.numel()] = x.index_select(0, index)  # index_select copies first


def shift_slot_columns(cache: Any, rows: int, width: int, count: int) -> None:
    """The first ``width`` columns of slots 0..rows-1 move ``count`` columns right (the
    layout's ``pad``: new dead columns in front)."""
    if count <= 0 or rows == 0 or width == 0:
        return
    for layer in _layers(cache):
        for x in (layer.keys, layer.values):
            x[:rows, :, count : count + width] = x[:rows, :, :width].clone()


def write_slot_rows(cache: Any, other: Any, first: int, width: int) -> None:
    """The rows of dynamic cache ``other`` (its ``w`` columns each) go to slots first..., at
    columns ``width - w .. width - 1`` (a joining batch's cache padded in front to ``width``)."""
    for layer, extra in zip(cache.layers, other.layers, strict=True):
        keys = getattr(extra, "keys", None)
        if keys is None or keys.dim() != 4 or not getattr(layer, "is_initialized", False):
            continue
        count, columns = keys.shape[0], keys.shape[-2]
        layer.keys[first : first + count, :, width - columns : width] = keys
        layer.values[first : first + count, :, width - columns : width] = extra.values


def grow_slots(old: Any, new: Any, rows: int, width: int, slots: int) -> None:
    """The first ``width`` columns of static cache ``old``'s first ``rows`` slots, copied into
    the same slots of static cache ``new`` (``slots`` slots, at least as many columns; its
    buffers are made here if no forward made them yet): a batch that outgrew its slots or its
    capacity moves into a larger bucket."""
    for source, layer in zip(old.layers, new.layers, strict=True):
        if not getattr(source, "is_initialized", False):
            continue
        if not getattr(layer, "is_initialized", False):
            heads, k_dim, v_dim = source.keys.shape[1], source.keys.shape[3], source.values.shape[3]
            layer.lazy_initialization(
                source.keys.new_zeros((slots, heads, 1, k_dim)),
                source.values.new_zeros((slots, heads, 1, v_dim)),
            )
        if rows and width:
            layer.keys[:rows, :, :width] = source.keys[:rows, :, :width]
            layer.values[:rows, :, :width] = source.values[:rows, :, :width]


def slot_rows(cache: Any) -> int | None:
    """The slots of a static cache's buffers (None before the first forward made them)."""
    layers = _layers(cache)
    return int(layers[0].keys.shape[0]) if layers else None
