"""Attention caches that grow in place: each layer's keys and values are prefix views of one
preallocated buffer, so a step writes only its new columns.

transformers' ``DynamicLayer`` concatenates every step: the whole cache is copied each
forward, a cost that grows with the context and the batch (about an eighth of a ragged round
of the demo pair at 16 rows). ``StoreLayer`` keeps the same tensors' meaning (``keys`` and
``values`` are ``(B, H, T, D)``, what transformers and flashspec's layout code read and
replace) and changes only where they live: ``update`` copies the new columns after the
layer's current ones inside a buffer with room to spare (growing it geometrically), and
returns views. Whatever replaced a layer's tensors since (a crop's shorter view, a batch
selection or column gather's new tensors) is adopted at the next update: a view of the
buffer is used as it is, anything else is copied into it.

A view handed out earlier may see later columns written past its end; never what it shows,
since a write only goes past the layer's current length. The values are those
concatenation gives, bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ENV = "FLASHSPEC_KV_STORE"
"""Set to ``0`` to keep transformers' concatenating layers."""

_GROW = 64
"""Least columns of room a buffer is made with past what a step needs."""


def _layer_class() -> Any:
    from transformers.cache_utils import DynamicLayer

    class StoreLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # an untyped base
        """A ``DynamicLayer`` whose keys and values are views of a growing buffer."""

        _store_k: torch.Tensor | None = None
        _store_v: torch.Tensor | None = None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if torch.compiler.is_compiling() or (
                torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
            ):
                # Training through a cache (scripts/train_draft.py) needs every step's tensors
                # kept as they were, and a traced graph no pointers: concatenate there.
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys: Any = self.keys
            values: Any = self.values
            past = int(keys.shape[-2]) if keys.dim() == 4 else 0
            new = int(key_states.shape[-2])
            store_k, store_v = self._store_k, self._store_v
            fits = (
                store_k is not None
                and store_v is not None
                and past + new <= store_k.shape[-2]
                and tuple(store_k.shape[:2]) == tuple(key_states.shape[:2])
                and store_k.dtype == key_states.dtype
                and store_k.device == key_states.device
                and (past == 0 or (_views(keys, store_k) and _views(values, store_v)))
            )
            if not fits:
                b, h, _, d = key_states.shape
                capacity = past + new + max(_GROW, (past + new) // 2)
                store_k = key_states.new_empty((b, h, capacity, d))
                store_v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
                if past:
                    store_k[:, :, :past].copy_(keys)
                    store_v[:, :, :past].copy_(values)
                self._store_k, self._store_v = store_k, store_v
            assert store_k is not None and store_v is not None
            store_k[:, :, past : past + new].copy_(key_states)
            store_v[:, :, past : past + new].copy_(value_states)
            self.keys = store_k[:, :, : past + new]
            self.values = store_v[:, :, : past + new]
            return self.keys, self.values

        def reset(self) -> None:
            self._store_k = self._store_v = None
            super().reset()

    return StoreLayer


def _views(tensor: torch.Tensor, store: torch.Tensor) -> bool:
    """Whether ``tensor`` is the first columns of ``store`` (the same memory and strides)."""
    return (
        tensor.dim() == 4
        and tensor.data_ptr() == store.data_ptr()
        and tensor.stride() == store.stride()
        and tuple(tensor.shape[:2]) == tuple(store.shape[:2])
        and tensor.shape[-1] == store.shape[-1]
    )


_CLASS: list[Any] = []


def store_layer_class() -> Any:
    """``StoreLayer``, a subclass of transformers' ``DynamicLayer`` (made on first use)."""
    if not _CLASS:
        _CLASS.append(_layer_class())
    return _CLASS[0]


def plain_layer_types() -> tuple[type, ...]:
    """transformers' ``DynamicLayer`` and ``StoreLayer``: the layers whose columns are all
    kept (not a sliding window's), which flashspec's layout code may crop, gather and shift."""
    from transformers.cache_utils import DynamicLayer

    return (DynamicLayer, store_layer_class())


def grow_in_place(cache: Any) -> int:
    """Make every plain ``DynamicLayer`` of ``cache`` a ``StoreLayer`` (before it holds
    anything); returns how many. Other layer kinds (sliding windows, static, recurrent)
    stay as they are. ``FLASHSPEC_KV_STORE=0``: none."""
    from transformers.cache_utils import DynamicLayer

    if os.environ.get(ENV, "").strip() == "0":
        return 0
    store = store_layer_class()
    changed = 0
    for layer in getattr(cache, "layers", None) or ():
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layer.__class__ = store
            changed += 1
    return changed


__all__ = ["ENV", "grow_in_place", "plain_layer_types", "store_layer_class"]
