"""Adaptive drafting: the selector picks (drafter, gamma) or plain decoding each round.

Selection only ever looks at past rounds, so it cannot change what is generated: greedy output
still equals the target's own greedy ``generate`` and sampled tokens still follow the target
(chi-squared), whichever arms are chosen. The rewards are wall-clock tokens/s, so which arms win
depends on the machine; the tests below only rely on gaps of an order of magnitude.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import torch

from flashspec import (
    BanditConfig,
    FlashSpecConfig,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.bandit import Selector
from flashspec.drafters import DraftContext, Drafter, Proposal
from tests.helpers.chi2 import chi_squared
from tests.helpers.distribution import exact, sample_two
from tests.helpers.distribution import models as dist_models
from tests.helpers.greedy import MAX_NEW, PROMPTS, check_equal, models, tokenizer


def adaptive_engine(
    kind: str,
    selector: str,
    *,
    plain: bool = True,
    gammas: tuple[int, ...] = (1, 3, 8),
    context: str = "none",
) -> SpeculativeEngine:
    target, draft = models(kind)
    bandit = BanditConfig(
        selector=selector,  # type: ignore[arg-type]
        gammas=gammas,
        plain=plain,
        seed=0,
        context=context,  # type: ignore[arg-type]
    )
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=4), bandit=bandit)
    drafters: list[Drafter] = [ModelDrafter(draft, name="draft"), PromptLookupDrafter()]
    return SpeculativeEngine(
        config, drafters, TargetModel("tiny", model=target, tokenizer=tokenizer())
    )


def test_arms_are_drafters_times_gammas_plus_plain() -> None:
    engine = adaptive_engine("plain", "ucb1")
    labels = [arm.label for arm in engine.arms]
    assert labels == [
        "draft/1", "draft/3", "draft/8",
        "prompt_lookup/1", "prompt_lookup/3", "prompt_lookup/8",
        "plain",
    ]  # fmt: skip
    assert engine.selector is not None and engine.selector.n_arms == 7
    # One drafter, one gamma, no plain arm: nothing to choose, no selector.
    target, draft = models("plain")
    single = SpeculativeEngine(FlashSpecConfig(), [ModelDrafter(draft)], TargetModel(model=target))
    assert single.selector is None and len(single.arms) == 1


@pytest.mark.parametrize(
    ("selector", "context"), [("ucb1", "none"), ("thompson", "none"), ("ucb1", "lookup")]
)
@pytest.mark.parametrize(("kind", "batch"), [("plain", 1), ("loopy", 1), ("loopy", 4)])
def test_greedy_with_selection_equals_target_generate(
    kind: str, batch: int, selector: str, context: str
) -> None:
    engine = adaptive_engine(kind, selector, context=context)
    ties = 0
    arms: Counter[str] = Counter()
    for start in range(0, len(PROMPTS), batch):
        group = PROMPTS[start : start + batch]
        result = engine.generate(group if batch > 1 else group[0], max_new_tokens=MAX_NEW)
        arms.update(result.stats.arm_rounds)
        for prompt, tokens in zip(group, result.tokens, strict=True):
            ties += check_equal(kind, prompt, tokens)
    assert ties <= 2
    # Every arm was tried (unpulled arms first / uniform prior), so the test saw them all.
    assert len(arms) == len(engine.arms), arms
    if context == "lookup":
        # Both contexts occurred: rounds with a 2-gram match and rounds without one.
        assert len(engine.selectors) == 2 and all(sum(s.counts) > 0 for s in engine.selectors)


@pytest.mark.parametrize(
    ("selector", "context"),
    [("ucb1", "none"), ("thompson", "lookup"), ("model", "none"), ("model", "lookup")],
)
def test_sampling_with_selection_follows_target(selector: str, context: str) -> None:
    target, draft = dist_models()
    bandit = BanditConfig(
        selector=selector,  # type: ignore[arg-type]
        # The bandits choose among fixed lengths; the model chooses the length itself.
        gammas=None if selector == "model" else (1, 3),
        plain=True,
        seed=1,
        context=context,  # type: ignore[arg-type]
        seeded="follow",  # the seeds fix the test's draws; the policy still chooses
    )
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=3, temperature=0.7, top_p=0.9), bandit=bandit
    )
    engine = SpeculativeEngine(
        config, [ModelDrafter(draft), PromptLookupDrafter()], TargetModel(model=target)
    )
    first, second = sample_two(engine, 1500, 50, seed=11)
    p_first, p_second = exact(0.7, 0.9)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"
    if engine.model is not None:
        assert engine.model.rounds > 0
        return
    pulled = [sum(c) for c in zip(*(s.counts for s in engine.selectors), strict=True)]
    assert sum(n > 0 for n in pulled) >= 3, pulled


class SlowWrongDrafter(Drafter):
    """Proposes tokens the target never picks, slowly: speculation that cannot pay."""

    name = "slow"

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        time.sleep(0.02)
        wrong = (ctx.tokens[:, -1:] + 1) % 7 + 50  # ids far from anything a random model argmaxes
        return Proposal(wrong.repeat(1, gamma))


@pytest.mark.parametrize("selector", ["ucb1", "thompson", "model"])
def test_falls_back_to_plain_decoding_when_drafting_does_not_pay(selector: str) -> None:
    target, _ = models("plain")
    bandit = BanditConfig(selector=selector, plain=True, seed=0)  # type: ignore[arg-type]
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=4), bandit=bandit)
    engine = SpeculativeEngine(
        config, [SlowWrongDrafter()], TargetModel(model=target, tokenizer=tokenizer())
    )
    result = engine.generate(PROMPTS[0], max_new_tokens=80, ignore_eos=True)
    arms = result.stats.arm_rounds
    # A slow round earns ~40 tok/s, a plain one ~10x more: the slow arm gets O(log t) rounds
    # from a bandit. The model learns its acceptance is ~0 within a few rounds; then only
    # posterior draws near the top of a Beta(1, 1 + n) could ever pick it again.
    ratio = 10 if selector == "model" else 3
    assert arms["plain"] >= ratio * arms["slow/gamma"], arms
    check_equal("plain", PROMPTS[0], result.tokens[0][:MAX_NEW])


class OracleDrafter(Drafter):
    """Drafts the target's own greedy continuation (read from a reference): always accepted."""

    name = "oracle"

    def __init__(self, continuation: list[int], prompt_length: int) -> None:
        self.continuation = continuation
        self.prompt_length = prompt_length

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        done = ctx.tokens.shape[1] - self.prompt_length
        drafts = self.continuation[done : done + gamma]
        return Proposal(torch.tensor([drafts], dtype=torch.int64))


