"""Structured output under speculation (``flashspec.grammar``, llguidance).

- Greedy with a grammar equals HF ``generate`` with the same grammar as a logits processor
  (its own matcher), on single rows and ragged batches, with a draft model that agrees (so most
  positions are verified after drafts the matcher had to consume and roll back) and with prompt
  lookup (whose drafts the grammar often refuses).
- Sampled JSON under a schema: every output parses and validates.
- Hostile or broken grammars are errors that name the problem.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import torch

from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

pytest.importorskip("llguidance")

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from flashspec.grammar import Grammar, GrammarError
from flashspec.grammar.spec import MAX_DEPTH
from flashspec.grammar.tokens import ll_tokenizer

VOCAB = 60  # the character tokenizer's 58 tokens and the braces
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["name: ", "{", "the answer is 42 and then some more words"]


@cache
def tokenizer() -> Any:
    """The shared character tokenizer with braces (which it lacks) after its 58 tokens."""
    return build_char_tokenizer(extra="{}")


@cache
def models() -> tuple[Any, Any]:
    target = build_llama(31, vocab_size=VOCAB, layers=2, init_range=0.3)
    return target, perturbed_copy(target, noise=0.02, seed=5)


def engine(drafter: str, sampling: SamplingConfig | None = None) -> SpeculativeEngine:
    target, draft = models()
    drafters: list[Drafter] = (
        [ModelDrafter(draft)] if drafter == "model" else [PromptLookupDrafter(min_ngram=1)]
    )
    config = FlashSpecConfig(
        sampling=sampling or SamplingConfig(gamma=4), bandit=BanditConfig(batches="fixed")
    )
    return SpeculativeEngine(config, drafters, TargetModel(model=target, tokenizer=tokenizer()))


class GrammarProcessor:
    """The reference: an HF logits processor masking by its own llguidance matcher, which
    consumes each newly generated token (one row)."""

    def __init__(self, grammar: Grammar, prompt: int) -> None:
        from llguidance import LLMatcher

        eos = [tokenizer().eos_token_id]
        self.matcher = LLMatcher(ll_tokenizer(tokenizer(), eos), grammar.llguidance_source())
        self.prompt = prompt
        self.seen = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.prompt :].tolist()
        assert self.matcher.consume_tokens(new[self.seen :])
        self.seen = len(new)
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((bits.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
        mask = torch.zeros(scores.shape[-1], dtype=torch.bool)
        n = min(scores.shape[-1], allowed.numel())
        mask[:n] = allowed[:n].bool()
        return scores.masked_fill(~mask, float("-inf"))


def hf_greedy(prompt: list[int], n: int, grammar: Grammar) -> list[int]:
    from transformers import LogitsProcessorList

    target, _ = models()
    out = target.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=tokenizer().eos_token_id,
        logits_processor=LogitsProcessorList([GrammarProcessor(grammar, len(prompt))]),
    )  # fmt: skip
    tokens = [int(t) for t in out[0, len(prompt) :]]
    eos = tokenizer().eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


GRAMMARS = {
    "regex": Grammar("regex", r"[a-z]{1,8}( [0-9]{1,3}){0,4}\."),
    "schema": Grammar.from_schema(SCHEMA),
    "lark": Grammar("lark", 'start: "(" item ("," item)* ")"\nitem: /[a-z]+/ | start'),
}


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("kind", sorted(GRAMMARS))
def test_greedy_with_a_grammar_equals_hf_with_the_same_mask(kind: str, drafter: str) -> None:
    grammar = GRAMMARS[kind]
    eng = engine(drafter)
    prompts = [tokenizer().encode(p, add_special_tokens=False) for p in PROMPTS]
    limits = [60, 45, 52]
    batch = eng.generate(prompts, max_new_tokens=limits, grammar=grammar)
    for row, (prompt, n) in enumerate(zip(prompts, limits, strict=True)):
        expected = hf_greedy(prompt, n, grammar)
        alone = eng.generate([prompt], max_new_tokens=n, grammar=grammar)
        assert alone.tokens[0] == expected, (row, alone.texts, tokenizer().decode(expected))
        assert batch.tokens[row] == expected, row
    if drafter == "model":
        assert batch.stats.accepted > 20  # positions after drafts the matcher took back


def validate(value: Any) -> None:
    """The schema's rules, checked by hand."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(tag in ("a", "bc") for tag in value["tags"])


def test_sampled_json_always_parses_and_validates() -> None:
    eng = engine("model", SamplingConfig(gamma=4, temperature=1.0))
    prompt = tokenizer().encode("json: ", add_special_tokens=False)
    grammar = Grammar.from_schema(SCHEMA)
    result = eng.generate([prompt] * 20, max_new_tokens=200, grammar=grammar, seed=3)
    assert result.texts is not None
    for text, reason in zip(result.texts, result.finish_reasons, strict=True):
        assert reason == "eos", (reason, text)
        validate(json.loads(text))
    # A free-form object may still be inside a string when the token budget ends (the API's
    # finish_reason "length"): every row that ended parses, and most rows end.
    objects = eng.generate([prompt] * 8, 200, grammar=Grammar("json_object"), seed=4)
    assert objects.texts is not None
    ended = [t for t, r in zip(objects.texts, objects.finish_reasons, strict=True) if r == "eos"]
    assert set(objects.finish_reasons) <= {"eos", "length"}
    assert len(ended) >= 4, objects.finish_reasons
    assert all(isinstance(json.loads(t), dict) for t in ended)


def test_rows_that_join_follow_the_grammar() -> None:
    eng = engine("model")
    grammar = GRAMMARS["regex"]
    prompts = [tokenizer().encode(p, add_special_tokens=False) for p in PROMPTS]
    stream = eng.stream([prompts[0]], max_new_tokens=60, grammar=grammar)
    joined = -1
    for chunk in stream:
        if joined < 0 and chunk.row == 0:
            joined = stream.join(prompts[2], 52)
    assert stream.result is not None
    assert stream.result.tokens[joined] == hf_greedy(prompts[2], 52, grammar)


def test_bad_grammars_are_clear_errors() -> None:
    deep: Any = {"type": "string"}
    for _ in range(MAX_DEPTH + 5):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match=r"nests .* levels deep"):
        Grammar.from_schema(deep)
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar("json_schema", "{not json")
    with pytest.raises(GrammarError, match="must be an object"):
        Grammar("json_schema", "[1, 2]")
    with pytest.raises(GrammarError, match="at most 65536"):
        Grammar("regex", "a" * 70_000)
    with pytest.raises(GrammarError, match="kind must be one of"):
        Grammar("xml")  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="needs a source"):
        Grammar("regex")
    eng = engine("lookup")
    with pytest.raises(GrammarError, match="does not compile"):
        eng.generate([[5, 6]], 4, grammar=Grammar("lark", "start: undefined_rule"))
    with pytest.raises(TypeError, match=r"grammar must be a flashspec\.grammar\.Grammar"):
        eng.generate([[5, 6]], 4, grammar={"type": "object"})  # type: ignore[arg-type]
