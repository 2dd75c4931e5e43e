"""FeatureDrafter: drafts from the target's own final hidden states with a features draft
(``flashspec.drafters.shared_head``, built with ``reads="features"``).

Each round, verification leaves the target's hidden state at each row's every committed token
but the newest (``TargetModel.gather_features``). The draft's column k of a row reads the pair
(the target's state at the row's token k, its token k + 1): a new round first reads the
columns it has not read yet, up to the newest committed token. Its final hidden state there
stands for the target's state at that token, whose head gives the first draft; the next step
reads that state with the drafted token, and so on. Its cache keeps only the columns read from
the target's states: the drafted ones, read from its own, are dropped when the round commits
(EAGLE's scheme, Li et al. 2024).

The draft's cache keeps each row's columns apart (``flashspec.kv.cache.RowCache``, as a
shiftable ``CausalLM`` does), so rows commit their own counts and join a running batch (ragged
batches, the server's continuous batching); lockstep batches are the case where every row
commits the same count.

Exactness does not rest on any of this: the drafts, and the distributions they were drawn from,
go to verification like any drafter's. The target must keep attention state only (a recurrent
target is refused by ``TargetModel.track_features``); the compiled path stays off
(``flashspec.compiled.policy.obstacle``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..kv.cache import RowCache
from ..kv.compat import ForwardSignature, new_cache
from ..kv.layout import RowLayout, shiftable
from ..models import Padding, TargetModel
from ..trees.tree import ROOT, TokenTree, TreeBuilder, TreeShape
from .base import DraftContext, Drafter, Proposal, no_drafts, tree_depth
from .model import RowStops, pick_draft
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
        limit = getattr(draft.config, "max_position_embeddings", None)
        # Per row: its columns read from the target's states, ...
        self._kv = RowCache(self._new_cache, None if limit is None else int(limit))
        self._drafted = 0  # ... then this round's drafted columns in every row, read from its own
        self._state: torch.Tensor | None = None  # (B, 1, d) its output at each row's newest read

    def bind(self, target: TargetModel) -> None:
        """Check the draft fits ``target`` and have the target keep its hidden states.

        Raises:
            ValueError: another width, vocabulary or device than the target's; a target whose
                hidden states cannot be kept (``TargetModel.track_features``).
        """
        head = self.draft.lm_head
        hidden = int(head.hidden)
        width = int(getattr(target.config, "hidden_size", hidden) or hidden)
        if head.vocab_size != target.vocab_size or hidden != width:
            raise ValueError(
                f"drafter {self.name!r} was made for a vocabulary of {head.vocab_size} and "
                f"width {hidden}, but the target {target.name!r} has {target.vocab_size} and "
                f"{width}; train or load a draft for this target"
            )
        if not shiftable(new_cache(self.draft)):
            raise ValueError(
                f"drafter {self.name!r}: the draft's cache is not a plain attention cache "
                "(sliding-window or recurrent layers); build it with build_shared_head_draft"
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
        """True: rows keep their own columns, so batches can be ragged."""
        return True

    def reset(self) -> None:
        """Empty the draft's cache."""
        self._kv.reset()
        self._drafted = 0
        self._state = None

    def begin(self, ctx: DraftContext) -> None:
        """Read the target's states the draft has not read yet (none before the first round)."""
        self._catch_up(ctx)

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Draft up to ``gamma`` tokens per row; none before the target has read every row's
        prompt."""
        if gamma <= 0 or not self._catch_up(ctx):
            return no_drafts(ctx.tokens)
        state = self._state
        assert state is not None
        every = [0] * ctx.tokens.shape[0]
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        stops = RowStops(ctx, gamma)
        while True:
            token, unsure = pick_draft(self.draft.lm_head(state)[:, -1], ctx, drafts, dists)
            if not stops.more(unsure):
                return stops.proposal(drafts, dists)
            state = self._read_columns(state, token.unsqueeze(1), every)
            self._drafted += 1

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        """An EAGLE-2 dynamic tree (Li et al. 2024) for a batch of one row; None for more rows
        or before the target has read the row's prompt.

        The root's children are the draft's ``top_k`` tokens, each with its draft probability
        as path probability. Each further level reads the ``expanded`` newest nodes of highest
        path probability in one draft forward (a tree mask: each sees the row's committed
        columns, its ancestors' columns and itself) and gives each its ``top_k`` children at
        path probability the parent's times the draft's. Of all nodes, the ``shape.nodes``
        most probable are kept (ancestor-closed: a child is never more probable than its
        parent, and ties go to the earlier node), in that order, which is topological with each
        parent's children most probable first. Probabilities are the warped draft distribution
        when sampling, the plain softmax when greedy; tokens of probability 0 are never nodes.
        Penalties (``ctx.adjust``) are not applied: the trials are point masses, which
        verification accepts exactly whatever they are.

        Every column read here is a drafted column, dropped at the next ``keep`` or catch-up
        as a chain's are.
        """
        depth = tree_depth(ctx, shape)
        if depth < 1 or not self._catch_up(ctx):
            return None
        root = self._state  # (1, 1, d)
        rows = self._rows
        assert root is not None and rows.alive is not None
        committed = rows.lengths[0]  # columns read from the target's states
        seen = rows.alive[0].clone()  # (W0,) the row's committed columns
        nodes = _Candidates()
        frontier = nodes.expand(self._tree_probs(self.draft.lm_head(root)[:, -1], ctx),
                                [ROOT], [1.0], shape.top_k)  # fmt: skip
        states: dict[int, torch.Tensor] = {ROOT: root[0, 0]}  # node -> its draft state (d,)
        for level in range(2, depth + 1):
            chosen = sorted(frontier, key=lambda i: (-nodes.probs[i], i))[: shape.expanded]
            if not chosen:
                break
            features = torch.stack([states[nodes.parents[i]] for i in chosen]).unsqueeze(0)
            ids = torch.tensor([[nodes.tokens[i] for i in chosen]], device=root.device)
            # A node at depth k sits where a chain's k-th draft does: committed + k - 1.
            hidden = self._read_tree(features, ids, committed + level - 2, chosen, nodes, seen)
            for n, i in enumerate(chosen):
                states[i] = hidden[0, n]
            dists = self._tree_probs(self.draft.lm_head(hidden)[0], ctx)  # (n, V)
            frontier = nodes.expand(dists, chosen, [nodes.probs[i] for i in chosen],
                                    shape.top_k)  # fmt: skip
        return nodes.tree(shape.nodes, ctx.tokens.device)

    def _read_tree(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        position: int,
        chosen: list[int],
        nodes: _Candidates,
        seen: torch.Tensor,
    ) -> torch.Tensor:
        """One draft forward of tree nodes ``chosen`` (all at one depth, at ``position``):
        (state, token) pairs ``features`` (1, n, d) and ``tokens`` (1, n); each column sees the
        committed columns ``seen`` (W0,), its ancestors' columns (read at earlier levels) and
        itself. Records the new columns as drafted; returns their hidden states (1, n, d)."""
        rows = self._rows
        count, width = len(chosen), rows.width
        device = features.device
        visible = torch.zeros((count, width + count), dtype=torch.bool, device=device)
        visible[:, : seen.shape[0]] = seen
        query: list[int] = []
        key: list[int] = []
        for n, node in enumerate(chosen):
            ancestor = nodes.parents[node]
            while ancestor != ROOT:
                query.append(n)
                key.append(nodes.columns[ancestor])
                ancestor = nodes.parents[ancestor]
            query.append(n)
            key.append(width + n)
            nodes.columns[node] = width + n
        visible[torch.tensor(query, device=device), torch.tensor(key, device=device)] = True
        dtype = features.dtype  # the draft's own states: the dtype its layers compute in
        # (1, 1, n, W + n) additive: 4-D masks reach the attention as they are.
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
        if self._kv.limit is not None:
            position = min(position, self._kv.limit - 1)  # (as RowCache.forward does)
        positions = torch.full((1, count), position, dtype=torch.int64, device=device)
        kwargs: dict[str, Any] = {
            self._cache_arg: self._kv.cache,
            "use_cache": True,
            "position_ids": positions,
            "attention_mask": mask,
        }
        hidden = feature_hidden(self.draft, features, tokens, **kwargs)
        # Counted in the row's length and in ``_drafted``, as a chain's columns are, so that
        # ``_drop_drafted`` restores the committed layout exactly.
        rows.append(torch.ones((1, count), dtype=torch.bool, device=device), [count])
        self._drafted += count
        return hidden

    @staticmethod
    def _tree_probs(logits: torch.Tensor, ctx: DraftContext) -> torch.Tensor:
        """(n, V) float32 draft probabilities of (n, V) ``logits``: warped when sampling."""
        if ctx.warper.greedy:
            return logits.float().softmax(dim=-1)
        return ctx.warper.probs(logits)

    def _catch_up(self, ctx: DraftContext) -> bool:
        """Drop this round's drafted columns and read the target's states up to each row's
        newest committed token; False when the target has not read that far in every row."""
        target = self._target
        if target is None:
            raise RuntimeError(
                f"drafter {self.name!r} is not bound to a target: build a SpeculativeEngine "
                "with it (which calls bind)"
            )
        if self._kv.cache is None:
            self.reset()
        self._drop_drafted()
        width, batch = ctx.tokens.shape[1], ctx.tokens.shape[0]
        known = [width - 1 - left for left in ctx.padding.lefts]  # columns to read, per row
        kept = target.feature_counts(ctx.padding)
        if kept is None or any(k < 1 or n < k for k, n in zip(known, kept, strict=True)):
            return False
        rows = self._rows
        if rows.alive is None or len(rows.lengths) != batch:
            self.reset()
            rows = self._rows
            rows.start(batch, ctx.tokens.device)
        if any(h > k for h, k in zip(rows.lengths, known, strict=True)):
            # The committed tokens went back past what it read: read every row again.
            self.reset()
            rows = self._rows
            rows.start(batch, ctx.tokens.device)
        need = [k - h for k, h in zip(known, rows.lengths, strict=True)]
        count = max(need)
        if count:
            # Rectangle column c is row b's draft column known[b] - count + c: the target's
            # state there, and the token after it (right-aligned, as the token matrix is).
            columns = torch.arange(count - 1, -1, -1, device=ctx.tokens.device)
            index = torch.tensor(known, device=ctx.tokens.device).unsqueeze(1) - 1 - columns
            features = target.gather_features(index.clamp_min(0), ctx.padding)
            hidden = self._read_columns(features, ctx.tokens[:, width - count :],
                                        [count - n for n in need])  # fmt: skip
            fresh = torch.tensor([n > 0 for n in need], device=hidden.device).view(-1, 1, 1)
            state = self._state
            self._state = hidden[:, -1:] if state is None else torch.where(fresh, hidden[:, -1:],
                                                                           state)  # fmt: skip
        return self._state is not None

    def _new_cache(self) -> Any:
        return new_cache(self.draft)

    @property
    def _rows(self) -> RowLayout:
        return self._kv.rows

    def _read_columns(
        self, features: torch.Tensor, tokens: torch.Tensor, dead: Sequence[int]
    ) -> torch.Tensor:
        """One draft forward of (state, token) pairs (B, n), the first ``dead[b]`` dead in row
        b (``RowLayout.plan``); its final hidden states (B, n, d)."""

        def call(positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            kwargs: dict[str, Any] = {
                self._cache_arg: self._kv.cache,
                "use_cache": True,
                "position_ids": positions,
            }
            if mask is not None:
                kwargs["attention_mask"] = mask
            hidden: torch.Tensor = feature_hidden(self.draft, features, tokens, **kwargs)
            return hidden

        return self._kv.forward(call, tokens.shape[1], dead, tokens.device)

    def _drop_drafted(self) -> None:
        if self._drafted:
            self._kv.drop(self._drafted)
            self._drafted = 0

    def keep(self, lengths: Sequence[int], padding: Padding) -> None:
        """Drop the drafted columns (read from its own states, not the target's); row b keeps
        at most ``lengths[b]`` read columns."""
        if not self._kv.started:
            return
        self._drop_drafted()
        self._kv.keep(lengths)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index``."""
        if not self._kv.started:
            return
        self._kv.select(index)
        if self._state is not None:
            self._state = self._state.index_select(0, index)

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """Rows joined the batch: they have read nothing yet (the next round reads their
        states, which the target keeps for them)."""
        if not self._kv.started:
            return  # nothing read yet: the first round reads every row
        self._kv.add_empty(tokens.shape[0], tokens.device)
        if self._state is not None:
            self._state = torch.cat([self._state, self._state.new_zeros(
                (tokens.shape[0], *self._state.shape[1:]))])  # fmt: skip


class _Candidates:
    """The nodes an EAGLE-2 tree round considered (host lists, by creation order: a parent is
    always created before its children)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []  # path probabilities
        self.columns: dict[int, int] = {}  # read nodes: their cache column

    def expand(
        self, dists: torch.Tensor, parents: list[int], probs: list[float], top_k: int
    ) -> list[int]:
        """Give each of ``parents`` (path probabilities ``probs``) the ``top_k`` most likely
        tokens of its (V,) row of ``dists`` (n, V) as children; returns the new nodes."""
        k = min(top_k, int(dists.shape[-1]))
        values, indices = dists.topk(k, dim=-1)  # (n, k), most likely first
        new: list[int] = []
        for parent, prob, qs, ids in zip(parents, probs, values.tolist(), indices.tolist(),
                                         strict=True):  # fmt: skip
            for q, token in zip(qs, ids, strict=True):
                if q <= 0.0:
                    break  # filtered out by the warp: never a node
                new.append(len(self.tokens))
                self.tokens.append(int(token))
                self.parents.append(parent)
                # q <= 1, so a child's path probability never exceeds its parent's.
                self.probs.append(prob * q)
        return new

    def tree(self, budget: int, device: torch.device) -> TokenTree | None:
        """The ``budget`` most probable nodes as a tree; ties go to the earlier node, so the
        order is topological and each parent's children come most probable first."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.probs[i], i))[:budget]
        if not order:
            return None
        builder = TreeBuilder()
        mine: dict[int, int] = {ROOT: ROOT}
        for i in order:
            mine[i] = builder.add(mine[self.parents[i]], self.tokens[i])
        tree = builder.build(device)
        tree.weights = [self.probs[i] for i in order]  # node k is order[k]: one trial each
        return tree