def oracle_engine(dynamic: bool, *, gamma: int = 2, max_gamma: int = 8) -> tuple[Any, int]:
    target, _ = models("plain")
    prompt = tokenizer()(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        out = target.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=60, pad_token_id=0,
            eos_token_id=None,
        )  # fmt: skip
    continuation = out[0, len(prompt) :].tolist()
    sampling = SamplingConfig(gamma=gamma, dynamic_gamma=dynamic, max_gamma=max_gamma)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=sampling),
        [OracleDrafter(continuation, len(prompt))],
        TargetModel(model=target, tokenizer=tokenizer()),
    )
    return engine, continuation


def test_dynamic_gamma_grows_after_full_acceptance() -> None:
    engine, continuation = oracle_engine(dynamic=True)
    result = engine.generate(PROMPTS[0], max_new_tokens=42, ignore_eos=True)
    assert result.tokens[0] == continuation[:42]
    # gamma 2, 4, 6, 8, 8, ... -> rounds of 3, 5, 7, 9, 9, 9 tokens = 42 in 6 rounds.
    assert result.stats.rounds == 6, result.stats
    fixed, _ = oracle_engine(dynamic=False)
    assert fixed.generate(PROMPTS[0], max_new_tokens=42, ignore_eos=True).stats.rounds == 14


