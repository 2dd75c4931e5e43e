"""Greedy speculative decoding equals the target's own greedy ``generate``, token for token.

A difference is accepted only where the target's top two logits at the first differing position
are within 1e-4: a floating-point tie between one k-token forward and k one-token forwards.
"""

from __future__ import annotations

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
from flashspec.drafters import ModelDrafter
from tests.helpers.greedy import (
    MAX_NEW,
    PROMPTS,
    check_against,
    check_equal,
    check_rows_without_eos,
    make_engine,
    models,
    tokenizer,
)
from tests.helpers.models import perturbed_copy


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
