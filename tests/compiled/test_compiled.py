"""The compiled path (``FlashSpecConfig(compile=True)``): static KV caches and torch.compile'd
draft and verify steps give the same tokens and the same distribution as the eager path.

Greedy output is checked against HF's own ``generate`` (eager, dynamic cache) under the tie rule
of ``test_engine_greedy``; sampling by the chi-squared test of ``test_engine_distribution``.
Every test also checks that the compiled steps really ran, and ran without recompiling.
"""

from __future__ import annotations

import logging
from collections import Counter
from functools import cache

import pytest
import torch

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.compiled import resolve_compile
from flashspec.compiled.static import MIN_COLUMNS, capacity_for, new_static_cache
from flashspec.compiled.step import CompiledForward, RecompileError
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from tests.helpers.chi2 import assert_first_two_follow
from tests.helpers.distribution import PROMPT, exact
from tests.helpers.distribution import models as distribution_models
from tests.helpers.greedy import PROMPTS, check_equal, models, tokenizer
from tests.helpers.models import build_llama

MAX_NEW = 32


@pytest.fixture(autouse=True)
def _recompiles_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSPEC_COMPILE_DEBUG", "1")


@cache
def greedy_engine(drafter: str, gamma: int) -> SpeculativeEngine:
    target, draft = models("loopy" if drafter == "lookup" else "plain")
    drafters: list[Drafter] = (
        [PromptLookupDrafter()] if drafter == "lookup" else [ModelDrafter(draft, name="draft")]
    )
    # The lookup engine also has the plain-decoding arm: its 1-token verification is compiled.
    bandit = BanditConfig(plain=drafter == "lookup", batches="fixed")
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=gamma), bandit=bandit, compile=True)
    return SpeculativeEngine(
        config, drafters, TargetModel("tiny", model=target, tokenizer=tokenizer())
    )


def compiled_parts(engine: SpeculativeEngine) -> list[CompiledForward]:
    parts = [engine.target.compiled, *(d.lm.compiled for d in engine.drafters if d.lm)]
    assert all(part is not None for part in parts), "the compiled path is not on"
    return [part for part in parts if part is not None]


@pytest.mark.parametrize(("drafter", "gamma"), [("model", 3), ("model", 1), ("lookup", 4)])
def test_compiled_greedy_equals_target_generate(drafter: str, gamma: int) -> None:
    engine = greedy_engine(drafter, gamma)
    assert engine.compiled.on, engine.compiled.reason
    kind = "loopy" if drafter == "lookup" else "plain"
    compiling, before = 0.0, sum(p.compile_seconds for p in compiled_parts(engine))
    for prompt in PROMPTS:
        result = engine.generate(prompt, MAX_NEW)
        check_equal(kind, prompt, result.tokens[0])
        compiling += result.stats.time_compile
    # The generations' stats carry the compile time the models counted.
    after = sum(p.compile_seconds for p in compiled_parts(engine))
    assert compiling == pytest.approx(after - before)
    for part in compiled_parts(engine):
        assert part.failed is None, part.failed
        assert part.compiled_calls > 0, f"{part.name}: no compiled forward ran"
        assert part.recompiles == 0
        # One graph per compiled length at most, all in the smallest capacity bucket.
        assert {shape[2] for shape in part.graphs} == {MIN_COLUMNS}
        assert len(part.graphs) <= len(part.lengths)


def test_compiled_matches_eager_engine_at_every_length() -> None:
    """Short limits end generations inside a round (shorter, padded verifications) and long
    prompts take a larger capacity bucket: tokens stay those of the eager engine."""
    compiled = greedy_engine("model", 3)
    target, draft = models("plain")
    eager = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), compile=False),
        [ModelDrafter(draft, name="draft")],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    # 216 tokens and 48 new pass the smallest bucket (and the tiny model's 256 positions).
    long_prompt = "def f(x):\n    return x + 1\n" * 8
    for prompt, limit in [("x = 1", 1), ("x = 1", 2), ("import os", 5), (long_prompt, 48)]:
        got = compiled.generate(prompt, limit).tokens[0]
        want = eager.generate(prompt, limit).tokens[0]
        assert got == want, f"{prompt[:20]!r} limit {limit}: {got} != {want}"
    part = compiled.target.compiled
    assert part is not None and any(shape[2] > MIN_COLUMNS for shape in part.graphs)


