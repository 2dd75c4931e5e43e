"""A Llama decoder's forward without the per-module overhead, bitwise equal to transformers'.

On a CPU a small model's step is dominated by Python, not arithmetic: SmolLM2-135M's 30
layers run ~1,100 torch operations a token, and transformers' module calls, keyword plumbing
and output-capture decorators around them cost as much again. ``lean_forward`` runs
the very same operations in the same order on the same tensors (the same mask from
``create_causal_mask``, the same rotary embedding, ``apply_rotary_pos_emb``, attention
interface and cache ``update``), called directly rather than through each submodule's
``__call__``: the logits are bit for bit those of ``LlamaModel.forward`` (tests compare them),
so greedy identity and exact sampling carry over unchanged.

Only the plain call shape takes this path: anything else (hidden states or attentions asked
for, embeddings passed in, an unknown keyword, tracing by ``torch.compile``) runs
transformers' own forward. The final norm stays a module call, so forward hooks on it (the
features draft reads the target's states there) still fire. ``hf_layers``
(``models.linear.untuned``) gives a model transformers' forward back while inside, for baselines.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch

DISABLE_ENV = "FLASHSPEC_LEAN_FORWARD"
"""Set to ``0`` to keep transformers' own decoder forward."""

_PLAIN_KWARGS = frozenset({"use_cache", "return_dict"})


