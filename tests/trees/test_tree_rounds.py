"""Rounds that verify a token tree (``FlashSpecConfig.tree``) emit what the target would.

Greedy: token for token the target's own ``generate`` (a difference only at a numerical tie of
its top two logits), with trees of every shape around the true continuation: deep, wide, the
true child at any rank, off-path subtrees. Sampling: chi-squared (alpha 0.01) of the first two
emitted tokens against the exact warped distributions, with trees whose shape is fixed before
the round. The target's cache after a tree round is the cache of the accepted tokens alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter
from flashspec.models import Padding
from flashspec.sampling import Warper
from flashspec.trees import TokenTree, TreeBuilder, TreeShape
from tests.helpers.chi2 import chi_squared
from tests.helpers.models import build_char_tokenizer, build_llama
from tests.helpers.trees import FixedShapeTrees, OracleTrees

TIE = 1e-4
MAX_NEW = 24
PROMPTS = ["def quicksort(arr):", "a", "hello world", "the cat sat on the mat. the cat", "[1, 2"]


@cache
def tokenizer() -> Any:
    return build_char_tokenizer()


@cache
def target_model() -> Any:
    return build_llama(0, init_range=0.3)


def prompt_ids(prompt: str) -> list[int]:
    ids: list[int] = tokenizer()(prompt)["input_ids"]
    return ids


@cache
def reference(prompt: str) -> tuple[int, ...]:
    """The target's own greedy continuation (EOS included)."""
    ids = torch.tensor([prompt_ids(prompt)])
    with torch.inference_mode():
        out = target_model().generate(ids, do_sample=False, max_new_tokens=MAX_NEW,
                                      pad_token_id=0)  # fmt: skip
    new = out[0, ids.shape[1] :].tolist()
    eos = target_model().generation_config.eos_token_id
    return tuple(new[: new.index(eos) + 1] if eos in new else new)


def engine_with(drafter: Drafter, shape: TreeShape | None, **sampling: Any) -> SpeculativeEngine:
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=shape.depth if shape else 4,
                                                     **sampling), tree=shape)  # fmt: skip
    target = TargetModel("tiny", model=target_model(), tokenizer=tokenizer())
    return SpeculativeEngine(config, [drafter], target)


def check_states(target: TargetModel) -> tuple[Callable[[Any], None], list[int]]:
    """A ``before_round`` hook asserting that the hidden states the target keeps (for a
    feature draft) are a fresh forward's over the committed tokens but the newest: the
    accepted path's states, not another node's; and the count of rounds it checked."""
    checked = [0]

    def check(view: Any) -> None:
        if target.feature_counts(view.padding) is None:
            return
        known = view.tokens.shape[1] - 1
        kept = target.gather_features(torch.arange(known).view(1, -1), view.padding)
        with torch.inference_mode():
            want = target.model.model(input_ids=view.tokens[:, :known]).last_hidden_state
        torch.testing.assert_close(kept, want, atol=1e-4, rtol=1e-4)
        checked[0] += 1

    return check, checked


def assert_greedy(prompt: str, got: list[int]) -> bool:
    """``got`` equals the target's greedy continuation; True if it differs at a tie."""
    ref = list(reference(prompt))
    for j, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            ids = torch.tensor([prompt_ids(prompt) + ref[:j]])
            with torch.inference_mode():
                top = target_model()(ids).logits[0, -1].topk(2).values
            gap = float(top[0] - top[1])
            assert gap < TIE, f"{prompt!r}: token {j} is {a}, not {b} (gap {gap:.2e})"
            return True
    assert got == ref
    return False


SHAPES = [
    TreeShape(depth=8, nodes=8, top_k=1),  # a chain
    TreeShape(depth=6, nodes=24, top_k=4),
    TreeShape(depth=2, nodes=16, top_k=6),  # wide
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hit", [0.9, 0.5])
def test_greedy_tree_rounds_equal_target_generate(shape: TreeShape, hit: float) -> None:
    truth = {tuple(prompt_ids(p)): list(reference(p)) for p in PROMPTS}
    drafter = OracleTrees(truth, hit, seed=int(hit * 10) + shape.nodes)
    engine = engine_with(drafter, shape)
    engine.target.track_features()  # as a feature draft would have it
    check, checked = check_states(engine.target)
    engine.before_round.append(check)
    ties = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW)
        ties += assert_greedy(prompt, result.tokens[0])
    assert ties <= 1
    assert checked[0] > 10
    assert drafter.trees > 0
    if shape.top_k > 1:
        assert drafter.moved > 0, "no tree moved an accepted path's columns"


