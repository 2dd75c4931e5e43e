"""What the throughput model measures of a round's time: a drafter's drafting seconds by draft
length (``_DraftTime``), the target side's seconds by verified tokens (``_CostLine``), and the
settling means both start from (``flashspec.select.throughput`` predicts rounds from them)."""

from __future__ import annotations

import numpy as np

# Cost memories. A drafter's drafting time (its level: mean length and seconds) is the mean of its
# first _COST_MEMORY measured rounds, then an exponential average over about as many of its own
# rounds; the verification line forgets with every round (~200 rounds). Round times jitter by
# several ms on a busy CPU, and a cost estimate that follows the jitter flips choices between arms
# a few percent apart. Starting with the plain mean keeps a drafter played rarely from carrying
# the cost of one lucky first round. The slope of drafting time in the length is a property of
# the drafter, not of
# the machine's speed of the moment (both are kept as shares of the target side's time), so it
# is fitted over a longer memory, _SLOPE_DECAY, across the lengths the model has played.
_COST_MEMORY = 50
_SLOPE_DECAY = 0.998
_LINE_DECAY = 0.995
_MIN_SPREAD = 0.25  # variance of the lengths below which a slope is not fitted
_MIN_SECONDS = 1e-6  # floor of a predicted round time


class _CostLine:
    """Exponentially weighted least-squares line ``seconds = a + b * n`` (b >= 0).

    Args:
        decay: weight left to each earlier point per point added.
    """

    def __init__(self, decay: float = _LINE_DECAY) -> None:
        self.decay = decay
        self.weight = self.n = self.nn = self.t = self.nt = 0.0

    def add(self, n: int, seconds: float) -> None:
        d = self.decay
        self.weight = self.weight * d + 1.0
        self.n = self.n * d + n
        self.nn = self.nn * d + n * n
        self.t = self.t * d + seconds
        self.nt = self.nt * d + n * seconds

    @property
    def known(self) -> bool:
        return self.weight > 0.0

    def slope(self) -> float | None:
        """The fitted slope (any sign), or None with (nearly) one length seen."""
        mean_n = self.n / self.weight
        spread = self.nn / self.weight - mean_n * mean_n
        if spread < _MIN_SPREAD:
            return None
        return (self.nt / self.weight - mean_n * (self.t / self.weight)) / spread

    def _fit(self) -> tuple[float, float, float]:
        """``(mean length, mean seconds, slope >= 0)`` of the fit."""
        # With (nearly) one length seen the slope is unknown: flat, i.e. optimistic about longer
        # drafts, which the next rounds then measure.
        slope = self.slope() or 0.0
        return self.n / self.weight, self.t / self.weight, max(slope, 0.0)

    def mean_seconds(self) -> float:
        """Weighted mean of the measured seconds (the line's level, free of its slope)."""
        return max(self.t / self.weight, _MIN_SECONDS)

    def __call__(self, n: float) -> float:
        mean_n, mean_t, slope = self._fit()
        return max(mean_t + slope * (n - mean_n), _MIN_SECONDS)

    def many(self, count: int, step: int = 1) -> np.ndarray:
        """``[self(0), self(step), ..., self((count - 1) * step)]`` as an array, from one fit."""
        mean_n, mean_t, slope = self._fit()
        n = np.arange(count) * step
        seconds: np.ndarray = np.maximum(mean_t + slope * (n - mean_n), _MIN_SECONDS)
        return seconds


def _settling_mean(mean: float, value: float, count: int) -> float:
    """The mean after its ``count``-th value: plain over the first ``_COST_MEMORY`` values, then
    exponential with weight ``1 / _COST_MEMORY`` (see the cost memories above)."""
    return mean + (value - mean) / min(count, _COST_MEMORY)


class _DraftTime:
    """A drafter's drafting seconds of a round, ``e + c * g``, in shares of the target side's mean
    round time (see ``ThroughputModel.draft_seconds``).

    A fixed part per round is real and differs between drafters: prompt lookup searches the
    whole context once whatever the length, and a model drafter pays a little per round besides
    its forwards. Charged per draft instead, it would make long drafts look dearer than they are.
    """

    def __init__(self) -> None:
        self.rounds = 0
        self.g = self.share = 0.0  # the level: mean length and share (see _settling_mean)
        self.line = _CostLine(_SLOPE_DECAY)  # for its slope

    def add(self, g: int, share: float) -> None:
        self.rounds += 1
        self.g = _settling_mean(self.g, g, self.rounds)
        self.share = _settling_mean(self.share, share, self.rounds)
        self.line.add(g, share)

    def fit(self) -> tuple[float, float]:
        """``(fixed share per round, share per draft)``, both >= 0."""
        mean_g, mean_share = self.g, self.share
        # With one length seen, or nearly, only the level is known: charged per draft, the
        # cautious reading for longer drafts (what the model did before the fixed part).
        proportional = mean_share / mean_g
        slope = self.line.slope()
        if slope is None:
            return 0.0, proportional
        # Neither part below zero: the slope within [0, the proportional one].
        slope = min(max(slope, 0.0), proportional)
        return mean_share - slope * mean_g, slope
