"""The greedy tie rule: when a greedy output that differs from the target's own is still right.

One forward over k tokens and k forwards over one token can round differently. So a greedy
output that differs from the target's own greedy decoding is a bug, unless, at the first
differing position, the target rounds to either token: in the target's own forward over the
whole prefix, the differing token's logit is within ``TIE`` of the top one, or within
``TIE_ULPS`` units in the last place of the model's dtype (what decides in bfloat16, whose step
at a logit of 20 is 0.125); it may be the top one itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

TIE = 1e-4
"""Top-2 logit gap below which a greedy difference is a floating-point tie."""

TIE_ULPS = 8
"""...or below this many units in the last place of the model's dtype at the top logit: in
bfloat16 the target's one-token and whole-prefix forwards were seen 3 units apart."""


@dataclass(frozen=True)
class GreedyComparison:
    """How a greedy output compares with the target's own.

    Attributes:
        status: ``"identical"``, ``"tie"`` (differs first where the target rounds to either
            token, see the module docstring) or ``"mismatch"``.
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
    logits = _next_logits(model, ids, max_context)
    if logits is None:
        return None
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _next_logits(model: Any, ids: Sequence[int], max_context: int | None) -> torch.Tensor | None:
    """float32 next-token logits after ``ids`` in one full forward (None past the context)."""
    if max_context is not None and len(ids) >= max_context:
        return None
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=torch.tensor([list(ids)], device=device)).logits
    return logits[0, -1].float()


def tie_threshold(dtype: torch.dtype, logit: float) -> float:
    """The largest logit gap that counts as a tie for a model in ``dtype`` at ``logit``."""
    if not dtype.is_floating_point:
        return TIE
    exponent = math.floor(math.log2(abs(logit))) if logit else 0
    return max(TIE, TIE_ULPS * torch.finfo(dtype).eps * 2.0**exponent)


def compare_greedy(
    model: Any,
    prompt: Sequence[int],
    got: Sequence[int],
    reference: Sequence[int],
    max_context: int | None = None,
) -> GreedyComparison:
    """Compare ``got`` with ``reference`` (the target's own greedy continuation of ``prompt``)
    under the tie rule; ``gap`` is how far the differing token's logit is below the top one."""
    at = first_difference(got, reference)
    if at is None:
        return GreedyComparison("identical")
    if at >= min(len(got), len(reference)):
        return GreedyComparison("mismatch", at)  # one stops early: no logits decide that
    logits = _next_logits(model, [*prompt, *reference[:at]], max_context)
    if logits is None:
        return GreedyComparison("mismatch", at)
    top = float(logits.max())
    gap = top - float(logits[got[at]])
    dtype = next(model.parameters()).dtype
    tie = gap <= tie_threshold(dtype, top)  # 0 when got[at] is the whole-prefix argmax
    return GreedyComparison("tie" if tie else "mismatch", at, gap)
