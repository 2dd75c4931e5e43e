"""Drafters that propose token trees (``Drafter.propose_tree``, issue #41).

References: for prompt lookup, a naive trie of every match's continuation written here from
the definition; for the features draft, the draft module run with no cache and its default
causal mask along each node's path as a plain chain (its own positions 0..n-1), and the
EAGLE-2 expansion re-derived from those chain distributions alone. Neither reference touches
the drafter's cache layout, tree mask or positions.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from flashspec.drafters import DraftContext, ModelDrafter, PromptLookupDrafter
from flashspec.feature_drafter import FeatureDrafter
from flashspec.models import Padding
from flashspec.sampling import Warper
from flashspec.shared_head import build_shared_head_draft, feature_hidden
from flashspec.trees import ROOT, TokenTree, TreeShape
from tests.helpers.models import build_llama

GREEDY = Warper(0.0)
SAMPLED = Warper(0.7, 0, 0.9)


def context(rows: list[list[int]], warper: Warper = GREEDY) -> DraftContext:
    """A context of equally long rows (no padding)."""
    tokens = torch.tensor(rows)
    return DraftContext(tokens, Padding(torch.zeros(len(rows), dtype=torch.long)), warper, None)


def paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's path of tokens from the root, in node order."""
    return [tuple(int(tree.tokens[i]) for i in tree.path(node)) for node in range(tree.size)]


def check_limits(tree: TokenTree, shape: TreeShape) -> None:
    """Size, depth and fan-out within ``shape``; parents before children; point masses."""
    assert 1 <= tree.size <= shape.nodes
    assert tree.depth <= shape.depth
    assert all(parent < node for node, parent in enumerate(tree.parents))
    assert tree.deterministic
    for node in [ROOT, *range(tree.size)]:
        children = tree.children(node)
        assert len(children) <= shape.top_k
        tokens = [int(tree.tokens[c]) for c in children]
        assert len(set(tokens)) == len(tokens)  # a token is one node under its parent


# Prompt lookup.


def naive_lookup(row: list[int], low: int, high: int, shape: TreeShape) -> list[tuple[int, ...]]:
    """The lookup tree's node paths, from the definition: every match of the suffix (longer
    n-grams first, then later matches first), its next ``depth`` tokens merged into a trie,
    each path cut where a node would get more than ``top_k`` children or the tree more than
    ``nodes`` nodes."""
    nodes: list[tuple[int, ...]] = []
    children: dict[tuple[int, ...], int] = {}
    length = len(row)
    for n in range(min(high, length - 1), low - 1, -1):
        for j in range(length - n - 1, -1, -1):
            if row[j : j + n] != row[length - n :]:
                continue
            path: tuple[int, ...] = ()
            for token in row[j + n : j + n + shape.depth]:
                longer = (*path, token)
                if longer not in nodes:
                    if len(nodes) == shape.nodes or children.get(path, 0) == shape.top_k:
                        break
                    nodes.append(longer)
                    children[path] = children.get(path, 0) + 1
                path = longer
    return nodes


A, B, C, X, Y, Z, W = 5, 6, 7, 8, 9, 10, 11


def test_lookup_tree_holds_each_match_continuation_most_recent_first() -> None:
    row = [A, B, C, X, Y, A, B, C, Z, W, A, B, C]
    drafter = PromptLookupDrafter()
    tree = drafter.propose_tree(context([row]), TreeShape(depth=3, nodes=24, top_k=4))
    assert tree is not None
    assert [int(tree.tokens[c]) for c in tree.children(ROOT)] == [Z, X]
    assert paths(tree) == [(Z,), (Z, W), (Z, W, A), (X,), (X, Y), (X, Y, A)]
    check_limits(tree, TreeShape(depth=3, nodes=24, top_k=4))


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        (TreeShape(depth=3, nodes=4, top_k=4), [(Z,), (Z, W), (Z, W, A), (X,)]),
        (TreeShape(depth=3, nodes=24, top_k=1), [(Z,), (Z, W), (Z, W, A)]),
        (TreeShape(depth=1, nodes=24, top_k=4), [(Z,), (X,)]),
        (TreeShape(depth=2, nodes=3, top_k=2), [(Z,), (Z, W), (X,)]),
    ],
)
def test_lookup_tree_respects_depth_nodes_and_top_k(
    shape: TreeShape, want: list[tuple[int, ...]]
) -> None:
    row = [A, B, C, X, Y, A, B, C, Z, W, A, B, C]
    tree = PromptLookupDrafter().propose_tree(context([row]), shape)
    assert tree is not None
    check_limits(tree, shape)
    assert paths(tree) == want


