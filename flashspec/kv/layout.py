"""Which cache columns hold which row's tokens, for the ragged batches of ``SpeculativeEngine``.

In a ragged round every row commits its own number of tokens. Moving each row's keys and values
so that the rows line up again would copy the whole cache every round, on top of the copy each
``DynamicCache`` update already makes. Instead the cache keeps its columns where they
are and records, per row, which of them hold the row's tokens (``RowLayout.alive``): the
columns of a row's rejected drafts stay in place as dead slots, hidden by the attention mask.
Positions are passed explicitly (a row's k-th token has position k whatever its column), so
keys keep the rotary phases they were computed with, and causality by column still holds,
since a row's tokens are in column order. A forward feeds every row's uncached tokens in one
rectangle: a row with fewer to feed gets dead columns in front of them.

Dead slots grow with the rounds; when every row has enough of them (``COMPACT_COLUMNS``), the
cache is packed once, each row's live columns moved to the right end (``compaction``), so memory
stays proportional to the longest row. Trailing columns dead in every row (a batch of one, or a
round every row rejected at the same draft) are cropped at once.

Only caches made entirely of plain ``DynamicLayer`` layers can do this (``shiftable``): a
sliding-window layer counts its window in columns, dead ones included, and drops old columns
itself; recurrent state has no columns at all. Nor can a model that windows its attention
without telling its cache (``column_window``: GPT-Neo's local layers mask by column distance
inside the module, over a plain cache): with dead columns inside a row, a window of w columns
covers fewer than w of the row's tokens, and the row's logits differ from its own. Such models
keep column-aligned lockstep batches, where a row's tokens are contiguous columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

COMPACT_COLUMNS = 16
"""Dead columns beyond the longest row at which a cache is packed (one copy of every layer)."""


def shiftable(cache: Any) -> bool:
    """Whether every layer of ``cache`` is a plain ``DynamicLayer`` or a ``StoreLayer`` (see
    the module docstring)."""
    from .store import plain_layer_types

    layers = getattr(cache, "layers", None)
    if layers is None:
        return False
    plain = plain_layer_types()
    return all(type(layer) in plain for layer in layers)


_FULL_LAYER_TYPES = frozenset({"full_attention", "global"})


def column_window(config: Any) -> str | None:
    """Why a model with ``config`` (its text config) limits attention to a window of columns,
    or None when every layer attends to all earlier columns.

    Read from the config, not the cache: GPT-Neo's local layers (``attention_layers``) window
    inside the module over a plain ``DynamicLayer``, and a release whose ``DynamicCache`` takes
    no config builds plain layers for sliding-window models too.
    """
    local = [kind for kind in getattr(config, "attention_layers", None) or () if kind != "global"]
    if local:
        return f"{local[0]} attention layers (window_size {getattr(config, 'window_size', '?')})"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        # Layer kinds named by the config decide (some configs keep a sliding_window value that
        # no layer uses); stateful kinds ("linear_attention", "mamba"...) are not windows.
        windowed = [
            kind
            for kind in layer_types
            if isinstance(kind, str)
            and kind not in _FULL_LAYER_TYPES
            and any(word in kind for word in ("sliding", "local", "chunk", "window"))
        ]
        return f"{windowed[0]} layers" if windowed else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    for name in ("sliding_window", "attention_chunk_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"{name} {value}"
    return None


def _filled(layer: Any) -> bool:
    keys = getattr(layer, "keys", None)
    return bool(getattr(layer, "is_initialized", False)) and keys is not None and keys.dim() == 4


class RowLayout:
    """Per row of a cache: which columns are its tokens (``alive``) and how many (``lengths``).

    The cache's width (its columns) is ``width``; ``lengths[b]`` of row b's columns are alive,
    in order: its first ``lengths[b]`` tokens.
    """

    def __init__(self) -> None:
        self.alive: torch.Tensor | None = None  # (B, width) bool, None before the first feed
        self.lengths: list[int] = []
        self.width = 0

    @property
    def dense(self) -> bool:
        """No dead column anywhere: the model may run without a mask."""
        return all(n == self.width for n in self.lengths)

    def start(self, rows: int, device: torch.device) -> None:
        """An empty layout of ``rows`` rows."""
        self.alive = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        self.lengths = [0] * rows
        self.width = 0

    def plan(
        self,
        dead: Sequence[int],
        count: int,
        device: torch.device,
        tails: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For a forward of ``count`` new columns of which the first ``dead[b]`` and the last
        ``tails[b]`` (drafts row b did not make) are dead in row b: ``(positions, new alive
        columns, attention mask or None)``."""
        assert self.alive is not None
        columns = torch.arange(count, device=device).unsqueeze(0)
        base = torch.tensor(self.lengths, device=device).unsqueeze(1)
        trailing = tails is not None and any(tails)
        if not any(dead) and not trailing and self.dense:
            # Every row reads all the new columns after all of its own (a batch of one's
            # every round): what the general case below computes, in fewer calls.
            new = torch.ones((len(self.lengths), count), dtype=torch.bool, device=device)
            return base + columns, new, None
        lead = torch.tensor(list(dead), device=device).unsqueeze(1)
        new = columns >= lead
        if trailing and tails is not None:
            new &= columns < count - torch.tensor(list(tails), device=device).unsqueeze(1)
        positions = (base + columns - lead).clamp_min(0)
        mask = None
        if any(dead) or trailing or not self.dense:
            mask = torch.cat([self.alive, new], dim=1).to(torch.int64)
        return positions, new, mask

    def append(self, new: torch.Tensor, added: Sequence[int]) -> None:
        """Record a forward's columns (``plan``'s alive columns) and each row's new tokens."""
        assert self.alive is not None
        self.alive = torch.cat([self.alive, new], dim=1)
        self.lengths = [n + a for n, a in zip(self.lengths, added, strict=True)]
        self.width += int(new.shape[1])

    def keep(self, counts: Sequence[int]) -> int:
        """Row b keeps its first ``counts[b]`` tokens (at most what it has); returns how many
        trailing columns are now dead in every row (the caller crops them)."""
        assert self.alive is not None
        kept = [min(c, n) for c, n in zip(counts, self.lengths, strict=True)]
        if kept == self.lengths:
            return self._trailing()
        limit = torch.tensor(kept, device=self.alive.device).unsqueeze(1)
        self.alive &= self.alive.to(torch.int32).cumsum(dim=1) <= limit
        self.lengths = kept
        return self._trailing()

    def select(self, index: torch.Tensor, positions: Sequence[int]) -> int:
        """Keep the rows ``index`` (host copy: ``positions``); returns the trailing columns now
        dead in every row."""
        assert self.alive is not None
        self.alive = self.alive.index_select(0, index)
        self.lengths = [self.lengths[p] for p in positions]
        return self._trailing()

    def crop(self, count: int) -> None:
        """The cache dropped its last ``count`` columns."""
        assert self.alive is not None
        if count > 0:
            self.width -= count
            self.alive = self.alive[:, : self.width]

    def _trailing(self) -> int:
        assert self.alive is not None
        if self.width == 0 or not self.lengths:
            return self.width
        if self.dense:
            return 0
        columns = torch.arange(1, self.width + 1, device=self.alive.device)
        end = int((self.alive * columns).amax())
        return self.width - end

    def compaction(self) -> tuple[torch.Tensor, int] | None:
        """When every row has ``COMPACT_COLUMNS`` dead columns or more: the source column of
        each packed column (B, width'), and width' (the longest row), else None. Each row's
        live columns are moved, in order, to the right end; the rest of the row is dead."""
        assert self.alive is not None
        longest = max(self.lengths, default=0)
        if self.width - longest < COMPACT_COLUMNS:
            return None
        rows = len(self.lengths)
        device = self.alive.device
        rank = self.alive.to(torch.int64).cumsum(dim=1) - 1
        start = longest - torch.tensor(self.lengths, device=device).unsqueeze(1)
        # Dead columns go to a spare last column, dropped afterwards.
        destination = torch.where(self.alive, start + rank, longest)
        source = torch.zeros((rows, longest + 1), dtype=torch.int64, device=device)
        columns = torch.arange(self.width, device=device).expand(rows, -1)
        source.scatter_(1, destination, columns)
        self.alive = torch.arange(longest, device=device).unsqueeze(0) >= start
        self.width = longest
        return source[:, :longest], longest

    def pad(self, count: int) -> None:
        """``count`` dead columns put before the first."""
        assert self.alive is not None
        if count > 0:
            filler = self.alive.new_zeros((self.alive.shape[0], count))
            self.alive = torch.cat([filler, self.alive], dim=1)
            self.width += count

    def extend(self, other: RowLayout) -> None:
        """Append ``other``'s rows (of the same width)."""
        assert self.alive is not None and other.alive is not None
        self.alive = torch.cat([self.alive, other.alive], dim=0)
        self.lengths = [*self.lengths, *other.lengths]


