"""Exact acceptance of token trees (``flashspec.trees.accept``).

Greedy acceptance is compared with the greedy continuation read off a context -> logits table.
Sampled acceptance is tested by chi-squared (alpha = 0.01, ``tests.helpers.chi2``) on the joint law
of the first two emitted tokens of a toy Markov target (V = 6), against the exact
p1(x1) p2(x2 | x1), for deterministic, sampled (a token drawn twice included), mixed and warped
trees. ``test_residual_without_the_rejected_mass_is_caught`` breaks the residual update and
checks that the same statistic then fails. Seeds are fixed: every run is the same run.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

import flashspec.trees.accept as accept_module
from flashspec.sampling import Warper
from flashspec.trees import (
    ROOT,
    TokenTree,
    TreeBuilder,
    Trial,
    accept_tree,
    accept_tree_greedy,
)
from tests.helpers.chi2 import chi_squared

# ---------------------------------------------------------------------------------------------
# Greedy


class LogitsTable:
    """Random integer logits per context (ties are common), made on first use."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.rows: dict[tuple[int, ...], list[float]] = {}

    def __call__(self, context: tuple[int, ...]) -> list[float]:
        if context not in self.rows:
            self.rows[context] = [float(self.rng.randint(0, 3)) for _ in range(self.vocab)]
        return self.rows[context]

    def greedy(self, length: int) -> list[int]:
        """The greedy continuation of the root, first maximum on ties (list.index)."""
        out: list[int] = []
        for _ in range(length):
            row = self(tuple(out))
            out.append(row.index(max(row)))
        return out

    def tree_logits(self, tree: TokenTree) -> torch.Tensor:
        """(N + 1, V): the root's row, then each node's row given its path."""
        tokens = tree.tokens.tolist()
        contexts = [()] + [tuple(tokens[j] for j in tree.path(i)) for i in range(tree.size)]
        return torch.tensor([self(c) for c in contexts])


def _random_tree(kind: str, table: LogitsTable, rng: random.Random) -> TokenTree:
    vocab = table.vocab
    builder = TreeBuilder()
    greedy = table.greedy(8)
    if kind == "chain":  # deep: the greedy continuation, then a random divergence
        keep = rng.randint(0, 7)
        builder.add_path(greedy[:keep] + [rng.randrange(vocab) for _ in range(8 - keep)])
    elif kind == "wide":  # many children at the top, a few grandchildren
        for token in rng.sample(range(vocab), rng.randint(1, vocab)):
            node = builder.add(ROOT, token)
            for child in rng.sample(range(vocab), rng.randint(0, 2)):
                builder.add(node, child)
    else:  # shared prefixes: branches leaving the greedy path at random depths
        for _ in range(rng.randint(1, 5)):
            keep = rng.randint(0, 6)
            tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            builder.add_path(greedy[:keep] + tail)
    return builder.build()


def _longest_greedy_prefix(tree: TokenTree, greedy: list[int]) -> int:
    """How many leading greedy tokens the tree holds as one path (independent of accept)."""
    index = {(tree.parents[i], int(tree.tokens[i])): i for i in range(tree.size)}
    node, depth = ROOT, 0
    while depth < len(greedy) and (node, greedy[depth]) in index:
        node = index[(node, greedy[depth])]
        depth += 1
    return depth


@pytest.mark.parametrize("kind", ["chain", "wide", "shared"])
def test_greedy_emits_the_greedy_continuation(kind: str) -> None:
    rng = random.Random(kind)
    for trial in range(60):
        table = LogitsTable(vocab=5, seed=1000 * len(kind) + trial)
        tree = _random_tree(kind, table, rng)
        out = accept_tree_greedy(table.tree_logits(tree), tree)
        tokens = tree.tokens.tolist()
        emitted = [tokens[i] for i in out.path] + [out.token]
        depth = _longest_greedy_prefix(tree, table.greedy(9))
        assert emitted == table.greedy(depth + 1)
        assert [tree.parents[i] for i in out.path] == [ROOT, *out.path][:-1]
        assert out.probabilities == [1.0] * depth + [0.0]