def test_lookup_tree_tries_longer_matches_first() -> None:
    # The suffix "A B C" matched at 0 (then X); "C" alone matched later (then Y): X first.
    row = [A, B, C, X, W, W, C, Y, W, A, B, C]
    tree = PromptLookupDrafter().propose_tree(context([row]), TreeShape(depth=2))
    assert tree is not None
    assert [int(tree.tokens[c]) for c in tree.children(ROOT)] == [X, Y]


def test_a_lookup_tree_of_one_match_is_the_chain_propose_drafts() -> None:
    row = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 6]  # "2 6" once before the end
    ctx = context([row])
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2)
    tree = drafter.propose_tree(ctx, TreeShape(depth=4))
    assert tree is not None
    chain = drafter.propose(ctx, 4).tokens[0]
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.tokens.tolist() == chain.tolist() == [5, 3, 5, 8]


def test_lookup_trees_equal_the_naive_trie_on_random_rows() -> None:
    rng = random.Random(11)
    checked = 0
    for _ in range(200):
        row = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        shape = TreeShape(rng.randrange(1, 6), rng.randrange(1, 16), rng.randrange(1, 4))
        low = rng.randrange(1, 3)
        high = low + rng.randrange(0, 3)
        tree = PromptLookupDrafter(high, low).propose_tree(context([row]), shape)
        want = naive_lookup(row, low, high, shape)
        if not want:
            assert tree is None
            continue
        assert tree is not None
        check_limits(tree, shape)
        assert paths(tree) == want, (row, shape, low, high)
        checked += 1
    assert checked > 150


def test_no_tree_without_a_match_or_for_two_rows() -> None:
    drafter = PromptLookupDrafter()
    assert drafter.propose_tree(context([[1, 2, 3, 4]]), TreeShape()) is None
    rows = [[A, B, C, X, A, B, C], [A, B, C, Y, A, B, C]]
    assert drafter.propose_tree(context(rows), TreeShape()) is None
    capped = context([[A, B, C, X, Y, A, B, C]])
    capped.caps = [2]
    tree = drafter.propose_tree(capped, TreeShape(depth=5))
    assert tree is not None and tree.depth == 2


# The features draft (EAGLE-2 trees).


class TargetStates:
    """What a bound target gives a ``FeatureDrafter``: the target's final hidden states at
    every committed token of each row but the newest (a full forward of the target over the
    row's own tokens), indexed by the row's own token index (as a ragged target keeps them)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.states = torch.zeros(0)  # (B, n, d), right-padded
        self.counts: list[int] = []

    def show(self, tokens: torch.Tensor, lefts: list[int] | None = None) -> None:
        """The committed tokens are now ``tokens`` (B, L), row b's from column ``lefts[b]``."""
        lefts = lefts or [0] * tokens.shape[0]
        rows = [
            self.target.model(input_ids=tokens[b : b + 1, left:]).last_hidden_state[0, :-1]
            for b, left in enumerate(lefts)
        ]
        self.counts = [int(r.shape[0]) for r in rows]
        self.states = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    def feature_counts(self, padding: Padding) -> list[int]:
        return list(self.counts)

    def gather_features(self, index: torch.Tensor, padding: Padding) -> torch.Tensor:
        index = index.clamp(0, self.states.shape[1] - 1)
        return self.states.gather(1, index.unsqueeze(-1).expand(-1, -1, self.states.shape[2]))


def feature_setup(seed: int = 3) -> tuple[Any, Any, TargetStates]:
    """A tiny target, a features draft of it over the whole vocabulary, and its states. The
    draft's layer is the target's first (sharp attention, unlike a fresh layer's nearly even
    one), so that what each column sees and at which position decides its drafts."""
    target = build_llama(0, init_range=0.3)
    torch.manual_seed(seed)
    draft = build_shared_head_draft(
        target, list(range(target.config.vocab_size)), layers=1, reads="features"
    ).eval()
    with torch.no_grad():
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    return target, draft, TargetStates(target)


