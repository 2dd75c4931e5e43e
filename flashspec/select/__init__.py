"""Selection: which arm (drafter and draft length, or plain decoding) each round runs.

Modules: ``policy`` (the interface the engine calls, ``choose``/``observe``, and the policies
behind it), ``bandit`` (UCB1 and Thompson selectors), ``throughput`` (the throughput model),
``context`` (the lookup-context probe).
"""

from __future__ import annotations

from .bandit import Selector, ThompsonSelector, UCB1Selector, make_selector
from .policy import Arm, Choice, Outcome, Policy, default_bandit, make_policy
from .throughput import ThroughputModel

__all__ = [
    "Arm",
    "Choice",
    "Outcome",
    "Policy",
    "Selector",
    "ThompsonSelector",
    "ThroughputModel",
    "UCB1Selector",
    "default_bandit",
    "make_policy",
    "make_selector",
]
