"""``RowCache``: a KV cache whose rows keep their own columns, and every operation on it.

The target and the model drafters (through ``CausalLM``) and the features draft
(``FeatureDrafter``) all keep ragged batches this way (``flashspec.kv.layout``): one object, so
that the planning of a forward, the crop of trailing dead columns and the compaction are
written once. The caller runs its own model: ``forward`` plans the new columns' positions and
mask, hands them to the caller's call, and records the columns the call added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .compat import crop_cache
from .layout import (
    RowLayout,
    append_rows,
    append_zero_rows,
    gather_columns,
    move_columns,
    pad_columns,
)
from .slots import gather_slot_columns, select_slots, shift_slot_columns, write_slot_rows
from .state import select_attention_rows

T = TypeVar("T")

Call = Callable[[torch.Tensor, "torch.Tensor | None"], T]
"""A forward of the new columns, given their positions (B, n) and the attention mask
(B, width + n), or None when every column is alive in every row."""


class RowCache:
    """A cache (``cache``) and which of its columns are each row's tokens (``rows``).

    Args:
        fresh: makes an empty cache of the model's (``flashspec.kv.compat.new_cache``).
        limit: positions the model has (``max_position_embeddings``), or None.

    Attributes:
        cache: the model's cache object.
        rows: its layout (``RowLayout``); not started until the first forward.
        static: the cache is a static one (the compiled path): kept even when it holds no
            column, where a dynamic one is replaced by a fresh cache.
        slots: a static cache's rows (``flashspec.kv.slots``): the batch's rows sit in its
            first slots and every move of keys and values writes into its buffers; 0 for a
            dynamic cache.
    """

    def __init__(self, fresh: Callable[[], Any], limit: int | None = None) -> None:
        self.fresh = fresh
        self.limit = limit
        self.cache: Any = None
        self.rows = RowLayout()
        self.static = False
        self.slots = 0

    @property
    def width(self) -> int:
        """Columns the cache holds (dead ones included)."""
        return self.rows.width

    @property
    def started(self) -> bool:
        """Whether a forward (or ``start``) has laid the rows out."""
        return self.rows.alive is not None

    def reset(self, cache: Any = None) -> None:
        """Empty: ``cache`` (a fresh one if None), no rows laid out yet."""
        self.cache = self.fresh() if cache is None else cache
        self.rows = RowLayout()
        self.static = False
        self.slots = 0

    def start(self, batch: int, device: torch.device) -> None:
        """Lay out ``batch`` empty rows."""
        self.rows.start(batch, device)

    def forward(
        self,
        call: Call[T],
        count: int,
        dead: Sequence[int],
        device: torch.device,
        tails: Sequence[int] | None = None,
    ) -> T:
        """``call`` a forward of ``count`` new columns, the first ``dead[b]`` and last
        ``tails[b]`` of them dead in row b (the rest its next tokens), and record them."""
        rows = self.rows
        if rows.width == 0 and not self.static:
            # No empty layer tensor of an earlier batch size may meet this batch's rows.
            self.cache = self.fresh()
        positions, alive, mask = rows.plan(dead, count, device, tails)
        if self.limit is not None:
            # A row nearer its limit than the row a round is sized for gets columns past it;
            # they are never emitted for it, and clamped they index no missing position.
            positions = positions.clamp_max(self.limit - 1)
        result = call(positions, mask)
        ends = tails or [0] * len(dead)
        rows.append(alive, [count - d - t for d, t in zip(dead, ends, strict=True)])
        return result

    def crop(self, count: int) -> None:
        """Drop the last ``count`` columns (of every row)."""
        if count <= 0:
            return
        crop_cache(self.cache, count)
        self.rows.crop(count)
        if self.rows.width == 0 and not self.static:
            # The layers' empty tensors keep the old batch size, which a later change of rows
            # would not update (nothing to select or append).
            self.cache = self.fresh()

    def drop(self, count: int) -> None:
        """Drop the last ``count`` columns, alive in every row (a round's drafts)."""
        if count > 0:
            self.crop(count)
            self.rows.lengths = [n - count for n in self.rows.lengths]

    def truncate(self, width: int) -> None:
        """Keep the first ``width`` columns; each row keeps its tokens among them."""
        count = self.rows.width - width
        if count > 0 and self.started:
            self.crop(count)
            assert self.rows.alive is not None
            self.rows.lengths = self.rows.alive.sum(dim=1).tolist()

    def compact(self) -> None:
        """Pack the rows once enough columns are dead in every row (``RowLayout.compaction``)."""
        plan = self.rows.compaction() if self.started else None
        if plan is not None:
            if self.static:
                gather_slot_columns(self.cache, plan[0])
            else:
                gather_columns(self.cache, plan[0])

    def keep(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` tokens (at most what it holds)."""
        self.crop(self.rows.keep(lengths))
        self.compact()

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows in ``index`` (in that order)."""
        if self.rows.width:
            if self.static:
                select_slots(self.cache, index)
            else:
                select_attention_rows(self.cache, index)
        self.crop(self.rows.select(index, index.tolist()))
        self.compact()

    def add_empty(self, count: int, device: torch.device) -> None:
        """``count`` rows join that hold no column yet (dead in every column there is)."""
        width = self.rows.width
        if width == 0 and not self.static:
            self.cache = self.fresh()  # no tensor of the old batch size stays
        joined = RowLayout()
        joined.start(count, device)
        joined.pad(width)
        if width and not self.static:
            append_zero_rows(self.cache, count)  # (a static cache's spare slots are the rows)
        self.rows.extend(joined)

    def join(self, other: RowCache) -> None:
        """Append ``other``'s rows (a cache of the same model, that read the joining rows):
        both are padded in front to the wider one's columns."""
        width = max(self.width, other.width)
        if self.static:
            rows = len(self.rows.lengths) if self.started else 0
            shift_slot_columns(self.cache, rows, self.width, width - self.width)
            write_slot_rows(self.cache, other.cache, rows, width)
            for part in (self, other):
                part.rows.pad(width - part.width)
            self.rows.extend(other.rows)
            return
        for part in (self, other):
            pad_columns(part.cache, width - part.width)
            part.rows.pad(width - part.width)
        append_rows(self.cache, other.cache)
        self.rows.extend(other.rows)

    def keep_path(self, start: int, nodes: int, path: Sequence[int]) -> None:
        """A batch of one read a token tree's ``nodes`` nodes from column ``start`` on: keep the
        columns of the nodes ``path`` (depth 1 first), moved next to the columns before them;
        the other nodes' columns are cut."""
        alive = self.rows.alive
        assert alive is not None
        move_columns(self.cache, [start + i for i in path], start)
        end = start + len(path)
        alive[0, end:] = False
        self.rows.lengths = [self.rows.lengths[0] - nodes + len(path)]
        self.crop(self.rows.width - end)
