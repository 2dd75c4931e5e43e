"""The greedy identity setup the engine tests share: a tiny seeded target and a 2%-noise draft
(plain, or "loopy" so prompt lookup hits), 20 prompts, the target's own greedy continuations,
and the check that an output equals them up to a numerical tie.

A difference is accepted only where the target's top two logits at the first differing position
are within 1e-4 (``TIE``): a floating-point tie between one k-token forward and k one-token
forwards.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from flashspec import (
    BanditConfig,
    FlashSpecConfig,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

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
