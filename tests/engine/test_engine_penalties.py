"""Penalties, logit bias and logprobs under speculation, against independent references.

- Greedy with ``repetition_penalty`` equals HF ``generate(repetition_penalty=...)``; with
  OpenAI's presence/frequency penalties and a logit bias it equals HF ``generate`` with a
  float64 reference processor, single rows and ragged batches, with drafts that are mostly
  accepted (so most emitted tokens come from positions that see drafts before them).
- Sampled: chi-squared of the first two tokens against the exact penalized distributions.
- Logprobs: equal to the log-softmax of the logits HF ``generate`` returns (``output_logits``).
"""

from __future__ import annotations

from collections import Counter
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
    TokenLogprob,
)
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from tests.helpers.chi2 import assert_first_two_follow
from tests.helpers.models import build_llama, perturbed_copy

VOCAB = 24
PROMPTS = [[3, 5, 7, 5, 3, 9], [4, 4, 4, 8, 10, 12, 4, 4, 11], [6, 7]]
MAX_NEW = [30, 17, 24]


@cache
def models() -> tuple[Any, Any]:
    """A tiny target that repeats itself a lot (few tokens), and a draft that mostly agrees."""
    target = build_llama(21, vocab_size=VOCAB, layers=2, hidden=32, init_range=0.3)
    return target, perturbed_copy(target, noise=0.02, seed=3)


class Reference:
    """OpenAI's presence/frequency penalties over the generated tokens only, and a bias, in
    float64, as an HF logits processor (the independent reference)."""

    def __init__(self, prompt: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt, self.presence, self.frequency, self.bias = prompt, presence, frequency, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        x = scores.double()
        for b in range(x.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt :], minlength=x.shape[1]).double()
            x[b] -= self.presence * (counts > 0).double() + self.frequency * counts
        for token, value in self.bias.items():
            x[:, token] += value
        return x.float()


def hf_greedy(prompt: list[int], n: int, **kwargs: Any) -> list[int]:
    from transformers import LogitsProcessorList

    target, _ = models()
    processors = kwargs.pop("reference", None)
    out = target.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([processors]) if processors else None,
        **kwargs,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def engine(sampling: SamplingConfig, drafter: str = "model") -> SpeculativeEngine:
    target, draft = models()
    drafters: list[Drafter] = (
        [ModelDrafter(draft)] if drafter == "model" else [PromptLookupDrafter(min_ngram=1)]
    )
    config = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed"))
    return SpeculativeEngine(config, drafters, TargetModel(model=target))


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_equals_hf(penalty: float, drafter: str) -> None:
    eng = engine(SamplingConfig(gamma=4, repetition_penalty=penalty), drafter)
    alone = [
        eng.generate([p], max_new_tokens=n, ignore_eos=True)
        for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    batch = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)
    drafted = 0
    for row, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        expected = hf_greedy(prompt, n, repetition_penalty=penalty)
        assert alone[row].tokens[0] == expected, row
        assert batch.tokens[row] == expected, row
        drafted += alone[row].stats.accepted
    # Many positions saw accepted drafts before them (lookup finds fewer under the penalty).
    assert drafted > (10 if drafter == "model" else 0), drafted


@pytest.mark.parametrize(
    ("presence", "frequency", "bias"),
    [(1.2, 0.0, {}), (0.0, 0.8, {}), (0.5, 0.5, {7: 3.0, 3: -100.0}), (-1.0, 0.3, {})],
)
def test_greedy_openai_penalties_and_bias_equal_reference(
    presence: float, frequency: float, bias: dict[int, float]
) -> None:
    sampling = SamplingConfig(
        gamma=4, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias
    )
    eng = engine(sampling)
    batch = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)
    for row, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        reference = Reference(len(prompt), presence, frequency, bias)
        expected = hf_greedy(prompt, n, reference=reference)
        assert eng.generate([prompt], max_new_tokens=n, ignore_eos=True).tokens[0] == expected
        assert batch.tokens[row] == expected, row
        if bias.get(3) == -100.0:
            assert 3 not in batch.tokens[row]


