"""Penalties and logit bias at every position of a round, as that position sees the output.

A round verifies g drafts in one forward: position i of the target's logits (rows, g + 1, V) is
the distribution after the committed tokens and the drafts before it. A penalty that counts the
output must therefore count those drafts too, position by position; then each position's
penalized distribution is exactly what plain decoding would have used there, and rejection
sampling (or the greedy rule) keeps the penalized target's output.
"""

from __future__ import annotations

import torch

from ..config import SamplingConfig
from ..models import Padding


def penalize(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    padding: Padding,
    generated: list[int],
    drafts: torch.Tensor,
    sampling: SamplingConfig,
) -> torch.Tensor:
    """``logits`` (rows, g + 1, V) with ``sampling``'s penalties and bias applied, in float32.

    Args:
        tokens: (rows, L) committed tokens, left padded (``padding``), prompt then output.
        generated: per row, how many of its committed tokens are output (the rest, after the
            padding, are its prompt).
        drafts: (rows, g) the round's drafts; position i counts drafts[:, :i].

    Repetition (HF's meaning: prompt and output, divide a positive logit, multiply a negative
    one), then presence and frequency (OpenAI's: output only), then the bias.
    """
    rows, positions, vocab = logits.shape
    x = logits.float()
    device = x.device
    columns = torch.arange(tokens.shape[1], device=device)
    width = tokens.shape[1]
    starts = torch.tensor([width - n for n in generated], device=device).unsqueeze(1)
    lefts = padding.left.to(device).unsqueeze(1)
    ids = tokens.clamp(0, vocab - 1)
    # (rows, V) output counts of the committed tokens.
    output = (columns >= starts).to(x.dtype)
    counts = torch.zeros(rows, vocab, device=device).scatter_add_(1, ids, output)
    # (rows, g + 1, V): position i adds the drafts before it.
    per_position = counts.unsqueeze(1).repeat(1, positions, 1)
    if positions > 1:
        hot = torch.nn.functional.one_hot(drafts.clamp(0, vocab - 1), vocab).to(x.dtype)
        per_position[:, 1:] += hot.cumsum(dim=1)
    if sampling.repetition_penalty != 1.0:
        real = (columns >= lefts).to(x.dtype)
        seen = torch.zeros(rows, vocab, device=device).scatter_add_(1, ids, real) > 0
        seen = seen.unsqueeze(1) | (per_position > 0)
        penalty = sampling.repetition_penalty
        x = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    if sampling.presence_penalty != 0.0:
        x = x - sampling.presence_penalty * (per_position > 0).to(x.dtype)
    if sampling.frequency_penalty != 0.0:
        x = x - sampling.frequency_penalty * per_position
    if sampling.logit_bias:
        index = torch.tensor(list(sampling.logit_bias), device=device)
        values = torch.tensor(list(sampling.logit_bias.values()), device=device)
        x[..., index] += values
    return x
