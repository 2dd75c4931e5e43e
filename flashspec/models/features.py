"""The target's final hidden states, kept for a drafter that reads them (EAGLE's features,
``flashspec.drafters.features``): ``HiddenStates``, the buffer ``TargetModel`` fills at every
column verification reads, and ``final_norm``, the module whose output they are.

States are kept by column of the token matrix (column-aligned caches) or, in a cache whose rows
keep their own columns, by each row's own token index, which stays put when the rows' layout in
the token matrix moves.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..kv.state import UnsupportedModelError
from .padding import Padding

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
"""Where HuggingFace decoders keep the norm whose output their LM head reads."""


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output ``model``'s LM head reads (its decoder's final norm).

    Raises:
        UnsupportedModelError: none of ``FINAL_NORM_NAMES`` on the decoder.
    """
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if callable(getter) else getattr(model, "model", model)
    for name in FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise UnsupportedModelError(
        f"{type(model).__name__}: no final norm found on its decoder (looked for "
        f"{', '.join(FINAL_NORM_NAMES)}), so its hidden states cannot be read for a features "
        "draft; use a ModelDrafter or prompt lookup with this target"
    )


class HiddenStates:
    """The states a hook on the final norm records (``track``), and the buffer they are kept
    in: (B, capacity, d), row b's first states ``counts`` of them."""

    def __init__(self) -> None:
        self.hook: Any = None
        self._fresh: list[torch.Tensor] = []
        self.buffer: torch.Tensor | None = None
        self._columns = 0  # column-aligned: columns written
        self._lengths: list[int] = []  # by row: states written per row
        self.tree: tuple[torch.Tensor, int] | None = None  # verify_tree's, pending

    @property
    def tracking(self) -> bool:
        """Whether the hook is on (``track``)."""
        return self.hook is not None

    def track(self, model: torch.nn.Module) -> None:
        """Record the final norm's output at every forward of ``model`` from now on.

        Raises:
            UnsupportedModelError: no final norm found (``final_norm``).
        """
        # The hook holds these states weakly and goes with them: a model outlives the engines
        # built on it, and a hook left behind would keep recording (and change what
        # ``torch.compile`` traces) for engines that read no states.
        record = weakref.WeakMethod(self._record)

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            method = record()
            if method is not None:
                method(module, args, output)

        self.hook = final_norm(model).register_forward_hook(hook)
        weakref.finalize(self, self.hook.remove)

    def untrack(self) -> None:
        """Take the hook off the model (no states recorded from now on)."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        self.reset()

    def _record(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._fresh.append(output if isinstance(output, torch.Tensor) else output[0])

    def clear_fresh(self) -> None:
        """Forget states recorded but not kept (a forward whose states are not wanted)."""
        self._fresh.clear()

    def take_fresh(self) -> torch.Tensor | None:
        """(B, n, d): the states recorded since the last take, in column order, or None."""
        fresh, self._fresh = self._fresh, []
        if not fresh:
            return None
        return fresh[0] if len(fresh) == 1 else torch.cat(fresh, dim=1)

    def reset(self) -> None:
        """No states kept (a new generation)."""
        self.buffer = None
        self._columns = 0
        self._lengths = []
        self._fresh.clear()

    def _buffer_for(self, hidden: torch.Tensor, end: int) -> torch.Tensor:
        """The buffer, with room for ``end`` states per row of ``hidden``'s batch."""
        buffer = self.buffer
        if buffer is None or buffer.shape[0] != hidden.shape[0]:
            buffer = hidden.new_zeros((hidden.shape[0], max(2 * end, 64), hidden.shape[2]))
        self.buffer = buffer = _grown(buffer, end)
        return buffer

    def keep_columns(self, end: int) -> None:
        """Column-aligned: verification's forwards read the last columns up to ``end`` (of the
        committed tokens followed by the drafts); write their states there."""
        hidden = self.take_fresh()
        assert hidden is not None
        buffer = self._buffer_for(hidden, end)
        buffer[:, end - hidden.shape[1] : end] = hidden
        self._columns = end

    def keep_rows(
        self, counts: list[int], held: list[int], drafts: int, tails: list[int] | None = None
    ) -> None:
        """Rows with their own columns: row b held ``held[b]`` of its ``counts[b]`` tokens, so
        the forward read its tokens from there on, then its drafts, which end ``tails[b]``
        columns before the rectangle's right end (``CausalLM.feed``)."""
        hidden = self.take_fresh()
        assert hidden is not None
        tails = tails or [0] * len(counts)
        ends = [n + drafts - t for n, t in zip(counts, tails, strict=True)]
        buffer = self._buffer_for(hidden, max(ends))
        width = hidden.shape[1]
        for row, (n, h, end, t) in enumerate(zip(counts, held, ends, tails, strict=True)):
            read = end - min(h, n)
            buffer[row, end - read : end] = hidden[row, width - t - read : width - t]
        self._lengths = ends

    def keep_path(self, path: Sequence[int], end: int) -> None:
        """After a tree's forward (``tree``): keep the states of the row's pending committed
        tokens and of the nodes ``path``, ending at its token ``end``."""
        kept, self.tree = self.tree, None
        if kept is None:
            return
        hidden, pending = kept  # (1, pending + N, d): the pending committed tokens, the nodes
        columns = [*range(pending), *(pending + i for i in path)]
        chosen = hidden[:, torch.tensor(columns, device=hidden.device)]
        buffer = self._buffer_for(hidden, end)
        buffer[:, end - len(columns) : end] = chosen
        self._lengths = [end]

    def counts(self, padding: Padding, ragged: bool) -> list[int] | None:
        """How many of each row's first tokens have their state kept, or None before any."""
        if self.buffer is None:
            return None
        if not ragged:
            return [self._columns - left for left in padding.lefts]
        return list(self._lengths)

    def gather(self, index: torch.Tensor, padding: Padding, ragged: bool) -> torch.Tensor | None:
        """(B, n, d): row b's states at its token indices ``index[b]`` (B, n), or None before
        any is kept."""
        buffer = self.buffer
        if buffer is None:
            return None
        if not ragged:
            index = index + torch.tensor(padding.lefts, device=index.device).unsqueeze(1)
        index = index.clamp(0, buffer.shape[1] - 1)
        return buffer.gather(1, index.unsqueeze(-1).expand(-1, -1, buffer.shape[2]))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows in ``index``."""
        if self.buffer is not None:
            self.buffer = self.buffer.index_select(0, index)
            if self._lengths:
                self._lengths = [self._lengths[i] for i in index.tolist()]

    def join(self, tokens: torch.Tensor, padding: Padding) -> None:
        """Rows (``tokens`` (n, L), laid out by ``padding``) joined the batch, and the forward
        just recorded read all but each one's newest token (nothing, when the cache was
        empty): keep those states after the others' rows."""
        rows, width = tokens.shape[0], tokens.shape[1] - 1
        hidden = self.take_fresh()
        if self.buffer is None:
            return  # nothing kept yet: the next verification reads every row
        buffer = self.buffer
        lengths = [0] * rows
        joined = buffer.new_zeros((rows, 0, buffer.shape[2]))
        if hidden is not None:
            lengths = [max(width - left, 0) for left in padding.lefts]
            joined = buffer.new_zeros((rows, max(lengths), buffer.shape[2]))
            for row, n in enumerate(lengths):
                joined[row, :n] = hidden[row, hidden.shape[1] - n :]
        buffer = _grown(buffer, joined.shape[1])
        room = buffer.new_zeros((rows, buffer.shape[1], buffer.shape[2]))
        room[:, : joined.shape[1]] = joined[:, : buffer.shape[1]]
        self.buffer = torch.cat([buffer, room])
        self._lengths = [*self._lengths, *lengths]


def _grown(buffer: torch.Tensor, end: int) -> torch.Tensor:
    """``buffer`` with room for ``end`` states per row; it doubles, so that a long generation
    copies its states a logarithmic number of times."""
    if buffer.shape[1] >= end:
        return buffer
    grown = buffer.new_zeros((buffer.shape[0], max(2 * end, 64), buffer.shape[2]))
    grown[:, : buffer.shape[1]] = buffer
    return grown
