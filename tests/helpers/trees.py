"""Drafters of token trees for tests: random trees around a known continuation."""

from __future__ import annotations

import random

import torch

from flashspec.drafters import DraftContext, Drafter, Proposal
from flashspec.trees import TokenTree, TreeBuilder, TreeShape


class OracleTrees(Drafter):
    """Random trees around a known continuation: at each level of the true path the true token
    is a child with probability ``hit`` at a random rank among wrong siblings, and wrong nodes
    grow subtrees of their own. Chains: the true continuation."""

    name = "oracle"

    def __init__(
        self, truth: dict[tuple[int, ...], list[int]], hit: float, seed: int, vocab: int = 40
    ) -> None:
        self.truth = truth
        self.vocab = vocab  # wrong tokens are drawn from ids below this
        self.hit = hit
        self.rng = random.Random(seed)
        self.trees = 0
        self.moved = 0  # trees whose true path is not the first nodes (columns moved)

    def _future(self, ctx: DraftContext) -> list[int]:
        row = ctx.tokens[0, int(ctx.padding.lefts[0]) :].tolist()
        for prompt, continuation in self.truth.items():
            if tuple(row[: len(prompt)]) == prompt:
                return continuation[len(row) - len(prompt) :]
        raise AssertionError("unknown prompt")

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return Proposal(torch.tensor([self._future(ctx)[:gamma]], dtype=torch.int64))

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        future, rng, vocab = self._future(ctx), self.rng, self.vocab
        builder = TreeBuilder()
        parent = -1
        for depth in range(min(shape.depth, len(future))):
            if builder.size >= shape.nodes:
                break
            wrong = [t for t in rng.sample(range(vocab), shape.top_k) if t != future[depth]]
            children = wrong[: rng.randrange(0, shape.top_k)]
            truth_here = rng.random() < self.hit
            if truth_here:
                children.insert(rng.randrange(len(children) + 1), future[depth])
            for token in children:
                if builder.size < shape.nodes:
                    node = builder.add(parent, token)
                    if token != future[depth] and rng.random() < 0.5 and builder.size < shape.nodes:
                        builder.add(node, rng.randrange(vocab))  # an off-path subtree
            here = builder.node(parent, future[depth])
            if here is None:
                break
            parent = here
        if builder.size == 0:
            return None
        tree = builder.build()
        self.trees += 1
        true_path = tree.path(parent) if parent >= 0 else []
        self.moved += true_path != list(range(len(true_path)))
        return tree


class FixedShapeTrees(Drafter):
    """Deterministic trees whose tokens depend only on the context: the same two-level
    shape each round (3 children of the root, 2 under each), children the tokens after the
    row's last token in a fixed table over ``vocab`` ids."""

    name = "fixed"

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return Proposal(ctx.tokens[:, -1:].clone())

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        last, vocab = int(ctx.tokens[0, -1]), self.vocab
        builder = TreeBuilder()
        for rank in range(3):
            node = builder.add(-1, (last * 5 + rank * 7) % vocab)
            for sub in range(2):
                builder.add(node, (last + rank * 3 + sub * 4 + 1) % vocab)
        return builder.build()
