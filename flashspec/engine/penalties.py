"""Penalties and logit bias at every position of a round, as that position sees the output.

A round verifies g drafts in one forward: position i of the target's logits (rows, g + 1, V) is
the distribution after the committed tokens and the drafts before it. A penalty that counts the
output must therefore count those drafts too, position by position; then each position's
penalized distribution is exactly what plain decoding would have used there, and rejection
sampling (or the greedy rule) keeps the penalized target's output. The draft's logits get the
same treatment step by step, so that a draft model proposes what the penalized target would
(exactness does not need it; acceptance does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import SamplingConfig
from ..models import Padding

if TYPE_CHECKING:
    from .generation import Generation


class Adjuster(Protocol):
    """A change to one round's logits: penalties, a grammar's masks."""

    def draft(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """(rows, V) logits of the next draft step, given the round's drafts so far."""
        ...

    def target(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """(rows, g + 1, V) verification logits; position i after drafts[:, :i]."""
        ...


def round_adjusters(gen: Generation, vocab: int) -> list[Adjuster]:
    """The round's logit changes, in the order they apply: penalties and bias, then the
    grammar's masks (last, so that nothing lifts a masked token)."""
    adjusters: list[Adjuster] = []
    settings = [gen.row_sampling[index].penalties for index in gen.live]
    if any(config is not None for config in settings):
        generated = [len(gen.rows[index].tokens) for index in gen.live]
        adjusters.append(Penalties(gen.tokens, gen.padding, generated, vocab, settings))
    if gen.grammar is not None:
        adjusters.append(gen.grammar.round(gen.live))
    return adjusters


def draft_adjust(
    adjusters: list[Adjuster],
) -> Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor] | None:
    """The draft-side function of ``DraftContext.adjust``: every adjuster in order."""
    if not adjusters:
        return None

    def adjust(logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        for adjuster in adjusters:
            logits = adjuster.draft(logits, drafts)
        return logits

    return adjust


class Penalties:
    """One round's penalties: the counts of the committed tokens, read once, applied to the
    draft's logits step by step and to the target's at every position.

    Repetition (HF's meaning: prompt and output, divide a positive logit, multiply a negative
    one), then presence and frequency (OpenAI's: output only), then the bias. Each row by its
    own settings: a (rows, 1) column per penalty and a (rows, V) bias, so one batch holds rows
    of any settings, and a row without any keeps its logits.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        padding: Padding,
        generated: list[int],
        vocab: int,
        sampling: SamplingConfig | Sequence[SamplingConfig | None],
    ) -> None:
        """
        Args:
            tokens: (rows, L) committed tokens, left padded (``padding``): prompt, then output.
            generated: per row, how many of its committed tokens are output (the rest, after
                the padding, are its prompt).
            vocab: width of the logits.
            sampling: the penalties and bias of every row, or of each row (None: none).
        """
        rows = tokens.shape[0]
        settings = [sampling] * rows if isinstance(sampling, SamplingConfig) else list(sampling)
        self.vocab = vocab
        device = tokens.device
        width = tokens.shape[1]
        columns = torch.arange(width, device=device)
        starts = torch.tensor([width - n for n in generated], device=device).unsqueeze(1)
        ids = tokens.clamp(0, vocab - 1)
        output = (columns >= starts).float()
        # (rows, V) how often each token is in the committed output
        self.counts = torch.zeros(rows, vocab, device=device).scatter_add_(1, ids, output)

        def column(name: str, neutral: float) -> torch.Tensor | None:
            values = [neutral if c is None else float(getattr(c, name)) for c in settings]
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, device=device).unsqueeze(1)  # (rows, 1)

        self.repetition = column("repetition_penalty", 1.0)
        self.presence = column("presence_penalty", 0.0)
        self.frequency = column("frequency_penalty", 0.0)
        self.seen: torch.Tensor | None = None  # (rows, V) in the prompt or the output
        if self.repetition is not None:
            real = (columns >= padding.left.to(device).unsqueeze(1)).float()
            self.seen = torch.zeros(rows, vocab, device=device).scatter_add_(1, ids, real) > 0
        self.bias: torch.Tensor | None = None  # (rows, V)
        if any(c is not None and c.logit_bias for c in settings):
            self.bias = torch.zeros(rows, vocab, device=device)
            for row, config in enumerate(settings):
                if config is not None and config.logit_bias:
                    index = torch.tensor(list(config.logit_bias), device=device)
                    values = torch.tensor(list(config.logit_bias.values()), device=device)
                    self.bias[row, index] = values.float()

    def target(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """(rows, g + 1, V) target logits -> penalized float32; position i counts
        ``drafts[:, :i]`` (drafts: (rows, g))."""
        positions = logits.shape[1]
        counts = self.counts.unsqueeze(1).repeat(1, positions, 1)
        if positions > 1:
            hot = torch.nn.functional.one_hot(drafts.clamp(0, self.vocab - 1), self.vocab)
            counts[:, 1:] += hot.float().cumsum(dim=1)
        seen = None if self.seen is None else self.seen.unsqueeze(1)
        return self._apply(logits.float(), counts, seen, per_position=True)

    def draft(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """(rows, V) draft logits of the next draft step -> penalized float32, counting the
        round's ``drafts`` so far (each (rows,))."""
        if logits.shape[-1] != self.vocab:
            return logits  # (a draft with a wider head: its proposals stay exact, unpenalized)
        counts = self.counts
        if drafts:
            index = torch.stack(drafts, dim=1).clamp(0, self.vocab - 1)
            counts = counts.scatter_add(1, index, torch.ones(index.shape, device=index.device))
        return self._apply(logits.float(), counts, self.seen, per_position=False)

    def _apply(
        self, x: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor | None, per_position: bool
    ) -> torch.Tensor:
        def rows(value: torch.Tensor) -> torch.Tensor:  # (rows, 1) -> broadcast over x
            return value.unsqueeze(1) if per_position else value

        if self.repetition is not None and seen is not None:
            penalty = rows(self.repetition)
            hit = seen | (counts > 0)
            x = torch.where(hit, torch.where(x < 0, x * penalty, x / penalty), x)
        if self.presence is not None:
            x = x - rows(self.presence) * (counts > 0).float()
        if self.frequency is not None:
            x = x - rows(self.frequency) * counts
        if self.bias is not None:
            x = x + rows(self.bias)
        return x