def test_batches_and_joins_stay_exact_on_the_compiled_path() -> None:
    """A batch runs in a static cache of fixed slots; a stream of one row starts in a
    one-slot cache and moves into a two-slot one when a row joins: rows still equal HF's
    (``test_compiled_batches`` checks the slots themselves)."""
    engine = greedy_engine("model", 3)
    batch = ["def quicksort(arr):", "x = 1", "hello world"]
    result = engine.generate(batch, MAX_NEW)
    for prompt, tokens in zip(batch, result.tokens, strict=True):
        check_equal("plain", prompt, tokens)
    stream = engine.stream("import os", MAX_NEW)
    rows: dict[int, list[int]] = {0: []}
    for i, chunk in enumerate(stream):
        rows.setdefault(chunk.row, []).extend(chunk.token_ids)
        if i == 2:
            rows[stream.join("class node:", MAX_NEW)] = []
    check_equal("plain", "import os", rows[0])
    check_equal("plain", "class node:", rows[1])


@cache
def sampled_engine(gamma: int) -> SpeculativeEngine:
    target, draft = distribution_models()
    return SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=gamma), compile=True),
        [ModelDrafter(draft)],
        TargetModel(model=target),
    )


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_compiled_sampling_follows_target(gamma: int, temperature: float, top_p: float) -> None:
    """Chi-squared (alpha 0.01) of the first and second tokens, 300 seeded generations. With
    gamma 1 the drafts disagree often, so the second token often comes from a second round:
    a compiled verification after the eager prefill."""
    engine = sampled_engine(gamma)
    sampling = SamplingConfig(gamma=gamma, temperature=temperature, top_p=top_p)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(300):
        # Room for a second round that drafts too (the stream is left after two tokens).
        stream = engine.stream(
            PROMPT, gamma + 3, ignore_eos=True, seed=1000 * gamma + call, sampling=sampling
        )
        tokens: list[int] = []
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            if len(tokens) >= 2:
                break
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert_first_two_follow(first, second, *exact(temperature, top_p))
    for part in compiled_parts(engine):
        assert part.compiled_calls > 0 and part.recompiles == 0 and part.failed is None


def test_recompile_is_detected() -> None:
    """A graph whose guards fail after warm-up is reported (an error in debug mode): here the
    model's weights are swapped for tensors of another dtype behind the engine's back."""
    model = build_llama(3, vocab_size=16, layers=1, hidden=32)
    forward = CompiledForward(model, [1], "tiny")
    cache_ = new_static_cache(model, 256)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        forward(ids, torch.arange(5)[None], 0, cache_)  # eager prefill makes the buffers
        forward(ids[:, :1], torch.tensor([[5]]), 5, cache_)
        assert forward.compiled_calls == 1 and forward.recompiles == 0
        model.to(torch.float64)
        with pytest.raises(RuntimeError, match="after it was compiled"):
            forward(ids[:, :1], torch.tensor([[6]]), 6, cache_)
    assert issubclass(RecompileError, RuntimeError)


def test_capacity_buckets() -> None:
    assert capacity_for(1) == MIN_COLUMNS
    assert capacity_for(MIN_COLUMNS) == MIN_COLUMNS
    assert capacity_for(MIN_COLUMNS + 1) == 2 * MIN_COLUMNS
    assert capacity_for(3000) == 4096