def test_dynamic_gamma_shrinks_after_rejections() -> None:
    target, _ = models("plain")
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=6, dynamic_gamma=True)),
        [SlowWrongDrafter()],
        TargetModel(model=target, tokenizer=tokenizer()),
    )
    result = engine.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    # Every draft is rejected: 6, 5, 4, 3, 2, 1, 1, ... drafts per round.
    assert result.stats.rounds == 12
    assert result.stats.drafted == 6 + 5 + 4 + 3 + 2 + 1 * 6


def test_bad_bandit_config() -> None:
    with pytest.raises(ValueError, match=r"BanditConfig\.selector"):
        BanditConfig(selector="eps-greedy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"BanditConfig\.gammas"):
        BanditConfig(gammas=(0, 2))
    with pytest.raises(ValueError, match=r"BanditConfig\.gammas is empty"):
        BanditConfig(gammas=())
    with pytest.raises(ValueError, match=r"BanditConfig\.plain"):
        BanditConfig(plain=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"BanditConfig\.context"):
        BanditConfig(context="ngram")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"BanditConfig\.seeded must be one of"):
        BanditConfig(seeded="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_gamma"):
        SamplingConfig(max_gamma=0)
    target, draft = models("plain")
    from flashspec import UCB1Selector

    with pytest.raises(ValueError, match="needs a PromptLookupDrafter"):
        SpeculativeEngine(
            FlashSpecConfig(bandit=BanditConfig(plain=True, context="lookup")),
            [ModelDrafter(draft)],
            TargetModel(model=target),
        )
    with pytest.raises(ValueError, match="selector has 2 arms but the engine has 3"):
        SpeculativeEngine(
            FlashSpecConfig(bandit=BanditConfig(gammas=(2, 4), plain=True)),
            [ModelDrafter(draft)],
            TargetModel(model=target),
            UCB1Selector(n_arms=2),
        )


# ------------------------------------------------------------------- the throughput model


def model_engine(kind: str, context: str = "none", seed: int = 0) -> SpeculativeEngine:
    target, draft = models(kind)
    bandit = BanditConfig(plain=True, seed=seed, context=context)  # type: ignore[arg-type]
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3, max_gamma=10), bandit=bandit)
    drafters: list[Drafter] = [ModelDrafter(draft, name="draft"), PromptLookupDrafter()]
    return SpeculativeEngine(
        config, drafters, TargetModel("tiny", model=target, tokenizer=tokenizer())
    )


def test_model_is_the_default_selection() -> None:
    engine = model_engine("plain")
    assert engine.model is not None and engine.selector is None and not engine.selectors
    assert [arm.label for arm in engine.arms] == ["draft/gamma", "prompt_lookup/gamma", "plain"]


