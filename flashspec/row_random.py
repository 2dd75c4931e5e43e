"""Each row's random source in a batch whose rows sample with their own seeds.

A batch of rows that all draw from one ``torch.Generator`` (unseeded rows, or a call's single
``seed``) takes its uniforms in one call, as a (B, n) block. ``RowRandom`` serves a batch in
which some rows have generators of their own (a seeded request beside others): each such row
draws only from its own generator, and only as many uniforms as its own round needs, so its
stream of draws, and with it its output, never depends on the rows beside it. Rows without a
generator of their own share one, drawn as a block.

What "its own round needs" means, per use:

* drafting (``draft_uniforms``): one uniform per draft step while the row is within its draft
  length (``caps``); past it the row's draft is cut anyway, and it takes a filler, not a draw;
* acceptance (``acceptance_uniforms``): one per draft the row proposed, then one for its
  replacement or bonus token, in the last column, where the accept rules read it; the columns
  of drafts it did not propose get fillers.

A row alone takes exactly the draws it takes inside any batch, so a seeded row's output is the
same alone and beside any neighbours, as long as its draft lengths are (``flashspec.engine``'s
``row_caps`` keeps a seeded row's length its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FILLER = 0.5
"""The uniform a row gets where it takes no draw: in a column that is never read."""


class RowRandom:
    """Random draws for a batch, row by row (see the module docstring).

    Args:
        generators: each row's generator (None: torch's default source).
        own: whether row b's generator is its own (else shared with the other rows that are
            not, drawn as one block).
        caps: each row's draft length this round (None: every draft step draws).
    """

    def __init__(
        self,
        generators: Sequence[torch.Generator | None],
        own: Sequence[bool],
        caps: Sequence[int] | None = None,
    ) -> None:
        self.generators = list(generators)
        self.own = list(own)
        self.caps = None if caps is None else list(caps)
        self._steps = 0  # draft steps drawn so far this round

    @property
    def rows(self) -> int:
        return len(self.generators)

    def _shared(self, columns: int, device: torch.device) -> torch.Tensor | None:
        """The block of the rows without a generator of their own, (shared rows, columns)."""
        shared = [b for b, own in enumerate(self.own) if not own]
        if not shared:
            return None
        return torch.rand(
            (len(shared), columns),
            generator=self.generators[shared[0]],
            device=device,
            dtype=torch.float64,
        )

    def _draw(self, row: int, count: int, device: torch.device) -> torch.Tensor:
        return torch.rand(
            (count,), generator=self.generators[row], device=device, dtype=torch.float64
        )

    def acceptance_uniforms(
        self, columns: int, lengths: Sequence[int] | None, device: torch.device
    ) -> torch.Tensor:
        """(B, columns) uniforms for a round's accept rule: ``columns - 1`` drafts and the
        replacement in the last column; ``lengths[b]``: drafts row b proposed (None: all)."""
        u = torch.full((self.rows, columns), FILLER, dtype=torch.float64, device=device)
        block = self._shared(columns, device)
        shared = 0
        for b, own in enumerate(self.own):
            if not own:
                assert block is not None
                u[b] = block[shared]
                shared += 1
                continue
            drafts = columns - 1 if lengths is None else min(lengths[b], columns - 1)
            drawn = self._draw(b, drafts + 1, device)
            u[b, :drafts] = drawn[:drafts]
            u[b, columns - 1] = drawn[drafts]
        return u

    def draft_uniforms(self, device: torch.device) -> torch.Tensor:
        """(B,) uniforms for one draft step of every row."""
        step, self._steps = self._steps, self._steps + 1
        u = torch.full((self.rows,), FILLER, dtype=torch.float64, device=device)
        block = self._shared(1, device)
        shared = 0
        for b, own in enumerate(self.own):
            if not own:
                assert block is not None
                u[b] = block[shared, 0]
                shared += 1
            elif self.caps is None or step < self.caps[b]:
                u[b] = self._draw(b, 1, device)[0]
        return u


def uniforms(
    source: torch.Generator | RowRandom | None,
    rows: int,
    columns: int,
    device: torch.device,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """(rows, columns) float64 uniforms for an accept rule: one block from a shared generator
    (or torch's default), or row by row (``RowRandom.acceptance_uniforms``)."""
    if isinstance(source, RowRandom):
        return source.acceptance_uniforms(columns, lengths, device)
    return torch.rand((rows, columns), generator=source, device=device, dtype=torch.float64)
