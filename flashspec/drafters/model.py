"""ModelDrafter: a small causal LM with the target's vocabulary drafts on its own KV cache;
``pick_draft`` and ``RowStops``, shared with the features drafter, choose each draft and when a
round stops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..models import CausalLM, Padding
from ..sampling import argmax_last, draft_sample
from .base import DraftContext, Drafter, Proposal, no_drafts


class ModelDrafter(Drafter):
    """A small causal LM with the target's vocabulary, drafting incrementally on its own KV cache.

    Args:
        model: the draft model (HuggingFace causal LM).
        name: label for stats and errors.
        tokenizer: its tokenizer, used to check the vocabulary against the target's.
        temperature: optional sampling temperature of its own (see ``Drafter.temperature``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        name: str | None = None,
        tokenizer: Any = None,
        temperature: float | None = None,
    ) -> None:
        if temperature is not None and (isinstance(temperature, bool) or not temperature >= 0):
            raise ValueError(f"ModelDrafter temperature must be None or >= 0, got {temperature!r}")
        self._lm = CausalLM(model, name=name, tokenizer=tokenizer, role="drafter")
        self.name = self._lm.name
        self.temperature = temperature

    @property
    def lm(self) -> CausalLM:
        """The draft model with its cache."""
        return self._lm

    def reset(self) -> None:
        """Empty the KV cache."""
        self._lm.reset()

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Draft autoregressively; the first forward also feeds committed tokens the cache lacks."""
        lm = self._lm
        length = ctx.tokens.shape[1]
        if lm.max_context is not None:
            # Draft i is produced by feeding column length + i - 2, a valid position for the
            # shortest row (longer rows' positions are clamped; their drafts past their limit
            # are never emitted).
            gamma = min(gamma, lm.max_context - (length - ctx.padding.max_left) + 1)
        if gamma <= 0:
            return no_drafts(ctx.tokens)
        last: torch.Tensor | None = None  # the previous draft, fed after the committed tokens
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        stops = RowStops(ctx, gamma)
        for i in range(gamma):
            if i:
                # A stateful drafter keeps a copy of its state at each committed-or-drafted
                # column, so keep() returns to the accepted one without feeding anything again.
                lm.mark()
            logits = lm.feed(ctx.tokens, ctx.padding, last, keep=1)[:, -1]
            token, unsure = pick_draft(logits, ctx, drafts, dists)
            if not stops.more(unsure):
                break
            last = token.unsqueeze(1)
        return stops.proposal(drafts, dists)

    def begin(self, ctx: DraftContext) -> None:
        """Feed the prompt (all but its last token, which ``propose`` feeds) into the cache."""
        lm = self._lm
        end = ctx.tokens.shape[1] - 1
        if lm.max_context is not None and end > lm.max_context:
            return
        if lm.rows is not None:
            held = lm.rows.lengths or [0] * len(ctx.padding.lefts)
            if any(end - left > n for left, n in zip(ctx.padding.lefts, held, strict=True)):
                lm.feed(ctx.tokens[:, :end], ctx.padding, keep=1)
        elif end > lm.cached:
            lm.forward(ctx.tokens[:, lm.cached : end], ctx.padding, keep=1)

    def keep(self, lengths: Sequence[int], padding: Padding) -> None:
        """Crop the cache to the still-valid prefix (each row's own, in the ragged layout);
        after a full acceptance the cache is one column short and the next ``propose`` catches
        up in its first forward."""
        if self._lm.rows is not None:
            self._lm.keep_rows(lengths)
        elif lengths:
            self._lm.rollback(lengths[0] + padding.lefts[0])  # column-aligned: equal in every row

    def select_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows from the cache."""
        self._lm.select_rows(index)

    @property
    def shiftable(self) -> bool:
        """Whether the draft model's cache serves ragged batches (``CausalLM.shiftable``)."""
        return self._lm.shiftable

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """Read the joining rows into the cache (see ``CausalLM.add_rows``)."""
        self._lm.add_rows(tokens, padding)


def pick_draft(
    logits: torch.Tensor,
    ctx: DraftContext,
    drafts: list[torch.Tensor],
    dists: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model drafter's next draft per row from its (B, V) ``logits``: the argmax when
    greedy, else a sample of the warped distribution (appended to ``dists``, for
    verification). The draft is appended to ``drafts``. Also returns the (B,) bool rows the
    confidence stop (``ctx.confidence_threshold``) asks to draft no further, still on the
    device (None without the stop; ``RowStops.more`` reads it)."""
    threshold = ctx.confidence_threshold
    if ctx.adjust is not None:
        logits = ctx.adjust(logits, drafts)
    if ctx.warper.greedy:
        token = argmax_last(logits)
        probs = logits.float().softmax(dim=-1) if threshold is not None else None
    else:
        probs = ctx.warper.probs(logits)
        token = draft_sample(probs, ctx.generator, ctx.residual)
        dists.append(probs)
    drafts.append(token)
    if threshold is None or probs is None:
        return token, None
    return token, probs.max(dim=-1).values < threshold


class RowStops:
    """When a model drafter's round stops, and how many drafts each row proposed.

    A row stops at its cap (``DraftContext.caps``) or once the confidence stop finds it unsure
    (keeping the unsure draft, which verification may still accept). In a ragged batch of two
    or more rows the others draft on while any row still goes and ``gamma`` allows: a row
    whose draft model is lost no longer ends the round of rows it drafts well. Otherwise (one
    row, lockstep) any unsure row ends the round for all, as the batch advances by its
    shortest row anyway.

    Host reads: none without the confidence stop; with it, one per draft step (the unsure
    flags), as the whole-batch stop always took.
    """

    def __init__(self, ctx: DraftContext, gamma: int) -> None:
        self.gamma = gamma
        self.step = 0  # drafts made so far, in every row
        self.per_row = ctx.ragged and ctx.tokens.shape[0] > 1
        self.lengths: list[int] | None = None if ctx.caps is None else list(ctx.caps)

    def more(self, unsure: torch.Tensor | None) -> bool:
        """After a draft step with the (B,) ``unsure`` rows (None: no confidence stop):
        whether to draft another."""
        self.step += 1
        step = self.step
        if step >= self.gamma:
            return False
        if unsure is not None and not self.per_row:
            return not bool(unsure.any())
        if unsure is not None:
            flags: list[bool] = unsure.tolist()
            lengths = self.lengths or [self.gamma] * len(flags)
            self.lengths = [min(n, step) if u else n for n, u in zip(lengths, flags, strict=True)]
        return self.lengths is None or any(n > step for n in self.lengths)

    def proposal(self, drafts: list[torch.Tensor], dists: list[torch.Tensor]) -> Proposal:
        """The round's (B, g) drafts and (B, g, V) distributions, each row's length set when
        some row proposes fewer than g."""
        tokens = torch.stack(drafts, dim=1)
        proposal = Proposal(tokens, torch.stack(dists, dim=1) if dists else None)
        return proposal.capped(self.lengths)
