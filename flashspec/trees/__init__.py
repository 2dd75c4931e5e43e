"""Token trees: several continuations verified in one forward, accepted exactly."""

from __future__ import annotations

from .tree import ROOT, TokenTree, TreeBuilder, TreeShape, Trial

__all__ = ["ROOT", "TokenTree", "TreeBuilder", "TreeShape", "Trial"]