def test_compile_setting_is_checked_and_explained(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        FlashSpecConfig(compile="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile must be"):
        FlashSpecConfig(compile=1)  # type: ignore[arg-type]
    target, draft = models("plain")
    lm = TargetModel("tiny", model=target, tokenizer=tokenizer())
    assert not resolve_compile("auto", [lm]).on  # a one-off CPU process: off, with the reason
    assert "outside a server" in resolve_compile("auto", [lm]).reason
    assert resolve_compile("auto", [lm], long_lived=True).on
    assert not resolve_compile(False, [lm]).on
    with caplog.at_level(logging.INFO, logger="flashspec"):
        SpeculativeEngine(
            FlashSpecConfig(), [ModelDrafter(draft)], TargetModel(model=target), long_lived=False
        )
    assert any("compiled path off" in record.getMessage() for record in caplog.records)


def test_compile_true_refuses_a_model_it_cannot_run() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    torch.manual_seed(0)
    target = TargetModel(model=MistralForCausalLM(config).eval())
    with pytest.raises(ValueError, match=r"compile=True cannot be honoured.*sliding"):
        SpeculativeEngine(
            FlashSpecConfig(compile=True), [PromptLookupDrafter()], target, long_lived=False
        )
    auto = SpeculativeEngine(FlashSpecConfig(compile="auto"), [PromptLookupDrafter()], target)
    assert not auto.compiled.on and "sliding" in auto.compiled.reason


def test_cli_compile_flag() -> None:
    from flashspec.options import UserError, compile_setting

    assert compile_setting("on") is True
    assert compile_setting("off") is False
    assert compile_setting("auto") == "auto"
    with pytest.raises(UserError, match="--compile"):
        compile_setting("yes")


def test_warm_up_compiles_before_the_first_generation() -> None:
    """``engine.warm_up()`` (what the server runs before it listens) compiles every step the
    generations then use: no compile happens inside a generation afterwards."""
    target, draft = models("plain")
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=2), compile=True),
        [ModelDrafter(draft, name="draft")],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    assert engine.warm_up() > 0
    parts = compiled_parts(engine)
    assert all(part.compile_seconds > 0 for part in parts)
    before = [(set(part.graphs), part.compile_seconds) for part in parts]
    assert all(graphs for graphs, _ in before)
    result = engine.generate("def quicksort(arr):", MAX_NEW)
    check_equal("plain", "def quicksort(arr):", result.tokens[0])
    assert [(set(part.graphs), part.compile_seconds) for part in parts] == before
    assert result.stats.time_compile == 0.0 and "time_compile" in result.stats.as_dict()
    assert all(part.compiled_calls > len(part.lengths) for part in parts)


def _hf_greedy(target: torch.nn.Module, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
    with torch.inference_mode():
        out = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)  # type: ignore[operator]
    new: list[int] = out[0, ids.shape[1] :].tolist()
    eos = target.generation_config.eos_token_id  # type: ignore[union-attr]
    return new[: new.index(eos) + 1] if eos in new else new


def test_frozen_warm_up_compiles_nothing_while_serving() -> None:
    """``warm_up(rows, freeze=True)`` (the server's): a context longer than the warmed bucket
    and a batch of more slots than warmed run eager, with the same tokens, instead of
    compiling while other streams wait; what was warmed still runs compiled."""
    from flashspec.compiled.static import MIN_COLUMNS
    from tests.helpers.greedy import check_against
    from tests.helpers.models import perturbed_copy

    target = build_llama(0, init_range=0.3, max_positions=4 * MIN_COLUMNS)
    draft = perturbed_copy(target, 0.02, seed=1)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=2), compile=True),
        [ModelDrafter(draft, name="draft")],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    assert engine.target.frozen_buckets is None
    engine.warm_up(2, freeze=True)
    assert engine.target.frozen_buckets == {(MIN_COLUMNS, 1), (MIN_COLUMNS, 2)}
    parts = compiled_parts(engine)

    def compiled_shapes() -> list[object]:
        return [(set(p.graphs), set(p.batch_graphs), p.compile_seconds) for p in parts]

    before = compiled_shapes()
    long = "def quicksort(arr):\n" * (MIN_COLUMNS // 16)  # past the warmed context bucket
    assert len(tokenizer()(long)["input_ids"]) > MIN_COLUMNS
    short = ["x = 1", "hello world", "import os"]  # three rows: the 4-slot bucket, not warmed
    result = engine.generate(long, MAX_NEW)
    check_against(target, long, result.tokens[0], _hf_greedy(target, long))
    batch = engine.generate(short, MAX_NEW)
    for prompt, tokens in zip(short, batch.tokens, strict=True):
        check_against(target, prompt, tokens, _hf_greedy(target, prompt))
    assert compiled_shapes() == before
    calls = engine.target.compiled.compiled_calls  # type: ignore[union-attr]
    alone = engine.generate(short[0], MAX_NEW)
    check_against(target, short[0], alone.tokens[0], _hf_greedy(target, short[0]))
    assert engine.target.compiled.compiled_calls > calls  # type: ignore[union-attr]
    assert compiled_shapes() == before
