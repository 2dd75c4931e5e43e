"""The sampling setup the engine tests share: a tiny target and a draft that disagree a lot
(different seeds), a fixed prompt, the exact float64 distributions of the first two emitted
tokens computed from the target, and the counts of those tokens over seeded generations (for
``tests.helpers.chi2``)."""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

import torch

from flashspec import SpeculativeEngine
from flashspec.sampling import Warper
from tests.helpers.chi2 import first_two_counts
from tests.helpers.models import build_llama

VOCAB = 12
PROMPT = [1, 5, 7, 3, 9, 5, 7]


@cache
def models() -> tuple[Any, Any]:
    """A target and a draft that disagree a lot (different seeds)."""
    target = build_llama(10, vocab_size=VOCAB, layers=1, hidden=32, init_range=0.15)
    draft = build_llama(11, vocab_size=VOCAB, layers=1, hidden=32, init_range=0.15)
    return target, draft


@cache
def exact(temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of the first and second emitted token, float64."""
    target, _ = models()
    warper = Warper(temperature=temperature, top_p=top_p)
    with torch.inference_mode():
        first = warper.probs(target(torch.tensor([PROMPT])).logits[0, -1]).double()
        extended = torch.tensor([[*PROMPT, x] for x in range(VOCAB)])
        second_given = warper.probs(target(extended).logits[:, -1]).double()
    return first, first @ second_given


def sample_two(
    engine: SpeculativeEngine, n: int, batch: int, seed: int
) -> tuple[Counter[int], Counter[int]]:
    """Counts of the first and second emitted tokens over n independent generations."""
    return first_two_counts(engine, PROMPT, batch, n // batch, seed)
