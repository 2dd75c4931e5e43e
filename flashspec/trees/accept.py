"""Exact acceptance of a token tree: greedy, and multi-draft recursive rejection sampling.

The target scores the root and every node in one forward (``TokenTree.ancestor_mask``): row 0
of its output is the distribution after the root (the newest committed token), row i + 1 the
distribution after node i given node i's path. Acceptance walks down from the root, visiting
only the rows along the accepted path, and emits the accepted nodes' tokens plus one more.

Greedy (``accept_tree_greedy``): descend to the child whose token is the row's argmax (first
maximum, as ``flashspec.sampling.accept_greedy``), emit the argmax where no child matches. The
output is the target's greedy continuation token for token.

Sampled (``accept_tree``, SpecInfer's multi-step speculative sampling, also called recursive
rejection sampling). At node u, r starts as the target's row p_u. The trials at u are tried in
order; a trial drew its token x from q (``Trial.q``; a point mass q = δ_x when None):

* accept with probability min(1, r(x) / q(x)) (``uniform * q(x) < r(x)``) and descend to the
  trial's child, which starts again with its own row;
* on rejection replace r by ``norm(max(r - q, 0))`` (``_reject``), for a point mass: r with
  r(x) set to 0, renormalized;
* when every trial at u is rejected (at once at a leaf), emit a sample of the final r.

Why the output follows the target exactly. Claim: at a node whose remaining trials are
t_1..t_k, run with a law r, the token the node emits (the accepted child's token, or the final
sample) has law r. By induction on k. k = 0: it samples r. k >= 1: t_1's token x was drawn from
q, so P(t_1 accepted and x = y) = q(y) min(1, r(y) / q(y)) = min(q(y), r(y)), and
P(rejected) = 1 - Σ min(q, r) = Σ max(r - q, 0) = β. Given the rejection, t_2..t_k are still
the draws they were (independent of t_1), so by induction they emit
r' = max(r - q, 0) / β; in total P(y) = min(q(y), r(y)) + max(r(y) - q(y), 0) = r(y). A point
mass is q = δ_x: accepted with probability r(x), residual r without x renormalized. Starting
from r = p_u, the node's token follows the target after u's path; an accepted child then runs
the same claim with its own row, so every later token follows the target given the tokens
before it, and the emitted sequence follows the target's distribution exactly.

The condition this needs: each sampled trial's token is drawn from its q independently of the
other trials, and the tree's shape (which trials a node has, in which order, with which q)
does not depend on the values sampled for them; a subtree may depend on its own path. A
deterministic trial (q None) has no such condition: the point-mass step is exact for any
token x, however it was chosen. A token drawn twice at one parent is one node with two trials
(``TreeBuilder``), both tried: each is a separate draw from its q.

The residual's total can be 0 only if r <= q everywhere, i.e. r = q (both sum to 1). Then every
token q can draw has r(x) >= q(x) and is accepted for sure, so the rejection had probability
0; for a point mass, r = δ_x and the trial is accepted since uniform < 1. Such a rejection only
happens within float rounding of these cases, and ``_reject`` keeps r, whose mass is where the
target puts it, rather than divide by 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import argmax_last, sample_inverse_cdf
from .tree import ROOT, TokenTree, Trial

# A floor for a hand-made q(x) = 0 in the acceptance probability (a token drawn from q has
# q(x) > 0): r(x) / floor is then >= 1 for any r(x) > 0, which is what ``u * 0 < r(x)`` decides.
_Q_FLOOR = 1e-300


@dataclass
class TreeAcceptance:
    """The outcome of accepting one tree.

    Attributes:
        path: the accepted nodes, depth 1 first (empty when no depth-1 node was accepted).
        token: the token emitted after the path (the argmax, or a sample of the residual).
        probabilities: for each node visited (the root, then every node in ``path``; the last
            is where descent stopped), the probability that some child's trial was accepted
            there given the tree: its expectation, not the coin flip (1.0 or 0.0 for greedy).
            Adaptive tree shaping learns from it with far less noise than from the flips.
    """

    path: list[int]
    token: int
    probabilities: list[float]


def _check_rows(rows: torch.Tensor, tree: TokenTree, name: str) -> None:
    if rows.dim() != 2 or int(rows.shape[0]) != tree.size + 1:
        raise ValueError(
            f"{name} must be (N + 1, V) = ({tree.size + 1}, V) for a tree of {tree.size} nodes, "
            f"got {tuple(rows.shape)}"
        )


def _first_children(tree: TokenTree, node: int, tokens: list[int]) -> dict[int, int]:
    """token -> node's child holding it; the first in trial order if two children share one."""
    out: dict[int, int] = {}
    for trial in tree.trials[node + 1]:
        out.setdefault(tokens[trial.child], trial.child)
    return out


