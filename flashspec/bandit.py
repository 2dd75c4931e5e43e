"""The earlier path of ``flashspec.select.bandit`` (the bandit selectors), kept for old imports."""

from .select.bandit import Selector, ThompsonSelector, UCB1Selector, make_selector

__all__ = ["Selector", "ThompsonSelector", "UCB1Selector", "make_selector"]
