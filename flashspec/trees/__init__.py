"""Token trees: several continuations verified in one forward, accepted exactly."""

from __future__ import annotations

from .accept import TreeAcceptance, accept_tree, accept_tree_greedy
from .tree import ROOT, TokenTree, TreeBuilder, TreeShape, Trial

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
