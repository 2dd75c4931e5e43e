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
    the live rows' method, after this round's logit changes."""
    sampling = gen.sampling
    generator = gen.random()
    # Per round, from the live rows: greedy rows beside sampled ones are point masses
    # (RowWarper), which both sampling rules accept exactly.
    method = "greedy" if gen.warper.greedy else "typical" if gen.typical else "rejection"
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
