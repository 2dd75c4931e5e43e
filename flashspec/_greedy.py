"""The greedy tie rule: when a greedy output that differs from the target's own is still right.

One forward over k tokens and k forwards over one token can round differently. So a greedy
output that differs from the target's own greedy decoding is a bug, unless the target's top two
logits at the first differing position are within ``TIE``. There either token is the argmax, up
to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

TIE = 1e-4
"""Top-2 logit gap below which a greedy difference is a floating-point tie."""


@dataclass(frozen=True)
class GreedyComparison:
    """How a greedy output compares with the target's own.

    Attributes:
        status: ``"identical"``, ``"tie"`` (differs first where the top two logits are within
            ``TIE``) or ``"mismatch"``.
        at: index of the first differing token (None when identical).
        gap: the target's top-2 logit gap there (None when identical or unknown).
    """

    status: Literal["identical", "tie", "mismatch"]
    at: int | None = None
    gap: float | None = None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; the shorter length if one is a prefix of the other;
    None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model: Any, ids: Sequence[int], max_context: int | None = None) -> float | None:
    """Gap between ``model``'s top two next-token logits after ``ids`` (one full forward);
    None when ``ids`` does not fit in ``max_context``."""
    if max_context is not None and len(ids) >= max_context:
        return None
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits
    top = logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def compare_greedy(
    model: Any,
    prompt: Sequence[int],
    got: Sequence[int],
    reference: Sequence[int],
    max_context: int | None = None,
) -> GreedyComparison:
    """Compare ``got`` with ``reference`` (the target's own greedy continuation of ``prompt``)
    under the tie rule."""
    at = first_difference(got, reference)
    if at is None:
        return GreedyComparison("identical")
    if at >= min(len(got), len(reference)):
        return GreedyComparison("mismatch", at)  # one stops early: no logits decide that
    gap = top2_gap(model, [*prompt, *reference[:at]], max_context)
    status: Literal["tie", "mismatch"] = "tie" if gap is not None and gap < TIE else "mismatch"
    return GreedyComparison(status, at, gap)
