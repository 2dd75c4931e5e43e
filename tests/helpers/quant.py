"""Tiny quantized Llama GGUF files and their references, for the quantized-model tests.

``Variant`` says which tensors of a tiny Llama file (``tests.helpers.gguf.write_tiny_gguf``) are in
which format; ``make_files`` writes each once with transformers' own load of it (gguf-py
dequantizes every tensor: the reference, sharing no code with the kernels); ``hf_greedy`` and
``assert_greedy_same`` compare greedy outputs under the tie rule of ``flashspec._greedy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashspec._greedy import compare_greedy
from flashspec.quant import QuantizedLoad, build_quantized_model
from tests.helpers.gguf import EOS_ID, transformers_gguf_load, write_tiny_gguf

# Tensor kinds of the tiny Llama file that are matrices (everything but the norms).
PROJECTIONS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
HF_PROJECTIONS = [
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
]  # fmt: skip
LAYERS = 2
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]
# The layout a load keeps each format in, where it is not the file's (ext/quant.h): the K
# formats are repacked; Q5_0 (like Q4_0, Q4_1, Q8_0) runs on the file's own blocks.
LOADED_AS = {"Q4_K": "Q4_KR", "Q6_K": "Q6_KR"}
# Repetitive prompts, so prompt-lookup drafts get proposed, accepted and rejected.
LOOKUP_PROMPTS = [
    "the dog the dog the dog the dog",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "hello world hello world hello",
]
RELATIVE = 1e-4  # of the largest |logit|: float32 sums in another order, nothing more


@dataclass(frozen=True)
class Variant:
    """One test file: which tensors are in which format, and how wide the model is."""

    name: str
    types: dict[str, str]
    hidden: int = 64
    ffn: int = 128
    untied: bool = False

    def write(self, folder: Path) -> Path:
        # Weight scales shrink with width so the 256-wide files behave like the 64-wide ones
        # (softmax neither saturated nor flat: greedy and sampling tests see real choices).
        width = self.hidden / 64
        return write_tiny_gguf(
            folder / self.name / "tiny.gguf",
            quant_types=self.types,
            hidden=self.hidden,
            ffn=self.ffn,
            scale=0.18 / width**0.5,
            embed_scale=0.5 / width**0.5,
            untied_output=self.untied,
        )


def every_matrix(fmt: str, untied: bool = False) -> Variant:
    wide = fmt.endswith("_K")  # K formats' blocks are 256 weights: rows must be that long
    types = dict.fromkeys([*PROJECTIONS, "token_embd", *(["output"] if untied else [])], fmt)
    return Variant(
        f"{fmt}{'-untied' if untied else ''}",
        types,
        hidden=256 if wide else 64,
        ffn=512 if wide else 128,
        untied=untied,
    )


VARIANTS = {fmt: every_matrix(fmt) for fmt in FORMATS}
# SmolLM2's mix: Q8_0 tied embedding, Q4_1 feed-forward, attention in float32.
MIXED = Variant("mixed", {"token_embd": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1",
                          "ffn_down": "Q4_1"})  # fmt: skip
UNTIED = every_matrix("Q4_0", untied=True)
# What llama.cpp's Q4_K_M makes of a model whose width is not a multiple of 256 (SmolLM2's
# 576): Q5_0 where Q4_K does not fit, Q8_0 for Q6_K's, the K formats on the wide rows.
Q4_K_M = Variant("Q4_K_M", {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0",
                            "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
                            "ffn_down": "Q6_K", "token_embd": "Q4_K"},
                 hidden=256, ffn=512)  # fmt: skip


@dataclass
class Files:
    path: Path
    reference: Any
    tokenizer: Any

    def quantized(self) -> tuple[Any, QuantizedLoad]:
        """A fresh quantized model (the engine makes its model lean in place: tests don't
        share one)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path.parent, gguf_file=self.path.name)
        return build_quantized_model(self.path, config)


def make_files(root: Path) -> Callable[[Variant], Files]:
    """``make(variant)``: the variant's file under ``root`` with transformers' load of it, each
    written and loaded once."""
    made: dict[str, Files] = {}

    def make(variant: Variant) -> Files:
        if variant.name not in made:
            path = variant.write(root)
            model, tokenizer = transformers_gguf_load(path)
            made[variant.name] = Files(path, model, tokenizer)
        return made[variant.name]

    return make


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, cut after its first EOS (the engine stops there)."""
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=EOS_ID,
        )
    tokens: list[int] = out[0, len(ids) :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def assert_greedy_same(reference: Any, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Identical, or first different where the dequantized model's top two logits tie."""
    verdict = compare_greedy(reference, prompt, got, want)
    assert verdict.status != "mismatch", (
        f"greedy output differs at token {verdict.at} (logit gap {verdict.gap}): "
        f"got {got}, transformers {want}"
    )


def max_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def exact_first_two(
    reference: Any, ids: list[int], warp: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 distributions of the first and second sampled token from the dequantized model:
    p1, and the sum over x of p1(x) p(. | prompt + x); ``warp`` (temperature, top-p: HF's
    processors in the tests) is applied to the logits first, as sampling does."""
    warp = warp or (lambda logits: logits)
    with torch.inference_mode():
        first = torch.softmax(warp(reference(torch.tensor([ids])).logits[:, -1]).double(), -1)[0]
        vocab = first.shape[0]
        extended = torch.tensor([[*ids, x] for x in range(vocab)])
        second_given = torch.softmax(warp(reference(extended).logits[:, -1]).double(), -1)
    return first, first @ second_given
