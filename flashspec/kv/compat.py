"""Differences between transformers releases, kept in one place.

transformers 5.x renamed the forward argument ``past_key_values`` to ``cache`` (and the output
field likewise), and changed ``Cache.crop`` from "crop to this length" to "remove this many".
Everything in flashspec goes through the helpers below.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .mamba1 import OWNED_CACHE
from .state import UnsupportedModelError
from .store import grow_in_place


@dataclass(frozen=True)
class ForwardSignature:
    """Which optional arguments a model's ``forward`` accepts."""

    cache_arg: str
    position_ids: bool
    attention_mask: bool
    logits_to_keep: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> ForwardSignature:
        """The signature of ``model.forward``.

        Raises:
            UnsupportedModelError: the forward takes no cache argument.
        """
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            cache_arg = "cache"
        elif "past_key_values" in params:
            cache_arg = "past_key_values"
        else:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                "flashspec needs a causal LM with a KV cache"
            )
        return cls(
            cache_arg=cache_arg,
            position_ids="position_ids" in params,
            attention_mask="attention_mask" in params,
            logits_to_keep="logits_to_keep" in params,
        )


def new_cache(model: torch.nn.Module) -> Any:
    """A fresh, croppable dynamic cache for ``model``."""
    from transformers import DynamicCache

    config: Any = getattr(model, "config", None)
    cache: Any
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # releases before the config argument
        cache = DynamicCache()
    # Sliding-window layers drop old states unless told to keep them until the next crop.
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    # Marks the cache as flashspec's: mixers it patched (``mamba1``) behave as shipped on others.
    setattr(cache, OWNED_CACHE, True)
    grow_in_place(cache)  # each step writes its new columns only (kv.store)
    return cache


_CROP_TAKES_COUNT = (
    "tokens_to_remove"
    in inspect.signature(importlib.import_module("transformers").DynamicCache.crop).parameters
)


def crop_cache(cache: Any, remove: int) -> None:
    """Drop the last ``remove`` positions of every layer.

    Both crop conventions accept a negative count as "remove this many"; the old one reads
    ``crop(0)`` as "keep nothing", so zero is only passed where it means "trim sliding layers".
    Layers that hold nothing yet are skipped (see ``_crop``).
    """
    if remove > 0:
        _crop(cache, -remove)
    elif remove == 0 and _CROP_TAKES_COUNT and any(getattr(cache, "is_sliding", ())):
        _crop(cache, 0)


def _crop(cache: Any, count: int) -> None:
    layers: list[Any] = list(getattr(cache, "layers", None) or ())
    empty = [_empty(layer) for layer in layers] if _CROP_TAKES_COUNT else []
    if not any(empty):
        cache.crop(count)
        return
    # transformers' DynamicSlidingWindowLayer.crop reads ``keys.shape`` of a layer that was never
    # filled (keys None) and raises: a drafter that no round has run yet holds no keys at all,
    # so the layers without any are left out (there is nothing in them to crop).
    for layer, skip in zip(layers, empty, strict=True):
        if not skip:
            layer.crop(count)


def _empty(layer: Any) -> bool:
    """An attention layer that has not received keys yet (hybrid layers, which also hold conv
    and recurrent state, are never skipped)."""
    return getattr(layer, "is_initialized", True) is False and not hasattr(layer, "conv_states")


def has_sliding_layers(cache: Any) -> bool:
    """Whether ``cache`` has sliding-window layers that need a ``crop(0)`` trim after rollbacks."""
    return _CROP_TAKES_COUNT and any(getattr(cache, "is_sliding", ()))


def select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only the batch rows in ``index`` (in that order)."""
    cache.batch_select_indices(index)