@pytest.mark.parametrize("context", ["none", "lookup"])
@pytest.mark.parametrize(("kind", "batch"), [("plain", 1), ("loopy", 1), ("loopy", 4)])
def test_greedy_with_model_selection_equals_target_generate(
    kind: str, batch: int, context: str
) -> None:
    engine = model_engine(kind, context)
    ties = 0
    arms: Counter[str] = Counter()
    lengths: set[int] = set()
    for start in range(0, len(PROMPTS), batch):
        group = PROMPTS[start : start + batch]
        result = engine.generate(group if batch > 1 else group[0], max_new_tokens=MAX_NEW)
        arms.update(result.stats.arm_rounds)
        lengths.add(result.stats.drafted // max(result.stats.row_rounds, 1))
        for prompt, tokens in zip(group, result.tokens, strict=True):
            ties += check_equal(kind, prompt, tokens)
    assert ties <= 2
    # An unmeasured drafter counts as free, so each drafter was tried.
    assert arms["draft/gamma"] > 0 and arms["prompt_lookup/gamma"] > 0, arms
    assert engine.model is not None and engine.model.rounds > 0


@pytest.mark.parametrize("rows", [1, 3])
def test_a_seeded_sampled_generation_runs_the_first_arm(rows: int) -> None:
    """A seed fixes a sampled output even where the policy follows timings: the generation
    runs the first arm (BanditConfig.seeded="fixed"), token for token what an engine with that
    arm alone draws; "follow" lets the policy choose again."""
    target, draft = dist_models()
    sampling = SamplingConfig(gamma=3, temperature=1.0)
    fixed = SpeculativeEngine(
        FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed")),
        [ModelDrafter(draft, name="draft")],
        TargetModel(model=target),
    )
    prompts: Any = [[5, 6, 7, 8]] * rows
    reference = fixed.generate(prompts, max_new_tokens=40, ignore_eos=True, seed=7)
    for seeded in ("fixed", "follow"):
        bandit = BanditConfig(plain=True, context="lookup", seed=0, seeded=seeded)  # type: ignore[arg-type]
        engine = SpeculativeEngine(
            FlashSpecConfig(sampling=sampling, bandit=bandit),
            [ModelDrafter(draft, name="draft"), PromptLookupDrafter()],
            TargetModel(model=target),
        )
        engine.generate(prompts, max_new_tokens=40, ignore_eos=True)  # teach it timings
        result = engine.generate(prompts, max_new_tokens=40, ignore_eos=True, seed=7)
        arms = set(result.stats.arm_rounds)
        if seeded == "fixed":
            assert arms == {"draft/gamma"}, result.stats.arm_rounds
            assert result.tokens == reference.tokens
        else:
            # An unmeasured drafter counts as free, so the policy tries more than one arm.
            assert len(arms) > 1, result.stats.arm_rounds


def test_the_default_engine_can_decode_plainly() -> None:
    """The engine a user gets without configuring one has the break-even arm: plain decoding,
    chosen by the throughput model where its drafters stop paying (e.g. late in a long
    generation); configured engines keep what they were given."""
    from flashspec.options import EngineOptions

    default = SpeculativeEngine.from_pretrained()
    assert [arm.label for arm in default.arms] == ["demo-draft/gamma", "plain"]
    assert default.throughput is not None
    lookup = SpeculativeEngine.from_pretrained(drafters=["demo-draft", "prompt_lookup"])
    assert [arm.label for arm in lookup.arms][-1] == "plain"
    assert lookup.config.bandit.context == "lookup"
    configured = SpeculativeEngine.from_pretrained(config=FlashSpecConfig())
    assert [arm.label for arm in configured.arms] == ["demo-draft/gamma"]
    cli = EngineOptions().build()
    assert [arm.label for arm in cli.arms] == ["demo-draft/gamma", "plain"]
    chosen = EngineOptions(draft="demo-draft3").build()
    assert [arm.label for arm in chosen.arms] == ["demo-draft3/gamma"]


def modelled_clock(engine: SpeculativeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's clock advances by a modelled cost of each forward (a verification: 5 ms
    and 0.3 ms a token; a draft: 0.2 ms a token), not by wall time, so that what the throughput
    model learns does not depend on the machine's load."""
    from types import SimpleNamespace

    import flashspec.engine.drafting as drafting
    import flashspec.engine.loop as loop

    now = [0.0]
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(drafting, "time", clock)
    verify, drafters = engine.target.verify, engine.drafters

    def timed_verify(tokens: torch.Tensor, drafts: torch.Tensor, *args: Any) -> torch.Tensor:
        now[0] += 5e-3 + 3e-4 * (drafts.shape[1] + 1)
        return verify(tokens, drafts, *args)

    monkeypatch.setattr(engine.target, "verify", timed_verify)
    for drafter in drafters:
        propose = drafter.propose

        def timed_propose(ctx: DraftContext, gamma: int, propose: Any = propose) -> Proposal:
            proposal: Proposal = propose(ctx, gamma)
            now[0] += 2e-4 * proposal.tokens.shape[1]
            return proposal

        monkeypatch.setattr(drafter, "propose", timed_propose)


def test_model_drafts_long_when_every_draft_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, continuation = oracle_engine(dynamic=False, gamma=2, max_gamma=8)
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=2, max_gamma=8), bandit=BanditConfig(plain=True, seed=0)
    )
    engine = SpeculativeEngine(config, engine.drafters, engine.target)
    modelled_clock(engine, monkeypatch)
    result = engine.generate(PROMPTS[0], max_new_tokens=60, ignore_eos=True)
    assert result.tokens[0] == continuation[:60]
    # Fixed gamma 2 needs 20 rounds; the model learns acceptance ~1 and drafts 8 (9 tokens a
    # round), apart from the prefill, a plain round or two and the first, default-length one.
    assert result.stats.rounds <= 11, result.stats