def _rms(norm: Any, x: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward, operation for operation.
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    out: torch.Tensor = norm.weight * h.to(dtype)
    return out


class _Transformers:
    """The names of transformers the lean forward calls, looked up once (None: missing)."""

    def __init__(self) -> None:
        try:
            outputs: Any = importlib.import_module("transformers.modeling_outputs")
            utils: Any = importlib.import_module("transformers.modeling_utils")
            llama: Any = importlib.import_module("transformers.models.llama.modeling_llama")
            self.model_class: Any = llama.LlamaModel
            self.causal_mask: Any = llama.create_causal_mask
            self.rotary: Any = llama.apply_rotary_pos_emb
            self.eager: Any = llama.eager_attention_forward
            self.attention: Any = utils.ALL_ATTENTION_FUNCTIONS
            self.result: Any = outputs.BaseModelOutputWithPast
            self.ok = True
        except (ImportError, AttributeError):  # a release without these names: keep its forward
            self.ok = False


_NAMES: _Transformers | None = None


def _names() -> _Transformers:
    global _NAMES
    if _NAMES is None:
        _NAMES = _Transformers()
    return _NAMES


def lean_forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """``LlamaModel.forward`` for the plain call shape, operation for operation (see the
    module docstring); any other call runs transformers' own."""
    t = _names()
    if not plain_call(self, input_ids, inputs_embeds, cache, kwargs):
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            **kwargs,
        )
    # A features draft passes its fused inputs as embeddings (drafters.shared_head).
    embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        seen = cache.get_seq_length()
        position_ids = (torch.arange(embeds.shape[1], device=embeds.device) + seen)[None]
    normed = fused_layers(self, embeds, position_ids, attention_mask, cache)
    if normed is not None:
        return t.result(last_hidden_state=normed, cache=cache)
    mask = t.causal_mask(
        config=self.config,
        inputs_embeds=embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    hidden = embeds
    cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
    attend = t.attention.get_interface(self.config._attn_implementation, t.eager)
    shape = hidden.shape[:-1]
    for layer in self.layers[: self.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms(layer.input_layernorm, hidden)
        heads = (*shape, -1, attn.head_dim)
        q = attn.q_proj(x).view(heads).transpose(1, 2)
        k = attn.k_proj(x).view(heads).transpose(1, 2)
        v = attn.v_proj(x).view(heads).transpose(1, 2)
        q, k = t.rotary(q, k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        hidden = hidden + attn.o_proj(out.reshape(*shape, -1).contiguous())
        x = _rms(layer.post_attention_layernorm, hidden)
        hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    return t.result(last_hidden_state=self.norm(hidden), cache=cache)


def _hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    hooks: Any = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def lean_logits(
    model: Any,
    ids: torch.Tensor,
    positions: torch.Tensor | None,
    mask: torch.Tensor | None,
    cache: Any,
    keep: int,
) -> torch.Tensor | None:
    """The last ``keep`` logits (B, keep, V) of ``model`` (a Llama causal LM whose decoder has
    the fused C step, ``flashspec.quant.decoder``) for ``ids`` (B, n) after ``cache``: what
    ``model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache,
    logits_to_keep=keep).logits`` holds, by the same operations in the same order (the lean
    forward's fused branch, then the head on the last ``keep`` positions), without the two
    outer calls' plumbing (output records, keyword and deprecation wrappers), which on a CPU
    is a measurable part of a small model's step. The final norm and the head stay module
    calls, so hooks on them fire. None, having changed nothing the caller reads, whenever
    the call is not one this path takes (hooks on the model or its decoder, the module path,
    training, tracing): the caller then runs the model. The caller sets torch's threads as
    the model's own forward would (``flashspec.quant.threads.forward_threads``)."""
    inner = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or head is None or keep < 1:
        return None
    if not (is_lean(inner) or getattr(inner, "runs_fused_step", False)):
        return None
    if "_flashspec_fused" not in inner.__dict__ or model.training:
        return None
    if torch.compiler.is_compiling():
        return None
    if _hooked(model) or _hooked(inner) or _global_hooks():
        return None
    embeds = inner.embed_tokens(ids)
    if positions is None:
        seen = cache.get_seq_length()
        positions = (torch.arange(int(ids.shape[1]), device=embeds.device) + seen)[None]
    normed = fused_layers(inner, embeds, positions, mask, cache)
    if normed is None:
        return None
    logits: torch.Tensor = head(normed[:, -keep:, :])
    return logits


def plain_call(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor | None,
    embeds: torch.Tensor | None,
    cache: Any,
    kwargs: dict[str, Any],
) -> bool:
    """Whether a decoder call has the one shape the lean forward (and the C step) repeat: ids
    or embeddings, a cache to extend, nothing asked for beyond the last hidden state, not
    traced by ``torch.compile``, not training."""
    return (
        (input_ids is None) != (embeds is None)
        and cache is not None
        and bool(kwargs.get("use_cache", True))
        and _PLAIN_KWARGS.issuperset(kwargs)
        and not torch.compiler.is_compiling()
        and not decoder.training
    )


def fused_layers(
    decoder: Any,
    embeds: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Any,
) -> torch.Tensor | None:
    """The final norm's output (B, n, dim) of ``decoder`` (a ``LlamaModel``) over ``embeds``
    with its quantized layers in one C call (``flashspec.quant.decoder``), the rows of a batch
    together, a padding mask (the ragged layout's dead columns) or a token tree's per-query
    mask with them; None, the cache untouched, when it has no fused plan or the call is not
    one the C step takes (the caller then runs the layers itself)."""
    fused = decoder.__dict__.get("_flashspec_fused")
    if fused is None:
        return None
    takes, keys = _fused_mask(mask, embeds, cache)
    if not takes:
        return None
    hidden = embeds.clone(memory_format=torch.contiguous_format)  # written in place
    cos, sin = decoder.rotary_emb(hidden, position_ids=positions)
    if not fused.step(cache, hidden, cos, sin, keys):
        return None
    normed: torch.Tensor = decoder.norm(hidden)
    return normed


def _fused_mask(
    mask: torch.Tensor | None, embeds: torch.Tensor, cache: Any
) -> tuple[bool, torch.Tensor | None]:
    """Whether the fused step can take ``mask``, and the mask it takes: None (every column
    visible), a 2-D padding mask as it came, or a 4-D one (B or 1, 1, m, past + m) as
    (B, m, past + m) visible bytes. transformers hands a 4-D mask to attention unchanged: an
    additive float one (0 visible, the dtype's min or -inf hidden: a weight of exactly 0) or a
    bool one (True visible); any other value (a finite bias) or shape is left to the module
    path, which applies it as it is."""
    if mask is None:
        return True, None
    if mask.dim() == 2:
        return True, None if _all_attended(mask) else mask
    batch, m = int(embeds.shape[0]), int(embeds.shape[1])
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch):
        return False, None
    # The kv length must be the cache's columns and the new ones: a mask over a longer or
    # shorter window would name other columns than those the C step's rows index.
    if mask.shape[2] != m or mask.shape[3] != int(cache.get_seq_length()) + m:
        return False, None
    rows = mask[:, 0]
    if rows.dtype == torch.bool:
        visible = rows
    elif rows.is_floating_point():
        visible = rows == 0
        if not bool((visible | (rows <= torch.finfo(rows.dtype).min)).all()):
            return False, None
    else:
        return False, None
    return True, visible.expand(batch, m, -1)


def _all_attended(mask: torch.Tensor) -> bool:
    """A 2-D padding mask with no padding (``generate`` passes one of ones): the causal mask
    is then the one without it."""
    return mask.dim() == 2 and bool(mask.all())


def is_lean(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs the lean forward."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is lean_forward


def make_lean(model: torch.nn.Module) -> int:
    """Give every plain ``LlamaModel`` inside ``model`` the lean forward; returns how many.

    Only the exact class is changed (a subclass may override what the lean forward repeats),
    and only with sdpa or eager attention, whose interface it calls as transformers does. The
    forward is set on the instance: the class, and what transformers keys by it, stay."""
    if os.environ.get(DISABLE_ENV, "").strip() == "0":
        return 0
    if not any(_transformers_llama(m) for m in model.modules()):
        return 0  # nothing to change: no need to import transformers' modeling code
    t = _names()
    if not t.ok:
        return 0
    changed = 0
    for module in model.modules():
        attention = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if type(module) is t.model_class and attention in ("sdpa", "eager"):
            if not is_lean(module):
                module.forward = types.MethodType(lean_forward, module)
            changed += 1
    return changed


def _transformers_llama(module: torch.nn.Module) -> bool:
    kind = type(module)
    return kind.__name__ == "LlamaModel" and kind.__module__.startswith("transformers.")


@contextlib.contextmanager
def hf_forward(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with transformers' own decoder forward while inside, lean again after (a
    ``flashspec.quant.llama`` model sends its calls to its transformers twin meanwhile)."""
    own: list[Any] = [m for m in model.modules() if getattr(m, "runs_fused_step", False)]
    modules = list(model.modules())
    for module in own:  # the twin's decoder runs the lean forward: swap it too
        modules += list(module.owner.transformers_model().modules())
    swapped = [m for m in modules if is_lean(m)]
    for module in swapped:
        del module.forward
    for module in own:
        module.runs_fused_step = False
    try:
        yield model
    finally:
        for module in swapped:
            module.forward = types.MethodType(lean_forward, module)
        for module in own:
            del module.runs_fused_step  # the class's True again
