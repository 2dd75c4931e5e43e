"""A round's accept/reject step: the generation's logit changes applied to the target's scores,
then its method (greedy, rejection sampling, typical) on the device (``flashspec.sampling``)."""

from __future__ import annotations

import torch

from ..drafters import Proposal
from ..profiling import span
from ..sampling import Acceptance, accept_greedy, accept_rejection, accept_typical
from .generation import Generation


def accept(gen: Generation, logits: torch.Tensor, proposal: Proposal) -> Acceptance:
    """Accept or reject the round's drafts against the target's ``logits`` (B, g + 1, V) by
    the generation's method, after this round's logit changes."""
    sampling = gen.sampling
    generator = gen.generator
    method = sampling.resolved_method
    for adjuster in gen.adjusters:
        logits = adjuster.target(logits, proposal.tokens)
    ragged = gen.ragged
    lengths = (
        torch.tensor(proposal.lengths, dtype=torch.int64, device=logits.device)
        if proposal.short and proposal.lengths is not None
        else None
    )
    if method == "greedy":
        with span("accept"):
            return accept_greedy(logits, proposal.tokens, ragged=ragged, lengths=lengths)
    p = gen.warper.probs(logits)
    with span("accept"):
        if method == "typical":
            return accept_typical(
                p,
                proposal.tokens,
                generator,
                sampling.typical_epsilon,
                sampling.typical_delta,
                ragged=ragged,
                lengths=lengths,
            )
        return accept_rejection(
            p,
            proposal.probs,
            proposal.tokens,
            generator,
            sampling.residual,
            ragged=ragged,
            lengths=lengths,
        )
