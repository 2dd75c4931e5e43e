"""Ragged batches on the compiled path: a static cache of fixed slots (``flashspec.kv.slots``)
and graphs per slot bucket (``CompiledForward.batch``). Every row equals HF's own ``generate``
of its prompt alone, through rows finishing at their own lengths, dead columns, compaction and
rows joining a running stream; a sampled row inside a batch whose neighbours draft elsewhere
follows the target (chi-squared, alpha 0.01); the graphs are one per (slot bucket, length,
capacity), none recompiled."""

from __future__ import annotations

from functools import cache

import pytest
import torch

import flashspec.kv.layout as layout
import flashspec.kv.slots as slots
from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.compiled.static import new_static_cache
from flashspec.compiled.step import CompiledForward
from flashspec.drafters import ModelDrafter
from flashspec.engine.build import compile_seconds
from flashspec.kv.slots import SLOT_BUCKETS
from flashspec.select.policy import Choice, Outcome
from tests.helpers.chi2 import assert_first_two_follow, first_two_counts
from tests.helpers.distribution import PROMPT, exact
from tests.helpers.distribution import models as distribution_models
from tests.helpers.greedy import PROMPTS, check_equal, check_rows_without_eos, models, tokenizer
from tests.helpers.models import build_llama

MAX_NEW = 32


@pytest.fixture(autouse=True)
def _recompiles_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSPEC_COMPILE_DEBUG", "1")


@cache
def greedy_engine() -> SpeculativeEngine:
    target, draft = models("plain")
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed"), compile=True
    )
    return SpeculativeEngine(
        config, [ModelDrafter(draft, name="draft")], TargetModel("tiny", model=target,
                                                                 tokenizer=tokenizer())
    )  # fmt: skip


def check_graphs(engine: SpeculativeEngine) -> None:
    parts = [engine.target.compiled, *(d.lm.compiled for d in engine.drafters if d.lm)]
    for part in parts:
        assert part is not None and part.failed is None, part and part.failed
        assert part.recompiles == 0
        assert {shape[0] for shape in part.batch_graphs} <= set(SLOT_BUCKETS)
    target = engine.target.compiled
    assert target is not None and target.batch_graphs, "no batch forward ran compiled"


@pytest.mark.parametrize("rows", [3, 5])
def test_compiled_batch_rows_equal_target_generate(rows: int) -> None:
    """Rows of different prompt lengths stop at their own EOS or limit (rows leave their slots
    as they finish)."""
    engine = greedy_engine()
    prompts = PROMPTS[:rows]
    result = engine.generate(prompts, MAX_NEW)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        check_equal("plain", prompt, tokens)
    assert engine.target.static, "the batch left the static cache"
    check_graphs(engine)


def test_compiled_batch_rows_of_their_own_lengths_and_compaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fixed-length rows of different limits (rows leave mid-generation) with compaction as
    soon as two dead columns sit in every row (moves inside the static buffers)."""
    monkeypatch.setattr(layout, "COMPACT_COLUMNS", 2)
    engine = greedy_engine()
    target, _ = models("plain")
    prompts = PROMPTS[5:11]
    limits = [8, 40, 24, 40, 16, 33]
    result = engine.generate(prompts, max_new_tokens=limits, ignore_eos=True)
    for prompt, tokens, n in zip(prompts, result.tokens, limits, strict=True):
        check_rows_without_eos(target, [prompt], [tokens], n)
    check_graphs(engine)


def test_rows_joining_a_compiled_stream_keep_their_slots() -> None:
    """Rows join a running stream into spare slots (the static cache stays); every row equals
    its own greedy ``generate``."""
    engine = greedy_engine()
    stream = engine.stream([PROMPTS[0], PROMPTS[3]], MAX_NEW)
    rows: dict[int, list[int]] = {0: [], 1: []}
    joined = {}
    for i, chunk in enumerate(stream):
        rows.setdefault(chunk.row, []).extend(chunk.token_ids)
        if i == 2:
            joined[stream.join(PROMPTS[8], MAX_NEW)] = PROMPTS[8]
        if i == 5:
            joined[stream.join(PROMPTS[11], MAX_NEW)] = PROMPTS[11]
    assert engine.target.static, "a row joining left the static cache"
    check_equal("plain", PROMPTS[0], rows[0])
    check_equal("plain", PROMPTS[3], rows[1])
    for row, prompt in joined.items():
        check_equal("plain", prompt, rows[row])
    check_graphs(engine)


def test_more_rows_than_any_bucket_continue_eager_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With buckets of one and two slots only, three rows run on a dynamic cache, and a
    two-row stream that a third row joins leaves its static cache for one: rows equal HF's."""
    monkeypatch.setattr(slots, "SLOT_BUCKETS", (1, 2))
    engine = greedy_engine()
    prompts = PROMPTS[12:15]
    for prompt, tokens in zip(prompts, engine.generate(prompts, MAX_NEW).tokens, strict=True):
        check_equal("plain", prompt, tokens)
    assert not engine.target.static
    stream = engine.stream(PROMPTS[15:17], MAX_NEW)
    rows: dict[int, list[int]] = {0: [], 1: []}
    for i, chunk in enumerate(stream):
        rows.setdefault(chunk.row, []).extend(chunk.token_ids)
        if i == 1:
            assert engine.target.static
            rows[stream.join(PROMPTS[17], MAX_NEW)] = []
    assert not engine.target.static, "three rows stayed in a two-slot cache"
    for row, prompt in enumerate([*PROMPTS[15:17], PROMPTS[17]]):
        check_equal("plain", prompt, rows[row])


