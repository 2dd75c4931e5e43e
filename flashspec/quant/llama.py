"""A Llama causal LM on quantized layers without transformers' modeling code.

Importing transformers' model classes (``modeling_utils``, ``modeling_llama``, ``LlamaConfig``)
brings in ``torch._dynamo``, ``torch.distributed.tensor``, scipy and sympy: more resident
memory before a weight is read than SmolLM2's quantized blocks take. A Llama whose
decoder layers all run in the fused C step (``flashspec.quant.decoder``) needs none of it:
``FusedLlamaForCausalLM`` holds the same modules under the same names (``model.embed_tokens``,
``model.layers[i].self_attn.q_proj``, ..., ``model.norm``, ``lm_head``), computes the rotary
tables and the final norm with transformers' own operations, and runs the layers in the C
step, as the lean forward (``flashspec._lean``) does for transformers' ``LlamaModel``.

Any call the C step does not take (a static cache, hidden states or attentions asked for,
tracing by ``torch.compile``, a mask it cannot read) goes to transformers' ``LlamaForCausalLM``
built on first need over the very same modules (``transformers_model``): every path stays
the one transformers runs, only the imports are paid late.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import warnings
from typing import Any

import torch

ENV = "FLASHSPEC_OWN_LLAMA"
"""Set to ``0`` to build quantized Llama models as transformers' ``LlamaForCausalLM``."""

_TWIN = "_flashspec_transformers_twin"


def wanted() -> bool:
    """Whether quantized Llama loads build this module (``ENV`` not ``0``)."""
    return os.environ.get(ENV, "").strip() != "0"


def fits(config: Any) -> str | None:
    """Why a Llama of ``config`` cannot be built as ``FusedLlamaForCausalLM`` (None: it can):
    the parts this module repeats are transformers' plain Llama (SiLU, no biases, default
    RoPE, one tensor-parallel rank)."""
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} is not 'llama'"
    rope = _rope(config)
    if rope is None:
        return "its RoPE is not the default kind"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "it has biases"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    return None


