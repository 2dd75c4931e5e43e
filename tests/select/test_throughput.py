"""ThroughputModel: the model-based choice of arm and draft length (flashspec/throughput.py).

References are independent of the implementation: expected counts by enumerating every
accept/reject pattern, predictions by summing the geometric series term by term, the best draft
length by brute force over the formula.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch

from flashspec.select.throughput import (
    _COST_MEMORY,
    PLAN_ROUNDS,
    RETRY_FACTOR,
    ThroughputModel,
    _CostLine,
    expected_counts,
)

DRAFT_COST = 0.002  # seconds per draft
VERIFY_BASE = 0.010  # seconds of a round's target side, plus ...
VERIFY_PER_TOKEN = 0.001  # ... this per verified token


def reference_counts(
    probability: list[list[float]], requested: int
) -> tuple[list[float], list[float]]:
    """Sum over every accept/reject pattern of its probability times its per-position counts."""
    g = len(probability[0])
    width = g + (g < requested)
    tried, accepted = [0.0] * width, [0.0] * width
    for row in probability:
        for pattern in itertools.product((True, False), repeat=g):
            weight = math.prod(p if ok else 1.0 - p for p, ok in zip(row, pattern, strict=True))
            run = next((i for i, ok in enumerate(pattern) if not ok), g)
            # Positions 1..run+1 are tried, the first run accepted; a position past the last
            # draft only exists when more were requested (and is never accepted).
            for i in range(min(run + 1, width)):
                tried[i] += weight
            for i in range(run):
                accepted[i] += weight
    return tried, accepted


@pytest.mark.parametrize(("rows", "g", "requested"), [(1, 1, 1), (1, 4, 4), (3, 5, 5), (2, 3, 6)])
def test_expected_counts_equal_enumeration(rows: int, g: int, requested: int) -> None:
    rng = random.Random(rows * 100 + g)
    probability = [[rng.random() for _ in range(g)] for _ in range(rows)]
    probability[0][0] = 1.0  # certain and impossible positions are covered too
    if g > 1:
        probability[-1][1] = 0.0
    tried, accepted = expected_counts(torch.tensor(probability, dtype=torch.float64), requested)
    want_tried, want_accepted = reference_counts(probability, requested)
    assert tried == pytest.approx(want_tried, rel=1e-12, abs=1e-12)
    assert accepted == pytest.approx(want_accepted, rel=1e-12, abs=1e-12)


def test_expected_counts_of_an_empty_proposal() -> None:
    # Asked for drafts, got none: one rejection per row at position 1. Plain decoding: nothing.
    assert expected_counts(torch.zeros((2, 0)), 4) == ([2.0], [0.0])
    assert expected_counts(torch.zeros((2, 0)), 0) == ([], [])


def geometric_tokens(alpha: float, gamma: int) -> float:
    return sum(alpha**k for k in range(gamma + 1))


def trained(alphas: list[float], rounds: int = 300, seed: int = 0) -> ThroughputModel:
    """A model fed rounds of exact costs and acceptances drawn with the given rates."""
    n = len(alphas)
    model = ThroughputModel([(d, None) for d in range(n)] + [(None, 0)], n, max_gamma=12, seed=seed)
    rng = random.Random(seed)
    for r in range(rounds):
        drafter = r % (n + 1)
        g = 0 if drafter == n else 1 + r % 8
        probability = torch.tensor([[alphas[drafter]] * g if drafter < n else []])
        model.observe(
            0,
            None if drafter == n else drafter,
            g,
            expected_counts(probability.reshape(1, g), g),
            DRAFT_COST * g * (1 + 0.01 * rng.random()),
            VERIFY_BASE + VERIFY_PER_TOKEN * (g + 1),
        )
    return model


def test_predictions_follow_the_round_formula() -> None:
    model = trained([0.6, 0.9])
    for gamma in (1, 4, 9):
        for alpha in (0.0, 0.5, 0.95):
            seconds = DRAFT_COST * gamma + VERIFY_BASE + VERIFY_PER_TOKEN * (gamma + 1)
            want = geometric_tokens(alpha, gamma) / seconds
            assert model.predict(0, gamma, alpha) == pytest.approx(want, rel=0.02)
    # A batch verifies rows * (gamma + 1) tokens. In lockstep it advances by its slowest row
    # (alpha ** rows per position); ragged rows each advance by their own acceptance.
    seconds = DRAFT_COST * 4 + VERIFY_BASE + VERIFY_PER_TOKEN * 3 * 5
    model.ragged = False
    want = 3 * geometric_tokens(0.8**3, 4) / seconds
    assert model.predict(0, 4, 0.8, rows=3) == pytest.approx(want, rel=0.02)
    model.ragged = True
    want = 3 * geometric_tokens(0.8, 4) / seconds
    assert model.predict(0, 4, 0.8, rows=3) == pytest.approx(want, rel=0.02)
    assert model.predict(None, 0, 0.0, rows=3) == pytest.approx(
        3 / (VERIFY_BASE + VERIFY_PER_TOKEN * 3), rel=1e-6
    )
    model.ragged = False
    plain = 1 / (VERIFY_BASE + VERIFY_PER_TOKEN)
    assert model.predict(None, 0, 0.0) == pytest.approx(plain, rel=1e-6)


def test_acceptance_estimates_converge() -> None:
    model = trained([0.6, 0.9], rounds=900)
    assert model.acceptance(0, 0) == pytest.approx(0.6, abs=0.03)
    assert model.acceptance(0, 1) == pytest.approx(0.9, abs=0.03)
    assert model.draft_cost(0) == pytest.approx(DRAFT_COST, rel=0.02)


def test_choice_is_the_formula_argmax() -> None:
    model = trained([0.7, 0.3], rounds=1200)
    # Brute force over arms and lengths with the posterior means (the draws concentrate there).
    best = max(
        ((d, g) for d in (0, 1) for g in range(1, 13)),
        key=lambda dg: (
            geometric_tokens([0.7, 0.3][dg[0]], dg[1])
            / (DRAFT_COST * dg[1] + VERIFY_BASE + VERIFY_PER_TOKEN * (dg[1] + 1))
        ),
    )
    choices = [model.choose(0) for _ in range(200)]
    arm, gamma = max(set(choices), key=choices.count)
    assert (arm, gamma) == best or (arm == best[0] and abs(gamma - best[1]) <= 1), choices[:20]
    assert sum(c[0] == best[0] for c in choices) >= 180


def test_plain_when_no_drafter_pays_and_long_drafts_when_all_are_accepted() -> None:
    hopeless = trained([0.02])
    assert all(hopeless.choose(0) == (1, 0) for _ in range(50))
    sure = trained([1.0])
    assert all(sure.choose(0) == (0, 12) for _ in range(50))
    assert sure.choose(0, max_gamma=3) == (0, 3)  # the room left caps the draft


def test_an_unmeasured_drafter_is_tried_at_the_default_length() -> None:
    model = ThroughputModel([(0, None), (1, None), (None, 0)], 2, default_gamma=5, seed=0)
    assert model.choose(0) == (0, 5)  # nothing measured at all: the first arm
    model.observe(0, None, 0, ([], []), 0.0, 0.01)
    # Costs unknown count as free: a drafter is tried before plain decoding can win.
    arm, gamma = model.choose(0)
    assert arm in (0, 1) and gamma == 5


def test_memory_follows_a_change_and_an_unplayed_drafter_is_retried() -> None:
    model = ThroughputModel([(0, None), (1, None), (None, 0)], 2, memory=64, seed=0)
    for _ in range(300):
        model.observe(0, 0, 4, expected_counts(torch.full((1, 4), 0.9), 4), 0.008, 0.015)
        model.observe(0, 1, 4, expected_counts(torch.full((1, 4), 0.3), 4), 0.008, 0.015)
    assert model.acceptance(0, 0) > 0.85 and model.acceptance(0, 1) < 0.35
    # Evidence is bounded: a drafter's own rounds decay it by 1 - 1/64, the other's rounds by
    # 1 - 1/(64 * RETRY_FACTOR), so a drafter played in every other round keeps
    # unplayed / (1 - played * unplayed) rounds' worth at position 1 after the other's round
    # (51 with factor 4; 300 rounds leave (played * unplayed) ** 300 < 0.3% to converge).
    played, unplayed = 1 - 1 / 64, 1 - 1 / (64 * RETRY_FACTOR)
    steady = unplayed / (1 - played * unplayed)
    assert model._counts(0, 0, 0)[0][0] == pytest.approx(steady, rel=5e-3)
    for _ in range(100):
        model.observe(0, 0, 4, expected_counts(torch.full((1, 4), 0.6), 4), 0.008, 0.015)
    # 100 rounds of its own replaced most of what drafter 0 knew...
    assert 0.55 < model.acceptance(0, 0) < 0.7
    # ...while drafter 1, unplayed, forgets slowly: it is not re-tried yet.
    assert model._counts(0, 0, 1)[0][0] > 0.6 * steady
    assert sum(model.choose(0)[0] == 1 for _ in range(400)) < 4
    for _ in range(700):
        model.observe(0, 0, 4, expected_counts(torch.full((1, 4), 0.6), 4), 0.008, 0.015)
    # After 800 rounds unplayed its counts shrank and its posterior is wide again: Thompson
    # draws give it a chance to be measured anew, but a bounded one (a worse drafter retried
    # as often as the played one forgets was chosen in a third of these draws).
    assert model._counts(0, 0, 1)[0][0] < 0.2 * 64
    assert 5 < sum(model.choose(0)[0] == 1 for _ in range(400)) < 90


def test_states_are_separate_and_positions_inherit_from_the_one_before() -> None:
    model = ThroughputModel([(0, None)], 1, n_states=2, max_gamma=8)
    for _ in range(50):
        model.observe(1, 0, 2, ([1.0, 1.0], [1.0, 1.0]), 0.004, 0.015)
    # State 0 learned nothing from state 1's rounds.
    assert model.acceptance(1, 0) > 0.95 and model.acceptance(0, 0) == pytest.approx(0.5)
    # Position 5 was never drafted: it inherits the high rate of the positions before.
    assert model.acceptance(1, 0, position=5) > 0.9
    fresh = ThroughputModel([(0, None)], 1, n_states=2)
    assert fresh.acceptance(0, 0) == pytest.approx(0.5)


def test_after_full_and_after_partial_lend_each_other_position_one() -> None:
    model = ThroughputModel([(0, None), (1, None)], 2, max_gamma=8)
    # One accepted draft after a full round: the other kind's prior is centred on (1 + 1) / (2 + 1)
    # with the strength of that one round and its uniform prior (3), not more.
    model.observe(0, 0, 1, ([1.0], [1.0]), 0.002, 0.012, full=True)
    assert model.acceptance(0, 0, full=False) == pytest.approx(2 / 3, rel=1e-12)
    assert model.acceptance(0, 1, full=False) == pytest.approx(0.5)  # another drafter: nothing
    # The lock-in this prevents: a drafter known well after full rounds (0.8) and from three
    # unlucky rounds after partial ones (0.2) is judged after partial ones mostly by the former:
    # (8 * 0.797 + 0.6) / (8 + 3) with a prior of strength 8, where the three alone give 0.32.
    for _ in range(400):
        model.observe(0, 0, 1, ([1.0], [0.8]), 0.002, 0.012, full=True)
    for _ in range(3):
        model.observe(0, 0, 1, ([1.0], [0.2]), 0.002, 0.012)
    assert model.acceptance(0, 0, full=True) == pytest.approx(0.8, abs=0.02)
    assert model.acceptance(0, 0, full=False) == pytest.approx(0.634, abs=0.003)


def test_a_drafter_known_from_few_rounds_is_rated_at_one_length() -> None:
    # Drafter 1 is worse (0.5 against 0.7) and known from twelve rounds of two drafts, so every
    # position past the second is a wide posterior. Rated at the best of twelve drawn lengths
    # it looks better than it is: chosen in 47-66 of 2,000 draws (seeds 0-7); rated at the
    # length the posterior means favour, in 23-35.
    model = ThroughputModel([(0, None), (1, None), (None, 0)], 2, max_gamma=12, seed=0)
    for _ in range(300):
        model.observe(0, 0, 4, expected_counts(torch.full((1, 4), 0.7), 4), 0.008, 0.015)
    for _ in range(12):
        model.observe(0, 1, 2, expected_counts(torch.full((1, 2), 0.5), 2), 0.004, 0.013)
    assert 5 < sum(model.choose(0)[0] == 1 for _ in range(2000)) < 42


def test_a_draft_cost_is_the_mean_of_the_first_rounds_then_a_moving_average() -> None:
    model = ThroughputModel([(0, None), (1, None)], 2)
    # The first round stands in for the cost until the first round in a row replaces it.
    model.observe(0, 0, 2, ([1.0, 1.0], [1.0, 1.0]), 0.03, 0.012)
    assert model.draft_cost(0) == pytest.approx(0.015, rel=1e-12)
    costs = [0.004, 0.001, 0.002, 0.009]  # per round of 2 drafts: half per draft
    for seconds in costs:
        model.observe(0, 0, 2, ([1.0, 1.0], [1.0, 1.0]), seconds, 0.012)
    assert model.draft_cost(0) == pytest.approx(sum(costs) / len(costs) / 2, rel=1e-12)
    # A round right after another drafter's also catches up on its tokens: not a cost sample.
    model.observe(0, 1, 2, ([1.0, 1.0], [1.0, 1.0]), 0.006, 0.012)
    model.observe(0, 0, 2, ([1.0, 1.0], [1.0, 1.0]), 0.05, 0.012)
    assert model.draft_cost(0) == pytest.approx(sum(costs) / len(costs) / 2, rel=1e-12)
    model.observe(0, 0, 2, ([1.0, 1.0], [1.0, 1.0]), 0.004, 0.012)
    assert model.draft_cost(0) == pytest.approx((sum(costs) + 0.004) / 5 / 2, rel=1e-12)
    # After the first 50 rounds, each new one weighs 1/50: 50 more rounds at another cost
    # leave (1 - 1/50) ** 50 of the old level.
    model = ThroughputModel([(0, None)], 1)
    for seconds in [0.002] * 200 + [0.004] * 50:
        model.observe(0, 0, 1, ([1.0], [1.0]), seconds, 0.012)
    assert model.draft_cost(0) == pytest.approx(0.004 - 0.002 * (1 - 1 / 50) ** 50, rel=1e-9)


def test_a_draft_cost_follows_the_machine_speed_while_its_drafter_is_unplayed() -> None:
    model = ThroughputModel([(0, None), (1, None)], 2)
    counts = expected_counts(torch.full((1, 4), 0.7), 4)
    for _ in range(100):
        model.observe(0, 0, 4, counts, 0.008, 0.015)
    assert model.draft_cost(0) == pytest.approx(0.002, rel=1e-9)
    # The machine slows down by half and only drafter 1 is played: drafter 0's cost, measured
    # at the old speed, follows the target side's (1500 rounds leave 0.995 ** 1500 of the old).
    for _ in range(1500):
        model.observe(0, 1, 4, counts, 0.016, 0.030)
    assert model.draft_cost(1) == pytest.approx(0.004, rel=1e-3)
    assert model.draft_cost(0) == pytest.approx(0.004, rel=1e-3)


def test_drafting_time_is_a_fixed_part_per_round_plus_a_part_per_draft() -> None:
    counts = ([1.0], [0.0])
    # A model drafter: a fixed part per round besides its part per draft, over the lengths the
    # model plays; prompt lookup: one search per round, whatever the length.
    for fixed, per_draft in ((0.0015, 0.002), (0.003, 0.0)):
        model = ThroughputModel([(0, None)], 1)
        rng = random.Random(1)
        for r in range(400):
            g = 2 + r % 5
            seconds = (fixed + per_draft * g) * (1 + 0.02 * (rng.random() - 0.5))
            model.observe(0, 0, g, counts, seconds, 0.012)
        for g in (1, 4, 9):
            assert model.draft_seconds(0, g) == pytest.approx(fixed + per_draft * g, rel=0.03)
        assert model.draft_cost(0) == pytest.approx(per_draft, abs=1e-4)
    # One length seen: only the level is known, charged per draft.
    model = ThroughputModel([(0, None)], 1)
    for _ in range(60):
        model.observe(0, 0, 4, counts, 0.008, 0.012)
    assert model.draft_seconds(0, 8) == pytest.approx(0.016, rel=1e-9)
    assert model.draft_seconds(0, 0) == pytest.approx(0.0, abs=1e-12)


def test_a_switch_is_charged_the_catch_up_measured_on_switching() -> None:
    def model_with(catch_up: float) -> ThroughputModel:
        model = ThroughputModel([(0, None), (1, None)], 2, seed=0)
        counts = expected_counts(torch.full((1, 4), 0.7), 4)
        for block in range(40):
            for r in range(10):  # blocks of 10 rounds: each drafter's first pays its catch-up
                extra = catch_up if r == 0 and block > 0 else 0.0
                model.observe(0, block % 2, 4, counts, 0.008 + extra, 0.012)
        return model

    # Two drafters alike in every round in a row; only their first round after the other's
    # takes 4 ms more. The mean of the target side's seconds is 12 ms.
    model = model_with(0.004)
    assert model._catch_up == pytest.approx([0.004 / 0.012] * 2, rel=1e-6)
    assert model._last_drafter == 1
    picks = [model.choose(0)[0] for _ in range(400)]
    assert picks.count(0) < 20, picks.count(0)
    # Without it, the draws pick either about as often.
    model = model_with(0.0)
    picks = [model.choose(0)[0] for _ in range(400)]
    assert 120 < picks.count(0) < 280, picks.count(0)


def test_rising_acceptance_makes_long_drafts_pay() -> None:
    # The same first-draft rate, but acceptance that rises along the run (bursty text) makes
    # the longest drafts the best, where a flat rate would not.
    flat, rising = [0.6] * 12, [0.6] + [0.97] * 11
    model = trained([0.6])
    by_length = [model.predict(0, g, rising) for g in range(1, 13)]
    assert max(range(12), key=by_length.__getitem__) >= 7
    by_length = [model.predict(0, g, flat) for g in range(1, 13)]
    assert max(range(12), key=by_length.__getitem__) < 6


def test_same_seed_same_choices_and_reset() -> None:
    a, b = trained([0.6, 0.65], seed=3), trained([0.6, 0.65], seed=3)
    first = [a.choose(0) for _ in range(50)]
    assert first == [b.choose(0) for _ in range(50)]
    a.reset()
    assert a.rounds == 0 and a.draft_cost(0) is None and a.acceptance(0, 0) == 0.5


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="arms is empty"):
        ThroughputModel([], 1)
    with pytest.raises(ValueError, match="arm drafter 2"):
        ThroughputModel([(2, None)], 2)
    with pytest.raises(ValueError, match="arm gamma"):
        ThroughputModel([(0, -1)], 1)
    for name in ("default_gamma", "max_gamma", "n_states", "memory"):
        with pytest.raises(ValueError, match=name):
            ThroughputModel([(0, None)], 1, **{name: 0})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="at least one observed round"):
        ThroughputModel([(0, None)], 1).predict(0, 4, 0.5)


def test_cost_line_many_is_the_line_at_every_length() -> None:
    # choose() reads the whole line at once; it must be the line predict() reads point by point,
    # fitted (spread lengths) or flat (one length seen) alike.
    for points in ([(2, 0.011), (5, 0.012), (9, 0.014)], [(4, 0.02), (4, 0.021)]):
        line = _CostLine()
        for n, seconds in points:
            line.add(n, seconds)
        assert line.many(18).tolist() == pytest.approx([line(n) for n in range(18)], rel=1e-12)


def test_the_room_left_clips_the_best_length_to_the_best_length_within_it() -> None:
    # choose() finds a drafter's best length once, at full room, and clips it to the room left:
    # exact only if the predicted rate rises up to its best length and falls after it. Checked
    # against predict() at every length within the room, for acceptance that rises along the
    # run (a late best length) and that falls (an early one).
    for rates in ([0.5, 0.7, 0.9, 0.95, 0.97, 0.98, 0.99, 0.99], [0.9, 0.8, 0.6, 0.4, 0.3]):
        model = ThroughputModel([(0, None)], 1, max_gamma=12, seed=0)
        rng = random.Random(0)
        for r in range(400):
            g = 1 + r % len(rates)
            probability = torch.tensor([rates[:g]], dtype=torch.float64)
            seconds = VERIFY_BASE + VERIFY_PER_TOKEN * (g + 1) * (1 + 0.01 * rng.random())
            model.observe(0, 0, g, expected_counts(probability, g), DRAFT_COST * g, seconds)
        means = [model.acceptance(0, 0, position) for position in range(1, 13)]
        for room in range(1, 13):
            want = max(range(1, room + 1), key=lambda g: model.predict(0, g, means))
            assert model.choose(0, max_gamma=room) == (0, want), (rates, room)


def test_a_plan_is_remade_within_plan_rounds_and_at_once_for_a_new_drafter() -> None:
    def made(model: ThroughputModel) -> object:
        plan = model._plan(0, False, 1)
        return (
            plan.made,
            plan.lengths,
            plan.fixed,
            plan.per_draft,
            plan.verify,
            {d: a.tolist() for d, a in plan.alpha.items()},
            {d: b.tolist() for d, b in plan.beta.items()},
        )

    def fresh(model: ThroughputModel) -> object:
        model = copy.deepcopy(model)
        model._plans.clear()
        return made(model)

    model = trained([0.6, 0.8], rounds=300)
    counts = expected_counts(torch.full((1, 4), 0.3), 4)
    for _ in range(_COST_MEMORY):  # the cost of its first rounds in a row: remade every round
        model.observe(0, 1, 4, counts, 0.008, 0.015)
        assert made(model) == fresh(model)
    first = made(model)
    for _ in range(PLAN_ROUNDS - 1):
        model.observe(0, 1, 4, counts, 0.008, 0.015)
        model.choose(0)
        assert made(model) == first  # settled: reused ...
    assert first != fresh(model)  # ... while the estimates moved
    model.observe(0, 1, 4, counts, 0.008, 0.015)
    model.choose(0)
    assert made(model) == fresh(model)  # ... for PLAN_ROUNDS rounds at most
    # A drafter's first rounds in a state move its estimates a lot: the plan is remade at once.
    model = ThroughputModel([(0, None), (1, None), (None, 0)], 2, seed=0)
    model.observe(0, 0, 4, counts, 0.008, 0.015)
    model.choose(0)
    model.observe(0, 0, 4, counts, 0.008, 0.015)
    assert made(model) == fresh(model)


def test_counts_follow_the_decay_recursion_across_rescales() -> None:
    # Counts are stored divided by the product of the decays and rescaled when that product
    # gets tiny (here every ~420 rounds of drafter 0): they must stay the plain recursion
    # counts * decay + new, for the played drafter and for the unplayed one.
    model = ThroughputModel([(0, None), (1, None)], 2, memory=2, max_gamma=4)
    played, unplayed = 1 - 1 / 2, 1 - 1 / (2 * RETRY_FACTOR)
    want = [[0.0] * 4, [0.0] * 4]
    rng = random.Random(0)
    for r in range(2500):  # unrescaled, drafter 0's scale would underflow to 0 by round ~1300
        drafter = 0 if r % 5 else 1
        g = 1 + r % 4
        probability = [[rng.random() for _ in range(g)]]
        counts = expected_counts(torch.tensor(probability, dtype=torch.float64), g)
        model.observe(0, drafter, g, counts, 0.004, 0.01)
        tried = counts[0]
        for d in (0, 1):
            want[d] = [n * (played if d == drafter else unplayed) for n in want[d]]
        want[drafter] = [n + (tried[i] if i < g else 0.0) for i, n in enumerate(want[drafter])]
    for d in (0, 1):
        assert model._counts(0, 0, d)[0] == pytest.approx(want[d], rel=1e-9)


@pytest.mark.parametrize("packs", [True, False])
def test_a_batch_drafts_when_the_target_verifies_only_what_rows_proposed(packs: bool) -> None:
    """8 rows whose drafts are accepted 0.8 of the time but which propose a quarter of the
    drafts asked, at 1 ms a verified token. A target that skips the drafts rows did not make
    (``verified``) verifies 8 * (1 + 4 / 4) tokens a round of 4, and drafting pays; one that
    computes the whole rectangle verifies 40, and plain decoding (8 tokens) pays."""
    model = ThroughputModel([(0, None), (None, 0)], 1, max_gamma=4, seed=3)
    model.ragged = True  # each row commits its own accepted drafts
    rows, gamma, per_token = 8, 4, 1e-3
    tried = [rows * 0.8**i for i in range(gamma)]
    counts = (tried, [t * 0.8 for t in tried])
    live = rows + rows * gamma // 4
    for _ in range(150):
        verified = live if packs else rows * (gamma + 1)
        model.observe(0, 0, gamma, counts, 1e-4, verified * per_token, rows=rows,
                      verified=live if packs else None)  # fmt: skip
        model.observe(0, None, 0, ([], []), 0.0, rows * per_token, rows=rows)
    assert model._fill[0] == pytest.approx(0.25 if packs else 1.0, abs=0.01)
    picks = [model.arms[model.choose(0, rows)[0]][0] for _ in range(40)]
    drafting = sum(p == 0 for p in picks)
    assert drafting >= 30 if packs else drafting <= 10, picks
