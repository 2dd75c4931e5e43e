"""Exact multi-token forwards for transformers' Mamba-1 mixers (Mamba, FalconMamba, Jamba).

Their PyTorch path runs the selective scan from a zero state whenever several tokens are fed,
even after a cached state ("Initial hidden state is not supported"), so one verify forward over
the drafts gives other logits than decoding one token at a time. ``patch`` makes a model's
mixers pass their cached state to the scan as its initial state. It does so only in a forward
over a cache flashspec made (``OWNED_CACHE``); other callers get the mixers as shipped.

The scan itself (``_scan_from``) is the recurrence of the Mamba paper (Gu & Dao 2023, Alg. 2)
written from its equations: h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t, y_t = C_t h_t + D x_t,
gated by silu(z_t). It starts from h_0, the cached state.
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

import torch
import torch.nn.functional as F

OWNED_CACHE = "_flashspec_owned"
"""Attribute set on every cache flashspec makes (``flashspec.kv.compat.new_cache``)."""
MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
_SCAN = "mamba_selective_scan"  # the module-level function each mixer's module calls
_initial = threading.local()  # the state the next scan call in this thread starts from


def patch(model: torch.nn.Module) -> bool:
    """Make every Mamba-1 mixer of ``model`` exact on multi-token inputs after a cached state.

    Returns whether that holds for every such mixer (False when none is found, or when a
    mixer's module has no scan function of the expected name and signature).
    """
    mixers = [m for m in model.modules() if type(m).__name__ in MIXERS]
    if not mixers:
        return False
    for mixer in mixers:
        if getattr(mixer, "_flashspec_patched", False):
            continue
        module = sys.modules.get(type(mixer).__module__)
        if not isinstance(getattr(mixer, "layer_idx", None), int) or not _patch_scan(module):
            return False
        # An instance attribute: other models' mixers stay as shipped.
        vars(mixer)["forward"] = _forward_with_state(mixer, mixer.forward)
        vars(mixer)["_flashspec_patched"] = True
    return True


def _patch_scan(module: Any) -> bool:
    scan = getattr(module, _SCAN, None)
    if scan is None:
        return False
    if getattr(scan, "_flashspec_original", None) is not None:
        return True
    signature = inspect.signature(scan)
    if not {"hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias"} <= set(
        signature.parameters
    ):
        return False

    def patched(*args: Any, **kwargs: Any) -> Any:
        state = getattr(_initial, "state", None)
        if state is None:
            return scan(*args, **kwargs)
        _initial.state = None  # one scan per mixer call
        return _scan_from(state, **signature.bind(*args, **kwargs).arguments)

    patched._flashspec_original = scan  # type: ignore[attr-defined]
    setattr(module, _SCAN, patched)
    return True


def _forward_with_state(mixer: torch.nn.Module, original: Any) -> Any:
    signature = inspect.signature(original)
    layer = int(getattr(mixer, "layer_idx", 0))

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        hidden = bound.arguments.get("hidden_states")
        cache: Any = bound.arguments.get("cache")
        if not isinstance(hidden, torch.Tensor) or not getattr(cache, OWNED_CACHE, False):
            return original(*args, **kwargs)
        length = hidden.shape[1]
        mask = bound.arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] > length:
            # These mixers multiply their inputs by the padding mask, which must then cover
            # just the columns fed; the engine passes the whole row's (attention needs it).
            bound.arguments["attention_mask"] = mask[:, -length:]
        state = cache.get_recurrent_state(layer) if length > 1 else None
        _initial.state = state
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            _initial.state = None

    return forward


def _scan_from(
    h0: torch.Tensor,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **_: Any,
) -> Any:
    """The selective scan from state ``h0`` (batch, d, n). Inputs as the mixers pass them:
    x (batch, d, L), dt (batch, d, L), A (d, n), B and C (batch, n, L)."""
    dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])  # (batch, d, L, n)
    drive = dt[..., None] * B.transpose(1, 2)[:, None].float() * hidden_states[..., None].float()
    C = C.transpose(1, 2)  # (batch, L, n)
    h = h0.to(dtype)
    outputs = []
    for t in range(hidden_states.shape[-1]):
        h = decay[:, :, t] * h + drive[:, :, t]
        outputs.append(torch.matmul(h.to(dtype), C[:, t, :, None])[..., 0])
    y = torch.stack(outputs, dim=-1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y
