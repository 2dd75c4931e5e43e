"""Recurrent and convolutional cache state: which caches the engine can roll back exactly, and
snapshots of the state that a crop cannot undo.

Attention keys/values are per position, so dropping rejected drafts is a crop. A recurrent
(SSM, linear-attention) state is one tensor per layer that has absorbed every token fed so far:
after a verify forward over the pending token plus gamma drafts it holds all of them. So a
stateful model's state is saved (``Snapshot``, small: layers x state, not sequence) before the
forward, and a rollback restores it and feeds the committed tokens again. A conv-only layer
(Lfm2) keeps its recent inputs and crops like attention.

``check_support`` is the gate: a model whose cache the engine cannot roll back exactly is refused
when the engine is built, never run.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import mamba1

StateMode = Literal["keep", "replay", "check"]
STATE_MODE_ENV = "FLASHSPEC_RECURRENT"
_STATE_MODES: tuple[StateMode, ...] = ("keep", "replay", "check")
CHECK_TOLERANCE = 1e-4
"""``check`` mode: the largest difference allowed between the kept state and a token-by-token
replay, relative to the state's largest magnitude (plus this much absolute): chunked and
single-step scans round differently, a wrong state differs by the state itself."""

# Families whose stateful caches are verified (tests/models/test_recurrent.py): greedy output equal
# to HF ``generate``, target and drafter, batches. The value says whether one forward over
# several tokens after a cached state is exact as transformers ships it; where it is not, the
# family's mixers get their cached state as the scan's initial state (``flashspec.kv.mamba1``).
_CHUNKED_EXACT: dict[str, bool] = {
    "mamba2": True,
    "qwen3_next": True,
    "lfm2": True,
    "falcon_h1": True,
    # transformers' Mamba-1 mixer restarts its selective scan from a zero state on a multi-token
    # input after a cached state (modeling_mamba: "Initial hidden state is not supported").
    "mamba": False,
    "falcon_mamba": False,
    "jamba": False,
}

_ATTENTION_LAYERS = frozenset(
    {"DynamicLayer", "DynamicSlidingWindowLayer", "DynamicIndexedLayer", "DummyLayer", "StoreLayer"}
)

# Attention models whose forward over several tokens after a cached state is not their own
# one-token decoding as transformers ships them, found by tests/models/test_arch_sweep.py: by cache
# layer kind, then by model type. Such a model cannot be a target; as a drafter it is fed one
# token per forward after a cached state (``CacheSupport.chunked_exact`` False).
_STEPWISE_LAYERS: dict[str, str] = {
    # With index_topk 16 a tiny DeepSeek-V3.2 was 1.9 logits off from the first token past
    # the budget; the selection's scores are ReLU sums that often tie at the cut.
    "DynamicIndexedLayer": (
        "its sparse-attention indexer keeps each token's top index_topk keys, and a forward "
        "over several tokens picks other keys than one-token decoding once a sequence is "
        "longer than that (tied scores are cut differently)"
    ),
}
_STEPWISE_FAMILIES: dict[str, str] = {
    # transformers' Moshi masks causally only and leaves the window to the sliding cache,
    # which keeps the last sliding_window - 1 keys: a one-token step sees a window, a forward
    # over several tokens sees more.
    "moshi": (
        "its sliding window comes only from the cache dropping old keys, so past the window a "
        "forward over several tokens attends to more keys than one-token decoding does"
    ),
}


class UnsupportedModelError(ValueError):
    """A model flashspec cannot run exactly: raised when an engine is built (a cache it cannot
    roll back, or a family it cannot decode, ``flashspec._families``), or when a generation
    asks a model for rows of different lengths that it cannot batch exactly."""


@dataclass(frozen=True)
class CacheSupport:
    """How a model's cache is rolled back.

    Attributes:
        stateful: some layers hold recurrent/conv state (snapshot and restore, or conv crop).
        chunked_exact: one forward over several tokens after a cached state equals feeding them
            one at a time; False means a drafter feeds one token per forward.
    """

    stateful: bool
    chunked_exact: bool


@functools.cache  # looked up every round of a stateful model
def _linear_mixin() -> type[Any] | None:
    from transformers import cache_utils

    mixin: type[Any] | None = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mixin


def _supported_list() -> str:
    return (
        "attention-only models, and with recurrent state the families "
        f"{', '.join(sorted(_CHUNKED_EXACT))}"
    )


def check_support(model: torch.nn.Module, cache: Any, role: str) -> CacheSupport:
    """Refuse ``model`` (as ``role``: "target" or "drafter") unless its cache rolls back exactly.

    Raises:
        UnsupportedModelError: naming the model class, the layer kind and what is supported.
    """
    name = type(model).__name__
    # RecurrentGemma keeps its recurrent state in the modules, outside any cache object.
    holders = [m for m in model.modules() if m is not model and hasattr(m, "_setup_cache")]
    if holders or hasattr(model, "_setup_cache"):
        holder = type(holders[-1] if holders else model).__name__
        raise UnsupportedModelError(
            f"{name} cannot be a {role}: its {holder} layers keep their recurrent state "
            "inside the model, where flashspec cannot snapshot or roll it back, so a rejected "
            f"draft would stay in it. Supported: {_supported_list()}"
        )
    layers = list(getattr(cache, "layers", ()))
    mixin = _linear_mixin()
    stateful = [layer for layer in layers if mixin is not None and isinstance(layer, mixin)]
    for layer in layers:
        kind = type(layer).__name__
        if layer not in stateful and kind not in _ATTENTION_LAYERS:
            raise UnsupportedModelError(
                f"{name} cannot be a {role}: its cache has {kind} layers, which flashspec "
                f"cannot roll back exactly after a rejected draft. Supported: {_supported_list()}"
            )
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    if not stateful:
        kinds = [type(layer).__name__ for layer in layers]
        reason = next((_STEPWISE_LAYERS[k] for k in kinds if k in _STEPWISE_LAYERS), None)
        reason = reason or _STEPWISE_FAMILIES.get(model_type)
        if reason is None:
            return CacheSupport(stateful=False, chunked_exact=True)
        if role == "target":
            raise UnsupportedModelError(
                f"{name} (model_type {model_type!r}) cannot be a target: {reason}, so one "
                "verify forward over the drafts cannot reproduce the model's own decoding. It "
                "can be a drafter (fed one token per forward after its cache)"
            )
        return CacheSupport(stateful=False, chunked_exact=False)
    kind = type(stateful[0]).__name__
    if model_type not in _CHUNKED_EXACT:
        raise UnsupportedModelError(
            f"{name} (model_type {model_type!r}) cannot be a {role}: its cache has {kind} "
            "layers (recurrent/conv state), and this family's state handling is not verified "
            f"by flashspec, so exactness cannot be promised. Supported: {_supported_list()}"
        )
    chunked = _CHUNKED_EXACT[model_type] or mamba1.patch(model)
    if role == "target" and not chunked:
        raise UnsupportedModelError(
            f"{name} cannot be a target: transformers' {model_type} mixer restarts its scan "
            "from a zero state when several tokens are fed after a cached state, so one "
            "verify forward over the drafts cannot reproduce the model's own decoding. Use it "
            f"as a drafter, or a target from: {_supported_list()}"
        )
    return CacheSupport(stateful=True, chunked_exact=chunked)


def state_mode() -> StateMode:
    """The rollback policy of stateful targets, from ``FLASHSPEC_RECURRENT``.

    ``keep`` (default): after a fully accepted round keep the state the verify forward left (it
    has processed exactly the committed tokens); on a partial accept restore and replay.
    ``replay``: always restore and replay (for A/B timing). ``check``: keep, then also replay
    one token at a time and raise if the two states differ beyond ``CHECK_TOLERANCE``.

    Raises:
        ValueError: an unknown value, naming the variable and the valid ones.
    """
    value = os.environ.get(STATE_MODE_ENV, "keep").strip().lower() or "keep"
    if value not in _STATE_MODES:  # narrows value to StateMode below
        raise ValueError(
            f"{STATE_MODE_ENV}={value!r} is not a rollback mode; use one of {list(_STATE_MODES)}"
        )
    return value


def _stateful_layers(cache: Any) -> list[Any]:
    mixin = _linear_mixin()
    return [layer for layer in getattr(cache, "layers", ()) if mixin and isinstance(layer, mixin)]


def has_recurrent_state(cache: Any) -> bool:
    """Whether a stateful layer holds a recurrent state (not only conv inputs, which crop)."""
    return any(
        any(layer.is_recurrent_states_initialized.values()) for layer in _stateful_layers(cache)
    )


@dataclass
class Snapshot:
    """Copies of every stateful layer's conv/recurrent tensors at ``columns`` committed columns.

    ``states[i]`` is layer i's ``(conv, recurrent, has_previous)`` per state index, None for a
    layer not yet initialised (restoring it means a fresh cache).
    """

    columns: int
    states: list[dict[int, tuple[torch.Tensor | None, torch.Tensor | None, bool]]]
    empty: bool


def take_snapshot(cache: Any, columns: int) -> Snapshot:
    """Copy the stateful layers' tensors (they are updated in place by the next forward)."""
    states = []
    empty = True
    for layer in _stateful_layers(cache):
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, bool]] = {}
        for i in range(layer.number_of_states):
            conv = layer.conv_states[i] if layer.is_conv_states_initialized[i] else None
            rec = layer.recurrent_states[i] if layer.is_recurrent_states_initialized[i] else None
            previous = bool(layer.has_previous_state[i])
            empty = empty and not previous
            saved[i] = (
                None if conv is None else conv.clone(),
                None if rec is None else rec.clone(),
                previous,
            )
        states.append(saved)
    return Snapshot(columns=columns, states=states, empty=empty)


