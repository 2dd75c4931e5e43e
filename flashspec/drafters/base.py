"""The contract between the engine and a drafter: ``Drafter``, what it reads each round
(``DraftContext``) and what it gives back (``Proposal``).

A drafter sees the committed token matrix (B, L) and proposes up to ``gamma`` tokens per row,
together with the distributions it sampled them from (``Proposal.probs``) — or None when each
draft was chosen deterministically, which verification treats as a point mass (q(d) = 1).
Proposing fewer than ``gamma`` (even zero) drafts is always allowed.

The verbs, in the order the engine calls them:

- ``bind(target)``: once, when the engine is built;
- ``reset()``: at the start of every generation;
- ``begin(ctx)``: the first round this drafter is chosen in a generation, before ``propose``
  (read the prompt into any cache, so that this reading is not charged to a round);
- ``propose(ctx, gamma)`` or ``propose_tree(ctx, shape)``: each round it is chosen;
- ``keep(lengths, padding)``: after every round, chosen or not, and after a probe: row b's
  first ``lengths[b]`` committed tokens (all but its newest) are what any cached state may
  still hold, laid out in the token matrix by ``padding``. In a ragged batch the rows'
  counts grew by different amounts; in lockstep by the same amount, so that a column-aligned
  cache keeps ``lengths[b] + padding.lefts[b]`` columns, the same in every row;
- ``select_rows(index)``: rows finished and left the batch;
- ``add_rows(tokens, padding)``: rows joined a running batch (ragged batches only).

``shiftable`` is each drafter's declaration that its state keeps the rows apart (or that it
keeps none), so the engine may run ragged batches and let rows join; a drafter whose cache is
column-aligned declares False, and its engine keeps batches in lockstep.

("Commit" is the engine's word for appending a round's tokens, and the target's for cropping
its cache to them; the drafter's part of it is ``keep``.) A drafter written against the
verbs' earlier names (``prefill``, ``commit(valid)``, ``keep_rows(lengths)``) runs unchanged:
``flashspec.legacy`` gives it the current verbs from its own methods.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ResidualBackend
from ..legacy import earlier_verbs
from ..models import CausalLM, Padding, TargetModel
from ..row_random import RowRandom
from ..sampling import Warper
from ..trees.tree import TokenTree, TreeShape


@dataclass
class DraftContext:
    """What a drafter may look at in one round.

    Attributes:
        tokens: (B, L) committed tokens, left padded.
        padding: where each row's real tokens start.
        warper: the sampling warp (the engine's, or the drafter's own temperature).
        generator: random source for sampled drafts (``RowRandom``: each row's own).
        confidence_threshold: stop drafting once a row's top probability falls below this.
        residual: sampling backend (``SamplingConfig.residual``), also used for drafting.
        adjust: the generation's penalties for a draft step's (B, V) logits, given the round's
            drafts so far (``pick_draft`` applies it); None without penalties.
        ragged: rows commit their own counts (``Generation.ragged``), so a row may stop
            drafting alone; in lockstep the batch advances by its shortest row, and the
            confidence stop ends the round for every row.
        caps: the most drafts each row may propose this round (None: ``gamma``); a model
            drafter stops once every row is capped or unsure (``RowStops``).
    """

    tokens: torch.Tensor
    padding: Padding
    warper: Warper
    generator: torch.Generator | RowRandom | None
    confidence_threshold: float | None = None
    residual: ResidualBackend = "auto"
    adjust: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor] | None = None
    ragged: bool = False
    caps: list[int] | None = None


@dataclass
class Proposal:
    """Drafted tokens (B, g) and the (B, g, V) distributions they came from (None: point masses).

    ``lengths``: how many of its g drafts each row really proposes (None: all of them). A row's
    tokens after its length are filler that is never accepted; in a ragged batch the target
    does not even read them (their columns are dead, ``flashspec.kv.layout``), so a row with
    nothing to propose decodes plainly inside the batch's verification.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    lengths: list[int] | None = None

    @property
    def count(self) -> int:
        """Drafts per row (g)."""
        return int(self.tokens.shape[1])

    @property
    def short(self) -> bool:
        """Whether some row proposes fewer than ``count`` drafts."""
        return self.lengths is not None and any(n < self.count for n in self.lengths)

    def capped(self, caps: Sequence[int] | None) -> Proposal:
        """This proposal with row b proposing at most ``caps[b]`` drafts (None: unchanged)."""
        if caps is None or self.count == 0:
            return self
        lengths = [min(n, c) for n, c in zip(self.lengths or [self.count] * len(caps), caps,
                                             strict=True)]  # fmt: skip
        short = any(n < self.count for n in lengths)
        return dataclasses.replace(self, lengths=lengths if short else None)


def no_drafts(tokens: torch.Tensor) -> Proposal:
    """No drafts for any row of ``tokens``."""
    return Proposal(tokens.new_empty((tokens.shape[0], 0)))


def tree_depth(ctx: DraftContext, shape: TreeShape) -> int:
    """The most levels a tree may have this round: ``shape.depth``, or the row's cap (a
    row near its token limit has no use for deeper drafts); 0 unless the batch has one row."""
    if ctx.tokens.shape[0] != 1:
        return 0
    return shape.depth if ctx.caps is None else min(shape.depth, ctx.caps[0])


class Drafter(ABC):
    """Interface between the engine and a drafter: the verbs of the module docstring."""

    name: str = "drafter"
    temperature: float | None = None
    """If set, drafts are sampled at this temperature instead of the engine's (still lossless,
    because verification uses the distribution the drafts were actually drawn from)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        earlier_verbs(cls, Drafter)  # a drafter written against the verbs' earlier names

    @property
    def lm(self) -> CausalLM | None:
        """The drafter's model, if it has one (used to check the vocabulary)."""
        return None

    @property
    def shiftable(self) -> bool:
        """Whether this drafter serves ragged batches (rows advance by their own counts and
        join a running batch). True here: a drafter that keeps no state between rounds, or
        keeps each row's apart. A drafter whose state is column-aligned declares False, and
        the engine keeps its batches in lockstep."""
        return True

    def bind(self, target: TargetModel) -> None:  # noqa: B027 - optional hook
        """The engine's target, given once when the engine is built (a drafter that reads the
        target's hidden states asks it to keep them here)."""

    def reset(self) -> None:  # noqa: B027 - optional hook, stateless drafters keep the default
        """Forget the previous generation."""

    def begin(self, ctx: DraftContext) -> None:  # noqa: B027 - stateless drafters: nothing to do
        """Bring any cached state up to all but the newest committed token, ahead of time.

        The engine calls it in the first round of a generation when it chooses among arms, so
        that no drafter's prompt prefill lands in (and skews) the reward of a later round.
        """

    @abstractmethod
    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Propose up to ``gamma`` tokens per row after ``ctx.tokens``."""

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        """A tree of continuations for a batch of ONE row (``ctx.tokens`` is (1, L)), or None:
        this drafter proposes chains only (the default), the batch has more rows, or it has
        nothing to propose.

        Trials are point masses (``q`` None), each parent's children in the drafter's order of
        preference (most likely first); the tree has at most ``shape.depth`` levels (and at
        most ``ctx.caps[0]``, when capped), ``shape.nodes`` nodes and ``shape.top_k`` children
        per node. The engine calls ``keep`` after the round as after a chain.
        """
        return None

    def keep(self, lengths: Sequence[int], padding: Padding) -> None:  # noqa: B027
        """Row b's first ``lengths[b]`` committed tokens are still correct in any cached state;
        ``padding`` lays them out in the token matrix (see the module docstring)."""

    def select_rows(self, index: torch.Tensor) -> None:  # noqa: B027
        """Keep only the batch rows in ``index``."""

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:  # noqa: B027
        """Rows joined the batch: ``tokens`` (n, L) right-aligned, laid out by ``padding``
        (``shiftable`` drafters only)."""


def with_temperature(warper: Warper, temperature: float | None) -> Warper:
    """``warper`` with the drafter's own temperature, if it has one."""
    return warper if temperature is None else dataclasses.replace(warper, temperature=temperature)