def test_the_cache_after_a_tree_round_is_the_committed_tokens() -> None:
    """Logits after a tree round (a path that is not the first nodes) equal a fresh forward of
    the committed tokens: the other nodes' columns are gone."""
    model = target_model()
    target = TargetModel("tiny", model=model)
    target.reset()
    ids = torch.tensor([prompt_ids("hello world")])
    padding = Padding(torch.zeros(1, dtype=torch.int64))
    builder = TreeBuilder()
    builder.add_path([5, 6, 7])
    builder.add_path([8, 9, 10, 11])
    builder.add(0, 12)
    tree = builder.build()
    with torch.inference_mode():
        logits = target.verify_tree(ids, padding, tree)
        for node in range(tree.size):  # every node's logits are those of its path as a chain
            path = [int(tree.tokens[i]) for i in tree.path(node)]
            chain = model(torch.cat([ids, torch.tensor([path])], dim=1)).logits[0, -1]
            torch.testing.assert_close(logits[0, node + 1], chain, atol=1e-4, rtol=1e-4)
        path = tree.path(5)  # 8, 9, 10: nodes 3, 4, 5, after nodes of another branch
        target.keep_path(path)
        committed = torch.cat([ids, torch.tensor([[8, 9, 10, 11]])], dim=1)
        target.commit(committed, padding)
        assert target.rows is not None and target.rows.lengths == [committed.shape[1] - 1]
        after = target.verify(committed, committed[:, :0], padding)[0, -1]
        fresh = model(committed).logits[0, -1]
    torch.testing.assert_close(after, fresh, atol=1e-4, rtol=1e-4)


VOCAB = 12
PROMPT = [1, 5, 7, 3, 9, 5, 7]


@cache
def small_target() -> Any:
    return build_llama(10, vocab_size=VOCAB, layers=1, hidden=32, init_range=0.15)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tree_rounds_follow_the_target(temperature: float, top_p: float) -> None:
    model = small_target()
    sampling = SamplingConfig(gamma=2, temperature=temperature, top_p=top_p)
    config = FlashSpecConfig(sampling=sampling, tree=TreeShape(depth=2, nodes=9, top_k=3))
    engine = SpeculativeEngine(config, [FixedShapeTrees(VOCAB)], TargetModel(model=model))
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(600):
        tokens = engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True, seed=call).tokens[0]
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    warper = Warper(temperature=temperature, top_p=top_p)
    with torch.inference_mode():
        p_first = warper.probs(model(torch.tensor([PROMPT])).logits[0, -1]).double()
        extended = torch.tensor([[*PROMPT, x] for x in range(VOCAB)])
        p_second = p_first @ warper.probs(model(extended).logits[:, -1]).double()
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"


def test_feature_and_lookup_trees_keep_identity_and_the_targets_states() -> None:
    """The shipped drafters' trees (the feature draft's EAGLE-2 trees and prompt lookup's
    tries), chosen among by the default policy: greedy identity, and before every round the
    hidden states the target keeps for the feature draft are a fresh forward's over the
    committed tokens (the accepted path's, not another node's)."""
    from flashspec.drafters import PromptLookupDrafter
    from flashspec.feature_drafter import FeatureDrafter
    from flashspec.shared_head import build_shared_head_draft

    model = target_model()
    torch.manual_seed(3)
    vocab = int(model.config.vocab_size)
    draft = build_shared_head_draft(model, list(range(vocab)), layers=1, reads="features").eval()
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=4), tree=TreeShape(4, 12, 3))
    target = TargetModel("tiny", model=model, tokenizer=tokenizer())
    engine = SpeculativeEngine(config, [FeatureDrafter(draft), PromptLookupDrafter()], target)
    check, checked = check_states(target)
    engine.before_round.append(check)
    verify_tree = target.verify_tree
    trees: list[TokenTree] = []

    def spy(tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        trees.append(tree)
        return verify_tree(tokens, padding, tree)

    target.verify_tree = spy  # type: ignore[method-assign]
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW)
        assert_greedy(prompt, result.tokens[0])
    assert checked[0] > 10
    assert sum(tree.size > tree.depth for tree in trees) > 5, "too few branching trees"


