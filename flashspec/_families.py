"""Model families that flashspec refuses, or batches only in part, for reasons outside their
cache layers (``flashspec.kv.state`` judges those): a forward that does not decode from the
tokens after its cache, a cache class of the family's own, attention that is not causal, and
positions that do not follow left padding.

Each entry is backed by tests/models/test_arch_sweep.py, which builds a tiny model of every
causal-LM architecture transformers ships and compares flashspec with the model's own greedy
``generate``; an architecture that breaks in a new transformers release shows up there.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv.state import UnsupportedModelError

REFUSED: dict[str, str] = {
    "cpmant": (
        "its forward reads the whole sequence on every call and cuts off itself what its cache "
        "holds, so it cannot be fed only the tokens after the cache"
    ),
    "xlm": (
        "transformers generates with it by appending a mask token to the whole sequence at "
        "every step, without a cache: it is not decoded as a causal LM"
    ),
    "prophetnet": (
        'its decoder takes one token at a time after a cached state (transformers: "use_cache '
        'is only supported for decoder_input_ids of length 1"), and verification feeds several'
    ),
}
"""Refused in every role, by ``model_type``, with the reason."""

POSITIONS_FROM_CONTENT = frozenset({"bloom", "mpt", "mamba", "mamba2", "falcon_mamba", "roformer"})
"""Families whose forward takes no ``position_ids`` and whose rows are still unaffected by left
padding: ALiBi biases taken from the attention mask (Bloom, MPT), no positions at all (Mamba,
Mamba2, FalconMamba), rotary phases that only enter as differences (RoFormer)."""

PADDED_BATCHES: dict[str, str] = {
    "git": (
        "GitModel widens a padding mask over image tokens it expects in the cache, which a "
        "text-only generation does not have, so the padding of a row is masked in the wrong "
        "columns (transformers' own batched generate differs from single rows too)"
    ),
}
"""Families whose rows of different lengths cannot share a batch, with the reason (beyond the
rule for models without ``position_ids``, ``padded_batch_refusal``)."""

CAUSALITY_TOLERANCE = 1e-3
"""``check_family``'s probe: how far an earlier position's logits may move, relative to the
largest logit (at least 1), when a later token changes. A causal model moves them by rounding
at most; attention that sees both ways moves them by the model's own scale."""


def model_type(model: torch.nn.Module) -> str:
    """The ``model_type`` of ``model``'s config ("" when it has none)."""
    return str(getattr(getattr(model, "config", None), "model_type", ""))


def check_family(model: torch.nn.Module, role: str) -> None:
    """Refuse ``model`` (as ``role``: "target" or "drafter") when its family cannot be decoded
    exactly whatever its cache: listed in ``REFUSED``, given a cache class of its own by
    transformers, or not causal. Call it on a model in eval mode.

    Raises:
        UnsupportedModelError: naming the model class, its ``model_type`` and the reason.
    """
    name = type(model).__name__
    kind = model_type(model)
    reason = REFUSED.get(kind)
    if reason is not None:
        raise UnsupportedModelError(f"{name} (model_type {kind!r}) cannot be a {role}: {reason}")
    dynamic = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(dynamic) and not dynamic():
        # transformers' own list of the models it never gives a DynamicCache (RWKV, xLSTM,
        # Reformer, XLNet, the linear-attention MiniMax): they keep their state in a cache
        # class of their own, which flashspec's DynamicCache would be handed in its place.
        raise UnsupportedModelError(
            f"{name} (model_type {kind!r}) cannot be a {role}: transformers runs it on a cache "
            "class of its own, not a DynamicCache, and flashspec can only roll back the cache "
            "layers transformers shares across models"
        )
    _check_causal(model, role)


def _check_causal(model: torch.nn.Module, role: str) -> None:
    """Refuse a model whose attention sees later tokens (an encoder's LM head built without
    ``is_decoder=True``): verification scores every draft in one forward, where such a model
    lets each draft see the ones after it.

    Only a config that says ``is_decoder=False`` is probed (encoder families whose attention
    follows that flag; a family that ignores it passes): one forward of two 6-token rows that
    differ in their last token."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "is_decoder", None) is not False:
        return
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 8:
        return  # no room for the probe's ids; nothing real is this small
    device = next(model.parameters()).device
    ids = torch.arange(1, 7, device=device).unsqueeze(0).repeat(2, 1)
    ids[1, -1] = 7  # the rows differ only in their last token
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    moved = float((logits[0, :-1] - logits[1, :-1]).abs().max())
    scale = max(float(logits.abs().max()), 1.0)
    if moved > CAUSALITY_TOLERANCE * scale:
        name = type(model).__name__
        raise UnsupportedModelError(
            f"{name} (model_type {model_type(model)!r}) cannot be a {role}: it is not causal. "
            f"Its logits at earlier positions change with a later token (by {moved:.3g}): its "
            "config has is_decoder=False, so its attention sees both ways. Build it with "
            "is_decoder=True to run it as a causal LM"
        )


def padded_batch_refusal(model: torch.nn.Module, takes_position_ids: bool) -> str | None:
    """Why rows of different lengths (left padded) cannot share a batch of ``model``'s, or
    None when they can.

    A forward without ``position_ids`` counts positions from the cache's length, so a row
    padded by p columns gets positions p higher than alone: exact only where positions do not
    matter that way (``POSITIONS_FROM_CONTENT``)."""
    kind = model_type(model)
    reason = PADDED_BATCHES.get(kind)
    if reason is not None:
        return reason
    if not takes_position_ids and kind not in POSITIONS_FROM_CONTENT:
        return (
            "its forward takes no position_ids and counts positions from the cache's length, so "
            "a row padded on the left would be read at shifted positions"
        )
    return None