def gather_columns(cache: Any, source: torch.Tensor) -> None:
    """Every layer's row b becomes its columns ``source[b]`` (B, width'), in that order."""
    rows, width = source.shape
    for layer in cache.layers:
        if not _filled(layer):
            continue
        old = layer.keys.shape[-2]
        flat = (source + torch.arange(rows, device=source.device).unsqueeze(1) * old).view(-1)
        layer.keys = _take(layer.keys, flat, rows, width)
        layer.values = _take(layer.values, flat, rows, width)


def _take(x: torch.Tensor, flat: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    # One index_select over (row, column) pairs: several times faster here than gather with an
    # index expanded over heads and head dimension.
    batch, heads, columns, dim = x.shape
    pairs = x.transpose(1, 2).reshape(batch * columns, heads * dim)
    taken = pairs.index_select(0, flat).view(rows, width, heads, dim)
    return taken.transpose(1, 2).contiguous()


def move_columns(cache: Any, sources: Sequence[int], start: int) -> None:
    """Every layer's columns ``sources`` (ascending, none before ``start``) are copied, in
    order, to the columns from ``start`` on (a token tree's accepted path moved next to the
    committed columns; the columns after them are then cropped)."""
    if list(sources) == list(range(start, start + len(sources))):
        return
    for layer in cache.layers:
        if _filled(layer):
            index = torch.tensor(list(sources), device=layer.keys.device)
            end = start + len(sources)
            # index_select copies first, so overlapping source and target columns are safe.
            layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
            layer.values[:, :, start:end] = layer.values.index_select(2, index)


def pad_columns(cache: Any, count: int) -> None:
    """Put ``count`` columns (zeros, dead in every row) before the first of every layer."""
    if count <= 0:
        return
    for layer in cache.layers:
        if _filled(layer):
            layer.keys = _pad(layer.keys, count)
            layer.values = _pad(layer.values, count)


def _pad(x: torch.Tensor, count: int) -> torch.Tensor:
    filler = x.new_zeros((*x.shape[:2], count, x.shape[-1]))
    return torch.cat([filler, x], dim=2)


def append_rows(cache: Any, other: Any) -> None:
    """Append ``other``'s rows after ``cache``'s, layer by layer (both hold the same columns)."""
    for layer, extra in zip(cache.layers, other.layers, strict=True):
        if _filled(layer) and _filled(extra):
            layer.keys = torch.cat([layer.keys, extra.keys], dim=0)
            layer.values = torch.cat([layer.values, extra.values], dim=0)
        elif _filled(layer) != _filled(extra):
            raise RuntimeError("append_rows: one cache has a layer the other has not filled")


def append_zero_rows(cache: Any, count: int) -> None:
    """Append ``count`` rows of zeros (dead columns) to every layer."""
    for layer in cache.layers:
        if _filled(layer):
            layer.keys = torch.cat([layer.keys, _zeros_like_rows(layer.keys, count)], dim=0)
            layer.values = torch.cat([layer.values, _zeros_like_rows(layer.values, count)], dim=0)


def _zeros_like_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    return x.new_zeros((count, *x.shape[1:]))
