"""``MergedDrafter``: two drafters' token trees verified as one tree.

A features draft and prompt lookup miss in different places: the draft guesses the next
words of ordinary text, lookup copies a span the row already holds (code, names, a quoted
question). Verifying both in one forward costs a few more tree nodes, not a second round.
The merged tree holds the first drafter's tree, then the second's nodes that the first does
not hold (a shared prefix is one path), within the shape's node budget: where both do not
fit, the second's new nodes take up to half of it and the first tree keeps its leading nodes
(a prefix in topological order, its most likely ones in a features draft's tree).

Acceptance stays exact for the same reason a single drafter's tree does
(``flashspec.trees.accept``): every trial is a point mass, or drawn from its q independently
of the others, and the tree's shape does not depend on those draws. To keep the second
condition, a first tree with sampled trials is verified alone: the budget left to the
second tree would depend on the first's draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..models import Padding
from ..trees.tree import TokenTree, TreeBuilder, TreeShape
from .base import DraftContext, Drafter, Proposal

if TYPE_CHECKING:
    from ..models import CausalLM, TargetModel


class MergedDrafter(Drafter):
    """Chains from ``first``; token trees holding both drafters' trees (see the module
    docstring).

    Args:
        first: the drafter whose chains and tree come first (a features or model draft).
        second: the drafter whose tree's new nodes follow (prompt lookup).
        name: a label for stats and logs (default ``"first+second"``).

    Raises:
        ValueError: both drafters run a model of their own (the engine checks and compiles
            one model per drafter), or either is a ``MergedDrafter`` already.

    The engine's cost cut (``TreeShape`` with the throughput model) keeps the nodes whose
    path probability pays for their verification; it needs every node's probability, so a
    merged tree with nodes from a drafter that gives none (prompt lookup) is verified whole,
    up to the shape's ``nodes``.
    """

    def __init__(self, first: Drafter, second: Drafter, name: str | None = None) -> None:
        for part, label in ((first, "first"), (second, "second")):
            if not isinstance(part, Drafter):
                raise TypeError(f"MergedDrafter: {label} must be a Drafter, got "
                                f"{type(part).__name__}")  # fmt: skip
            if isinstance(part, MergedDrafter):
                raise ValueError(f"MergedDrafter: {label} is merged already; merge two "
                                 "drafters once")  # fmt: skip
        if first.lm is not None and second.lm is not None:
            raise ValueError(
                "MergedDrafter: both drafters run a model of their own; merge a model or "
                "features draft with a model-free drafter such as PromptLookupDrafter"
            )
        self.first = first
        self.second = second
        self.name = name or f"{first.name}+{second.name}"
        self.temperature = first.temperature

    @property
    def lm(self) -> CausalLM | None:
        return self.first.lm if self.first.lm is not None else self.second.lm

    @property
    def shiftable(self) -> bool:
        return self.first.shiftable and self.second.shiftable

    def bind(self, target: TargetModel) -> None:
        self.first.bind(target)
        self.second.bind(target)

    def reset(self) -> None:
        self.first.reset()
        self.second.reset()

    def begin(self, ctx: DraftContext) -> None:
        self.first.begin(ctx)
        self.second.begin(ctx)

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return self.first.propose(ctx, gamma)

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        """The first drafter's tree, then the second's new nodes, at most ``shape.nodes``
        (None when neither proposes one; see the module docstring for the budget)."""
        first = self.first.propose_tree(ctx, shape)
        if first is not None and not first.deterministic:
            return first  # its draws must not decide how much of the second tree is verified
        second = self.second.propose_tree(ctx, shape)
        if second is None or not second.size:
            return first
        if first is None or not first.size:
            return second
        builder = TreeBuilder()
        builder.merge(first)
        builder.merge(second)
        fresh = builder.size - first.size
        if not fresh:
            return first  # nothing new: keep the first's probabilities (and its cost cut)
        # A first tree that fills the budget would leave no room: the second's new nodes get
        # up to half of it, and the first keeps its leading nodes (its most likely, in a
        # features draft's tree) in the rest.
        room = max(shape.nodes - min(fresh, shape.nodes // 2), 1)
        builder = TreeBuilder()
        builder.merge(first.prefix(min(first.size, room)))
        builder.merge(second)
        merged = builder.build(first.tokens.device)
        return merged.prefix(min(merged.size, shape.nodes))

    def keep(self, lengths: Sequence[int], padding: Padding) -> None:
        self.first.keep(lengths, padding)
        self.second.keep(lengths, padding)

    def select_rows(self, index: torch.Tensor) -> None:
        self.first.select_rows(index)
        self.second.select_rows(index)

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        self.first.add_rows(tokens, padding)
        self.second.add_rows(tokens, padding)
