"""Per-row draft lengths in one verification (``Proposal.lengths``): a row drafts its own
number of tokens, none included (it then decodes plainly inside the batch's forward), and each
row's output stays exactly what it is alone.

A drafter here cuts prompt lookup's proposals to a length per row that changes every round
(0, 1, ..., gamma), so rows with no draft sit beside rows drafting the full length, and the
ragged layout's trailing dead columns (drafts a row did not make, never read) meet its leading
ones. References: HF ``generate`` on each prompt alone (greedy), and the exact first/second-token
distributions of the target (chi-squared at alpha = 0.01).
"""

from __future__ import annotations

from typing import Any

import pytest
from chi2_helpers import first_two_counts
from drafter_helpers import CutLookup
from test_engine_distribution import PROMPT, chi_squared, exact
from test_engine_distribution import models as sampling_models
from test_engine_greedy import PROMPTS, check_rows_without_eos, models, tokenizer

import flashspec._layout as layout
from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, PromptLookupDrafter

GAMMA = 4


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