def _rope(config: Any) -> float | None:
    """The default RoPE's theta, or None for any other kind."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
            return None
        return float(params["rope_theta"])
    if getattr(config, "rope_scaling", None):
        return None
    theta = getattr(config, "rope_theta", None)
    return None if theta is None else float(theta)


def _linear(features: int, out: int) -> torch.nn.Linear:
    """An ``nn.Linear`` whose weight is a placeholder on the meta device, not initialized
    (initializing a meta tensor runs through ``torch._refs``, which imports
    ``torch._dynamo``: 70 MB resident for weights the file replaces)."""
    with warnings.catch_warnings():  # "initializing zero-element tensors is a no-op"
        warnings.simplefilter("ignore", UserWarning)
        layer = torch.nn.Linear(0, 0, bias=False)
    layer.in_features, layer.out_features = features, out
    layer.weight = torch.nn.Parameter(torch.empty(out, features, device="meta"))
    return layer


def _embedding(rows: int, dim: int) -> torch.nn.Embedding:
    """An ``nn.Embedding`` whose weight is a placeholder on the meta device (see ``_linear``)."""
    layer = torch.nn.Embedding(0, dim)
    layer.num_embeddings = rows
    layer.weight = torch.nn.Parameter(torch.empty(rows, dim, device="meta"))
    return layer


class RMSNorm(torch.nn.Module):
    """transformers' ``LlamaRMSNorm``, operation for operation."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., size) to (..., size), in the input's dtype."""
        dtype = hidden.dtype
        h = hidden.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        out: torch.Tensor = self.weight * h.to(dtype)
        return out


class RotaryEmbedding(torch.nn.Module):
    """transformers' default ``LlamaRotaryEmbedding``: the same frequencies, the same ops."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (B, n, head_dim) in ``x``'s dtype, for ``position_ids`` (B, n)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device, torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _Attention(torch.nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        dim, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.layer_idx = index
        self.head_dim = int(getattr(config, "head_dim", None) or dim // heads)
        self.scaling = self.head_dim**-0.5
        self.q_proj = _linear(dim, heads * self.head_dim)
        self.k_proj = _linear(dim, kv * self.head_dim)
        self.v_proj = _linear(dim, kv * self.head_dim)
        self.o_proj = _linear(heads * self.head_dim, dim)


class _MLP(torch.nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim, ffn = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(dim, ffn)
        self.up_proj = _linear(dim, ffn)
        self.down_proj = _linear(ffn, dim)
        self.act_fn = torch.nn.SiLU()


class DecoderLayer(torch.nn.Module):
    """One layer's parts under transformers' names (the C step runs them)."""

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        self.self_attn = _Attention(config, index)
        self.mlp = _MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FusedLlamaModel(torch.nn.Module):
    """The decoder: ``LlamaModel``'s parts and forward for the calls the C step takes."""

    runs_fused_step = True
    """Whether plain calls run the C step (``flashspec._lean.lean_logits`` reads it too);
    ``flashspec._lean.hf_forward`` turns it off for a while, sending every call to
    transformers' model."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        theta = _rope(config)
        if theta is None:
            raise ValueError(f"FusedLlamaModel: {fits(config)}")
        self.config = config
        self.padding_idx = getattr(config, "pad_token_id", None)
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = int(getattr(config, "head_dim", None) or
                       config.hidden_size // config.num_attention_heads)  # fmt: skip
        self.rotary_emb = RotaryEmbedding(head_dim, theta)
        self.owner: FusedLlamaForCausalLM | None = None

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Any:
        """``LlamaModel.forward``: the final norm's output after the C step, or transformers'
        own forward over these modules for a call the C step does not take."""
        cache = cache if cache is not None else past_key_values
        normed = self._fused(input_ids, attention_mask, position_ids, cache, inputs_embeds,
                             kwargs)  # fmt: skip
        if normed is not None:
            return _output("BaseModelOutputWithPast", last_hidden_state=normed, cache=cache)
        twin = self._twin().model
        return twin(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, inputs_embeds=inputs_embeds,
                    **_cache_kwarg(twin, cache), **kwargs)  # fmt: skip

    def _fused(
        self,
        input_ids: torch.Tensor | None,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        cache: Any,
        embeds: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | None:
        from .._lean import fused_layers, plain_call

        if not (self.runs_fused_step and plain_call(self, input_ids, embeds, cache, kwargs)):
            return None
        if embeds is None:
            embeds = self.embed_tokens(input_ids)
        if positions is None:
            seen = cache.get_seq_length()
            positions = (torch.arange(embeds.shape[1], device=embeds.device) + seen)[None]
        return fused_layers(self, embeds, positions, mask, cache)

    def _twin(self) -> Any:
        if self.owner is None:
            raise RuntimeError("a FusedLlamaModel runs inside its FusedLlamaForCausalLM")
        return self.owner.transformers_model()


class FusedLlamaForCausalLM(torch.nn.Module):
    """A Llama causal LM whose decoder runs in the C step, with transformers' interface for
    what flashspec calls (see the module docstring). Its projections and embedding are built
    as placeholders on the meta device; fill them as ``flashspec.quant.load`` does (quantized
    layers in their place, other tensors assigned). Its modules carry transformers'
    ``LlamaForCausalLM`` names, so the same state-dict keys and GGUF name mapping apply.

    Args:
        config: a transformers config of ``model_type`` ``"llama"`` (``fits`` says which).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        reason = fits(config)
        if reason is not None:
            raise ValueError(f"FusedLlamaForCausalLM cannot build this model: {reason}")
        self.config = config
        self.generation_config = _generation_config(config)
        self.model = FusedLlamaModel(config)
        self.model.__dict__["owner"] = self  # not a submodule: no cycle in modules()
        self.lm_head: torch.nn.Module = _linear(config.hidden_size, config.vocab_size)

    @property
    def device(self) -> torch.device:
        """Where the blocks live (the CPU)."""
        tensors: list[torch.Tensor] = list(
            self.model.embed_tokens.state_dict(keep_vars=True).values()
        )
        return tensors[0].device if tensors else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: float32."""
        return torch.float32

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: torch.nn.Module) -> None:
        self.lm_head = head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Any:
        """``LlamaForCausalLM.forward``: logits (B, kept positions, V) and the cache."""
        cache = cache if cache is not None else past_key_values
        normed = self.model._fused(input_ids, attention_mask, position_ids, cache,
                                   inputs_embeds, kwargs)  # fmt: skip
        if normed is None:
            twin = self.transformers_model()
            return twin(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, inputs_embeds=inputs_embeds,
                        logits_to_keep=logits_to_keep, **_cache_kwarg(twin, cache),
                        **kwargs)  # fmt: skip
        if isinstance(logits_to_keep, int):
            kept = normed[:, -logits_to_keep:, :] if logits_to_keep else normed
        else:
            kept = normed[:, logits_to_keep, :]
        logits = self.lm_head(kept)
        return _output("CausalLMOutputWithPast", logits=logits, cache=cache)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, run by the transformers model over these modules."""
        return self.transformers_model().generate(*args, **kwargs)

    def transformers_model(self) -> Any:
        """transformers' ``LlamaForCausalLM`` over this model's very modules (built once, on
        first need: it imports transformers' modeling code). Its forward is the one
        transformers ships; hooks on these modules fire in it too."""
        twin = self.__dict__.get(_TWIN)
        if twin is not None:
            return twin
        from accelerate import init_empty_weights  # type: ignore[import-untyped]
        from transformers import AutoConfig, LlamaForCausalLM

        settings = self.config.to_dict()
        settings.pop("model_type", None)  # transformers' base config writes its own, ""
        kind = str(getattr(self.config, "model_type", "") or "llama")
        config: Any = AutoConfig.for_model(kind, **settings)
        config._attn_implementation = self.config._attn_implementation or "sdpa"
        with init_empty_weights(include_buffers=False):
            twin = LlamaForCausalLM(config)
        for name in _shared_names(self):
            parent_name, _, child = name.rpartition(".")
            parent = twin.get_submodule(parent_name) if parent_name else twin
            setattr(parent, child, self.get_submodule(name))  # same weights, same hooks
        left = [n for n, p in twin.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"transformers' model over these modules lacks {left[:3]}")
        twin.generation_config = self.generation_config
        twin.train(False)
        # transformers' generate over the twin still runs the C step for its plain calls.
        from .._lean import make_lean

        make_lean(twin)
        fused = self.model.__dict__.get("_flashspec_fused")
        if fused is not None:
            twin.model.__dict__["_flashspec_fused"] = fused
        self.__dict__[_TWIN] = twin
        return twin


_LAYER_PARTS = (
    "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    "mlp.act_fn",
)  # fmt: skip


def _shared_names(model: FusedLlamaForCausalLM) -> list[str]:
    """The modules transformers' model takes from ``model`` as they are: every part that
    holds weights or computes (the attention and decoder-layer wrappers stay transformers'
    own), and any top-level module transformers' class has no place for (a draft's
    ``fuse``)."""
    names = ["lm_head", "model.embed_tokens", "model.norm", "model.rotary_emb"]
    for index in range(len(model.model.layers)):
        names += [f"model.layers.{index}.{part}" for part in _LAYER_PARTS]
    names += [name for name in model._modules if name not in ("model", "lm_head")]
    return names


def _generation_config(config: Any) -> Any:
    from transformers.generation.configuration_utils import GenerationConfig

    return GenerationConfig.from_model_config(config)


def _cache_kwarg(model: Any, cache: Any) -> dict[str, Any]:
    """The cache under the name ``model``'s forward takes (``cache`` in transformers 5,
    ``past_key_values`` before)."""
    kind: Any = type(model)
    return {_cache_parameter(kind): cache}


@functools.cache
def _cache_parameter(kind: Any) -> str:
    params = inspect.signature(kind.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@functools.cache
def _record(name: str) -> tuple[Any, str]:
    """transformers' output record class ``name`` and the field its cache goes in."""
    from transformers import modeling_outputs

    kind: Any = getattr(modeling_outputs, name)
    names = {f.name for f in dataclasses.fields(kind)}
    return kind, "cache" if "cache" in names else "past_key_values"


def _output(name: str, cache: Any, **fields: Any) -> Any:
    """transformers' output record ``name`` with the cache in its field of this release."""
    kind, field = _record(name)
    fields[field] = cache
    return kind(**fields)


__all__ = ["ENV", "FusedLlamaForCausalLM", "FusedLlamaModel", "fits", "wanted"]