def bound(draft: Any, states: TargetStates) -> FeatureDrafter:
    drafter = FeatureDrafter(draft)
    drafter._target = states  # type: ignore[assignment]  # the states are all it reads
    return drafter


def chain_probs(
    draft: Any, states: TargetStates, tokens: torch.Tensor, path: tuple[int, ...], warper: Warper
) -> torch.Tensor:
    """The draft's (V,) distribution after ``path`` drafted as a plain chain: no cache, the
    default causal mask and positions; each step reads the target's states, then its own."""
    features, ids = states.states, tokens[:, 1:]
    hidden = feature_hidden(draft, features, ids)[:, -1:]
    for token in path:
        features = torch.cat([features, hidden], dim=1)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        hidden = feature_hidden(draft, features, ids)[:, -1:]
    logits = draft.lm_head(hidden)[0, -1]
    return logits.float().softmax(-1) if warper.greedy else warper.probs(logits)


def reference_tree(
    draft: Any, states: TargetStates, tokens: torch.Tensor, shape: TreeShape, warper: Warper
) -> tuple[list[tuple[int, ...]], dict[tuple[int, ...], float]]:
    """EAGLE-2 from chain distributions alone: the kept nodes' paths, most probable first,
    and every considered node's path probability."""
    prob: dict[tuple[int, ...], float] = {}
    order: list[tuple[int, ...]] = []  # creation order breaks ties

    def grow(path: tuple[int, ...]) -> list[tuple[int, ...]]:
        dist = chain_probs(draft, states, tokens, path, warper)
        values, ids = dist.topk(shape.top_k)
        new = []
        for q, token in zip(values.tolist(), ids.tolist(), strict=True):
            if q > 0:
                child = (*path, token)
                prob[child] = prob.get(path, 1.0) * q
                order.append(child)
                new.append(child)
        return new

    frontier = grow(())
    for _ in range(2, shape.depth + 1):
        chosen = sorted(frontier, key=lambda p: (-prob[p], order.index(p)))[: shape.top_k]
        frontier = [child for path in chosen for child in grow(path)]
    kept = sorted(order, key=lambda p: (-prob[p], order.index(p)))[: shape.nodes]
    return kept, prob


@pytest.mark.parametrize("warper", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "shape",
    [TreeShape(depth=4, nodes=12, top_k=3), TreeShape(depth=3, nodes=5, top_k=2)],
    ids=["wide", "narrow"],
)
def test_feature_tree_nodes_have_the_draft_top_k_along_their_paths(
    warper: Warper, shape: TreeShape
) -> None:
    """Every node's children are the most likely tokens of the draft run as a chain along
    the node's path (this checks the tree mask and positions), and the tree is EAGLE-2's:
    the ``nodes`` most probable of the expanded candidates, most probable first."""
    _, draft, states = feature_setup()
    drafter = bound(draft, states)
    tokens = torch.tensor([[1, 5, 9, 13, 7, 22, 31, 4, 18]])
    with torch.inference_mode():
        states.show(tokens)
        tree = drafter.propose_tree(context(tokens.tolist(), warper), shape)
        assert tree is not None
        check_limits(tree, shape)
        got = paths(tree)
        kept, prob = reference_tree(draft, states, tokens, shape, warper)
        assert got == kept
        for node in [ROOT, *range(tree.size)]:
            path = () if node == ROOT else got[node]
            children = [int(tree.tokens[c]) for c in tree.children(node)]
            if not children:
                continue
            dist = chain_probs(draft, states, tokens, path, warper)
            top = dist.topk(shape.top_k).indices.tolist()
            assert children == top[: len(children)], (path, children, top)
            for c in tree.children(node):
                want = prob.get(path, 1.0) * float(dist[int(tree.tokens[c])])
                assert prob[got[c]] == pytest.approx(want, rel=1e-4)
    assert tree.depth == shape.depth  # the tree went as deep as allowed


