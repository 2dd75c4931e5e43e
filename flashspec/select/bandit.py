"""Arm selectors for adaptive drafting: UCB1 and Thompson sampling, with optional sliding windows.

An arm is one drafting choice (a drafter and a draft length gamma; gamma = 0 is plain
decoding). Each round the engine asks ``select()`` for an arm, runs the round with it and
reports ``update(arm, reward)``, the reward being the round's tokens per second. A choice
depends only on rewards already seen, never on the tokens being sampled, and the selector
draws from its own ``random.Random``, never from the generation's torch generator, so
speculative decoding's output stays exactly the target model's.

Both selectors take rewards on any non-negative scale: tokens per second run from tens to
thousands, while UCB1's exploration bonus assumes rewards in [0, 1]; UCB1 therefore divides
rewards by a scale: a fixed ``reward_scale`` when one is known (1.0 for Bernoulli rewards),
else the largest reward within the window. Thompson sampling uses a Beta-Bernoulli posterior
when the scale is known and a Gaussian one, which needs no scale, when it is not.

``make_selector`` builds either from the engine's settings.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from typing import Literal

from .._validate import is_int

__all__ = ["Selector", "ThompsonSelector", "UCB1Selector", "make_selector"]

BanditKind = Literal["ucb1", "thompson"]
"""The bandit selectors (``BanditConfig.selector`` also offers "model", the throughput model)."""
BANDIT_KINDS: tuple[BanditKind, ...] = ("ucb1", "thompson")


def _check_n_arms(owner: str, n_arms: object) -> int:
    if is_int(n_arms, minimum=1):
        return n_arms
    raise ValueError(f"{owner} n_arms must be an integer >= 1 (e.g. 2), got {n_arms!r}")


def _check_window(owner: str, window_size: object) -> int | None:
    if window_size is None:
        return None
    if is_int(window_size, minimum=1):
        return window_size
    raise ValueError(
        f"{owner} window_size must be None (every pull counts) or an integer >= 1, "
        f"got {window_size!r}"
    )


def _check_nonnegative(owner: str, name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{owner} {name} must be a finite number >= 0 (e.g. 1.0), got {value!r}")
    return float(value)


def _check_scale(owner: str, reward_scale: object) -> float | None:
    if reward_scale is None:
        return None
    if (
        isinstance(reward_scale, bool)
        or not isinstance(reward_scale, int | float)
        or not math.isfinite(reward_scale)
        or reward_scale <= 0
    ):
        raise ValueError(
            f"{owner} reward_scale must be None (scale by the largest reward seen) or a "
            f"finite number > 0 (e.g. 1.0 for rewards in [0, 1]), got {reward_scale!r}"
        )
    return float(reward_scale)


def _check_seed(owner: str, seed: object) -> int | None:
    if seed is None:
        return None
    if is_int(seed):
        return seed
    raise ValueError(f"{owner} seed must be None or an integer (e.g. 0), got {seed!r}")


class Selector(ABC):
    """Chooses an arm each round from the rewards of earlier rounds.

    Keeps, per arm, the pulls and reward sum within the window, and the largest reward within
    the window (the adaptive scale). Subclasses decide how to choose.

    Args:
        n_arms: number of arms (>= 1).
        window_size: if set, only the last ``window_size`` pulls count (sliding window), so the
            choice follows drift in which arm does best; None: every pull counts.
        reward_scale: rewards are divided by this to bring them into [0, 1]; None: by the
            largest reward within the window (for unbounded rewards such as tokens/s).
    """

    def __init__(
        self, n_arms: int, window_size: int | None = None, reward_scale: float | None = None
    ) -> None:
        owner = type(self).__name__
        self.n_arms: int = _check_n_arms(owner, n_arms)
        self.window_size: int | None = _check_window(owner, window_size)
        self.reward_scale: float | None = _check_scale(owner, reward_scale)
        self._init_state()

    def _init_state(self) -> None:
        # (arm, reward, outcome): outcome is whatever the subclass derived from the reward.
        self._history: deque[tuple[int, float, int]] = deque()
        self._counts = [0] * self.n_arms
        self._sums = [0.0] * self.n_arms
        self._pulls = 0
        # Candidates for the window's maximum: (pull index, reward), rewards strictly
        # decreasing, so the front is the maximum and each pull enters and leaves once.
        self._max_candidates: deque[tuple[int, float]] = deque()

    @property
    def counts(self) -> list[int]:
        """Pulls per arm (within the window)."""
        return list(self._counts)

    @property
    def means(self) -> list[float]:
        """Mean reward per arm (within the window), unscaled; 0 for arms not pulled."""
        return [s / n if n else 0.0 for s, n in zip(self._sums, self._counts, strict=True)]

    @property
    def scale(self) -> float:
        """What rewards are divided by: ``reward_scale``, else the window's largest reward.

        1.0 while no positive reward is in the window: every mean is then 0, and any positive
        scale leaves the choice to the exploration terms alone.
        """
        if self.reward_scale is not None:
            return self.reward_scale
        if self._max_candidates and self._max_candidates[0][1] > 0:
            return self._max_candidates[0][1]
        return 1.0

    @abstractmethod
    def select(self) -> int:
        """The arm to pull next."""

    def update(self, arm: int, reward: float) -> None:
        """Record ``reward`` (>= 0, e.g. tokens per second) for a pull of ``arm``."""
        owner = type(self).__name__
        if not is_int(arm, minimum=0, maximum=self.n_arms - 1):
            raise ValueError(
                f"{owner}.update: arm must be in [0, {self.n_arms}) (from select()), got {arm!r}"
            )
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
            or reward < 0
        ):
            raise ValueError(
                f"{owner}.update: reward must be a finite number >= 0 (e.g. tokens per "
                f"second), got {reward!r}"
            )
        reward = float(reward)
        if self.reward_scale is not None and reward > self.reward_scale:
            raise ValueError(
                f"{owner}.update: reward {reward!r} exceeds reward_scale={self.reward_scale!r}; "
                "pass reward_scale=None to scale by the largest reward seen"
            )
        index = self._pulls
        self._pulls += 1
        candidates = self._max_candidates
        while candidates and candidates[-1][1] <= reward:
            candidates.pop()
        candidates.append((index, reward))
        outcome = self._observe(arm, reward)
        self._counts[arm] += 1
        self._sums[arm] += reward
        self._history.append((arm, reward, outcome))
        if self.window_size is not None and len(self._history) > self.window_size:
            old_arm, old_reward, old_outcome = self._history.popleft()
            self._counts[old_arm] -= 1
            self._sums[old_arm] -= old_reward
            self._forget(old_arm, old_reward, old_outcome)
            if candidates[0][0] == index - self.window_size:
                candidates.popleft()
        elif self.window_size is None:
            # No pull ever leaves, so only the aggregates are needed.
            self._history.clear()

    def _observe(self, arm: int, reward: float) -> int:
        """Hook: derive and record a subclass statistic of a new pull (its ``outcome``)."""
        return 0

    def _forget(self, arm: int, reward: float, outcome: int) -> None:  # noqa: B027 (no-op hook)
        """Hook: undo ``_observe`` for a pull leaving the window."""

    def reset(self) -> None:
        """Forget every pull."""
        self._init_state()


class UCB1Selector(Selector):
    """UCB1 (Auer, Cesa-Bianchi & Fischer 2002): the arm maximising ``mean + c·s·√(2 ln t / n)``.

    ``s`` is ``scale``: UCB1's bonus is sized for rewards in [0, 1] (it comes from Hoeffding's
    inequality on that range), and raw tokens/s would dwarf it, turning UCB1 greedy. Scoring
    ``mean / s + c·√(2 ln t / n)`` fixes that and ranks arms exactly as the formula above, so
    with the adaptive scale multiplying every reward by a constant changes no choice. With
    ``reward_scale=1.0`` (or rewards in [0, 1] and the adaptive scale on Bernoulli rewards)
    this is textbook UCB1.

    ``t`` and ``n`` count pulls within the window (sliding-window UCB). Arms not pulled within
    the window come first, lowest index first; ties go to the lowest index.

    Args:
        n_arms: number of arms (>= 1).
        window_size: if set, only the last ``window_size`` pulls count.
        c: exploration constant (>= 0; 1 is UCB1's).
        reward_scale: see ``Selector``; None adapts to the rewards.
    """

    def __init__(
        self,
        n_arms: int,
        window_size: int | None = None,
        c: float = 1.0,
        reward_scale: float | None = None,
    ) -> None:
        self.c: float = _check_nonnegative("UCB1Selector", "c", c)
        super().__init__(n_arms, window_size, reward_scale)

    def scores(self) -> list[float]:
        """Each arm's ``mean + c·scale·√(2 ln t / n)``; ``inf`` for arms not pulled."""
        t = sum(self._counts)
        log_t = math.log(t) if t else 0.0
        bonus = self.c * self.scale
        return [
            total / count + bonus * math.sqrt(2.0 * log_t / count) if count else math.inf
            for total, count in zip(self._sums, self._counts, strict=True)
        ]

    def select(self) -> int:
        """The arm to pull next: an unpulled one, else the highest score."""
        scores = self.scores()
        return max(range(self.n_arms), key=scores.__getitem__)


class ThompsonSelector(Selector):
    """Thompson sampling: draw a plausible mean for every arm from its posterior, take the best.

    Two posteriors, by what is known about the rewards:

    - ``reward_scale`` given (rewards in [0, scale]): Beta-Bernoulli, prior Beta(1, 1). A
      reward ``r`` becomes a Bernoulli trial that succeeds with probability ``r / scale``
      (Agrawal & Goyal 2012: this keeps Thompson sampling's guarantees for any rewards in
      [0, 1]). Bernoulli rewards with ``reward_scale=1.0`` give textbook Thompson sampling.
    - ``reward_scale=None`` (unbounded rewards such as tokens/s): Gaussian, the draw being
      ``mean + sd / sqrt(n) * Z`` with the arm's own sample variance, shrunk towards the
      variance of all pulls by one pseudo-observation. Bernoulli trials against the largest
      reward seen would throw away what the rewards' spread says, and would judge early pulls
      against a smaller scale than later ones. Arms not pulled yet come first.

    All randomness comes from this selector's own ``random.Random(seed)``, never from the
    generation's torch generator, so the draws cannot disturb sampling.

    Args:
        n_arms: number of arms (>= 1).
        window_size: if set, only the last ``window_size`` pulls count.
        reward_scale: see ``Selector``; None adapts to the rewards.
        seed: seeds the selector's random numbers (None: from the OS); ``reset`` reseeds.
    """

    def __init__(
        self,
        n_arms: int,
        window_size: int | None = None,
        reward_scale: float | None = None,
        seed: int | None = None,
    ) -> None:
        self.seed: int | None = _check_seed("ThompsonSelector", seed)
        super().__init__(n_arms, window_size, reward_scale)

    def _init_state(self) -> None:
        super()._init_state()
        self._successes = [0] * self.n_arms
        self._squares = [0.0] * self.n_arms
        self._rng = random.Random(self.seed)

    @property
    def posterior(self) -> list[tuple[int, int]]:
        """Each arm's Beta posterior parameters ``(1 + successes, 1 + failures)``."""
        return [(1 + s, 1 + n - s) for s, n in zip(self._successes, self._counts, strict=True)]

    def select(self) -> int:
        """The arm whose posterior sample is largest."""
        if self.reward_scale is not None:
            draws = [self._rng.betavariate(a, b) for a, b in self.posterior]
        else:
            draws = self._gaussian_draws()
        return max(range(self.n_arms), key=draws.__getitem__)

    def _gaussian_draws(self) -> list[float]:
        counts, sums, squares = self._counts, self._sums, self._squares
        total = sum(counts)
        if total == 0:
            return [math.inf] * self.n_arms
        # Spread of every pull around its own arm's mean: the prior for each arm's variance.
        within = sum(q - s * s / n for q, s, n in zip(squares, sums, counts, strict=True) if n)
        pooled = max(within, 0.0) / total
        draws = []
        for q, s, n in zip(squares, sums, counts, strict=True):
            if n == 0:
                draws.append(math.inf)
                continue
            mean = s / n
            variance = (max(q - s * mean, 0.0) + pooled) / (n + 1)
            draws.append(mean + math.sqrt(variance / n) * self._rng.gauss(0.0, 1.0))
        return draws

    def _observe(self, arm: int, reward: float) -> int:
        self._squares[arm] += reward * reward
        if self.reward_scale is None:
            return 0
        success = int(self._rng.random() < reward / self.scale)
        self._successes[arm] += success
        return success

    def _forget(self, arm: int, reward: float, outcome: int) -> None:
        self._squares[arm] -= reward * reward
        self._successes[arm] -= outcome


def make_selector(
    kind: BanditKind,
    n_arms: int,
    *,
    window_size: int | None = None,
    exploration: float = 1.0,
    seed: int | None = None,
    reward_scale: float | None = None,
) -> Selector:
    """Build the selector ``kind`` names.

    Args:
        kind: ``"ucb1"`` or ``"thompson"``.
        n_arms: number of arms (>= 1).
        window_size: sliding window in pulls; None keeps every pull.
        exploration: UCB1's constant c (validated, unused by Thompson sampling).
        seed: Thompson sampling's seed (validated, unused by UCB1, which is deterministic).
        reward_scale: fixed reward scale; None (the default) adapts to rewards such as tokens/s.
    """
    if kind not in BANDIT_KINDS:
        raise ValueError(
            f"make_selector kind must be one of {', '.join(map(repr, BANDIT_KINDS))}, got {kind!r}"
        )
    c = _check_nonnegative("make_selector", "exploration", exploration)
    seed = _check_seed("make_selector", seed)
    if kind == "ucb1":
        return UCB1Selector(n_arms, window_size=window_size, c=c, reward_scale=reward_scale)
    return ThompsonSelector(n_arms, window_size=window_size, reward_scale=reward_scale, seed=seed)
