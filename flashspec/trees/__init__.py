"""Token trees: several continuations verified in one forward, accepted exactly.

``tree`` (the tree, its shape) imports torch only, so ``flashspec.config`` can name
``TreeShape``; the acceptance rules (``accept``, which builds on ``flashspec.sampling`` and so
on the config) load on first use (PEP 562), which keeps the two free of an import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .tree import ROOT, TokenTree, TreeBuilder, TreeShape, Trial

if TYPE_CHECKING:
    from .accept import TreeAcceptance, accept_tree, accept_tree_greedy

_LAZY = {name: ".accept" for name in ("TreeAcceptance", "accept_tree", "accept_tree_greedy")}

__all__ = [
    "ROOT",
    "TokenTree",
    "TreeAcceptance",
    "TreeBuilder",
    "TreeShape",
    "Trial",
    "accept_tree",
    "accept_tree_greedy",
]

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