def lookup_would_draft(tokens: torch.Tensor, left: torch.Tensor, n: int) -> bool:
    """The reference for the lookup context: whether prompt lookup itself drafts anything."""
    from flashspec.models import Padding
    from flashspec.sampling import Warper

    drafter = PromptLookupDrafter(min_ngram=n, max_ngram=n + 1)
    ctx = DraftContext(tokens, Padding(left), Warper(0.0, None, None), None)
    return drafter.propose(ctx, 1).count > 0


@pytest.mark.parametrize("n", [2, 3])
def test_lookup_context_probe_agrees_with_prompt_lookup(n: int) -> None:
    from flashspec.select.context import NgramIndex as _NgramIndex

    generator = torch.Generator().manual_seed(n)
    seen = Counter()
    for trial in range(300):
        rows, length = 1 + trial % 3, 2 + trial % 12
        # A 3-token vocabulary, so that matches are common but not certain.
        tokens = torch.randint(0, 3, (rows, length), generator=generator)
        left = torch.randint(0, length, (rows,), generator=generator) * (trial % 2)
        expected = lookup_would_draft(tokens, left, n)
        assert _NgramIndex(n, tokens, left).match(tokens) == expected, (tokens, left)
        seen[expected] += 1
    assert seen[True] > 30 and seen[False] > 30, seen


@pytest.mark.parametrize("n", [2, 3])
def test_incremental_probe_agrees_with_prompt_lookup_as_it_grows(n: int) -> None:
    # The engine's probe keeps an index that grows with each round's tokens; it must answer
    # like prompt lookup at every length, with padding, and after rows leave.
    from flashspec.select.context import NgramIndex as _NgramIndex

    generator = torch.Generator().manual_seed(10 + n)
    seen = Counter()
    for trial in range(60):
        rows = 1 + trial % 3
        tokens = torch.randint(0, 4, (rows, 1 + trial % 4), generator=generator)
        left = torch.randint(0, tokens.shape[1], (rows,), generator=generator) * (trial % 2)
        index: _NgramIndex | None = None
        grown = 0
        for _ in range(12):
            if index is None or not index.follows(tokens):
                index = _NgramIndex(n, tokens, left)
            else:
                grown += 1
            expected = lookup_would_draft(tokens, left, n)
            assert index.match(tokens) == expected, (tokens, left)
            seen[expected] += 1
            step = 1 + int(torch.randint(0, 4, (1,), generator=generator))
            tokens = torch.cat(
                [tokens, torch.randint(0, 4, (tokens.shape[0], step), generator=generator)], dim=1
            )
            if tokens.shape[0] > 1 and torch.rand(1, generator=generator) < 0.2:
                keep = torch.tensor([0, tokens.shape[0] - 1][: tokens.shape[0] - 1])
                tokens, left = tokens[keep], left[keep]
        assert grown > 0  # the index was reused, not rebuilt every time
    assert seen[True] > 100 and seen[False] > 50, seen


