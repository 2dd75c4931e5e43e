"""A token tree: several continuations of one row, verified by the target in one forward.

Node i holds one token; its parent is ``parents[i]`` (an earlier node, or -1: the root, which
is the row's newest committed token). A chain of g drafts is the tree whose node i has parent
i - 1. Nodes are in topological order (a parent before its children), so a flat sequence of the
nodes with positions by depth and an ancestor mask (``ancestor_mask``) is a causal forward in
which each node sees the committed context and its own ancestors only.

Each parent's children are tried in order (``trials``): a trial names a child and how its token
was chosen. ``q`` None: deterministically (a point mass: top-k, prompt lookup); else the (V,)
distribution it was drawn from, independently of the other trials. A token drawn twice is one
node (one subtree) with two trials. ``flashspec.trees.accept`` verifies the trials in this order,
which keeps the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1
"""The parent of depth-1 nodes: the row's newest committed token (not a node)."""


@dataclass(frozen=True)
class TreeShape:
    """How large a tree a drafter may propose: ``depth`` levels at most, ``nodes`` nodes at
    most, ``top_k`` children of a node at most; a model drafter expands (drafts on from) the
    ``expand`` most probable nodes of a level (None: ``top_k``). ``expand=1`` is a chain with
    its nodes' runner-up tokens as leaves beside it, which costs the draft no more than the
    chain: each draft step's distribution gives them."""

    depth: int = 5
    nodes: int = 24
    top_k: int = 4
    expand: int | None = None

    @property
    def expanded(self) -> int:
        """Nodes a level expands: ``expand``, or ``top_k``."""
        return self.top_k if self.expand is None else self.expand

    @staticmethod
    def parse(text: str) -> TreeShape | None:
        """``DEPTH,NODES,TOP_K`` (e.g. ``5,24,4``), or ``off`` (None).

        Raises:
            ValueError: anything else, with the expected form.
        """
        if text.strip().lower() in ("off", "none", "0"):
            return None
        parts = text.split(",")
        if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(
                "a tree shape is DEPTH,NODES,TOP_K[,EXPAND] integers >= 1 such as 5,24,4 or "
                f"4,9,2,1, or off; got {text!r}"
            )
        depth, nodes, top_k, *expand = (int(p) for p in parts)
        return TreeShape(depth, nodes, top_k, expand[0] if expand else None)

    def __str__(self) -> str:
        tail = "" if self.expand is None else f",{self.expand}"
        return f"{self.depth},{self.nodes},{self.top_k}{tail}"

    def __post_init__(self) -> None:
        for name in ("depth", "nodes", "top_k", "expand"):
            value = getattr(self, name)
            if name == "expand" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TreeShape {name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Trial:
    """One try of a child at its parent: the child's node index, and the (V,) distribution its
    token was drawn from (None: chosen deterministically, a point mass)."""

    child: int
    q: torch.Tensor | None = None


@dataclass
class TokenTree:
    """Nodes in topological order (see the module docstring).

    Attributes:
        tokens: (N,) int64, node i's token.
        parents: node i's parent (< i), or ``ROOT``.
        trials: ``trials[i + 1]``: node i's children as they are tried; ``trials[0]``: the
            root's. Every node is some trial's child.
        weights: the drafter's probability that node i's path is accepted, not increasing
            along the nodes (None: unknown). The engine keeps the first nodes that pay
            (``prefix``) by them.
    """

    tokens: torch.Tensor
    parents: list[int]
    trials: list[list[Trial]]
    weights: list[float] | None = None
    depths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.parents)
        if self.tokens.dim() != 1 or int(self.tokens.shape[0]) != n:
            raise ValueError(f"TokenTree: tokens must be ({n},), got {tuple(self.tokens.shape)}")
        if len(self.trials) != n + 1:
            raise ValueError(f"TokenTree: trials must have {n + 1} lists, got {len(self.trials)}")
        depths: list[int] = []
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"TokenTree: node {i}'s parent {parent} is not before it")
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        self.depths = depths
        tried = [False] * n
        for at, trials in enumerate(self.trials):
            for trial in trials:
                if not 0 <= trial.child < n or self.parents[trial.child] != at - 1:
                    raise ValueError(
                        f"TokenTree: a trial at node {at - 1} names {trial.child}, not its child"
                    )
                tried[trial.child] = True
        if not all(tried):
            raise ValueError(f"TokenTree: node {tried.index(False)} is no trial's child")

    @property
    def size(self) -> int:
        """Nodes (N)."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """The deepest node's depth (0 for an empty tree)."""
        return max(self.depths, default=0)

    @property
    def deterministic(self) -> bool:
        """Whether every trial is a point mass."""
        return all(t.q is None for trials in self.trials for t in trials)

    def children(self, node: int) -> list[int]:
        """Node ``node``'s children (``ROOT``: the depth-1 nodes), each once, in trial order."""
        seen: list[int] = []
        for trial in self.trials[node + 1]:
            if trial.child not in seen:
                seen.append(trial.child)
        return seen

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to ``node`` (empty for ``ROOT``)."""
        out: list[int] = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def prefix(self, count: int) -> TokenTree:
        """The tree of the first ``count`` nodes (ancestor-closed: parents come first)."""
        if count >= self.size:
            return self
        trials = [[t for t in at if t.child < count] for at in self.trials[: count + 1]]
        weights = None if self.weights is None else self.weights[:count]
        return TokenTree(self.tokens[:count], self.parents[:count], trials, weights)

    def ancestor_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """(N, N) bool: [i, j] True when node j is node i or one of its ancestors."""
        n = self.size
        mask = torch.zeros((n, n), dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                mask[i] = mask[parent]
            mask[i, i] = True
        return mask.to(device) if device is not None else mask

    @staticmethod
    def chain(tokens: torch.Tensor, probs: torch.Tensor | None = None) -> TokenTree:
        """The tree of one chain of drafts ``tokens`` (g,), drawn from ``probs`` (g, V) or
        chosen deterministically (None)."""
        g = int(tokens.shape[0])
        trials = [[Trial(i, None if probs is None else probs[i])] for i in range(g)]
        return TokenTree(tokens.to(torch.int64), [i - 1 for i in range(g)], [*trials, []])


class TreeBuilder:
    """Builds a ``TokenTree`` one trial at a time; a token tried again at the same parent
    reuses its node (a point mass tried again adds no trial: it would be rejected for sure)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.trials: list[list[Trial]] = [[]]
        self._index: dict[tuple[int, int], int] = {}

    @property
    def size(self) -> int:
        """Nodes so far."""
        return len(self.tokens)

    def node(self, parent: int, token: int) -> int | None:
        """The node of ``token`` under ``parent``, or None."""
        return self._index.get((parent, token))

    def add(self, parent: int, token: int, q: torch.Tensor | None = None) -> int:
        """Try ``token`` at ``parent`` (drawn from ``q``, or a point mass); returns its node."""
        if not ROOT <= parent < len(self.tokens):
            raise ValueError(f"TreeBuilder.add: no node {parent}")
        key = (parent, int(token))
        node = self._index.get(key)
        if node is None:
            node = self._index[key] = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.trials.append([])
        elif q is None and any(t.child == node and t.q is None for t in self.trials[parent + 1]):
            return node
        self.trials[parent + 1].append(Trial(node, q))
        return node

    def add_path(self, tokens: Sequence[int], parent: int = ROOT) -> list[int]:
        """Try ``tokens`` one under another as point masses from ``parent``; their nodes."""
        nodes = []
        for token in tokens:
            parent = self.add(parent, token)
            nodes.append(parent)
        return nodes

    def merge(self, tree: TokenTree) -> None:
        """Add ``tree``'s trials under the root, in its order (two drafters' proposals)."""
        mine: dict[int, int] = {ROOT: ROOT}
        for at, trials in enumerate(tree.trials):
            for trial in trials:
                token = int(tree.tokens[trial.child])
                mine[trial.child] = self.add(mine[at - 1], token, trial.q)

    def build(self, device: torch.device | None = None) -> TokenTree:
        """The tree so far."""
        tokens = torch.tensor(self.tokens, dtype=torch.int64, device=device)
        return TokenTree(tokens, list(self.parents), [list(t) for t in self.trials])
