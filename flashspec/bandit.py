"""UCB1 arm selection, used by the engine to choose among drafters."""

from __future__ import annotations

import math
from collections import deque


class UCB1Selector:
    """UCB1 (Auer et al. 2002): pick the arm maximising ``mean + c * sqrt(2 ln t / n)``.

    Arms never pulled (within the window) are tried first, lowest index first. Rewards are
    expected in [0, 1]; the engine reports a round's acceptance fraction.

    Args:
        n_arms: number of arms (>= 1).
        window_size: if set, only the last ``window_size`` pulls count (sliding-window UCB), so
            the choice follows changes in which drafter does best.
        c: exploration constant.
    """

    def __init__(self, n_arms: int, window_size: int | None = None, c: float = 1.0) -> None:
        if isinstance(n_arms, bool) or not isinstance(n_arms, int) or n_arms < 1:
            raise ValueError(f"UCB1Selector n_arms must be an integer >= 1, got {n_arms!r}")
        if window_size is not None and (
            isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1
        ):
            raise ValueError(
                f"UCB1Selector window_size must be None or an integer >= 1, got {window_size!r}"
            )
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"UCB1Selector c must be a finite number >= 0, got {c!r}")
        self.n_arms = n_arms
        self.window_size = window_size
        self.c = c
        self._history: deque[tuple[int, float]] = deque()
        self._counts = [0] * n_arms
        self._sums = [0.0] * n_arms

    @property
    def counts(self) -> list[int]:
        """Pulls per arm (within the window)."""
        return list(self._counts)

    @property
    def means(self) -> list[float]:
        """Mean reward per arm (within the window); 0 for arms not pulled."""
        return [s / n if n else 0.0 for s, n in zip(self._sums, self._counts, strict=True)]

    def select(self) -> int:
        """The arm to pull next."""
        for arm, count in enumerate(self._counts):
            if count == 0:
                return arm
        log_t = math.log(sum(self._counts))
        scores = [
            total / count + self.c * math.sqrt(2.0 * log_t / count)
            for total, count in zip(self._sums, self._counts, strict=True)
        ]
        return max(range(self.n_arms), key=scores.__getitem__)

    def update(self, arm: int, reward: float) -> None:
        """Record ``reward`` for a pull of ``arm``."""
        if not 0 <= arm < self.n_arms:
            raise ValueError(f"UCB1Selector.update: arm must be in [0, {self.n_arms}), got {arm}")
        self._counts[arm] += 1
        self._sums[arm] += reward
        if self.window_size is not None:
            self._history.append((arm, reward))
            if len(self._history) > self.window_size:
                old_arm, old_reward = self._history.popleft()
                self._counts[old_arm] -= 1
                self._sums[old_arm] -= old_reward

    def reset(self) -> None:
        """Forget every pull."""
        self._history.clear()
        self._counts = [0] * self.n_arms
        self._sums = [0.0] * self.n_arms