class SpyDrafter(Drafter):
    """Proposes a fixed wrong token; counts its prefills and proposals, and its prefill is slow
    (``PREFILL_SECONDS``), so that a round that charged it to the arm would show."""

    name = "spy"
    PREFILL_SECONDS = 0.5

    def __init__(self) -> None:
        self.prefills: list[int] = []  # committed length at each prefill
        self.proposals = 0

    def begin(self, ctx: DraftContext) -> None:
        self.prefills.append(ctx.tokens.shape[1])
        time.sleep(self.PREFILL_SECONDS)

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        self.proposals += 1
        return Proposal(torch.zeros((ctx.tokens.shape[0], gamma), dtype=torch.int64))


class ScriptedSelector(Selector):
    """Plays arm 0, except ``arm`` in round ``at`` (0-based); records every reward."""

    def __init__(self, n_arms: int, arm: int, at: int | None) -> None:
        super().__init__(n_arms)
        self.arm, self.at, self.round = arm, at, 0
        self.rewards: list[tuple[int, float]] = []

    def select(self) -> int:
        chosen = self.arm if self.round == self.at else 0
        self.round += 1
        return chosen

    def update(self, arm: int, reward: float) -> None:
        super().update(arm, reward)
        self.rewards.append((arm, reward))


@pytest.mark.parametrize("at", [None, 5])
def test_a_drafter_reads_the_prompt_only_when_first_chosen_and_is_not_charged_for_it(
    at: int | None,
) -> None:
    target, draft = models("plain")
    spy = SpyDrafter()
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(selector="ucb1"))
    drafters: list[Drafter] = [ModelDrafter(draft, name="draft"), spy]
    selector = ScriptedSelector(2, arm=1, at=at)
    engine = SpeculativeEngine(
        config, drafters, TargetModel(model=target, tokenizer=tokenizer()), selector=selector
    )
    result = engine.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    check_equal("plain", PROMPTS[0], result.tokens[0][:MAX_NEW])
    if at is None:
        # Never chosen: it never read anything, so it cost nothing.
        assert spy.prefills == [] and spy.proposals == 0
        return
    # Chosen once, in a later round: it read everything committed then, once, and proposed.
    assert spy.proposals == 1 and len(spy.prefills) == 1
    assert spy.prefills[0] > len(tokenizer()(PROMPTS[0])["input_ids"])
    # Its round is rewarded without the reading. The spy's drafts are all rejected, so the
    # round emits one token: charged with the reading, its reward would be at most
    # 1 / PREFILL_SECONDS. Twice that leaves a loaded machine a quarter second per round.
    (reward,) = [r for arm, r in selector.rewards if arm == 1]
    assert reward > 2 / SpyDrafter.PREFILL_SECONDS, selector.rewards


def test_the_model_does_not_charge_a_drafter_for_reading_the_prompt() -> None:
    target, draft = models("plain")
    spy = SpyDrafter()
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(seed=0))
    engine = SpeculativeEngine(
        config,
        [ModelDrafter(draft, name="draft"), spy],
        TargetModel(model=target, tokenizer=tokenizer()),
    )
    assert engine.model is not None
    seconds: list[float] = []
    observe = engine.model.observe

    def spy_observe(state: int, drafter: int | None, drafted: int, *args: Any, **kw: Any) -> None:
        if drafter == 1:
            seconds.append(args[1])  # draft_seconds
        observe(state, drafter, drafted, *args, **kw)

    engine.model.observe = spy_observe  # type: ignore[method-assign]
    engine.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    # An unmeasured drafter counts as free, so the model tries the spy early; the first
    # round's prefill is not learned from, and later ones are kept out of its cost.
    assert len(spy.prefills) == 1 and seconds, (spy.prefills, seconds)
    assert max(seconds) < SpyDrafter.PREFILL_SECONDS / 4, seconds
