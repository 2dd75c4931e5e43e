"""Tiny random models of the architectures transformers ships, for the architecture sweeps
(tests/models/test_arch_sweep.py, tests/models/test_engine_windowed.py): configs, the target
with drafters that agree often or rarely, prompts, and the target's own greedy references.

A tiny config is the family's own defaults with every size field it has shrunk (``SIZES``),
sub-configs (text, vision, audio) included, then the family's ``OVERRIDES``: nothing is
downloaded and a model builds in milliseconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from flashspec._greedy import compare_greedy
from tests.helpers.models import perturbed_copy

VOCAB = 64

SIZES: dict[str, Any] = {
    # Every config: a 2-layer model of width 32 (4 heads of 8, 2 key/value heads).
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    # Wide initial weights: sharp logits, so greedy ties (top-2 gaps near zero) are rare.
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # Mixture of experts: few small experts; one dense layer then one sparse one.
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_topk": 2,  # LongCat's names for the same
    "ffn_hidden_size": 64,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    # Multi-head latent attention (DeepSeek-style low-rank keys/values).
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    # Linear attention (gated delta rule and the like).
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    # Sparse attention indexers.
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 8,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 16,
    # Partial rotary embeddings given in dimensions (CodeGen, GPT-J).
    "rotary_dim": 4,
    # State-space mixers.
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": "auto",
    "mamba_d_ssm": 64,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_chunk_size": 16,
    "mamba_dt_rank": 4,
    "state_size": 8,
    # Decoders of encoder-decoder families (their ForCausalLM is the decoder alone).
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    # Encoder families run as decoders only with causal self-attention.
    "is_decoder": True,
    # Vision and audio towers of multimodal configs (unused by text prompts, built anyway).
    "image_size": 16,
    "depth": 1,
    "out_hidden_size": 32,
    "patch_size": 8,
}
"""Sizes set wherever a config has the field (see ``tiny_config``)."""

_SLIDING = {"sliding_window": 8}
_MIXED = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}

WINDOWED: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    # Every layer sliding: a window and no layer_types in the config.
    "mistral": _SLIDING,
    "ministral": _SLIDING,
    "mixtral": _SLIDING,
    "phi3": _SLIDING,
    "starcoder2": _SLIDING,
    "qwen2": {**_SLIDING, "use_sliding_window": True, "max_window_layers": 1},
    # Sliding and full layers, by layer_types.
    "gemma2": _MIXED,
    "gemma3_text": _MIXED,
    "cohere2": _MIXED,
    "olmo3": _MIXED,
    "exaone4": _MIXED,
    "vaultgemma": _MIXED,
    "granite_swa": _MIXED,
    "cwm": _MIXED,
    "gpt_oss": _MIXED,
    # Chunked attention: a window that restarts every attention_chunk_size positions.
    "llama4_text": {
        "attention_chunk_size": 8,
        "layer_types": ["chunked_attention", "full_attention"],
    },
}
"""Windowed families (tests/models/test_engine_windowed.py) by model type, with what makes them
windowed (a window of 8 columns) in a tiny config."""

_MLA = {"num_key_value_heads": 4}  # latent attention expands its keys to every query head
_HYBRID = {"layer_types": ["linear_attention", "full_attention"]}

OVERRIDES: dict[str, dict[str, Any]] = {
    # Latent attention: as many key/value heads as query heads.
    "axk1": _MLA,
    "axk2": _MLA,
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "deepseek_v32": _MLA,
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA,
    "minicpm3": _MLA,
    "sarvam_mla": _MLA,
    "youtu": _MLA,
    "dots3_note_text": _MLA,
    "longcat_flash": {**_MLA, "head_dim": 4},  # its rotary embedding spans qk_rope_head_dim
    # Hybrids: one recurrent (linear-attention) layer and one attention layer; transformers'
    # generate counts cached tokens on an attention layer, so two recurrent layers fail there.
    "bailing_hybrid": _HYBRID,
    "granitemoehybrid": _HYBRID,
    "kimi_linear": _HYBRID,
    "qwen3_5_text": _HYBRID,
    "qwen3_5_moe_text": _HYBRID,
    "qwen3_next": _HYBRID,
    "qwen4_exp_text": _HYBRID,
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    # Zamba ties its shared transformer across hybrid layers: it needs two of them.
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    "mamba2": {"num_heads": 4, "head_dim": 16, "chunk_size": 16},  # heads x head_dim = 2 x 32
    # A looped model: one input layer, one layer run twice, one output layer.
    "dory": {
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "n_recurrent_loops": 2,
        "sliding_window": 8,
    },
    # Per-layer embeddings and shared key/value layers, sized for two layers.
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
        "altup_num_inputs": 2,
    },
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    # A draft head: every layer reads shared keys/values, no per-layer inputs.
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": 2,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        },
    },
    # Adapters whose widths must match the towers' and the text model's.
    "dots3_note": {
        "vision_config": {
            "mlp_layer_types": ["dense", "dense"],
            "adapter_in_dim": 32,
            "adapter_out_dim": 32,
        },
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32},
    },
    # Moshi's sub-configs take their vocabulary from the main config: left as the family
    # builds them. A window shorter than the prompts (its default is 3000).
    "moshi": {"depth_decoder_config": None, "audio_encoder_config": None, "sliding_window": 8},
    # Per-layer-type rotary settings, with a multimodal section that fits head_dim 8.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            }
        }
    },
    # DBRX names its sizes its own way; its attention reads attn_config.rope_theta, which its
    # config class does not define, and clamps by clip_qkv, which must be set.
    "dbrx": {
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 128,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # Fields derived from, or checked against, the default sizes.
    "inkling2_text": {"unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB},
    "reformer": {"axial_pos_shape": [8, 16], "axial_pos_embds_dim": [16, 16]},
    "xlnet": {"d_head": 8},
    "xmod": {"default_language": "en_XX"},
    "zaya": {"num_experts_per_tok": 1},
}
"""Per family: fields set after ``SIZES`` (``None`` leaves the family's default)."""


def _fields(config_class: type[Any]) -> set[str]:
    """The keyword arguments ``config_class`` takes: its dataclass fields and aliases."""
    names = {f.name for f in dataclasses.fields(config_class)}
    return names | set(getattr(config_class, "attribute_map", {}))


def _sized(config_class: type[Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``SIZES`` restricted to the fields of ``config_class``, then ``overrides``."""
    fields = _fields(config_class)
    kwargs = {key: value for key, value in SIZES.items() if key in fields}
    kwargs.update(overrides)
    return {key: value for key, value in kwargs.items() if value is not None}


def tiny_config(family: str, **extra: Any) -> Any:
    """A tiny config of model type ``family``: ``SIZES``, then ``OVERRIDES[family]`` and
    ``WINDOWED[family]``, then ``extra``.

    Each sub-config the family builds by default (text, vision, audio...) is shrunk the same
    way, with its own model type's overrides and window, then a dict given for it in the
    family's (``None`` there keeps the family's default sub-config)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    overrides = {**OVERRIDES.get(family, {}), **WINDOWED.get(family, {}), **extra}
    kwargs = _sized(config_class, overrides)
    for key, spec in (getattr(config_class, "sub_configs_defaults", None) or {}).items():
        given = overrides.get(key, {})
        if given is None or (spec.optional and key not in overrides):
            continue  # the family's default, or an optional tower left out as by default
        sub_class = CONFIG_MAPPING[spec.model_type] if spec.model_type else spec.config_class
        sub_type = str(getattr(sub_class, "model_type", ""))
        own = {**OVERRIDES.get(sub_type, {}), **WINDOWED.get(sub_type, {})}
        sized = _sized(sub_class, {**own, **given})
        kwargs[key] = {
            **spec.init_kwargs,
            **sized,
            **({"model_type": sub_type} if sub_type else {}),
        }
    return config_class(**kwargs)


@cache
def models(family: str) -> tuple[Any, Any, Any]:
    """(target, a 1%-noise copy that agrees often, a 30%-noise copy that rarely does) of
    ``tiny_config(family)``, built once per test session."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    return target, perturbed_copy(target, 0.01, seed=1), perturbed_copy(target, 0.3, seed=2)


def prompts(lengths: Sequence[int], seed: int = 5) -> list[list[int]]:
    """Random prompts of ``lengths`` tokens (ids 3 and up: no pad, BOS or EOS)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def reference(target: Any, prompt: Sequence[int], max_new: int) -> list[int]:
    """The target's own greedy continuation of ``prompt`` alone, EOS ignored."""
    with torch.inference_mode():
        out = target.generate(
            torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=max_new,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


def mismatch(
    target: Any, prompt: Sequence[int], got: Sequence[int], ref: Sequence[int]
) -> str | None:
    """Why ``got`` is not the target's greedy continuation ``ref`` of ``prompt`` (float ties
    allowed, ``flashspec._greedy``), or None when it is."""
    result = compare_greedy(target, prompt, got, ref)
    if result.status != "mismatch":
        return None
    return f"{len(prompt)}-token prompt: {result}\n  got {list(got)}\n  ref {list(ref)}"
