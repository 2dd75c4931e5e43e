"""Drafters for tests of per-row draft lengths (``Proposal.lengths``)."""

from __future__ import annotations

import dataclasses

import torch

from flashspec.drafters import DraftContext, Drafter, ModelDrafter, PromptLookupDrafter, Proposal


class CutLookup(Drafter):
    """Prompt lookup with each row's proposal cut to ``(row + round) % (gamma + 1)`` drafts
    (at most what lookup found); the filler after a row's length is ``filler`` (default: the
    row's last token)."""

    name = "cut_lookup"

    def __init__(self, filler: int | None = None) -> None:
        self.inner = PromptLookupDrafter()
        self.filler = filler
        self.round = 0
        self.lengths: list[list[int]] = []

    def reset(self) -> None:
        self.round = 0

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        full = self.inner.propose(ctx, gamma)
        rows, g = full.tokens.shape
        found = full.lengths or [g] * rows
        lengths = [min(n, (row + self.round) % (gamma + 1)) for row, n in enumerate(found)]
        self.round += 1
        if g == 0:
            return full
        self.lengths.append(lengths)
        columns = torch.arange(g).unsqueeze(0)
        filler = (
            ctx.tokens[:, -1:]
            if self.filler is None
            else ctx.tokens.new_full((rows, 1), self.filler)
        )
        filler = filler.expand(-1, g)
        tokens = torch.where(columns < torch.tensor(lengths).unsqueeze(1), full.tokens, filler)
        return Proposal(tokens, lengths=lengths)


class RecordingDrafter(ModelDrafter):
    """A model drafter that records each round's caps (``DraftContext.caps``) and the lengths
    it proposed (``Proposal.lengths``, None: all). With ``spoil``, that row's drafts become
    ``draft + 1`` while the batch has two or more rows: with the target itself as the draft
    model (greedy drafts are the target's own next tokens) they are always rejected."""

    def __init__(self, model: torch.nn.Module, spoil: int | None = None) -> None:
        super().__init__(model)
        self.spoil = spoil
        self.vocab = int(model.config.vocab_size)
        self.rounds: list[tuple[list[int] | None, list[int] | None]] = []

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        proposal = super().propose(ctx, gamma)
        if proposal.count == 0:
            return proposal
        self.rounds.append((ctx.caps, proposal.lengths))
        if self.spoil is not None and ctx.tokens.shape[0] > 1:
            tokens = proposal.tokens.clone()
            tokens[self.spoil] = (tokens[self.spoil] + 1) % self.vocab
            proposal = dataclasses.replace(proposal, tokens=tokens)
        return proposal
