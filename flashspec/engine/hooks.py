"""What a ``before_round`` hook sees of the round about to run (``RoundView``), and its probe:
a round drafted and verified with nothing committed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..drafters import Drafter, Proposal
from ..sampling import Acceptance
from .accept import accept
from .drafting import draft_context
from .generation import Generation

if TYPE_CHECKING:
    from .loop import SpeculativeEngine


class RoundView:
    """What a ``before_round`` hook sees of the round about to run.

    Attributes:
        tokens: (rows, L) committed tokens of the live rows, left padded.
        padding: where each row's real tokens start.
        room: tokens the round may emit per row.
        prefilled: whether the target has read the prompt (False before the first round).
    """

    def __init__(self, engine: SpeculativeEngine, gen: Generation, room: int) -> None:
        self._engine = engine
        self._gen = gen
        self.tokens = gen.tokens
        self.padding = gen.padding
        self.room = room
        self.prefilled = engine.target.cached > 0

    def probe(self, drafter: Drafter, gamma: int) -> tuple[Proposal, Acceptance]:
        """Draft ``gamma`` tokens with ``drafter`` and verify them as a round would, then put
        the target's and the drafter's caches back: what that round would have accepted
        (``Acceptance.probability``), with nothing committed. Random draws advance the
        generation's generator, so a sampled generation's later tokens change."""
        engine, gen = self._engine, self._gen
        before = engine.target.cached
        proposal = drafter.propose(draft_context(engine, gen, drafter), gamma)
        logits = engine.target.verify(gen.tokens, proposal.tokens, gen.padding)
        acceptance = accept(gen, logits, proposal)
        engine.target.rollback(before)
        lengths = [gen.tokens.shape[1] - 1 - left for left in gen.padding.lefts]
        drafter.keep(lengths, gen.padding)
        return proposal, acceptance
