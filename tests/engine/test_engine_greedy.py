"""Greedy speculative decoding equals the target's own greedy ``generate``, token for token.

A difference is accepted only where the target's top two logits at the first differing position
are within 1e-4: a floating-point tie between one k-token forward and k one-token forwards.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from flashspec import (
    BanditConfig,
    FlashSpecConfig,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from tests.conftest import build_char_tokenizer, build_llama, perturbed_copy

TIE = 1e-4
MAX_NEW = 32
PROMPTS = [
    "def quicksort(arr):",
    "a",
    "x = 1",
    "for i in range(10):\n    print(i)",
    "hello world",
    "if x:",
    "import os",
    "return a + b",
    "class node:",
    "1 2 3 4 5 6",
    "aaaaaaaaaaaa",
    "the cat sat on the mat. the cat",
    "while true:\n  pass",
    "[1, 2, 3]",
    "print('hi')",
    "zz",
    "data = {'k': 1, 'v': 2}",
    "lambda x: x * 2",
    "abcabcabcabc",
    "; ; ; ;",
]


@cache
def tokenizer() -> Any:
    return build_char_tokenizer()


@cache
def models(kind: str) -> tuple[Any, Any]:
    """(target, draft). "loopy" damps attention so greedy output repeats: prompt lookup hits."""
    target = build_llama(0, init_range=0.3)
    if kind == "loopy":
        with torch.no_grad():
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.01)
    return target, perturbed_copy(target, 0.02, seed=1)


@cache
def reference(kind: str, prompt: str) -> tuple[int, ...]:
    """The target's own greedy continuation (batch 1, no padding), EOS included."""
    target, _ = models(kind)
    ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
    with torch.inference_mode():
        out = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    new = out[0, ids.shape[1] :].tolist()
    eos = target.generation_config.eos_token_id
    return tuple(new[: new.index(eos) + 1] if eos in new else new)


def check_equal(kind: str, prompt: str, got: list[int]) -> bool:
    """Assert ``got`` equals the reference; return True if they differ at a numerical tie."""
    return check_against(models(kind)[0], prompt, got, list(reference(kind, prompt)))


def check_against(target: Any, prompt: str, got: list[int], ref: list[int]) -> bool:
    for j, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            ids = torch.tensor([tokenizer()(prompt)["input_ids"] + ref[:j]])
            with torch.inference_mode():
                top = target(ids).logits[0, -1].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < TIE, (
                f"{prompt!r}: token {j} is {a}, target greedy gives {b}; "
                f"top-2 logit gap {gap:.2e} is no tie\ngot {got}\nref {ref}"
            )
            return True
    assert got == ref, f"{prompt!r}: length differs\ngot {got}\nref {ref}"
    return False


def make_engine(kind: str, drafter: str, gamma: int, **sampling: Any) -> SpeculativeEngine:
    target, draft = models(kind)
    drafters: list[Drafter] = [ModelDrafter(draft, name="draft")]
    if drafter == "lookup":
        drafters = [PromptLookupDrafter()]
    elif drafter == "both":
        drafters.append(PromptLookupDrafter())
    # batches="fixed": every batch size drafts at gamma, so the tests exercise it (the default
    # lets the throughput model shorten drafts in batches, or fall back to plain decoding).
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=gamma, **sampling), bandit=BanditConfig(batches="fixed")
    )
    return SpeculativeEngine(
        config, drafters, TargetModel("tiny", model=target, tokenizer=tokenizer())
    )


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize(("kind", "drafter"), [("plain", "model"), ("loopy", "lookup")])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_target_generate(kind: str, drafter: str, gamma: int, batch: int) -> None:
    engine = make_engine(kind, drafter, gamma)
    ties = 0
    accepted = 0
    for start in range(0, len(PROMPTS), batch):
        # Consecutive prompts have different lengths, so batches are left padded.
        group = PROMPTS[start : start + batch]
        result = engine.generate(group if batch > 1 else group[0], max_new_tokens=MAX_NEW)
        accepted += result.stats.accepted
        for prompt, tokens in zip(group, result.tokens, strict=True):
            ties += check_equal(kind, prompt, tokens)
    assert ties <= 2, f"{ties} numerical ties in {len(PROMPTS)} prompts is suspiciously many"
    assert accepted > 0, "no draft was ever accepted: the test would not exercise acceptance"


def test_greedy_with_two_drafters_and_bandit() -> None:
    engine = make_engine("loopy", "both", gamma=4)
    result = engine.generate(PROMPTS[:4], max_new_tokens=MAX_NEW)
    for prompt, tokens in zip(PROMPTS[:4], result.tokens, strict=True):
        check_equal("loopy", prompt, tokens)
    # Two arms: the default selection (the throughput model) chose among them.
    assert engine.model is not None and engine.model.rounds > 0


def test_greedy_confidence_stop_keeps_output() -> None:
    # Threshold 1.0: every distribution is "unsure", so each round drafts exactly one token.
    engine = make_engine("plain", "model", gamma=4, confidence_threshold=1.0)
    result = engine.generate(PROMPTS[0], max_new_tokens=MAX_NEW)
    check_equal("plain", PROMPTS[0], result.tokens[0])
    assert result.stats.drafted <= result.stats.rounds


def test_greedy_gpt2_target_with_llama_drafter() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=len(tokenizer()), n_embd=64, n_layer=2, n_head=4, n_positions=128,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    target: Any = GPT2LMHeadModel(config).eval()
    draft = perturbed_copy(target, 0.02, seed=2)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [ModelDrafter(draft, name="gpt2-draft"), ModelDrafter(models("plain")[1], name="llama")],
        TargetModel("gpt2-tiny", model=target, tokenizer=tokenizer()),
    )
    prompts = PROMPTS[:4]
    result = engine.generate(prompts, max_new_tokens=24)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
        with torch.inference_mode():
            out = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
        ref = out[0, ids.shape[1] :].tolist()
        check_against(target, prompt, tokens, ref[: ref.index(2) + 1] if 2 in ref else ref)


def test_greedy_sliding_window_target() -> None:
    """Sliding-window caches (Mistral) are rolled back and trimmed correctly."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    config = MistralConfig(
        vocab_size=len(tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, initializer_range=0.3,
    )  # fmt: skip
    target: Any = MistralForCausalLM(config).eval()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed")),
        [ModelDrafter(perturbed_copy(target, 0.02, seed=5), name="draft")],
        TargetModel("mistral-tiny", model=target, tokenizer=tokenizer()),
    )
    prompts = ["def quicksort(arr):", "ab", "hello world, this is long"]
    result = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, 24)
    assert result.stats.accepted > 0


def check_rows_without_eos(
    target: Any, prompts: list[str], rows: list[list[int]], max_new: int
) -> None:
    """Each row equals the target's own greedy ``generate`` of its prompt alone, EOS ignored."""
    for prompt, tokens in zip(prompts, rows, strict=True):
        ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
        with torch.inference_mode():
            out = target.generate(
                ids, do_sample=False, max_new_tokens=max_new, pad_token_id=0, eos_token_id=None
            )
        check_against(target, prompt, tokens, out[0, ids.shape[1] :].tolist())