def restore_snapshot(cache: Any, snapshot: Snapshot, cached: int, *, copy: bool = False) -> None:
    """Put ``cache`` (holding ``cached`` columns) back to ``snapshot``: attention layers are
    cropped to ``snapshot.columns``, stateful layers get the saved tensors back (copies of them
    with ``copy``, so the snapshot can be restored again)."""
    crop_attention(cache, cached - snapshot.columns)
    for layer, saved in zip(_stateful_layers(cache), snapshot.states, strict=True):
        for i, (conv, rec, previous) in saved.items():
            # Without copy the saved tensor becomes the live one, which the next forward
            # updates in place: such a snapshot is restored once.
            if conv is not None:
                layer.conv_states[i] = conv.clone() if copy else conv
            if rec is not None:
                layer.recurrent_states[i] = rec.clone() if copy else rec
            layer.has_previous_state[i] = previous


def crop_attention(cache: Any, remove: int) -> None:
    """Drop the last ``remove`` positions of every attention layer, the key/value part of hybrid
    layers included; ``remove == 0`` trims sliding-window layers (as ``crop(0)`` does). Stateful
    layers are left alone: a crop would only cut their recorded conv inputs."""
    from transformers.cache_utils import CacheLayerMixin

    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, CacheLayerMixin):
            continue
        if remove == 0 and not getattr(layer, "is_sliding", False):
            continue
        if not layer.is_initialized:
            continue  # nothing to crop, and a sliding layer's crop raises on empty keys
        for cls in type(layer).__mro__:
            # The first attention class in the MRO that defines crop: for a hybrid layer that
            # skips the class combining both, whose crop also cuts the conv part.
            if issubclass(cls, CacheLayerMixin) and _is_attention(cls) and "crop" in vars(cls):
                vars(cls)["crop"](layer, -remove)
                break