def test_greedy_ties_take_the_first_maximum() -> None:
    # Root row: tokens 2 and 4 tie; node of 4 is tried first, yet 2 (the first maximum) wins.
    builder = TreeBuilder()
    four = builder.add(ROOT, 4)
    two = builder.add(ROOT, 2)
    tree = builder.build()
    logits = torch.zeros((3, 6))
    logits[0, [2, 4]] = 5.0
    logits[two + 1, [1, 3]] = 7.0  # the leaf's tie: 1
    logits[four + 1, 0] = 9.0
    out = accept_tree_greedy(logits, tree)
    assert (out.path, out.token, out.probabilities) == ([two], 1, [1.0, 0.0])


def test_greedy_on_an_empty_tree_is_the_argmax() -> None:
    tree = TreeBuilder().build()
    out = accept_tree_greedy(torch.tensor([[0.0, 3.0, 3.0]]), tree)
    assert (out.path, out.token, out.probabilities) == ([], 1, [0.0])


def test_rows_must_match_the_tree() -> None:
    tree = TokenTree.chain(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="N \\+ 1"):
        accept_tree_greedy(torch.zeros((2, 4)), tree)
    with pytest.raises(ValueError, match="N \\+ 1"):
        accept_tree(torch.full((4,), 0.25), tree, None)


# ---------------------------------------------------------------------------------------------
# Sampled: a toy Markov target over V = 6 tokens; state 6 is the prompt (the first root).

V = 6
PROMPT = V
DRAWS = 12_000

# Target and draft logits per state (row = the last token; row 6 the prompt). -inf: zero
# probability, so that the joint law has at most 5 x 5 cells (the harness's table stops at 30
# degrees of freedom) and the tests see tokens the target never emits being drafted.
_NEG = float("-inf")
TARGET_LOGITS = torch.tensor(
    [
        [0.5, 1.2, _NEG, 0.1, 0.9, -0.4],
        [1.0, -0.3, 0.6, _NEG, 0.2, 0.8],
        [0.0, 0.7, 1.1, -0.5, _NEG, 0.4],
        [-0.2, 0.3, 0.9, 1.4, 0.1, _NEG],
        [_NEG, 0.6, -0.1, 0.5, 1.0, 0.2],
        [0.8, _NEG, 0.4, 0.0, -0.6, 1.3],
        [1.1, 0.4, 0.9, -0.3, 0.6, _NEG],  # the prompt: token 5 never first
    ],
    dtype=torch.float64,
)
DRAFT_LOGITS = torch.tensor(
    [
        [0.9, 0.2, 0.8, _NEG, 0.9, 0.0],  # mass on the target's impossible token 2, none on 3
        [0.1, 0.2, 1.5, 0.4, 0.3, _NEG],
        [0.6, 1.4, 0.2, 0.0, 0.7, 0.1],
        [0.3, 0.9, _NEG, 0.5, 1.2, 0.6],
        [0.7, 0.1, 0.5, 1.1, -0.2, 0.4],
        [0.2, 0.8, 0.6, 0.3, 0.9, -0.1],
        [0.2, 1.3, 0.4, 0.9, -0.2, 1.0],  # the prompt: mass on 5, which the target never emits
    ],
    dtype=torch.float64,
)

Tables = tuple[torch.Tensor, torch.Tensor]  # (target P, draft Q), each (7, V) float64


def _tables(warper: Warper) -> Tables:
    p = warper.probs(TARGET_LOGITS).double()
    q = warper.probs(DRAFT_LOGITS).double()
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _exact_pairs(p: torch.Tensor) -> torch.Tensor:
    """(V * V,) float64: P(x1, x2) = p1(x1) p2(x2 | x1) at index x1 * V + x2."""
    return (p[PROMPT].unsqueeze(1) * p[:V]).reshape(-1)


