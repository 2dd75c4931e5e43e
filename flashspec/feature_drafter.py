"""FeatureDrafter: drafts from the target's own final hidden states with a features draft
(``flashspec.shared_head``, built with ``reads="features"``).

Each round, verification leaves the target's hidden state at every committed column but the
newest (``TargetModel.features``). The draft's column j reads the pair (the target's state at
column j, the token at column j + 1): a new round first reads the columns it has not read yet,
up to the newest committed token. Its final hidden state there stands for the target's state at
that token, whose head gives the first draft; the next step reads that state with the drafted
token, and so on. Its cache keeps only the columns read from the target's states: the drafted
ones, read from its own, are dropped when the round commits (EAGLE's scheme, Li et al. 2024).

Exactness does not rest on any of this: the drafts, and the distributions they were drawn from,
go to verification like any drafter's. The target must keep attention state only (a recurrent
target is refused by ``TargetModel.track_features``), and batches run in lockstep (the drafter
is not ``shiftable``); the compiled path stays off (``flashspec.compiled.policy.obstacle``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._compat import ForwardSignature, crop_cache, new_cache, select_cache_rows
from .drafters import DraftContext, Drafter, Proposal, _no_drafts, pick_draft
from .models import TargetModel
from .shared_head import draft_input, feature_hidden


class FeatureDrafter(Drafter):
    """Drafts with a features draft from the target's hidden states (see the module docstring).

    Args:
        draft: a shared-head draft that reads features (``build_shared_head_draft(...,
            reads="features")`` or ``load_shared_head_draft``), on the target's device and dtype.
        name: label for stats and errors.
        temperature: optional sampling temperature of its own (see ``Drafter.temperature``).

    Raises:
        ValueError: ``draft`` reads tokens (use ``ModelDrafter``), or a bad ``temperature``.
    """

    def __init__(
        self, draft: torch.nn.Module, name: str = "features", temperature: float | None = None
    ) -> None:
        if not isinstance(draft, torch.nn.Module) or draft_input(draft) != "features":
            raise ValueError(
                "draft: FeatureDrafter needs a shared-head draft that reads the target's hidden "
                "states (build_shared_head_draft(..., reads='features')); a draft that reads "
                "tokens drafts with ModelDrafter"
            )
        if temperature is not None and (isinstance(temperature, bool) or not temperature >= 0):
            raise ValueError(
                f"FeatureDrafter temperature must be None or >= 0, got {temperature!r}"
            )
        self.draft: Any = draft.eval()
        self._cache_arg = ForwardSignature.of(draft).cache_arg
        self.name = name
        self.temperature = temperature
        self._target: TargetModel | None = None
        self._cache: Any = None
        self._read = 0  # draft columns read from the target's states
        self._drafted = 0  # draft columns after them, read from its own (this round's)
        self._state: torch.Tensor | None = None  # its output at its newest read column

    def bind(self, target: TargetModel) -> None:
        """Check the draft fits ``target`` and have the target keep its hidden states.

        Raises:
            ValueError: another width, vocabulary or device than the target's; a target whose
                hidden states cannot be kept (``TargetModel.track_features``).
        """
        head = self.draft.lm_head
        hidden = int(head.get_buffer("rows").shape[1])
        width = int(getattr(target.config, "hidden_size", hidden) or hidden)
        if head.vocab_size != target.vocab_size or hidden != width:
            raise ValueError(
                f"drafter {self.name!r} was made for a vocabulary of {head.vocab_size} and "
                f"width {hidden}, but the target {target.name!r} has {target.vocab_size} and "
                f"{width}; train or load a draft for this target"
            )
        device = next(self.draft.parameters()).device
        if device != target.device:
            raise ValueError(
                f"drafter {self.name!r} is on {device} but the target is on {target.device}; "
                "load both on the same device"
            )
        target.track_features()
        self._target = target

    @property
    def shiftable(self) -> bool:
        """False: its columns follow the token matrix's, so batches run in lockstep."""
        return False

    def reset(self) -> None:
        """Empty the draft's cache."""
        self._cache = new_cache(self.draft)
        self._read = self._drafted = 0
        self._state = None

    def prefill(self, ctx: DraftContext) -> None:
        """Read the target's states the draft has not read yet (none before the first round)."""
        self._catch_up(ctx)

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Draft up to ``gamma`` tokens per row; none before the target has read the prompt."""
        if gamma <= 0 or not self._catch_up(ctx):
            return _no_drafts(ctx.tokens)
        state = self._state
        assert state is not None
        column = ctx.tokens.shape[1] - 1  # the draft column a step after the first reads
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for i in range(gamma):
            token, unsure = pick_draft(self.draft.lm_head(state)[:, -1], ctx, drafts, dists)
            if i + 1 == gamma or unsure:
                break
            state = self._step(state, token.unsqueeze(1), ctx, column + i)
            self._drafted += 1
        return Proposal(torch.stack(drafts, dim=1), torch.stack(dists, dim=1) if dists else None)

    def _catch_up(self, ctx: DraftContext) -> bool:
        """Drop this round's drafted columns and read the target's states up to the newest
        committed token; False when the target has not read that far."""
        target = self._target
        if target is None:
            raise RuntimeError(
                f"drafter {self.name!r} is not bound to a target: build a SpeculativeEngine "
                "with it (which calls bind)"
            )
        if self._cache is None:
            self.reset()
        self._drop_drafted()
        known = ctx.tokens.shape[1] - 1
        features = target.features
        if known < 1 or features is None or features.shape[1] < known:
            return False
        if self._read > known:
            self.reset()  # the committed tokens went back past what it read: read them again
        if self._read < known:
            start = self._read
            hidden = feature_hidden(
                self.draft,
                features[:, start:known],
                ctx.tokens[:, start + 1 : known + 1],
                **self._inputs(ctx, start, known - start),
            )
            self._read = known
            self._state = hidden[:, -1:]
        return self._state is not None

    def _step(
        self, state: torch.Tensor, token: torch.Tensor, ctx: DraftContext, column: int
    ) -> torch.Tensor:
        """Read its own ``state`` with the drafted ``token`` at draft column ``column``."""
        return feature_hidden(self.draft, state, token, **self._inputs(ctx, column, 1))

    def _inputs(self, ctx: DraftContext, start: int, length: int) -> dict[str, Any]:
        positions = ctx.padding.position_ids(start, length)
        limit = getattr(self.draft.config, "max_position_embeddings", None)
        if limit is not None:
            positions = positions.clamp_max(int(limit) - 1)  # (as CausalLM does)
        kwargs: dict[str, Any] = {
            self._cache_arg: self._cache,
            "use_cache": True,
            "position_ids": positions,
        }
        mask = ctx.padding.attention_mask(start + length)
        if mask is not None:
            kwargs["attention_mask"] = mask
        return kwargs

    def _drop_drafted(self) -> None:
        if self._drafted:
            crop_cache(self._cache, self._drafted)
            self._drafted = 0

    def commit(self, valid: int) -> None:
        """Drop the drafted columns (read from its own states, not the target's)."""
        if self._cache is None:
            return
        self._drop_drafted()
        if self._read > valid:
            self.reset()

    def select_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows from the cache."""
        if self._cache is not None and self._read + self._drafted > 0:
            select_cache_rows(self._cache, index)
        if self._state is not None:
            self._state = self._state.index_select(0, index)

    def keep_rows(self, lengths: Sequence[int]) -> None:
        """Not used: the drafter is not ``shiftable``, so the engine never calls this."""
        raise RuntimeError("FeatureDrafter runs lockstep batches only (it is not shiftable)")
