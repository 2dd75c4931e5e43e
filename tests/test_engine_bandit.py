"""UCB1Selector: the drafter chooser."""

from __future__ import annotations

import math
import random

import pytest

from flashspec import UCB1Selector


def test_unpulled_arms_come_first_in_order() -> None:
    selector = UCB1Selector(n_arms=3)
    for expected in range(3):
        arm = selector.select()
        assert arm == expected
        selector.update(arm, 0.0)


def test_score_is_mean_plus_exploration_bonus() -> None:
    selector = UCB1Selector(n_arms=2, c=1.0)
    selector.update(0, 1.0)  # mean 1.0, n = 1
    for _ in range(9):
        selector.update(1, 0.9)  # mean 0.9, n = 9
    # t = 10: arm 0 scores 1 + sqrt(2 ln 10); arm 1 scores 0.9 + sqrt(2 ln 10 / 9).
    assert selector.select() == 0
    assert selector.means == pytest.approx([1.0, 0.9])
    assert 1 + math.sqrt(2 * math.log(10)) > 0.9 + math.sqrt(2 * math.log(10) / 9)


def test_finds_the_best_arm() -> None:
    rng = random.Random(0)
    means = [0.2, 0.7, 0.4]
    selector = UCB1Selector(n_arms=3)
    for _ in range(2000):
        arm = selector.select()
        selector.update(arm, 1.0 if rng.random() < means[arm] else 0.0)
    assert max(range(3), key=selector.counts.__getitem__) == 1
    assert selector.counts[1] > 1500


def test_sliding_window_forgets_and_follows_a_change() -> None:
    rng = random.Random(1)
    selector = UCB1Selector(n_arms=2, window_size=100)
    means = [0.9, 0.1]
    for step in range(1200):
        if step == 600:
            means = [0.1, 0.9]  # the best drafter changes
        arm = selector.select()
        selector.update(arm, 1.0 if rng.random() < means[arm] else 0.0)
    assert sum(selector.counts) == 100
    assert selector.counts[1] > selector.counts[0]


def test_reset_and_bad_arm() -> None:
    selector = UCB1Selector(n_arms=2)
    selector.update(1, 0.5)
    selector.reset()
    assert selector.counts == [0, 0]
    with pytest.raises(ValueError, match="arm must be in"):
        selector.update(2, 1.0)