@cache
def sampled_engine(temperature: float, top_p: float) -> SpeculativeEngine:
    target, draft = distribution_models()
    sampling = SamplingConfig(gamma=2, temperature=temperature, top_p=top_p)
    config = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed"),
                             compile=True)  # fmt: skip
    return SpeculativeEngine(config, [ModelDrafter(draft)], TargetModel(model=target))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_sampled_row_in_a_compiled_batch_follows_the_target(
    temperature: float, top_p: float
) -> None:
    """Counted rows beside neighbours of another prompt (so their drafts and acceptance
    differ), six rows on eight slots."""
    engine = sampled_engine(temperature, top_p)
    first, second = first_two_counts(
        engine, PROMPT, batch=6, calls=100, seed=4000, neighbour=[*PROMPT, 2]
    )
    assert_first_two_follow(first, second, *exact(temperature, top_p))
    check_graphs(engine)


def test_a_compiled_batch_forward_equals_each_row_alone() -> None:
    """Rows with dead columns of their own (left padding, a dead column inside), in a batch
    of 3 on 4 slots: each row's logits equal its own tokens read by the eager model."""
    model = build_llama(5, vocab_size=32, layers=2, hidden=32, init_range=0.3)
    forward = CompiledForward(model, [2], "tiny")
    cache_ = new_static_cache(model, 256)
    ids = torch.tensor([[0, 3, 4, 5, 6], [7, 8, 9, 10, 11], [0, 0, 12, 13, 14]])
    alive = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 0, 1, 1], [0, 0, 1, 1, 1]])
    positions = (alive.cumsum(dim=1) - 1).clamp_min(0)
    step = torch.tensor([[20, 21], [22, 23], [24, 25]])
    with torch.inference_mode():
        forward.batch(ids, positions, 0, cache_, alive, 4)  # eager: the buffers
        after = positions[:, -1:] + torch.tensor([[1, 2]])
        owned = torch.cat([alive, torch.ones((3, 2), dtype=torch.int64)], dim=1)
        logits = forward.batch(step, after, 5, cache_, owned, 4)
        assert forward.batch_graphs == {(4, 2, 256)}
        for b in range(3):
            own = [int(t) for t, a in zip(ids[b], alive[b], strict=True) if a]
            alone = model(torch.tensor([own + step[b].tolist()])).logits[0, -2:]
            torch.testing.assert_close(logits[b], alone, atol=1e-4, rtol=1e-4)


def test_a_round_that_compiled_teaches_the_policy_nothing() -> None:
    """The default policy of batches (the draft at a length it chooses, or plain decoding)
    learns from no round whose forward compiled a graph: its time is the compiling's, not the
    arm's. Such rounds happen (each new slot bucket and draft length compiles on first use),
    and every other round past the first teaches it."""
    target, draft = models("plain")
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), compile=True)
    engine = SpeculativeEngine(
        config, [ModelDrafter(draft, name="draft")], TargetModel("tiny", model=target,
                                                                 tokenizer=tokenizer())
    )  # fmt: skip
    policy = engine.batch_policy
    assert policy is not None, "the default engine has no policy of batches"
    seen: list[tuple[bool, bool]] = []  # (learned, compiled) per observed round
    observe = policy.observe
    compiled = [0.0]

    def spy(choice: Choice, outcome: Outcome) -> None:
        now = compile_seconds(engine)
        seen.append((choice.learn, now > compiled[0]))
        compiled[0] = now
        observe(choice, outcome)

    policy.observe = spy  # type: ignore[method-assign]
    prompts = PROMPTS[:3]
    result = engine.generate(prompts, MAX_NEW, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, MAX_NEW)
    assert any(c for _, c in seen[1:]), "no round past the first compiled: the test shows nothing"
    assert not [i for i, (learned, c) in enumerate(seen) if learned and c], seen
    assert any(learned for learned, _ in seen), "no round taught the policy"