class Drafts:
    """Draws trial tokens from the draft table with a NumPy generator (not the acceptance's)."""

    def __init__(self, q: torch.Tensor, seed: int) -> None:
        self.q = q
        self.cdf = np.cumsum(q.numpy(), axis=1)
        self.cdf[:, -1] = 1.0  # a uniform below 1 always lands on a token of positive mass
        self.rng = np.random.default_rng(seed)
        # The draft's tokens by decreasing probability per state, ties by index.
        self.order = torch.argsort(q, dim=1, descending=True, stable=True).tolist()

    def draw(self, state: int) -> int:
        return int(np.searchsorted(self.cdf[state], self.rng.random(), side="right"))

    def top(self, state: int, k: int) -> list[int]:
        return self.order[state][:k]


# Each builder makes a tree rooted at ``state`` (the last committed token) whose shape (the
# trials per node, their order and q) is fixed in advance; only the sampled tokens vary.
TreeMaker = Callable[[Drafts, int], TokenTree]


def _deterministic(drafts: Drafts, state: int) -> TokenTree:
    """Top-3 of the draft at the root, top-2 under each (top-k style, point masses)."""
    builder = TreeBuilder()
    for token in drafts.top(state, 3):
        node = builder.add(ROOT, token)
        for child in drafts.top(token, 2):
            builder.add(node, child)
    return builder.build()


def _sampled(drafts: Drafts, state: int) -> TokenTree:
    """3 i.i.d. draws at the root (equal draws: one node, several trials), 2 under each node."""
    builder = TreeBuilder()
    q = drafts.q
    nodes = [builder.add(ROOT, drafts.draw(state), q[state]) for _ in range(3)]
    for node in dict.fromkeys(nodes):
        token = builder.tokens[node]
        for _ in range(2):
            builder.add(node, drafts.draw(token), q[token])
    return builder.build()


def _mixed(drafts: Drafts, state: int) -> TokenTree:
    """The draft's argmax as a point mass, then 2 i.i.d. draws at the root; under each node one
    draw, then the draft's argmax as a point mass."""
    builder = TreeBuilder()
    q = drafts.q
    nodes = [builder.add(ROOT, drafts.top(state, 1)[0])]
    nodes += [builder.add(ROOT, drafts.draw(state), q[state]) for _ in range(2)]
    for node in dict.fromkeys(nodes):
        token = builder.tokens[node]
        builder.add(node, drafts.draw(token), q[token])
        builder.add(node, drafts.top(token, 1)[0])
    return builder.build()


def _first_two(make: TreeMaker, p: torch.Tensor, drafts: Drafts, g: torch.Generator) -> int:
    """One stream's first two emitted tokens, as x1 * V + x2.

    When the first tree accepts no node the second token comes from one more call, on a fresh
    tree rooted at x1: what the next round does. A direct sample of p2(. | x1) would also be
    exact, but this way the second call's own output is under test too.
    """
    emitted: list[int] = []
    state = PROMPT
    while len(emitted) < 2:
        tree = make(drafts, state)
        rows = p[[state, *tree.tokens.tolist()]]  # (N + 1, V): the Markov target's rows
        out = accept_tree(rows, tree, g)
        tokens = tree.tokens.tolist()
        emitted += [tokens[i] for i in out.path] + [out.token]
        state = emitted[-1]
    return emitted[0] * V + emitted[1]


def _chi2(make: TreeMaker, tables: Tables, seed: int, draws: int = DRAWS) -> tuple[float, float]:
    p, q = tables
    drafts = Drafts(q, seed)
    g = torch.Generator().manual_seed(seed)
    counts = Counter(_first_two(make, p, drafts, g) for _ in range(draws))
    return chi_squared(counts, _exact_pairs(p))


MAKERS = {"deterministic": _deterministic, "sampled": _sampled, "mixed": _mixed}


@pytest.mark.parametrize("name", list(MAKERS))
def test_sampled_acceptance_follows_the_target(name: str) -> None:
    stat, critical = _chi2(MAKERS[name], _tables(Warper()), seed=11)
    assert stat < critical, f"{name}: chi2 {stat:.1f} >= {critical}"


