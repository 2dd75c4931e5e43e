"""Per-row draft lengths in one verification (``Proposal.lengths``): a row drafts its own
number of tokens, none included (it then decodes plainly inside the batch's forward), and each
row's output stays exactly what it is alone.

A drafter here cuts prompt lookup's proposals to a length per row that changes every round
(0, 1, ..., gamma), so rows with no draft sit beside rows drafting the full length, and the
ragged layout's trailing dead columns (drafts a row did not make, never read) meet its leading
ones. Model drafters make rows of other lengths themselves: the confidence stop ends each row's
drafting on its own (``RowStops``), and each row's cap follows its own acceptance
(``flashspec.select.rows``). References: HF ``generate`` on each prompt alone (greedy), and the
exact first/second-token distributions of the target (chi-squared at alpha = 0.01).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

import flashspec.kv.layout as layout
from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, PromptLookupDrafter
from tests.helpers.chi2 import assert_first_two_follow, chi_squared, first_two_counts
from tests.helpers.distribution import PROMPT, exact
from tests.helpers.distribution import models as sampling_models
from tests.helpers.drafters import CutLookup, RecordingDrafter
from tests.helpers.greedy import PROMPTS, check_rows_without_eos, models, tokenizer

GAMMA = 4
THRESHOLD = 0.5  # the greedy tests' confidence stop
SAMPLED_THRESHOLD = 0.3  # between the draft's top probability after PROMPT and after PROMPT + [2]


def engine_with(target: Any, drafter: Drafter, **sampling: Any) -> SpeculativeEngine:
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=GAMMA, **sampling), bandit=BanditConfig(batches="fixed")
    )
    return SpeculativeEngine(
        config, [drafter], TargetModel("tiny", model=target, tokenizer=tokenizer())
    )


@pytest.fixture
def tails(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every forward's trailing dead columns per row (``RowLayout.plan``'s tails)."""
    seen: list[list[int]] = []
    plan = layout.RowLayout.plan

    def spy(self: Any, dead: Any, count: int, device: Any, tails: Any = None) -> Any:
        if tails is not None:
            seen.append(list(tails))
        return plan(self, dead, count, device, tails)

    monkeypatch.setattr(layout.RowLayout, "plan", spy)
    return seen


def test_rows_drafting_different_lengths_each_equal_their_own_generate(
    tails: list[list[int]],
) -> None:
    target, _ = models("loopy")
    drafter = CutLookup()
    engine = engine_with(target, drafter)
    prompts = PROMPTS[:6]
    result = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, 24)
    # Rows with no draft beside rows with the full length, in the same verification.
    assert any(0 in lengths and GAMMA in lengths for lengths in drafter.lengths)
    assert any(max(t) > 0 and min(t) == 0 for t in tails)
    assert result.stats.accepted > 0


def test_prompt_lookup_in_a_batch_drafts_only_what_it_found(tails: list[list[int]]) -> None:
    """Rows without a match propose nothing: their drafts are dead columns, not filler the
    target reads and rejects."""
    target, _ = models("loopy")
    engine = engine_with(target, PromptLookupDrafter())
    prompts = ["aaaaaaaaaaaa", "xyz", "the cat sat on the mat. the cat", "q"]
    result = engine.generate(prompts, max_new_tokens=20, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, 20)
    assert any(max(t) > 0 for t in tails)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_row_beside_neighbours_of_other_lengths_follows_the_target(
    temperature: float, top_p: float
) -> None:
    """The filler after a row's length is the target's likeliest first token, so a row that
    treated it as a draft would take it out of its residual: the first token's counts would
    miss their mode."""
    target, _ = sampling_models()
    p_first, p_second = exact(temperature, top_p)
    drafter = CutLookup(filler=int(p_first.argmax()))
    engine = SpeculativeEngine(
        FlashSpecConfig(
            sampling=SamplingConfig(gamma=GAMMA, temperature=temperature, top_p=top_p),
            bandit=BanditConfig(batches="fixed"),
        ),
        [drafter],
        TargetModel(model=target),
    )
    first, second = first_two_counts(engine, PROMPT, batch=50, calls=30, seed=900)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"
    assert any(0 in lengths and max(lengths) > 0 for lengths in drafter.lengths)


def test_a_model_drafter_stops_each_row_at_its_own_confidence() -> None:
    """With the confidence stop on, a row whose draft model turns unsure stops drafting while
    the others draft on: rounds where no row was capped still propose lengths that differ
    across rows, and every row equals its own greedy ``generate``."""
    target, draft = models("plain")
    drafter = RecordingDrafter(draft)
    engine = engine_with(target, drafter, confidence_threshold=THRESHOLD)
    prompts = PROMPTS[:6]
    result = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, 24)
    uncapped = [n for caps, n in drafter.rounds if caps is None or min(caps) == GAMMA]
    assert any(n is not None and len(set(n)) > 1 for n in uncapped), drafter.rounds
    assert result.stats.accepted > 0


def test_a_row_whose_drafts_are_rejected_decodes_plainly_beside_one_drafted_well() -> None:
    """Row 0's drafts are always rejected, row 1's always accepted: within a few rounds row 0's
    cap is 0 (it decodes plainly inside the batch's forward) while row 1 keeps the full
    length, and both rows equal their own greedy ``generate``."""
    target, _ = models("loopy")
    drafter = RecordingDrafter(copy.deepcopy(target), spoil=0)
    engine = engine_with(target, drafter)
    prompts = PROMPTS[:2]
    result = engine.generate(prompts, max_new_tokens=[20, 40], ignore_eos=True)
    for prompt, tokens, n in zip(prompts, result.tokens, [20, 40], strict=True):
        check_rows_without_eos(target, [prompt], [tokens], n)
    caps = [c for c, _ in drafter.rounds if c is not None]
    assert caps[0] == [GAMMA, GAMMA]
    assert [0, GAMMA] in caps[:5], caps


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_sampled_row_beside_rows_the_model_drafter_stopped_elsewhere_follows_the_target(
    temperature: float, top_p: float
) -> None:
    """The draft model is unsure after ``PROMPT`` (its top probability below the threshold)
    and sure after the neighbours' prompt, so the counted rows propose one draft beside
    neighbours drafting on. A counted row that accepted its draft is at its length: its second
    token comes from p. Its filler is a real draw of the draft model, so a row that took that
    draw's distribution out of p (as if it had proposed it) would miss the target's
    distribution."""
    target, draft = sampling_models()
    drafter = RecordingDrafter(draft)
    sampling = SamplingConfig(
        gamma=GAMMA, temperature=temperature, top_p=top_p, confidence_threshold=SAMPLED_THRESHOLD
    )
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed")),
        [drafter],
        TargetModel(model=target),
    )
    first, second = first_two_counts(
        engine, PROMPT, batch=50, calls=40, seed=900, neighbour=[*PROMPT, 2]
    )
    assert_first_two_follow(first, second, *exact(temperature, top_p))
    assert any(n is not None and n[0] == 1 and max(n) > 1 for _, n in drafter.rounds)
