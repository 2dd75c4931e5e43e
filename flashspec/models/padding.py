"""``Padding``: where each row's real tokens start in a left-padded batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Padding:
    """Left padding of a batch: where each row's real tokens start.

    Row b's token in column j sits at position ``j - left[b]``; columns before ``left[b]`` are
    padding, masked out and given position 0 (as HF ``generate`` does).
    """

    def __init__(self, left: torch.Tensor) -> None:
        self.left = left
        # Read once per batch layout: rounds size themselves per row from these on the host.
        self.lefts: list[int] = [int(v) for v in left.tolist()]
        self.max_left = max(self.lefts, default=0)
        self.min_left = min(self.lefts, default=0)
        # Without padding the models can take their faster unmasked causal path.
        self.any = self.max_left > 0

    def position_ids(self, start: int, length: int) -> torch.Tensor:
        """(B, length) positions of columns ``start .. start + length - 1``."""
        columns = torch.arange(start, start + length, device=self.left.device)
        if not self.any:
            return columns.unsqueeze(0).expand(self.left.shape[0], -1)
        return (columns.unsqueeze(0) - self.left.unsqueeze(1)).clamp_min(0)

    def attention_mask(self, total: int) -> torch.Tensor | None:
        """(B, total) mask of columns ``0 .. total - 1``, or None when no row is padded."""
        if not self.any:
            return None
        columns = torch.arange(total, device=self.left.device)
        return (columns.unsqueeze(0) >= self.left.unsqueeze(1)).to(torch.int64)

    def select(self, index: torch.Tensor) -> Padding:
        """The layout of the rows in ``index``."""
        return Padding(self.left.index_select(0, index))

    def shifted(self, shifts: Sequence[int]) -> Padding:
        """The layout after row b moved ``shifts[b]`` columns to the right."""
        return Padding(self.left + torch.tensor(list(shifts), device=self.left.device))

    def dropped(self, count: int) -> Padding:
        """The layout after the first ``count`` columns (padding in every row) were removed."""
        return Padding(self.left - count)

    @staticmethod
    def stack(layouts: Sequence[Padding]) -> Padding:
        """The rows of ``layouts``, one after another."""
        return Padding(torch.cat([layout.left for layout in layouts]))