def exact_two(sampling: SamplingConfig, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 distributions of the first and second emitted tokens under penalties
    (temperature 1): the second averages over the first."""
    target, _ = models()

    def penalized(logits: torch.Tensor, seen: list[int], output: list[int]) -> torch.Tensor:
        x = logits.double().clone()
        rp = sampling.repetition_penalty
        for t in set(seen) | set(output):
            x[t] = x[t] * rp if x[t] < 0 else x[t] / rp
        for t in set(output):
            x[t] -= sampling.presence_penalty + sampling.frequency_penalty * output.count(t)
        for t, value in (sampling.logit_bias or {}).items():
            x[t] += value
        return x.softmax(-1)

    with torch.inference_mode():
        first = penalized(target(torch.tensor([prompt])).logits[0, -1], prompt, [])
        after = target(torch.tensor([[*prompt, x] for x in range(VOCAB)])).logits[:, -1]
    second = sum(first[x] * penalized(after[x], prompt, [x]) for x in range(VOCAB))
    assert isinstance(second, torch.Tensor)
    return first, second


def test_sampled_tokens_follow_the_penalized_target() -> None:
    """Chi-squared (alpha 0.01) of the first and second tokens with every penalty on, 4
    drafts a round from a draft close to the target (so the second token mostly comes from a
    position after an accepted draft, which the penalties must count) but not equal to it."""
    target, _ = models()
    draft = perturbed_copy(target, noise=0.3, seed=4)
    # The bias makes two tokens likely, so whether the second repeats the first (what the
    # penalties act on) carries much of the second token's mass.
    sampling = SamplingConfig(
        gamma=4, temperature=1.0, repetition_penalty=1.3, presence_penalty=1.5,
        frequency_penalty=0.5, logit_bias={5: 3.0, 7: 3.0},
    )  # fmt: skip
    config = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed"))
    eng = SpeculativeEngine(config, [ModelDrafter(draft)], TargetModel(model=target))
    prompt = PROMPTS[0]
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(30):
        result = eng.generate([prompt] * 50, max_new_tokens=2, ignore_eos=True, seed=100 + call)
        for tokens in result.tokens:
            first[tokens[0]] += 1
            second[tokens[1]] += 1
    assert_first_two_follow(first, second, *exact_two(sampling, prompt))


@pytest.mark.parametrize("rows", [1, 3])
def test_logprobs_equal_hf_output_logits(rows: int) -> None:
    """Every emitted token's logprob (and the top 5) is the log-softmax of the raw logits HF
    ``generate`` returns at that step, with penalties on (logprobs are taken before them)."""
    sampling = SamplingConfig(gamma=4, repetition_penalty=1.2)
    eng = engine(sampling)
    prompts, limits = PROMPTS[:rows], MAX_NEW[:rows]
    result = eng.generate(prompts, max_new_tokens=limits, ignore_eos=True, logprobs=5)
    assert result.logprobs is not None
    target, _ = models()
    for row, (prompt, n) in enumerate(zip(prompts, limits, strict=True)):
        out = target.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0, repetition_penalty=1.2, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        assert result.tokens[row] == out.sequences[0, len(prompt) :].tolist()
        reported = result.logprobs[row]
        assert len(reported) == n and all(isinstance(t, TokenLogprob) for t in reported)
        for step, entry in enumerate(reported):
            logp = out.logits[step][0].double().log_softmax(-1)
            assert entry.token == result.tokens[row][step]
            assert abs(entry.logprob - float(logp[entry.token])) < 1e-4
            top_values, top_ids = logp.topk(5)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert all(
                abs(v - float(w)) < 1e-4 for (_, v), w in zip(entry.top, top_values, strict=True)
            )


def test_prompt_logprobs_equal_hf_scoring_the_prompt() -> None:
    """``engine.prompt_logprobs`` (the server's ``echo``): token i + 1 of the prompt scored by
    the log-softmax of the target's logits at position i over the whole prompt, top 3 too;
    bad ids and bounds are ValueErrors naming them."""
    eng = engine(SamplingConfig(gamma=4))
    target, _ = models()
    prompt = PROMPTS[0]
    entries = eng.prompt_logprobs(prompt, 3)
    with torch.inference_mode():
        logp = target(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert [e.token for e in entries] == prompt[1:]
    for i, entry in enumerate(entries):
        assert abs(entry.logprob - float(logp[i, prompt[i + 1]])) < 1e-4
        assert [t for t, _ in entry.top] == logp[i].topk(3).indices.tolist()
    assert eng.prompt_logprobs(prompt[:1]) == []
    with pytest.raises(ValueError, match="prompt_ids"):
        eng.prompt_logprobs([VOCAB])
    with pytest.raises(ValueError, match="top"):
        eng.prompt_logprobs(prompt, 21)


def test_streamed_logprobs_match_the_result_and_stop_cuts_them() -> None:
    eng = engine(SamplingConfig(gamma=4))
    stream = eng.stream([PROMPTS[0]], max_new_tokens=20, ignore_eos=True, logprobs=0)
    streamed: list[TokenLogprob] = []
    for chunk in stream:
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
        streamed += chunk.logprobs
    assert stream.result is not None and stream.result.logprobs is not None
    assert streamed == stream.result.logprobs[0] and all(not t.top for t in streamed)
    # EOS cuts a round's tokens; the logprobs follow.
    tokens = stream.result.tokens[0]
    ended = eng.generate([PROMPTS[0]], max_new_tokens=20, eos_token_id=tokens[5], logprobs=2)
    assert ended.logprobs is not None
    assert [t.token for t in ended.logprobs[0]] == ended.tokens[0] == tokens[:6]
    assert eng.generate([PROMPTS[0]], max_new_tokens=4).logprobs is None


def test_bad_penalties_are_clear_errors() -> None:
    for field, value in (
        ("repetition_penalty", 0.0), ("repetition_penalty", float("nan")),
        ("presence_penalty", 2.5), ("frequency_penalty", float("inf")),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=f"SamplingConfig.{field} must be"):
            SamplingConfig(**{field: value})
    with pytest.raises(ValueError, match=r"logit_bias\[3\] must be in \[-100, 100\]"):
        SamplingConfig(logit_bias={3: 1e9})
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingConfig(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias must be a mapping"):
        SamplingConfig(logit_bias=[1, 2])  # type: ignore[arg-type]
    eng = engine(SamplingConfig())
    with pytest.raises(ValueError, match="outside the target's vocabulary of 24"):
        eng.generate([PROMPTS[0]], 4, sampling=SamplingConfig(logit_bias={VOCAB: 1.0}))
    for bad in (-1, 21, 2.5, "3"):
        with pytest.raises(ValueError, match=r"logprobs must be None \(off\) or an integer"):
            eng.generate([PROMPTS[0]], 4, logprobs=bad)  # type: ignore[arg-type]


def test_drafts_are_penalized_like_the_target() -> None:
    """A draft equal to the target, penalized the same way step by step, proposes exactly the
    penalized target's tokens: every draft is accepted (unpenalized drafts are exact too, but
    rejected wherever a penalty changes the argmax)."""
    import copy

    target, _ = models()
    sampling = SamplingConfig(
        gamma=4, repetition_penalty=1.3, presence_penalty=2.0, frequency_penalty=1.0,
        logit_bias={5: 2.0},
    )  # fmt: skip
    config = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed"))
    eng = SpeculativeEngine(
        config, [ModelDrafter(copy.deepcopy(target))], TargetModel(model=target)
    )
    result = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert result.stats.drafted > 40
    assert result.stats.accepted == result.stats.drafted, result.stats


def test_rows_of_one_batch_each_follow_their_own_penalties() -> None:
    """Rows with different penalties and biases in one batch (``sampling=`` per row): each
    equals HF greedy with its own processor, alone and beside the others, and a row without
    any beside penalized rows keeps plain greedy decoding."""
    settings = [
        SamplingConfig(gamma=4, repetition_penalty=1.5),
        SamplingConfig(gamma=4, presence_penalty=0.5, frequency_penalty=0.5,
                       logit_bias={7: 3.0, 3: -100.0}),
        SamplingConfig(gamma=4),
    ]  # fmt: skip
    references: list[dict[str, Any]] = [
        {"repetition_penalty": 1.5},
        {"reference": Reference(len(PROMPTS[1]), 0.5, 0.5, {7: 3.0, 3: -100.0})},
        {},
    ]
    eng = engine(SamplingConfig(gamma=4))
    batch = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True, sampling=settings)
    swapped = eng.generate(
        PROMPTS[::-1], max_new_tokens=MAX_NEW[::-1], ignore_eos=True, sampling=settings[::-1]
    )
    for row, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW, strict=True)):
        expected = hf_greedy(prompt, n, **references[row])
        assert batch.tokens[row] == expected, row
        assert swapped.tokens[len(PROMPTS) - 1 - row] == expected, row
    assert 3 not in batch.tokens[1]
    assert batch.stats.accepted > 10, batch.stats


def test_a_sampled_row_follows_its_own_penalties_beside_other_rows() -> None:
    """Chi-squared (alpha 0.01) of the first two tokens of rows with every penalty on, and of
    rows with none, sampled in the same batches: each follows its own exact distribution."""
    target, _ = models()
    draft = perturbed_copy(target, noise=0.3, seed=4)
    penalized = SamplingConfig(
        gamma=4, temperature=1.0, repetition_penalty=1.3, presence_penalty=1.5,
        frequency_penalty=0.5, logit_bias={5: 3.0, 7: 3.0},
    )  # fmt: skip
    plain = SamplingConfig(gamma=4, temperature=1.0)
    config = FlashSpecConfig(sampling=plain, bandit=BanditConfig(batches="fixed"))
    eng = SpeculativeEngine(config, [ModelDrafter(draft)], TargetModel(model=target))
    prompt = PROMPTS[0]
    counts = {name: (Counter[int](), Counter[int]()) for name in ("penalized", "plain")}
    for call in range(30):
        rows = [penalized, plain] * 25
        result = eng.generate(
            [prompt] * len(rows), max_new_tokens=2, ignore_eos=True, sampling=rows,
            seed=[1000 * call + i for i in range(len(rows))],
        )  # fmt: skip
        for config, tokens in zip(rows, result.tokens, strict=True):
            first, second = counts["penalized" if config is penalized else "plain"]
            first[tokens[0]] += 1
            second[tokens[1]] += 1
    assert_first_two_follow(*counts["penalized"], *exact_two(penalized, prompt))
    assert_first_two_follow(*counts["plain"], *exact_two(plain, prompt))