def test_the_paying_prefix_keeps_the_nodes_that_pay() -> None:
    """Shape by cost: with a verification that costs 1 s plus 0.1 s a token and no drafting,
    node k pays while its weight exceeds the rate so far times 0.1 s; a tree without weights,
    or a cost not measured yet, is kept whole."""
    from flashspec.engine.tree_round import paying_prefix

    builder = TreeBuilder()
    builder.add_path([1, 2, 3])
    builder.add(-1, 4)
    builder.add(0, 5)
    tree = builder.build()
    tree.weights = [0.9, 0.8, 0.5, 0.05, 0.01]  # nodes 0..4 by path probability
    line: Callable[[int], float | None] = lambda n: 1.0 + 0.1 * n  # noqa: E731

    def rate(n: int) -> float:
        return (1 + sum(tree.weights[:n])) / (1.0 + 0.1 * (n + 1))  # type: ignore[index]

    kept = paying_prefix(tree, 0.0, line)
    assert kept.size == max(range(1, 6), key=rate) == 3
    assert kept.tokens.tolist() == [1, 2, 3] and kept.trials[0] == [tree.trials[0][0]]
    assert paying_prefix(tree, 0.0, lambda n: None).size == 5
    tree.weights = None
    assert paying_prefix(tree, 0.0, line).size == 5


def test_the_tree_gate_runs_the_mode_that_emits_more_a_second() -> None:
    """Trees for the first rounds, then chains, then the faster mode, with one decided round
    in ``_GATE_EXPLORE`` on the other; per drafter; a question not observed teaches nothing."""
    from flashspec.engine import tree_round
    from flashspec.engine.tree_round import TreeGate

    gate = TreeGate()
    modes = []
    for _ in range(tree_round._GATE_START * 2 + tree_round._GATE_EXPLORE * 2):
        tree = gate.wants_tree(0)
        modes.append(tree)
        gate.observe(tree, 4 if tree else 2, 1.0)  # trees emit twice as much a second
    start = tree_round._GATE_START
    assert modes[:start] == [True] * start and modes[start : 2 * start] == [False] * start
    decided = modes[2 * start :]
    assert decided.count(False) == 2 and decided[tree_round._GATE_EXPLORE - 1] is False
    assert gate.wants_tree(1)  # another drafter starts over
    gate.forget()
    gate.observe(True, 100, 1.0)  # forgotten: not counted for drafter 1
    assert gate._rate(1, True).rounds == 0
    slow = TreeGate()
    for _ in range(2 * start):
        tree = slow.wants_tree(0)
        slow.observe(tree, 1 if tree else 3, 1.0)
    assert [slow.wants_tree(0) for _ in range(tree_round._GATE_EXPLORE)].count(True) == 1


@pytest.mark.parametrize("slow", ["tree", "chain"])
def test_an_adaptive_engine_runs_chains_when_trees_do_not_pay(slow: str) -> None:
    """The default policy with trees on: when tree verifications are slow (50 ms each), most
    rounds after the first few run chains, and when chains are, most run trees; greedy
    output stays the target's either way."""
    import time

    from flashspec.drafters import PromptLookupDrafter

    config = FlashSpecConfig(sampling=SamplingConfig(gamma=4), tree=TreeShape(4, 12, 3))
    target = TargetModel("tiny", model=target_model(), tokenizer=tokenizer())
    truth = {tuple(prompt_ids(p)): list(reference(p)) for p in PROMPTS}
    drafters: list[Drafter] = [OracleTrees(truth, 0.9, seed=1), PromptLookupDrafter()]
    engine = SpeculativeEngine(config, drafters, target)
    verify, verify_tree = target.verify, target.verify_tree
    rounds = {"tree": 0, "chain": 0}

    def chain_spy(tokens: torch.Tensor, drafts: torch.Tensor, *rest: Any) -> torch.Tensor:
        if drafts.shape[1]:
            rounds["chain"] += 1
            if slow == "chain":
                time.sleep(0.05)
        return verify(tokens, drafts, *rest)

    def tree_spy(tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        rounds["tree"] += 1
        if slow == "tree":
            time.sleep(0.05)
        return verify_tree(tokens, padding, tree)

    target.verify = chain_spy  # type: ignore[method-assign]
    target.verify_tree = tree_spy  # type: ignore[method-assign]
    for prompt in PROMPTS * 3:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW)
        assert_greedy(prompt, result.tokens[0])
    fast = "chain" if slow == "tree" else "tree"
    assert rounds[fast] > 2 * rounds[slow], rounds
