"""A round's drafts: each row's cap from its own acceptance, the chosen drafter's chain or token
tree, and what a drafter sees of the generation (``DraftContext``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..drafters import DraftContext, Drafter, Proposal, with_temperature
from ..profiling import span
from ..sampling import RowWarper
from ..select.policy import Choice, Policy, ThroughputPolicy
from ..trees.tree import TokenTree
from .generation import Generation
from .penalties import draft_adjust
from .stopping import row_room
from .tree_round import paying_prefix, tree_shape

if TYPE_CHECKING:
    from .loop import SpeculativeEngine


def row_caps(
    engine: SpeculativeEngine, gen: Generation, policy: Policy, choice: Choice, follow: bool
) -> list[int] | None:
    """The most drafts each row proposes this round, from its own acceptance so far and
    the batch's measured verification cost (``flashspec.select.rows``). Ragged batches of
    two or more rows only, whose short rows' drafts are dead columns; None for plain
    rounds, one row, lockstep and the compiled path, which keep one length for all."""
    rows = len(gen.live)
    drafter = choice.arm.drafter
    if drafter is None or choice.gamma <= 0 or rows < 2 or not gen.ragged:
        return None
    if engine.compiled.on:
        return None
    # Not from measured times when the random draws must not follow them (a seeded
    # sampled generation, ``BanditConfig.seeded``): then from acceptance alone.
    model = policy.model if follow and isinstance(policy, ThroughputPolicy) else None
    share = None if model is None else model.verify_share(rows)
    caps = gen.row_rates.caps(gen.live, drafter, choice.gamma, share or 0.0)
    if follow:
        return caps
    # A row seeded on its own drafts what it would alone: the fixed arm's length cut by its
    # own room only, so that neither its draws nor its output depend on the rows beside it.
    width = gen.tokens.shape[1]
    for position, own in enumerate(gen.own_seeded()):
        if own:
            index, left = gen.live[position], gen.padding.lefts[position]
            caps[position] = min(choice.gamma, row_room(gen, index, width - left) - 1)
    return caps


def draft(
    engine: SpeculativeEngine,
    gen: Generation,
    index: int | None,
    gamma: int,
    learn: bool,
    caps: list[int] | None = None,
) -> tuple[Proposal, float]:
    """Drafter ``index``'s proposal of up to ``gamma`` tokens per row (none for plain
    decoding), row b's cut to ``caps[b]``, and the seconds of its first reading of the
    generation's tokens."""
    if index is None or gamma <= 0:
        return Proposal(gen.tokens.new_empty((gen.tokens.shape[0], 0))), 0.0
    began = time.perf_counter()
    drafter = engine.drafters[index]
    ctx = draft_context(engine, gen, drafter, caps)
    setup = 0.0
    if index not in gen.drafted_by:
        # A drafter reads the prompt (and the tokens since) when it is first chosen in a
        # generation, not up front: one never chosen costs nothing (the 3-layer demo
        # draft's prefill was ~0.6% of a sampled generation it took no round of). The
        # policy does not learn that reading as the arm's cost, or a drafter first chosen
        # late would look dearer than it is.
        gen.drafted_by.add(index)
        if learn:
            drafter.begin(ctx)
            setup = time.perf_counter() - began
    with span("draft"):
        return drafter.propose(ctx, gamma).capped(caps), setup


def draft_tree(
    engine: SpeculativeEngine, gen: Generation, choice: Choice
) -> tuple[TokenTree | None, float]:
    """The round's token tree (``FlashSpecConfig.tree``) and the seconds of the drafter's
    first reading of the generation, or (None, 0.0): a chain round."""
    index = choice.arm.drafter
    drafter = None if index is None else engine.drafters[index]
    compiled = engine.target.compiled
    eager_only = engine.compiled.on and (compiled is None or not compiled.tree_lengths)
    shape = tree_shape(engine.config.tree, gen, drafter, choice.gamma, engine.target,
                       eager_only)  # fmt: skip
    if shape is None or drafter is None or index is None:
        return None, 0.0
    # Shape by cost: the nodes whose expected tokens pay for their verification, and a chain
    # instead when trees have not paid (``TreeGate``); not from measured times when the random
    # draws must not follow them (as the round chooses).
    follow = not gen.seeded_sampling() or engine.config.bandit.seeded == "follow"
    model = engine.policy.model if isinstance(engine.policy, ThroughputPolicy) else None
    if model is not None and follow and not engine.tree_gate.wants_tree(index):
        return None, 0.0
    began = time.perf_counter()
    ctx = draft_context(engine, gen, drafter)
    setup = 0.0
    if index not in gen.drafted_by:
        gen.drafted_by.add(index)  # as in draft
        if choice.learn:
            drafter.begin(ctx)
            setup = time.perf_counter() - began
    with span("draft"):
        tree = drafter.propose_tree(ctx, shape)
    if tree is None or not tree.size:
        return None, setup
    if model is not None and follow:
        drafted = time.perf_counter() - began - setup
        tree = paying_prefix(tree, drafted, model.verify_seconds)
    return tree, setup


def draft_context(
    engine: SpeculativeEngine, gen: Generation, drafter: Drafter, caps: list[int] | None = None
) -> DraftContext:
    """What ``drafter`` sees of ``gen`` this round (rows capped at ``caps``)."""
    warper = gen.warper
    if not warper.greedy and drafter.temperature is not None:
        if isinstance(warper, RowWarper):
            warper = warper.with_temperature(drafter.temperature)
        else:
            warper = with_temperature(warper, drafter.temperature)
    return DraftContext(
        tokens=gen.tokens,
        padding=gen.padding,
        warper=warper,
        generator=gen.random(caps),
        confidence_threshold=gen.sampling.confidence_threshold,
        residual=gen.sampling.residual,
        adjust=draft_adjust(gen.adjusters),
        ragged=gen.ragged,
        caps=caps,
    )
