"""Per-row draft lengths: how many drafts each row of a ragged batch may propose, from that
row's own acceptance history.

Rows of one batch draft very different text (one copies its prompt, another invents), so one
draft length for all makes the batch verify drafts that a poorly drafted row almost always
rejects. Draft k of a row whose drafts are each accepted with probability a is emitted with
probability a^k (drafts 1..k all accepted). Verifying it costs what one more verified token
costs; plain decoding buys a whole token for a plain round's seconds per row. So draft k is
worth verifying while a^k stays at least that cost ratio, ``worth``: row b's cap is the
largest such k, up to the round's gamma, and 0 (the row decodes plainly inside the batch's
forward, its drafts dead columns) when even its first draft is not worth it. ``worth`` comes
from the batch's measured verification line (``ThroughputModel.verify_share``) and is never
below ``MIN_WORTH``: drafting and the cache writes of a draft are not free either.

The cap only trims a row's proposal (``Proposal.capped``): its drafts past the cap are never
accepted, so the output does not depend on this rule, only the speed.
"""

from __future__ import annotations

from collections.abc import Sequence

ROW_DECAY = 0.7
"""Weight left to a row's earlier counts per round it drafts: about three rounds of memory, as a
row's text changes from copying to inventing within a few rounds."""

RETRY_DECAY = 0.98
"""Weight left per round a row drafts nothing: its estimate drifts back to the prior, so a row
cut to plain decoding tries a draft again after about ten rounds instead of never."""

PRIOR = 0.5
"""Pseudo-drafts, all accepted, in every row's estimate: a row without history drafts the full
length, and about three rounds of rejected first drafts bring it to plain decoding."""

MIN_WORTH = 0.2
"""The least probability of being emitted for which a draft is verified."""


def reach_length(rate: float, worth: float, gamma: int) -> int:
    """The largest k <= ``gamma`` with ``rate ** k >= worth`` (0 when ``rate < worth``)."""
    k, reach = 0, rate
    while k < gamma and reach >= worth:
        k, reach = k + 1, reach * rate
    return k


class RowRates:
    """Each row's decayed counts of tried and accepted drafts, per drafter (a row drafted well
    by prompt lookup may be drafted badly by a model), keyed by the row's index in the
    generation, so that rows that join start from the prior and finished rows are never read
    again."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], tuple[float, float]] = {}  # (tried, accepted)

    def rate(self, row: int, drafter: int) -> float:
        """Estimated probability that the row's next draft is accepted, once those before it
        were."""
        tried, accepted = self._counts.get((row, drafter), (0.0, 0.0))
        return (accepted + PRIOR) / (tried + PRIOR)

    def caps(self, rows: Sequence[int], drafter: int, gamma: int, worth: float) -> list[int]:
        """The most drafts each row of ``rows`` should propose (see the module docstring)."""
        worth = max(worth, MIN_WORTH)
        return [reach_length(self.rate(row, drafter), worth, gamma) for row in rows]

    def observe(
        self, rows: Sequence[int], drafter: int, lengths: Sequence[int], accepted: Sequence[int]
    ) -> None:
        """Learn from a round: row ``rows[i]`` proposed ``lengths[i]`` drafts and accepted the
        leading ``accepted[i]``. Its tried drafts are those up to its first rejection."""
        for row, length, run in zip(rows, lengths, accepted, strict=True):
            key = (row, drafter)
            tried, took = self._counts.get(key, (0.0, 0.0))
            if length == 0:
                self._counts[key] = (tried * RETRY_DECAY, took * RETRY_DECAY)
            else:
                self._counts[key] = (
                    tried * ROW_DECAY + min(run + 1, length),
                    took * ROW_DECAY + min(run, length),
                )