def test_warped_acceptance_follows_the_warped_target() -> None:
    warper = Warper(temperature=0.7, top_p=0.9)
    tables = _tables(warper)
    assert int((tables[0][PROMPT] == 0).sum()) >= 2  # top-p did drop tokens
    stat, critical = _chi2(_mixed, tables, seed=12)
    assert stat < critical, f"T 0.7 / top-p 0.9: chi2 {stat:.1f} >= {critical}"


def test_sampled_trees_do_draw_a_token_twice() -> None:
    # The chi-squared of "sampled" covers a node with two trials only if such trees occur.
    drafts = Drafts(_tables(Warper())[1], 11)
    trees = [_sampled(drafts, PROMPT) for _ in range(200)]
    twice = sum(any(len(t) > len({x.child for x in t}) for t in tree.trials) for tree in trees)
    assert twice > 50


@pytest.mark.parametrize("name", ["deterministic", "sampled"])
def test_residual_without_the_rejected_mass_is_caught(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A residual that keeps a rejected sibling's mass is a real bug the chi-squared sees."""

    def keep(r: torch.Tensor, trial: Trial, token: int) -> torch.Tensor:
        return r

    monkeypatch.setattr(accept_module, "_reject", keep)
    stat, critical = _chi2(MAKERS[name], _tables(Warper()), seed=11, draws=5000)
    assert stat > critical


# ---------------------------------------------------------------------------------------------
# Acceptance probabilities


def test_point_mass_probability_is_the_mass_of_the_distinct_tried_tokens() -> None:
    # Root: tokens 3, 1, 3 again (one node, two point-mass trials) and 0; node 0 (token 3) has
    # children 4 and 2.
    tree = TokenTree(
        torch.tensor([3, 1, 0, 4, 2]),
        [ROOT, ROOT, ROOT, 0, 0],
        [[Trial(0), Trial(1), Trial(0), Trial(2)], [Trial(3), Trial(4)], [], [], [], []],
    )
    p = torch.tensor(
        [[0.05, 0.2, 0.1, 0.6, 0.05], [0.1, 0.1, 0.3, 0.2, 0.3]] + [[0.2] * 5] * 4,
        dtype=torch.float32,
    )
    for seed in range(40):
        out = accept_tree(p, tree, torch.Generator().manual_seed(seed))
        assert out.probabilities[0] == pytest.approx(0.6 + 0.2 + 0.05)
        if out.path[:1] == [0]:
            assert out.probabilities[1] == pytest.approx(0.3 + 0.3)
        assert len(out.probabilities) == len(out.path) + 1
        assert out.probabilities[-1] < 1.0


def test_sampled_probability_is_the_acceptance_rate() -> None:
    # A fixed tree with sampled trials (one token tried twice): the reported probability at the
    # root is the expectation of the root's coin flips over the uniforms.
    p_root = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.5, 0.1, 0.1, 0.3], dtype=torch.float64)
    tree = TokenTree(
        torch.tensor([0, 3]), [ROOT, ROOT], [[Trial(0, q), Trial(1, q), Trial(0, q)], [], []]
    )
    p = torch.stack([p_root, p_root, p_root])
    g = torch.Generator().manual_seed(5)
    runs = [accept_tree(p, tree, g) for _ in range(4000)]
    expected = runs[0].probabilities[0]
    assert all(r.probabilities[0] == expected for r in runs)
    rate = sum(bool(r.path) for r in runs) / len(runs)
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / len(runs)) ** 0.5
    # By hand: r = p, trial on 0: min(1, .1/.5) = .2; residual (0, .3, .2, 0) / .5; trial on
    # 3: r(3) = 0, so 0; trial on 0 again: r(0) = 0, so 0. Accepted with probability 0.2.
    assert expected == pytest.approx(0.2)


def test_a_leaf_emits_a_sample_of_its_row() -> None:
    tree = TokenTree.chain(torch.tensor([2]))
    p = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    out = accept_tree(p, tree, torch.Generator().manual_seed(0))
    assert (out.path, out.token, out.probabilities) == ([0], 1, [1.0, 0.0])