def accept_tree_greedy(logits: torch.Tensor, tree: TokenTree) -> TreeAcceptance:
    """Greedy acceptance: follow the target's argmax down the tree.

    Args:
        logits: (N + 1, V) target logits (or any scores with the same argmax); row 0 after the
            root, row i + 1 after node i.
        tree: the drafted tree; its trials' q are ignored.

    Returns:
        The accepted path and the argmax where it stops: path tokens + token are the target's
        greedy continuation. One host read per visited node.
    """
    _check_rows(logits, tree, "accept_tree_greedy: logits")
    tokens: list[int] = tree.tokens.tolist()
    path: list[int] = []
    probabilities: list[float] = []
    node = ROOT
    while True:
        # The first maximum, the tie rule of accept_greedy.
        best = int(argmax_last(logits[node + 1]).item())
        child = _first_children(tree, node, tokens).get(best)
        probabilities.append(0.0 if child is None else 1.0)
        if child is None:
            return TreeAcceptance(path=path, token=best, probabilities=probabilities)
        path.append(child)
        node = child


def _reject(r: torch.Tensor, trial: Trial, token: int) -> torch.Tensor:
    """The law the later trials must produce once ``trial`` (its token ``token``) is rejected:
    r less the mass min(r, q) the trial could have accepted, renormalized.

    Args:
        r: (V,) float64, sums to 1.

    Returns:
        (V,) float64; r itself when nothing is left (see the module docstring: the rejection
        had probability 0 up to rounding).
    """
    if trial.q is None:
        rest = r.clone()
        rest[token] = 0.0  # min(δ_x, r) is r(x) at x and 0 elsewhere
    else:
        rest = (r - trial.q.to(r)).clamp_min(0.0)
    total = rest.sum()
    # where() instead of an if: no host read of the total (the floor keeps the branch that
    # where() drops finite).
    return torch.where(total > 0, rest / total.clamp_min(_Q_FLOOR), r)


def _trial_node(
    row: torch.Tensor, trials: list[Trial], tokens: list[int], u: torch.Tensor
) -> tuple[list[bool], float, int]:
    """Every trial at one node, on the row's device with one host read at the end.

    Each trial's r(x) is the one it would see if every earlier trial was rejected; the caller
    takes the first accepted trial, so a decision is only used when all trials before it were
    rejected, which is the sequential rule. The trials after an accepted one are still
    computed: the acceptance probability is over all of them.

    Args:
        row: (V,) the target's warped probabilities at the node.
        trials: the node's trials in order (k of them).
        tokens: every node's token (host list).
        u: (k + 1,) float64 uniforms: one per trial, the last for the residual sample.

    Returns:
        (accepted flag per trial, probability that some trial is accepted, the token sampled
        from the residual left after all k rejections).
    """
    r = row.to(torch.float64)
    r = r / r.sum()  # a float32 row sums to 1 only within its rounding
    seen: list[torch.Tensor] = []  # per trial r(x), then q(x) for a sampled one; () each
    for trial in trials:
        x = tokens[trial.child]
        seen.append(r[x])
        if trial.q is not None:
            seen.append(trial.q[x].to(device=r.device, dtype=torch.float64))
        r = _reject(r, trial, x)
    residual = sample_inverse_cdf(r, u[-1])  # ()
    if not trials:
        return [], 0.0, int(residual.item())
    # One read for everything: the uniforms, the values seen, the token (exact in float64).
    values: list[float] = torch.cat(
        [u[:-1], torch.stack(seen), residual.to(torch.float64).view(1)]
    ).tolist()
    uniforms, picked = values[: len(trials)], iter(values[len(trials) : -1])
    oks: list[bool] = []
    kept = 1.0  # the probability that every trial so far was rejected
    for trial, uniform in zip(trials, uniforms, strict=True):
        rx = next(picked)
        qx = 1.0 if trial.q is None else next(picked)
        oks.append(uniform * qx < rx)  # accepted with probability min(1, r(x) / q(x))
        kept *= 1.0 - min(1.0, rx / max(qx, _Q_FLOOR))
    return oks, 1.0 - kept, int(values[-1])


def accept_tree(
    p: torch.Tensor, tree: TokenTree, generator: torch.Generator | None
) -> TreeAcceptance:
    """Recursive rejection sampling over the tree's trials (see the module docstring): the
    emitted sequence follows the target's distribution exactly.

    Args:
        p: (N + 1, V) the target's warped probabilities (float32 or float64, rows summing to
            1); row 0 after the root, row i + 1 after node i.
        tree: the drafted tree; each trial's q is the (V,) distribution its token was drawn
            from, or None for a deterministic choice.
        generator: every uniform comes from it (on p's device); None: torch's default.

    Returns:
        The accepted path, the token after it, and the acceptance probability at each visited
        node. One host read per visited node.
    """
    _check_rows(p, tree, "accept_tree: p")
    tokens: list[int] = tree.tokens.tolist()
    path: list[int] = []
    probabilities: list[float] = []
    node = ROOT
    while True:
        trials = tree.trials[node + 1]
        u = torch.rand(
            (len(trials) + 1,), generator=generator, device=p.device, dtype=torch.float64
        )
        oks, probability, residual = _trial_node(p[node + 1], trials, tokens, u)
        probabilities.append(probability)
        if not any(oks):
            return TreeAcceptance(path=path, token=residual, probabilities=probabilities)
        node = trials[oks.index(True)].child
        path.append(node)
