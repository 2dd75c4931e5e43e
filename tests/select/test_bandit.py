"""The arm selectors (flashspec.bandit): UCB1 and Thompson sampling, windows, scales, errors."""

from __future__ import annotations

import math
import random

import pytest

from flashspec.select.bandit import (
    BanditKind,
    Selector,
    ThompsonSelector,
    UCB1Selector,
    make_selector,
)

MEANS = (0.9, 0.7, 0.4)


def bernoulli_run(selector: Selector, means: tuple[float, ...], pulls: int, seed: int) -> list[int]:
    """Pull ``pulls`` times on Bernoulli arms; the arms chosen."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(pulls):
        arm = selector.select()
        selector.update(arm, 1.0 if rng.random() < means[arm] else 0.0)
        chosen.append(arm)
    return chosen


def pseudo_regret(chosen: list[int], means: tuple[float, ...]) -> float:
    return sum(max(means) - means[arm] for arm in chosen)


def auer_bound(means: tuple[float, ...], t: int) -> float:
    # Written out here rather than imported, so that the benchmark's copy is checked too.
    gaps = [max(means) - m for m in means if m < max(means)]
    return sum(8 * math.log(t) / d for d in gaps) + (1 + math.pi**2 / 3) * sum(gaps)


@pytest.mark.parametrize("kind", ["ucb1", "thompson"])
def test_selector_base(kind: BanditKind) -> None:
    selector = make_selector(kind, 3, window_size=None, exploration=1.0, seed=0)
    assert isinstance(selector, Selector)
    assert selector.n_arms == 3
    assert selector.counts == [0, 0, 0] and selector.means == [0.0, 0.0, 0.0]
    selector.update(2, 4.0)
    selector.update(2, 2.0)
    assert selector.counts == [0, 0, 2] and selector.means == [0.0, 0.0, 3.0]
    selector.reset()
    assert selector.counts == [0, 0, 0]


def test_ucb1_pulls_unpulled_arms_first_even_after_big_rewards() -> None:
    selector = UCB1Selector(n_arms=4)
    selector.update(2, 1000.0)
    selector.update(0, 999.0)
    # Arms 1 and 3 have never been pulled: they come first, lowest index first.
    assert selector.select() == 1
    selector.update(1, 0.0)
    assert selector.select() == 3


def test_ucb1_score_matches_a_hand_computation() -> None:
    # Rewards in tokens/s: arm 0 = (300, 500), arm 1 = (800,), arm 2 = (100, 200, 300); c = 0.5.
    selector = UCB1Selector(n_arms=3, c=0.5)
    for arm, reward in [(0, 300), (1, 800), (2, 100), (0, 500), (2, 200), (2, 300)]:
        selector.update(arm, reward)
    # t = 6, scale = 800 (the largest reward seen); score = mean + 0.5 * 800 * sqrt(2 ln 6 / n).
    root = math.sqrt(2 * math.log(6))  # 1.8930...
    expected = [400 + 400 * root / math.sqrt(2), 800 + 400 * root, 200 + 400 * root / math.sqrt(3)]
    assert selector.scale == 800
    assert selector.scores() == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx([935.43, 1557.21, 637.17], abs=0.01)
    assert selector.select() == 1


def test_ucb1_fixed_scale_and_zero_rewards() -> None:
    selector = UCB1Selector(n_arms=2, c=1.0, reward_scale=2.0)
    selector.update(0, 1.0)
    selector.update(1, 0.5)
    bonus = 2.0 * math.sqrt(2 * math.log(2))
    assert selector.scores() == pytest.approx([1.0 + bonus, 0.5 + bonus])
    # Adaptive scale with only zero rewards: the scale is 1, and the less pulled arm wins.
    zeros = UCB1Selector(n_arms=2)
    for arm in (0, 1, 0):
        zeros.update(arm, 0.0)
    assert zeros.scale == 1.0
    assert zeros.select() == 1


def test_ucb1_adaptive_scale_is_textbook_on_bernoulli_arms() -> None:
    # Rewards in {0, 1}: the largest reward is 1 once any is, and the fallback is 1 before.
    adaptive = bernoulli_run(UCB1Selector(3), MEANS, 2000, seed=3)
    fixed = bernoulli_run(UCB1Selector(3, reward_scale=1.0), MEANS, 2000, seed=3)
    assert adaptive == fixed


def test_ucb1_choices_do_not_depend_on_the_reward_unit() -> None:
    rng = random.Random(4)
    rates = (500.0, 650.0, 600.0)  # tokens/s per arm, with noise below
    small, large = UCB1Selector(3, window_size=64), UCB1Selector(3, window_size=64)
    for _ in range(1500):
        arm = small.select()
        # 1024, not 1000: scaling by a power of two is exact in floating point, so every
        # score scales exactly and not even a rounding can break a tie differently.
        assert large.select() == arm
        reward = rates[arm] * rng.uniform(0.5, 1.5)
        small.update(arm, reward)
        large.update(arm, reward * 1024)
    assert small.counts == large.counts
    assert max(range(3), key=small.counts.__getitem__) == 1


@pytest.mark.parametrize("kind", ["ucb1", "thompson"])
def test_concentrates_on_the_best_arm_with_regret_below_the_auer_bound(kind: BanditKind) -> None:
    selector = make_selector(kind, 3, window_size=None, exploration=1.0, seed=7, reward_scale=1.0)
    chosen = bernoulli_run(selector, MEANS, 5000, seed=5)
    assert chosen.count(0) > 0.8 * 5000
    regrets = []
    for seed in range(10):
        selector = make_selector(
            kind, 3, window_size=None, exploration=1.0, seed=seed, reward_scale=1.0
        )
        regrets.append(pseudo_regret(bernoulli_run(selector, MEANS, 2000, seed=100 + seed), MEANS))
    assert sum(regrets) / len(regrets) < auer_bound(MEANS, 2000)


@pytest.mark.parametrize("kind", ["ucb1", "thompson"])
def test_sliding_window_follows_a_drift(kind: BanditKind) -> None:
    selector = make_selector(kind, 2, window_size=200, exploration=1.0, seed=1)
    rng = random.Random(2)
    means = [0.8, 0.2]
    chosen = []
    for step in range(2000):
        if step == 1000:
            means = [0.2, 0.8]  # the best arm changes
        arm = selector.select()
        selector.update(arm, 1.0 if rng.random() < means[arm] else 0.0)
        chosen.append(arm)
    assert sum(selector.counts) == 200
    assert chosen[800:1000].count(0) > 150
    # Within three windows of the change, the new best arm has most pulls.
    assert chosen[1600:2000].count(1) > 300
    # Without the window, UCB1 still trusts arm 0's long record far longer.
    if kind == "ucb1":
        unwindowed = UCB1Selector(2)
        rng = random.Random(2)
        means, late = [0.8, 0.2], []
        for step in range(2000):
            if step == 1000:
                means = [0.2, 0.8]
            arm = unwindowed.select()
            unwindowed.update(arm, 1.0 if rng.random() < means[arm] else 0.0)
            late.append(arm)
        assert late[1000:1200].count(0) > chosen[1000:1200].count(0)


def test_window_forgets_the_scale_too() -> None:
    selector = UCB1Selector(2, window_size=3)
    selector.update(0, 900.0)
    for _ in range(3):
        selector.update(1, 100.0)
    assert selector.counts == [0, 3]
    assert selector.scale == 100.0  # the 900 left the window
    assert selector.select() == 0  # and arm 0 counts as unpulled again


def test_thompson_is_reproducible_and_uses_its_own_random_numbers() -> None:
    state = random.getstate()
    first = bernoulli_run(ThompsonSelector(3, reward_scale=1.0, seed=11), MEANS, 500, seed=6)
    random.seed(12345)  # the global generator must not matter
    second = bernoulli_run(ThompsonSelector(3, reward_scale=1.0, seed=11), MEANS, 500, seed=6)
    assert random.getstate() == random.Random(12345).getstate()
    random.setstate(state)
    assert first == second
    other = bernoulli_run(ThompsonSelector(3, reward_scale=1.0, seed=12), MEANS, 500, seed=6)
    assert other != first
    # reset restarts the random stream too.
    selector = ThompsonSelector(3, reward_scale=1.0, seed=11)
    bernoulli_run(selector, MEANS, 100, seed=9)
    selector.reset()
    assert bernoulli_run(selector, MEANS, 500, seed=6) == first


def test_thompson_posterior_counts_bernoulli_trials() -> None:
    selector = ThompsonSelector(2, window_size=3, reward_scale=1.0, seed=0)
    for arm, reward in [(0, 1.0), (0, 0.0), (1, 1.0), (1, 1.0)]:
        selector.update(arm, reward)
    # Window of 3: the first pull (a success of arm 0) is gone.
    assert selector.posterior == [(1, 2), (3, 1)]
    # Rewards on another scale become trials with probability reward / scale.
    scaled = ThompsonSelector(1, reward_scale=1000.0, seed=0)
    for _ in range(4000):
        scaled.update(0, 250.0)
    successes = scaled.posterior[0][0] - 1
    assert successes == pytest.approx(0.25 * 4000, abs=100)


def test_thompson_gaussian_posterior_for_unbounded_rewards() -> None:
    selector = ThompsonSelector(3, seed=4)
    assert [selector.select() for _ in range(2)] == [0, 0]  # unpulled arms first, in order
    for arm, reward in [(0, 100.0), (1, 110.0), (2, 90.0)]:
        selector.update(arm, reward)
    # Every arm pulled once with no spread: the draws are the means exactly.
    assert all(selector.select() == 1 for _ in range(20))
    # Hand computation of one draw: arm means 100 and 300, sample variances 0 and 100^2.
    rng_selector = ThompsonSelector(2, seed=9)
    for reward in (100.0, 100.0, 200.0, 400.0):
        rng_selector.update(0 if reward == 100.0 else 1, reward)
    pooled = (0.0 + 2 * 100.0**2) / 4  # within-arm squared deviations over all pulls
    z = random.Random(9)
    draw0 = 100.0 + math.sqrt((0.0 + pooled) / 3 / 2) * z.gauss(0.0, 1.0)
    draw1 = 300.0 + math.sqrt((2 * 100.0**2 + pooled) / 3 / 2) * z.gauss(0.0, 1.0)
    assert rng_selector.select() == (0 if draw0 > draw1 else 1)
    # A noisy but better arm wins in the long run.
    rng = random.Random(3)
    noisy = ThompsonSelector(2, seed=5)
    for _ in range(2000):
        arm = noisy.select()
        noisy.update(arm, rng.uniform(0, 400) if arm == 0 else rng.uniform(80, 240))
    assert noisy.counts[0] > 1600


def test_thompson_adaptive_scale_is_unit_free() -> None:
    rng = random.Random(8)
    rates = (500.0, 650.0, 600.0)
    small, large = ThompsonSelector(3, seed=3), ThompsonSelector(3, seed=3)
    for _ in range(1000):
        arm = small.select()
        assert large.select() == arm
        reward = rates[arm] * rng.uniform(0.5, 1.5)
        small.update(arm, reward)
        large.update(arm, reward * 1024)  # a power of two: r / scale is unchanged exactly


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: UCB1Selector(0), "n_arms must be an integer >= 1"),
        (lambda: UCB1Selector(True), "n_arms"),
        (lambda: UCB1Selector(2.0), "n_arms"),  # type: ignore[arg-type]
        (lambda: UCB1Selector(2, window_size=0), "window_size must be None"),
        (lambda: UCB1Selector(2, window_size=True), "window_size"),
        (lambda: UCB1Selector(2, c=-1.0), "c must be a finite number >= 0"),
        (lambda: UCB1Selector(2, c=math.nan), "c must be"),
        (lambda: UCB1Selector(2, c=True), "c must be"),
        (lambda: UCB1Selector(2, reward_scale=0.0), "reward_scale must be None"),
        (lambda: UCB1Selector(2, reward_scale=math.inf), "reward_scale"),
        (lambda: ThompsonSelector(2, seed=1.5), "seed must be None or an integer"),  # type: ignore[arg-type]
        (lambda: ThompsonSelector(2, seed=False), "seed"),
        (lambda: ThompsonSelector(-1), "n_arms"),
        (lambda: make_selector("eps", 2), "kind must be one of 'ucb1', 'thompson'"),  # type: ignore[arg-type]
        (lambda: make_selector("thompson", 2, exploration=-1), "exploration must be"),
        (lambda: make_selector("ucb1", 2, exploration=math.nan), "exploration must be"),
        (lambda: make_selector("ucb1", 2, seed="0"), "seed must be"),  # type: ignore[arg-type]
        (lambda: make_selector("thompson", 2, window_size=-3), "window_size"),
    ],
)
def test_bad_arguments_raise(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["ucb1", "thompson"])
def test_bad_updates_raise_and_change_nothing(kind: BanditKind) -> None:
    selector = make_selector(kind, 2, seed=0, reward_scale=10.0)
    for arm, reward, match in [
        (2, 1.0, "arm must be in"),
        (-1, 1.0, "arm must be in"),
        (True, 1.0, "arm must be in"),
        (0, math.nan, "reward must be a finite number >= 0"),
        (0, -0.5, "reward must be"),
        (0, math.inf, "reward must be"),
        (0, "3", "reward must be"),
        (0, 11.0, "exceeds reward_scale=10.0; pass reward_scale=None"),
    ]:
        with pytest.raises(ValueError, match=match):
            selector.update(arm, reward)  # type: ignore[arg-type]
    assert selector.counts == [0, 0]


def test_make_selector_builds_each_kind() -> None:
    ucb = make_selector("ucb1", 3, window_size=10, exploration=0.5)
    assert isinstance(ucb, UCB1Selector) and ucb.c == 0.5 and ucb.window_size == 10
    assert ucb.reward_scale is None
    ts = make_selector("thompson", 3, window_size=None, seed=4, reward_scale=2.0)
    assert isinstance(ts, ThompsonSelector) and ts.seed == 4 and ts.reward_scale == 2.0
