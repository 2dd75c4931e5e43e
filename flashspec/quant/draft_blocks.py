"""A draft's layers on Q8_0 blocks, so it runs the C decoder step beside a quantized target.

A features draft attached to a quantized target computes in float32 (the target's head and
states are float32), and each of its steps ran transformers' module by module: for
SmolLM2's one-layer draft that was a quarter of a target step, paid once a drafted token.
``run_on_blocks`` quantizes the draft's seven projections of every decoder layer to Q8_0
(GGML's own rule: one fp16 scale a block of 32, ``round(w / d)`` with ``d = max|w| / 127``)
and gives the draft the lean forward and the fused C step the target runs.

This changes the draft's proposals slightly, never the output: the target verifies every
token exactly whatever the draft proposes. ``FLASHSPEC_DRAFT_BLOCKS=0`` keeps the draft's
float layers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .decoder import attach
from .layers import QuantLinear

ENV = "FLASHSPEC_DRAFT_BLOCKS"
"""Set to ``0`` to run a draft beside a quantized target on its float layers."""

Q8_0 = 8  # GGML type id
_BLOCK = 32
_LEVELS = 127.0
_PROJECTIONS = (
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
    ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"),
)  # fmt: skip


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """(n, k) float weights (k a multiple of 32) as (n, k / 32 * 34) uint8 Q8_0 blocks: per
    32 weights an fp16 scale ``d = max|w| / 127`` and int8 ``round(w / d)`` (halves away from
    zero, as GGML's reference quantizer)."""
    n, k = (int(s) for s in weight.shape)
    if k % _BLOCK:
        raise ValueError(f"weight: {k} columns, not a multiple of {_BLOCK}")
    w = weight.detach().to(torch.float32).cpu().numpy().reshape(n, k // _BLOCK, _BLOCK)
    d = np.abs(w).max(axis=-1, keepdims=True) / np.float32(_LEVELS)  # (n, kb, 1)
    inverse = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    scaled = w * inverse
    q = np.clip(np.trunc(scaled + np.copysign(np.float32(0.5), scaled)), -128, 127)
    out = np.empty((n, k // _BLOCK, 2 + _BLOCK), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8)
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return torch.from_numpy(out.reshape(n, -1))


def _linear_fits(linear: Any) -> bool:
    weight = getattr(linear, "weight", None)
    return (
        type(linear) is torch.nn.Linear
        and linear.bias is None
        and isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and int(weight.shape[1]) % _BLOCK == 0
    )


def enabled() -> bool:
    """Whether drafts beside a quantized target run on blocks (``ENV`` not ``0``)."""
    return os.environ.get(ENV, "").strip() != "0"


def run_on_blocks(draft: torch.nn.Module) -> bool:
    """Quantize ``draft``'s decoder-layer projections to Q8_0 and attach the fused C step;
    False (the draft unchanged) when switched off, or when a layer is not one the C step
    runs (then its float layers stay)."""
    if not enabled():
        return False
    from .._lean import make_lean
    from .decoder import llama_decoder

    models = [m for m in draft.modules() if llama_decoder(m)]
    if len(models) != 1:
        return False
    model: Any = models[0]
    layers: list[Any] = list(model.layers[: model.config.num_hidden_layers])
    parts = [getattr(getattr(layer, a), b) for layer in layers for a, b in _PROJECTIONS]
    if not layers or not all(_linear_fits(linear) for linear in parts):
        return False
    for layer in layers:
        for owner_name, name in _PROJECTIONS:
            owner = getattr(layer, owner_name)
            weight = getattr(owner, name).weight
            setattr(owner, name, QuantLinear(q8_0_blocks(weight), Q8_0, int(weight.shape[1])))
    make_lean(draft)
    return attach(draft) == 1


__all__ = ["ENV", "enabled", "q8_0_blocks", "run_on_blocks"]
