"""A round that verifies a token tree: when it runs, and how its accepted path becomes the
chain-shaped proposal, logits and acceptance the rest of the round reads (append, commit,
stop, logprobs), so that a tree round differs from a chain round only in draft and verify."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..drafters import Drafter, Proposal
from ..models import TargetModel
from ..sampling import Acceptance
from ..trees.accept import accept_tree, accept_tree_greedy
from ..trees.tree import TokenTree, TreeShape
from .generation import Generation


@dataclass
class TreeOutcome:
    """A tree round's acceptance as a chain's: the accepted path's tokens (1, L), the logits
    at the root and along the path (1, L + 1, V), the acceptance, and for the policy the depth
    levels tried (``levels``) with the probability that each accepted some child (1, levels)."""

    proposal: Proposal
    logits: torch.Tensor
    acceptance: Acceptance
    levels: int
    probability: torch.Tensor
    verified: int


def tree_shape(
    shape: TreeShape | None,
    gen: Generation,
    drafter: Drafter | None,
    gamma: int,
    target: TargetModel,
    eager_only: bool,
) -> TreeShape | None:
    """The tree a round drafts (``gamma`` levels at most), or None: a chain round. Trees
    need one row, a target whose rows keep their own columns, a path that verifies trees
    (``eager_only``: a compiled target without tree graphs does not), greedy or rejection
    sampling, and no per-round logit changes (penalties, grammars), whose adjustments follow
    one chain of drafts."""
    if shape is None or drafter is None or gamma <= 0 or eager_only:
        return None
    if len(gen.live) != 1 or gen.joining or target.rows is None:
        return None
    if gen.typical or gen.adjusters or gen.grammar is not None:
        return None
    return dataclasses.replace(shape, depth=min(shape.depth, gamma))


# The tree gate's memories. Rates are exponential averages over about _GATE_MEMORY rounds of
# each mode; _GATE_START rounds of each are measured before they decide; then one decided
# round in _GATE_EXPLORE runs the losing mode, so its rate follows the text (lookup trees pay
# on code and not on prose, say).
_GATE_MEMORY = 12
_GATE_START = 3
_GATE_EXPLORE = 8


@dataclass
class _Rate:
    """Emitted tokens over round seconds, exponentially averaged."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - 1.0 / _GATE_MEMORY
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + seconds
        self.rounds += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class TreeGate:
    """Whether a drafter's round drafts a tree or a chain of the same length: the mode whose
    measured rounds with that drafter emitted more tokens a second (drafting, verification and
    the rest of the round). The prefix a tree keeps (``paying_prefix``) cannot undo what
    drafting the tree cost; on a target whose every verified token costs a large share of a
    step (the quantized C step multiplies each row in float32) no prefix pays, and the gate
    then runs chains, with a tree round now and then to follow the text. Only the shape of a
    round changes: acceptance is exact either way."""

    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._decided: dict[int, int] = {}
        self._asked: int | None = None

    def wants_tree(self, drafter: int) -> bool:
        """The mode of this round with ``drafter`` (``observe`` then learns its outcome)."""
        self._asked = drafter
        tree, chain = self._rate(drafter, True), self._rate(drafter, False)
        if tree.rounds < _GATE_START:
            return True
        if chain.rounds < _GATE_START:
            return False
        count = self._decided[drafter] = self._decided.get(drafter, 0) + 1
        better = tree.rate >= chain.rate
        return better if count % _GATE_EXPLORE else not better

    def observe(self, tree: bool, emitted: int, seconds: float) -> None:
        """The outcome of the round ``wants_tree`` was last asked about (none: nothing)."""
        drafter, self._asked = self._asked, None
        if drafter is not None and seconds > 0:
            self._rate(drafter, tree).add(emitted, seconds)

    def forget(self) -> None:
        """Drop a question whose round will not be observed."""
        self._asked = None

    def _rate(self, drafter: int, tree: bool) -> _Rate:
        return self._rates.setdefault((drafter, tree), _Rate())


def paying_prefix(
    tree: TokenTree, draft_seconds: float, verify_seconds: Callable[[int], float | None]
) -> TokenTree:
    """The first nodes of ``tree`` that maximize the round's expected tokens per second: with
    the drafter's path probabilities (``TokenTree.weights``) a prefix of n nodes yields
    1 + their sum tokens on average, and costs the drafting already done plus the measured
    target side of n + 1 tokens (``ThroughputModel.verify_seconds``). The whole tree when
    either is unknown (the model then measures it)."""
    weights = tree.weights
    if weights is None or verify_seconds(tree.size + 1) is None:
        return tree
    best, best_rate, expected = tree.size, -1.0, 1.0
    for n in range(1, tree.size + 1):
        expected += weights[n - 1]
        seconds = verify_seconds(n + 1)
        assert seconds is not None
        rate = expected / (draft_seconds + seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    return tree.prefix(best)


def accept_tree_round(
    gen: Generation, logits: torch.Tensor, tree: TokenTree, target: TargetModel
) -> TreeOutcome:
    """Accept along ``tree`` from its verification's (1, N + 1, V) ``logits`` (exactly:
    ``flashspec.trees.accept``), keep the accepted path in the target's cache, and return the
    round as a chain of the path's tokens."""
    row = logits[0]
    if gen.warper.greedy:
        accepted = accept_tree_greedy(row, tree)
    else:
        accepted = accept_tree(gen.warper.probs(row), tree, gen.row_generator(0))
    path = accepted.path
    target.keep_path(path)
    device = logits.device
    along = torch.tensor([0, *(i + 1 for i in path)], device=device)
    tokens = tree.tokens[torch.tensor(path, dtype=torch.int64, device=device)].view(1, len(path))
    length = len(path)
    levels = max(1, min(len(accepted.probabilities), tree.depth))
    probability = torch.tensor([accepted.probabilities[:levels]], dtype=torch.float64)
    return TreeOutcome(
        proposal=Proposal(tokens),
        logits=logits.index_select(1, along),
        acceptance=Acceptance(
            accepted=torch.tensor([length], device=device),
            token=torch.tensor([accepted.token], device=device),
            probability=probability[:, :length].to(device),
        ),
        levels=levels,
        probability=probability,
        verified=tree.size + 1,
    )