def test_a_feature_tree_of_one_child_per_node_is_the_greedy_chain() -> None:
    """top_k 1: the tree is a chain, read with the chain's positions, so it drafts the
    tokens greedy ``propose`` drafts."""
    _, draft, states = feature_setup()
    tokens = torch.tensor([[1, 5, 9, 13, 7, 22, 31]])
    with torch.inference_mode():
        states.show(tokens)
        tree = bound(draft, states).propose_tree(context(tokens.tolist()), TreeShape(5, 5, 1))
        chain = bound(draft, states).propose(context(tokens.tolist()), 5)
    assert tree is not None and tree.parents == [-1, 0, 1, 2, 3]
    assert tree.tokens.tolist() == chain.tokens[0].tolist()


def test_after_a_tree_round_the_drafter_drafts_as_one_that_never_drafted_a_tree() -> None:
    """The tree's columns are dropped at ``keep``: over rounds that commit a few tokens
    each, chain drafts, the cache width and the read state equal a drafter's that drafted
    chains only."""
    _, draft, states = feature_setup()
    trees, chains = bound(draft, states), bound(draft, states)
    row = [1, 5, 9, 13, 7, 22, 31]
    with torch.inference_mode():
        for step in range(4):
            tokens = torch.tensor([row])
            states.show(tokens)
            ctx = context([row])
            tree = trees.propose_tree(ctx, TreeShape(depth=4, nodes=10, top_k=3))
            assert tree is not None and trees._drafted > 0
            for drafter in (trees, chains):
                drafter.keep([len(row) - 1], ctx.padding)
            mine, theirs = trees.propose(ctx, 3), chains.propose(ctx, 3)
            assert mine.tokens.tolist() == theirs.tokens.tolist()
            assert trees._rows.lengths == chains._rows.lengths
            assert trees._rows.width == chains._rows.width
            assert trees._state is not None and chains._state is not None
            torch.testing.assert_close(trees._state, chains._state)
            # Commit a few tokens (the chain's first drafts and one other) for the next round.
            row = [*row, *mine.tokens[0, : step % 2 + 1].tolist(), (7 * step + 3) % 60]
            for drafter in (trees, chains):
                drafter.keep([len(row) - 1], ctx.padding)


def test_no_feature_tree_for_two_rows_or_before_the_states_exist() -> None:
    _, draft, states = feature_setup()
    drafter = bound(draft, states)
    rows = [[1, 5, 9, 13], [4, 8, 15, 16]]
    with torch.inference_mode():
        states.show(torch.tensor(rows[:1]))
        assert drafter.propose_tree(context(rows), TreeShape()) is None
        states.counts = [0]  # the target has read nothing yet
        assert drafter.propose_tree(context(rows[:1]), TreeShape()) is None
    target = build_llama(0)
    assert ModelDrafter(target).propose_tree(context(rows[:1]), TreeShape()) is None


def test_a_row_with_dead_columns_sees_only_its_own() -> None:
    """A row left alone from a ragged batch keeps dead columns in the draft's cache (the
    padding its reading skipped); its tree is the one the draft gives over that row alone."""
    _, draft, states = feature_setup()
    drafter = bound(draft, states)
    long, short = [1, 5, 9, 13, 7, 22, 31, 4, 18], [3, 40, 12, 8, 27]
    tokens = torch.tensor([long, [0] * 4 + short])
    lefts = [0, 4]
    shape = TreeShape(depth=3, nodes=8, top_k=3)
    with torch.inference_mode():
        states.show(tokens, lefts)
        ctx = DraftContext(tokens, Padding(torch.tensor(lefts)), GREEDY, None, ragged=True)
        drafter.propose(ctx, 2)
        drafter.keep([8, 4], ctx.padding)
        drafter.select_rows(torch.tensor([1]))
        assert drafter._rows.alive is not None and not bool(drafter._rows.alive.all())
        alone = torch.tensor([short])
        states.show(alone)
        tree = drafter.propose_tree(context([short]), shape)
        assert tree is not None
        check_limits(tree, shape)
        assert paths(tree) == reference_tree(draft, states, alone, shape, GREEDY)[0]
