"""``MergedDrafter``: two drafters' token trees verified as one. The merged tree holds the first
tree's nodes, then the second's new ones (a shared prefix once), within the node budget;
an engine verifying merged trees emits the target's greedy tokens (HF ``generate``) and its
sampled distribution (chi-squared, alpha 0.01)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import (
    DraftContext,
    Drafter,
    MergedDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    Proposal,
)
from flashspec.flags.options import EngineOptions, UserError
from flashspec.models import Padding
from flashspec.sampling import Warper
from flashspec.trees import TokenTree, TreeBuilder, TreeShape
from tests.helpers.chi2 import assert_first_two_follow
from tests.helpers.distribution import PROMPT, VOCAB, exact
from tests.helpers.distribution import models as distribution_models
from tests.helpers.greedy import PROMPTS, check_equal, models, tokenizer
from tests.helpers.trees import FixedShapeTrees

SHAPE = TreeShape(depth=4, nodes=12, top_k=3)


class Paths(Drafter):
    """A fixed tree of the given token paths (point masses), whatever the context."""

    def __init__(self, *paths: list[int], name: str = "paths") -> None:
        self.paths = paths
        self.name = name

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return Proposal(torch.tensor([self.paths[0][:gamma]]))

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        if not self.paths:
            return None
        builder = TreeBuilder()
        for path in self.paths:
            builder.add_path(path)
        return builder.build()


def context() -> DraftContext:
    tokens = torch.tensor([[1, 2, 3]])
    return DraftContext(tokens, Padding(torch.zeros(1, dtype=torch.long)), Warper(0.0), None)


def node_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[i]) for i in tree.path(node)) for node in range(tree.size)]


def test_the_merged_tree_is_the_first_then_the_seconds_new_nodes() -> None:
    first = Paths([5, 6, 7], [5, 8])
    second = Paths([5, 6, 9], [4, 4])
    tree = MergedDrafter(first, second).propose_tree(context(), SHAPE)
    assert tree is not None
    want_first = node_paths(first.propose_tree(context(), SHAPE))  # type: ignore[arg-type]
    assert sorted(node_paths(tree)[: len(want_first)]) == sorted(want_first)
    assert node_paths(tree)[len(want_first) :] == [(4,), (5, 6, 9), (4, 4)]
    assert tree.deterministic


def test_the_merged_tree_shares_the_node_budget_and_keeps_either_tree_alone() -> None:
    first, second = Paths([5, 6, 7], [5, 8]), Paths([4, 4, 4, 4])
    cut = MergedDrafter(first, second).propose_tree(context(), TreeShape(4, 6, 3))
    # The budget of 6: the second's four new nodes take half, the first its leading three.
    assert cut is not None and node_paths(cut) == [(5,), (5, 6), (5, 6, 7), (4,), (4, 4),
                                                   (4, 4, 4)]  # fmt: skip
    roomy = MergedDrafter(first, second).propose_tree(context(), TreeShape(4, 9, 3))
    assert roomy is not None and len(node_paths(roomy)) == 8  # both whole
    alone = MergedDrafter(first, Paths()).propose_tree(context(), SHAPE)
    assert alone is not None and sorted(node_paths(alone)) == [(5,), (5, 6), (5, 6, 7), (5, 8)]
    only = MergedDrafter(Paths(), second).propose_tree(context(), SHAPE)
    assert only is not None and node_paths(only) == [(4,), (4, 4), (4, 4, 4), (4, 4, 4, 4)]
    assert MergedDrafter(Paths(), Paths()).propose_tree(context(), SHAPE) is None


def test_a_sampled_first_tree_is_verified_alone() -> None:
    """Its draws would decide how much of the second tree fits the budget."""

    class Sampled(Paths):
        def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
            builder = TreeBuilder()
            builder.add(-1, 5, torch.full((VOCAB,), 1.0 / VOCAB))
            return builder.build()

    tree = MergedDrafter(Sampled([5]), Paths([4, 4])).propose_tree(context(), SHAPE)
    assert tree is not None and node_paths(tree) == [(5,)]


def test_merging_checks_its_drafters() -> None:
    target, draft = models("plain")
    with pytest.raises(ValueError, match="both drafters run a model"):
        MergedDrafter(ModelDrafter(draft), ModelDrafter(target))
    merged = MergedDrafter(ModelDrafter(draft, name="d"), PromptLookupDrafter())
    with pytest.raises(ValueError, match="merged already"):
        MergedDrafter(merged, PromptLookupDrafter())
    with pytest.raises(TypeError, match="must be a Drafter"):
        MergedDrafter(merged.first, "prompt-lookup")  # type: ignore[arg-type]
    assert merged.lm is merged.first.lm and merged.name == "d+prompt_lookup"


def test_merged_trees_equal_target_generate() -> None:
    """A features draft's EAGLE-2 trees merged with prompt lookup's tries, on a target whose
    text repeats (lookup hits): greedy identity, and many rounds verify nodes of both."""
    from flashspec.drafters import FeatureDrafter
    from flashspec.drafters.shared_head import build_shared_head_draft

    target, _ = models("loopy")
    torch.manual_seed(3)
    vocab = int(target.config.vocab_size)
    draft = build_shared_head_draft(target, list(range(vocab)), layers=1, reads="features")
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=SHAPE.depth), tree=SHAPE)
    features = FeatureDrafter(draft.eval())
    merged = MergedDrafter(features, PromptLookupDrafter())
    engine = SpeculativeEngine(
        config, [merged], TargetModel("tiny", model=target, tokenizer=tokenizer())
    )
    firsts: list[TokenTree | None] = []
    both = [0]  # tree rounds whose tree holds nodes of the draft's tree and of lookup's
    first_tree, merged_tree = features.propose_tree, merged.propose_tree

    def first_spy(ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        firsts.append(first_tree(ctx, shape))
        return firsts[-1]

    def merged_spy(ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        tree = merged_tree(ctx, shape)
        first = firsts[-1] if firsts else None
        if tree is not None and first is not None and first.size:
            mine, ours = set(node_paths(first)), set(node_paths(tree))
            both[0] += bool(ours - mine) and bool(ours & mine)
        return tree

    features.propose_tree = first_spy  # type: ignore[method-assign]
    merged.propose_tree = merged_spy  # type: ignore[method-assign]
    for prompt in PROMPTS:
        check_equal("loopy", prompt, engine.generate(prompt, 32).tokens[0])
    assert both[0] > 10, f"only {both[0]} of {len(firsts)} trees held both drafters' nodes"


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_merged_trees_follow_the_target(temperature: float, top_p: float) -> None:
    target, _ = distribution_models()
    shape = TreeShape(depth=2, nodes=12, top_k=3)
    sampling = SamplingConfig(gamma=2, temperature=temperature, top_p=top_p)
    merged = MergedDrafter(FixedShapeTrees(VOCAB), PromptLookupDrafter())
    engine = SpeculativeEngine(FlashSpecConfig(sampling=sampling, tree=shape), [merged],
                               TargetModel(model=target))  # fmt: skip
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(600):
        tokens = engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True, seed=call).tokens[0]
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert_first_two_follow(first, second, *exact(temperature, top_p))


def test_the_merged_drafter_flag_needs_a_tree() -> None:
    with pytest.raises(UserError, match="add --tree"):
        EngineOptions(target="demo", drafter="model+prompt-lookup").build()
    engine = EngineOptions(target="demo", drafter="model+prompt-lookup", tree="3,8,2").build()
    (only,) = engine.drafters
    assert isinstance(only, MergedDrafter) and isinstance(only.second, PromptLookupDrafter)