def select_attention_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only the batch rows in ``index`` of every attention layer (hybrid ones included)."""
    from transformers.cache_utils import CacheLayerMixin

    mixin = _linear_mixin()
    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, CacheLayerMixin):
            if mixin is None or not isinstance(layer, mixin):
                layer.batch_select_indices(index)  # DummyLayer: nothing stored
            continue
        for cls in type(layer).__mro__:
            if (
                issubclass(cls, CacheLayerMixin)
                and _is_attention(cls)
                and "batch_select_indices" in vars(cls)
            ):
                vars(cls)["batch_select_indices"](layer, index)
                break


def _is_attention(cls: type[Any]) -> bool:
    mixin = _linear_mixin()
    return mixin is None or not issubclass(cls, mixin)


def trim_conv(cache: Any) -> None:
    """Shrink recorded conv inputs back to the kernel width (they grow until a crop)."""
    for layer in _stateful_layers(cache):
        for i in range(layer.number_of_states):
            width = layer.conv_kernel_size[i]
            conv = layer.conv_states[i]
            if layer.is_conv_states_initialized[i] and width and conv.shape[-1] > width:
                layer.conv_states[i] = conv[..., -width:]


def select_state_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only the batch rows in ``index`` of every stateful layer (attention layers are left
    to the cache's own ``batch_select_indices``)."""
    for layer in _stateful_layers(cache):
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                conv = layer.conv_states[i]
                layer.conv_states[i] = conv.index_select(0, index.to(conv.device))
            if layer.is_recurrent_states_initialized[i]:
                rec = layer.recurrent_states[i]
                layer.recurrent_states[i] = rec.index_select(0, index.to(rec.device))


def state_difference(cache: Any, other: Snapshot) -> float:
    """Largest difference between ``cache``'s stateful tensors and ``other``, relative to the
    larger of their largest magnitudes (conv inputs compared over the kernel width)."""
    worst = 0.0
    for layer, saved in zip(_stateful_layers(cache), other.states, strict=True):
        for i, (conv, rec, _) in saved.items():
            pairs = []
            if conv is not None and layer.is_conv_states_initialized[i]:
                width = layer.conv_kernel_size[i] or conv.shape[-1]
                pairs.append((layer.conv_states[i][..., -width:], conv[..., -width:]))
            if rec is not None and layer.is_recurrent_states_initialized[i]:
                pairs.append((layer.recurrent_states[i], rec))
            for live, ref in pairs:
                scale = max(float(live.abs().max()), float(ref.abs().max()), 1.0)
                worst = max(worst, float((live.float() - ref.float()).abs().max()) / scale)
    return worst
