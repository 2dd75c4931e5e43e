"""Token trees on the compiled path (``FlashSpecConfig(compile=True, tree=...)``): a tree's
forward runs as a compiled graph of its own on the static cache, and the accepted path's
columns move inside the static buffers. Greedy output is checked against HF's own
``generate``; sampling by chi-squared (alpha 0.01) of the first two tokens; a node's logits
against its path read as a chain (a node never sees a non-ancestor)."""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest
import torch

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.compiled.static import new_static_cache
from flashspec.compiled.step import CompiledForward
from flashspec.drafters import Drafter, PromptLookupDrafter
from flashspec.kv.layout import move_columns
from flashspec.trees import TokenTree, TreeBuilder, TreeShape
from tests.helpers.chi2 import assert_first_two_follow
from tests.helpers.distribution import PROMPT, VOCAB, exact
from tests.helpers.distribution import models as distribution_models
from tests.helpers.greedy import PROMPTS, check_equal, models, reference, tokenizer
from tests.helpers.models import build_llama
from tests.helpers.trees import FixedShapeTrees, OracleTrees

MAX_NEW = 32
SHAPE = TreeShape(depth=5, nodes=16, top_k=4)


@pytest.fixture(autouse=True)
def _recompiles_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSPEC_COMPILE_DEBUG", "1")


def compiled_engine(kind: str, drafter: Drafter, shape: TreeShape, **sampling: float) -> (
    SpeculativeEngine
):  # fmt: skip
    target, _ = models(kind)
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=shape.depth, **sampling), tree=shape, compile=True
    )
    engine = SpeculativeEngine(
        config, [drafter], TargetModel("tiny", model=target, tokenizer=tokenizer())
    )
    assert engine.compiled.on, engine.compiled.reason
    return engine


def spy_trees(engine: SpeculativeEngine) -> list[TokenTree]:
    trees: list[TokenTree] = []
    verify_tree = engine.target.verify_tree

    def spy(tokens: torch.Tensor, padding: object, tree: TokenTree) -> torch.Tensor:
        assert engine.target.static, "the tree left the static cache"
        trees.append(tree)
        return verify_tree(tokens, padding, tree)  # type: ignore[arg-type]

    engine.target.verify_tree = spy  # type: ignore[method-assign]
    return trees


def assert_compiled_trees_ran(engine: SpeculativeEngine) -> None:
    part = engine.target.compiled
    assert part is not None and part.failed is None, part and part.failed
    assert part.tree_graphs, "no tree forward ran compiled"
    assert part.recompiles == 0
    assert {shape[1] for shape in part.tree_graphs} == {SHAPE.nodes + 1}


@pytest.mark.parametrize("hit", [0.9, 0.5])
def test_compiled_tree_rounds_equal_target_generate(hit: float) -> None:
    """Random trees around the true continuation (its child at any rank, off-path subtrees):
    the accepted path is often not the tree's first nodes, so its columns move."""
    truth = {tuple(tokenizer()(p)["input_ids"]): list(reference("plain", p)) for p in PROMPTS}
    drafter = OracleTrees(truth, hit, seed=int(hit * 10))
    engine = compiled_engine("plain", drafter, SHAPE)
    trees = spy_trees(engine)
    ties = 0
    for prompt in PROMPTS:
        ties += check_equal("plain", prompt, engine.generate(prompt, MAX_NEW).tokens[0])
    assert ties <= 1
    assert len(trees) > 20 and drafter.moved > 5
    assert_compiled_trees_ran(engine)


def test_compiled_lookup_tries_equal_target_generate() -> None:
    """Prompt lookup's tries, the trees a compiled engine's shipped drafters give (a features
    draft keeps the eager path)."""
    engine = compiled_engine("loopy", PromptLookupDrafter(), SHAPE)
    trees = spy_trees(engine)
    for prompt in PROMPTS:
        check_equal("loopy", prompt, engine.generate(prompt, MAX_NEW).tokens[0])
    assert sum(tree.size > tree.depth for tree in trees) > 5, "too few branching tries"
    assert_compiled_trees_ran(engine)


@cache
def sampled_engine(temperature: float, top_p: float) -> SpeculativeEngine:
    target, _ = distribution_models()
    shape = TreeShape(depth=2, nodes=9, top_k=3)
    sampling = SamplingConfig(gamma=2, temperature=temperature, top_p=top_p)
    config = FlashSpecConfig(sampling=sampling, tree=shape, compile=True)
    return SpeculativeEngine(config, [FixedShapeTrees(VOCAB)], TargetModel(model=target))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_compiled_sampled_tree_rounds_follow_the_target(temperature: float, top_p: float) -> None:
    engine = sampled_engine(temperature, top_p)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(600):
        # Room for a second round that drafts a tree too (the first round's tree runs eager
        # with the prompt's prefill; the stream is left after two tokens).
        stream = engine.stream(PROMPT, 6, ignore_eos=True, seed=call)
        tokens: list[int] = []
        for chunk in stream:
            tokens.extend(chunk.token_ids)
            if len(tokens) >= 2:
                break
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert_first_two_follow(first, second, *exact(temperature, top_p))
    part = engine.target.compiled
    assert part is not None and part.tree_graphs and part.recompiles == 0


def test_a_compiled_tree_node_sees_its_ancestors_only() -> None:
    """Every node's logits from one compiled tree forward on a static cache equal its path
    read as a chain by the eager model; after the accepted path's columns move, the next
    forward equals a fresh one over the committed tokens."""
    model = build_llama(4, vocab_size=32, layers=2, hidden=32, init_range=0.3)
    forward = CompiledForward(model, [1], "tiny")
    forward.compile_trees(12)  # the 9-node tree's forward is padded up to 13 tokens
    cache_ = new_static_cache(model, 256)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    builder = TreeBuilder()
    builder.add_path([5, 6, 7])
    builder.add_path([8, 9, 10, 11])
    builder.add(0, 12)
    builder.add(-1, 13)
    tree = builder.build()
    n, start = tree.size, prompt.shape[1] - 1
    with torch.inference_mode():
        forward(prompt[:, :start], torch.arange(start)[None], 0, cache_)  # eager prefill
        ids = torch.cat([prompt[:, start:], tree.tokens.view(1, n)], dim=1)
        depths = torch.tensor(tree.depths, dtype=torch.int64)
        positions = torch.cat([torch.tensor([start]), start + depths]).view(1, n + 1)
        block = torch.zeros((n + 1, n + 1), dtype=torch.bool)
        block[:, 0] = True
        block[1:, 1:] = tree.ancestor_mask(torch.device("cpu"))
        logits = forward.tree(ids, positions, start, cache_, block)
        assert forward.tree_graphs and forward.failed is None
        for node in range(n):
            path = [int(tree.tokens[i]) for i in tree.path(node)]
            chain = model(torch.cat([prompt, torch.tensor([path])], dim=1)).logits[0, -1]
            torch.testing.assert_close(logits[0, node + 1], chain, atol=1e-4, rtol=1e-4)
        path = tree.path(5)  # 8, 9, 10: nodes 3, 4, 5, after another branch's nodes
        move_columns(cache_, [start + 1 + i for i in path], start + 1)
        width = start + 1 + len(path)
        committed = torch.cat([prompt, torch.tensor([[8, 9, 10, 11]])], dim=1)
        after = forward(committed[:, width:], torch.tensor([[width]]), width, cache_)[0, -1]
        fresh = model(committed).logits[0, -1]
    torch.testing.assert_close(after, fresh, atol=1e-4, rtol=1e-4)
