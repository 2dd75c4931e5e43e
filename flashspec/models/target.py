"""``TargetModel``: the model whose output distribution the engine reproduces. It verifies a
round's drafts (a chain, or a token tree), commits what the round accepted (a crop, or a
stateful model's restore and replay, checked on request), and keeps its final hidden states
for a drafter that reads them (``flashspec.models.features``)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..config import AUTO_DTYPE, resolve_dtype
from ..kv.compat import crop_cache, new_cache
from ..kv.state import (
    CHECK_TOLERANCE,
    Snapshot,
    UnsupportedModelError,
    crop_attention,
    has_recurrent_state,
    restore_snapshot,
    state_difference,
    take_snapshot,
    trim_conv,
)
from ..loading.pretrained import load_pretrained
from ..trees.tree import TokenTree
from .causal import CausalLM
from .features import HiddenStates
from .linear import tune_linears
from .padding import Padding


def place_model(
    model: torch.nn.Module, device: str | torch.device | None, dtype: str | torch.dtype | None
) -> torch.nn.Module:
    """Move/cast ``model`` only where a device or dtype is given."""
    if device is not None:
        model = model.to(device)
    if dtype is not None:
        model = model.to(resolve_dtype(dtype))
    return model


def _try_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None


class TargetModel(CausalLM):
    """The model whose output distribution the engine reproduces.

    Args:
        hub_id: local directory or hub id; only a label when ``model`` is given.
        device: device to load onto (or to move ``model`` to, if given).
        dtype: dtype to load with (or to cast ``model`` to, if given).
        model: an already-loaded causal LM; nothing is downloaded.
        tokenizer: the model's tokenizer (loaded from ``hub_id`` when the model is loaded by name,
            or when ``hub_id`` is a local directory).

    A float32 model on the CPU has its large linear layers tuned in place for verification's
    few-row products (``flashspec.models.linear``; ``FLASHSPEC_TUNE_LINEAR=0`` leaves them as
    they are).
    """

    def __init__(
        self,
        hub_id: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        if model is None:
            model, loaded_tokenizer = load_pretrained(
                hub_id, device or "cpu", dtype if dtype is not None else AUTO_DTYPE
            )
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            model = place_model(model, device, dtype)
            if tokenizer is None and hub_id is not None and os.path.isdir(hub_id):
                tokenizer = _try_tokenizer(hub_id)
        super().__init__(model, name=hub_id, tokenizer=tokenizer, role="target")
        tune_linears(self.model)  # verification's few-row products, in the faster form here
        self._hidden = HiddenStates()

    def reset(self) -> None:
        """Start a new generation: empty cache (and no hidden states kept)."""
        super().reset()
        self._hidden.reset()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (and their hidden states)."""
        super().select_rows(index)
        self._hidden.select(index)

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """New rows join the batch (``CausalLM.add_rows``), with the hidden states of what is
        read of them now."""
        if not self._hidden.tracking:
            super().add_rows(tokens, padding)
            return
        self._hidden.clear_fresh()
        super().add_rows(tokens, padding)
        self._hidden.join(tokens, padding)

    def verify(
        self,
        tokens: torch.Tensor,
        drafts: torch.Tensor,
        padding: Padding,
        lengths: list[int] | None = None,
    ) -> torch.Tensor:
        """Score the committed tokens the cache lacks (of ``tokens`` (B, L)) plus the drafts in
        one forward. ``lengths``: drafts each row proposed (``Proposal.lengths``): in the ragged
        layout the rest are dead columns, not read (None: every draft).

        A stateful target first feeds all but the newest pending token and marks its state
        there, at a committed column the round can return to.

        Returns:
            (B, g + 1, V) logits: entry i predicts the token after draft i - 1 (entry 0 follows
            the last committed token, entry g is the bonus position).
        """
        g = drafts.shape[1]
        tails = None
        if lengths is not None and self.rows is not None and any(n < g for n in lengths):
            tails = [g - min(max(n, 0), g) for n in lengths]
        hidden = self._hidden
        if not hidden.tracking:
            return self._verify(tokens, drafts, padding, tails)
        hidden.clear_fresh()
        if self.rows is None:
            logits = self._verify(tokens, drafts, padding)
            hidden.keep_columns(tokens.shape[1] + drafts.shape[1])
            return logits
        held = self.rows.lengths or [0] * tokens.shape[0]
        counts = [tokens.shape[1] - left for left in padding.lefts]  # each row's tokens
        logits = self._verify(tokens, drafts, padding, tails)
        hidden.keep_rows(counts, held, g, tails)
        return logits

    def verify_tree(self, tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        """``feed_tree`` (the one row's pending committed tokens, then ``tree``'s nodes):
        (1, N + 1, V) logits, entry 0 after the newest committed token, entry i + 1 after node
        i. ``keep_path`` commits the accepted nodes (and their hidden states)."""
        hidden = self._hidden
        if not hidden.tracking:
            return self.feed_tree(tokens, padding, tree)
        hidden.clear_fresh()
        held = self.rows.lengths[0] if self.rows is not None and self.rows.lengths else 0
        count = tokens.shape[1] - padding.lefts[0]
        logits = self.feed_tree(tokens, padding, tree)
        states = hidden.take_fresh()
        assert states is not None
        hidden.tree = (states, count - min(held, count))
        return logits

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``verify_tree``: keep the nodes ``path``'s columns, and their hidden states
        after the row's committed ones."""
        super().keep_path(path)
        if self._hidden.tree is not None:
            assert self.rows is not None
            self._hidden.keep_path(path, self.rows.lengths[0])

    def _verify(
        self,
        tokens: torch.Tensor,
        drafts: torch.Tensor,
        padding: Padding,
        tails: list[int] | None = None,
    ) -> torch.Tensor:
        if self.rows is not None:
            return self.feed(tokens, padding, drafts, keep=drafts.shape[1] + 1, tails=tails)
        pending = tokens[:, self.cached :]
        if self.support.stateful:
            if pending.shape[1] > 1:
                self.forward(pending[:, :-1], padding, keep=1)
                pending = pending[:, -1:]
            self.mark()
        tokens = torch.cat([pending, drafts], dim=1) if drafts.shape[1] else pending
        return self.forward(tokens, padding, keep=drafts.shape[1] + 1)

    # Hidden states for drafters that read them (``flashspec.drafters.features``).

    @property
    def tracks_features(self) -> bool:
        """Whether verification keeps the target's final hidden states (``track_features``)."""
        return self._hidden.tracking

    def track_features(self) -> None:
        """From now on keep the final hidden state (what the LM head reads) at every column
        verification reads: ``features`` after a round holds it for every committed column but
        the newest, the columns whose inputs were all committed tokens.

        Raises:
            UnsupportedModelError: the target keeps recurrent state, or its final norm cannot
                be found (the message names the model class).
        """
        if self._hidden.tracking:
            return
        if self.support.stateful:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} keeps recurrent state; a drafter that reads the "
                "target's hidden states works with attention-only targets. Use a ModelDrafter "
                "or prompt lookup with this target"
            )
        self._hidden.track(self.model)

    def untrack_features(self) -> None:
        """Stop keeping hidden states (``track_features`` undone; the model's hook removed)."""
        self._hidden.untrack()

    def feature_counts(self, padding: Padding) -> list[int] | None:
        """How many of each row's first tokens have their hidden state kept (at least all its
        committed tokens but the newest after a round), or None before any."""
        return self._hidden.counts(padding, ragged=self.rows is not None)

    def gather_features(self, index: torch.Tensor, padding: Padding) -> torch.Tensor:
        """(B, n, hidden): row b's hidden states at its token indices ``index[b]`` (B, n) (a
        row's first token has index 0; indices past ``feature_counts`` are not its states)."""
        states = self._hidden.gather(index, padding, ragged=self.rows is not None)
        if states is None:
            raise RuntimeError(f"{self.name}: no hidden states kept yet (track_features)")
        return states

    # Committing a round.

    def commit(self, tokens: torch.Tensor, padding: Padding) -> None:
        """After a round, hold every committed token of ``tokens`` (B, L) but the newest.

        Ragged layout (``shiftable``): each row keeps its own count (``keep_rows``).

        Attention: a crop. Stateful, fully accepted (``keep``): the verify forward fed exactly
        those columns, so its state stays. Otherwise the state marked before the forward is
        restored and the committed columns after it are fed again. ``state_mode`` ``replay``
        always does the latter; ``check`` also replays one token at a time from the mark and
        raises if that state differs from the one kept.

        Raises:
            RuntimeError: in ``check`` mode, a kept state that is not the replayed one.
        """
        valid = tokens.shape[1] - 1
        if self.rows is not None:
            self.keep_rows([valid - left for left in padding.lefts])
            return
        mark = next(iter(self._marks.values()), None)  # verify marks once per round
        if mark is None or not self.support.stateful:
            self.rollback(valid)
            return
        replay = self.state_mode == "replay" or (
            self.cached > valid and has_recurrent_state(self.cache)
        )
        if replay:
            self._replay(tokens, padding, mark, step=False, copy=self.state_mode == "check")
        elif self.cached > valid:
            crop_cache(self.cache, self.cached - valid)  # conv-only state crops exactly
            self.cached = valid
        if self.state_mode == "check":
            kept = take_snapshot(self.cache, self.cached)
            self._replay(tokens, padding, mark, step=True, copy=False)
            difference = state_difference(self.cache, kept)
            if difference > CHECK_TOLERANCE:
                raise RuntimeError(
                    f"{self.name}: the state kept after a round differs from a token-by-token "
                    f"replay of the committed tokens by {difference:.3g} (relative; tolerance "
                    f"{CHECK_TOLERANCE}); flashspec's rollback of this model is wrong, please "
                    "report it"
                )
        self._marks.clear()
        crop_attention(self.cache, 0)
        trim_conv(self.cache)

    def _replay(
        self, tokens: torch.Tensor, padding: Padding, mark: Snapshot, *, step: bool, copy: bool
    ) -> None:
        """Restore ``mark`` and feed the committed columns after it (one forward, or one per
        token with ``step``), up to all but the newest."""
        start = time.perf_counter()
        valid = tokens.shape[1] - 1
        if mark.empty:
            self.cache = new_cache(self.model)
        else:
            restore_snapshot(self.cache, mark, self.cached, copy=copy)
        self.cached = mark.columns
        chunk = 1 if step else valid - mark.columns
        for begin in range(mark.columns, valid, max(chunk, 1)):
            self.forward(tokens[:, begin : begin + chunk], padding, keep=1)
        if not step:
            self.replays += 1
            self.replayed_tokens += valid - mark.columns
            self.replay_seconds += time.perf_counter() - start
