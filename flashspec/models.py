"""Models: the KV-cache bookkeeping shared by target and drafters, and the target.

A ``CausalLM`` wraps a HuggingFace causal LM together with its KV cache and one integer,
``cached``: how many leading columns of the committed token matrix the cache holds. Every
forward feeds the columns after ``cached``; rolling back after a rejection is a crop to the
number of columns still valid. Nothing is ever recomputed from the start of the prompt.

A target's model runs leaner than transformers ships it (``make_lean``: the same operations
without the module overhead; ``tune_linears``: the same products in a faster form on a CPU);
``untuned(model)`` gives it transformers' forward and torch's linear layers back
while inside, for baselines. ``new_cache``, ``crop_cache`` and ``ForwardSignature`` are the
cache helpers every model here uses, for code that calls a model's forward itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

# ``as``: re-exported, public here (see the module docstring).
from ._compat import ForwardSignature as ForwardSignature
from ._compat import crop_cache as crop_cache
from ._compat import has_sliding_layers
from ._compat import new_cache as new_cache
from ._families import check_family, padded_batch_refusal
from ._layout import (
    RowLayout,
    append_rows,
    append_zero_rows,
    column_window,
    gather_columns,
    move_columns,
    pad_columns,
    shiftable,
)
from ._lean import make_lean
from ._linear import tune_linears
from ._linear import untuned as untuned
from ._state import (
    CHECK_TOLERANCE,
    CacheSupport,
    Snapshot,
    StateMode,
    UnsupportedModelError,
    check_support,
    crop_attention,
    has_recurrent_state,
    restore_snapshot,
    select_attention_rows,
    select_state_rows,
    state_difference,
    state_mode,
    take_snapshot,
    trim_conv,
)
from .compiled.static import MIN_COLUMNS, capacity_for, new_static_cache, to_dynamic
from .compiled.step import CompiledForward
from .config import AUTO_DTYPE, resolve_dtype

# Loading moved to flashspec.loading; these names stay importable from here.
from .loading.pretrained import DEMO_DIR as DEMO_DIR
from .loading.pretrained import DEMO_DRAFT3_NAME as DEMO_DRAFT3_NAME
from .loading.pretrained import DEMO_DRAFT_NAME as DEMO_DRAFT_NAME
from .loading.pretrained import DEMO_NAME as DEMO_NAME
from .loading.pretrained import DEMO_NAMES as DEMO_NAMES
from .loading.pretrained import load_pretrained as load_pretrained
from .loading.pretrained import resolve_model_path as resolve_model_path
from .profiling import span
from .trees.tree import TokenTree


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


def _eos_ids(*sources: Any) -> list[int]:
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else [int(v) for v in value]
        if ids:
            return ids
    return []


def _logit_width(model: torch.nn.Module) -> int:
    get_head = getattr(model, "get_output_embeddings", None)
    weight = getattr(get_head() if callable(get_head) else None, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    config: Any = getattr(model, "config", None)
    return int(
        config.get_text_config().vocab_size
        if hasattr(config, "get_text_config")
        else config.vocab_size
    )


def _max_positions(config: Any) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class CausalLM:
    """A causal LM plus its KV cache, with rollback by cropping (attention) or by snapshots
    (recurrent state, see ``flashspec._state``).

    Wrap the model after moving it to its device and dtype.

    Args:
        model: the HuggingFace causal LM.
        name: a label for messages and stats.
        tokenizer: the model's tokenizer, if known.
        role: "target" or "drafter", for the refusal of a cache that cannot roll back exactly.

    Raises:
        UnsupportedModelError: (a ValueError) the model's cache cannot be rolled back exactly
            in ``role``, or its family cannot be decoded exactly (``flashspec._families``); the
            message names the model class and the reason.

    Attributes:
        model: the HuggingFace model (in eval mode).
        name: a label for messages and stats.
        tokenizer: the model's tokenizer, if known.
        vocab_size: width of the logits (rows of the output embedding).
        max_context: positions the model can attend over (``max_position_embeddings``), or None.
        window: why the model's attention is limited to a window of columns
            (``flashspec._layout.column_window``), or None.
        padded_batches: why rows of different lengths (left padded) cannot share a batch
            (``flashspec._families.padded_batch_refusal``), or None when they can.
        shiftable: whether rows of a batch can keep their own columns (ragged batches): a plain
            attention cache, positions and a mask taken, no ``window``, and padded rows exact.
        cached: committed columns whose keys/values are in ``cache``.
        support: whether the cache holds recurrent/conv state, and whether a multi-token
            forward after a cached state is exact.
        state_mode: rollback policy of a stateful model (``flashspec._state.state_mode``; read
            from ``FLASHSPEC_RECURRENT``, settable).
        replays, replayed_tokens, replay_seconds: restore-and-replay forwards this generation.
        compiled: the compiled forward (``compile_steps``), or None: eager only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        name: str | None = None,
        tokenizer: Any = None,
        role: str = "target",
    ) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                "model must be a HuggingFace causal LM (torch.nn.Module with .config), "
                f"got {type(model).__name__}"
            )
        self.model = model.eval()
        make_lean(self.model)  # the same operations as transformers', without its call overhead
        self.name = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        self.tokenizer = tokenizer
        check_family(self.model, role)
        self.signature = ForwardSignature.of(model)
        # Read once: HF config attribute access is slow enough to show up per round.
        self.vocab_size = _logit_width(model)
        self.max_context = _max_positions(self.config)
        fresh = new_cache(model)
        self.support: CacheSupport = check_support(model, fresh, role)
        # Rows can keep their own columns (ragged batches, ``flashspec._layout``) only in a
        # plain attention cache of a model that takes positions and a mask, and attends to
        # every earlier column (a window counts dead columns too).
        self.window = column_window(self.config)
        self.padded_batches = padded_batch_refusal(model, self.signature.position_ids)
        self.shiftable = (
            not self.support.stateful
            and self.support.chunked_exact
            and self.padded_batches is None
            and shiftable(fresh)
            and self.window is None
            and self.signature.position_ids
            and self.signature.attention_mask
        )
        self.state_mode: StateMode = state_mode()
        self.cache: Any = None
        self.cached = 0
        self.rows: RowLayout | None = None
        self._sliding = False
        # Stateful models: state copies by committed column, kept within one round.
        self._marks: dict[int, Snapshot] = {}
        self.replays = 0
        self.replayed_tokens = 0
        self.replay_seconds = 0.0
        self._span = span("target_forward" if role == "target" else "forward")
        self.compiled: CompiledForward | None = None
        self._statics: dict[int, Any] = {}  # static caches by capacity, kept across generations
        self._static = False  # this generation's cache is one of them
        self._tree_nodes: tuple[int, int] | None = None  # a tree's (first column, nodes)

    # The compiled path (``flashspec.compiled``).

    def compile_steps(self, lengths: Sequence[int]) -> None:
        """Run forwards of ``lengths`` tokens compiled on a static cache from now on (models
        ``flashspec.compiled.policy.obstacle`` accepts)."""
        self.compiled = CompiledForward(self.model, lengths, self.name, self.signature.cache_arg)

    def reserve(self, rows: int, columns: int) -> None:
        """After ``reset``: a generation of ``rows`` rows needs up to ``columns`` columns. On
        the compiled path a batch of one takes a static cache of that size's bucket."""
        if self.compiled is None or rows != 1 or self.rows is None:
            return
        capacity = capacity_for(columns)
        if self.max_context is not None:
            capacity = min(capacity, max(self.max_context, columns))
        cache = self._statics.get(capacity)
        if cache is None:
            cache = self._statics[capacity] = new_static_cache(self.model, capacity)
        self.cache = cache
        self._static = True

    def warm_up(self) -> None:
        """Compile every compiled length now, in the smallest capacity bucket (a server does
        this before it listens, so that no request waits for a compile)."""
        if self.compiled is None:
            return
        capacity = MIN_COLUMNS
        if self.max_context is not None:
            capacity = min(capacity, self.max_context)
        cache = self._statics.get(capacity)
        if cache is None:
            cache = self._statics[capacity] = new_static_cache(self.model, capacity)
        device = self.device
        start = 2
        with torch.inference_mode():
            ids = torch.zeros((1, start), dtype=torch.int64, device=device)
            self.compiled(ids, torch.arange(start, device=device)[None], 0, cache)  # buffers
            for n in self.compiled.lengths:
                ids = torch.zeros((1, n), dtype=torch.int64, device=device)
                positions = torch.arange(start, start + n, device=device)[None]
                self.compiled(ids, positions, start, cache)

    @property
    def static(self) -> bool:
        """Whether this generation's cache is a static one (the compiled path)."""
        return self._static

    def _leave_static(self) -> None:
        """Continue eager on a dynamic cache with the same columns (rows joining or leaving a
        batch: the compiled path runs a batch of one)."""
        if self._static:
            self.cache = to_dynamic(self.cache, self.cached, self.model)
            self._static = False

    @property
    def config(self) -> Any:
        """The model's (text) config."""
        model: Any = self.model
        config = model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from the generation config, model config or tokenizer."""
        return _eos_ids(getattr(self.model, "generation_config", None), self.config, self.tokenizer)

    def reset(self) -> None:
        """Start a new generation: empty cache."""
        self.cache = new_cache(self.model)
        self._static = False
        self.cached = 0
        self.rows = RowLayout() if self.shiftable else None
        self._sliding = has_sliding_layers(self.cache)
        self._marks.clear()
        self.replays = 0
        self.replayed_tokens = 0
        self.replay_seconds = 0.0

    def feed(
        self,
        tokens: torch.Tensor,
        padding: Padding,
        extra: torch.Tensor | None = None,
        keep: int = 1,
        tails: list[int] | None = None,
    ) -> torch.Tensor:
        """Feed each row's committed tokens (``tokens`` (B, L), right-aligned, laid out by
        ``padding``) that the cache lacks, then ``extra`` (B, n) in every row; return the last
        ``keep`` logits, (B, keep, V). The last column fed must be a token of every row (a
        committed one, or ``extra``), unless ``tails[b]``: the last ``tails[b]`` columns of
        ``extra`` in row b are not its tokens (drafts it did not make: dead columns, never
        read; their logits mean nothing). Needs the ragged layout for tails."""
        if self.rows is None:
            pending = tokens[:, self.cached :]
            ids = pending if extra is None else torch.cat([pending, extra], dim=1)
            return self.forward(ids, padding, keep)
        rows = self.rows
        if rows.alive is None:
            rows.start(tokens.shape[0], tokens.device)
        width = tokens.shape[1]
        # A row may hold more than its committed tokens (a drafter's own drafts): none to feed.
        need = [
            max(width - left - n, 0) for left, n in zip(padding.lefts, rows.lengths, strict=True)
        ]
        count = max(need, default=0)
        ids = tokens[:, width - count :]
        if extra is not None and extra.shape[1]:
            ids = torch.cat([ids, extra], dim=1)
        with self._span:
            return self._rows_forward(ids, [count - n for n in need], keep, tails)

    def _rows_forward(
        self, ids: torch.Tensor, dead: list[int], keep: int, tails: list[int] | None = None
    ) -> torch.Tensor:
        """One forward of ``ids`` whose first ``dead[b]`` and last ``tails[b]`` columns are dead
        in row b (the rest are its next tokens)."""
        rows = self.rows
        assert rows is not None
        if rows.width == 0 and not self._static:
            # Nothing cached: start from a fresh cache, so that no empty layer tensor of an
            # earlier batch size meets this batch's rows.
            self.cache = new_cache(self.model)
        positions, alive, mask = rows.plan(dead, ids.shape[1], ids.device, tails)
        added = [ids.shape[1] - d - t for d, t in zip(dead, tails or [0] * len(dead), strict=True)]
        if self.max_context is not None:
            positions = positions.clamp_max(self.max_context - 1)  # as in _model_forward
        if self._static and (mask is not None or ids.shape[0] != 1):
            self._leave_static()  # only a batch of one, every column alive, runs static
        if self._static:
            assert self.compiled is not None
            scores = self.compiled(ids, positions, rows.width, self.cache)
            rows.append(alive, added)
            self.cached = rows.width
            return scores[:, -keep:]
        kwargs: dict[str, Any] = {
            self.signature.cache_arg: self.cache,
            "use_cache": True,
            "position_ids": positions,
        }
        if mask is not None:
            kwargs["attention_mask"] = mask
        if self.signature.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        output = self.model(input_ids=ids, **kwargs)
        rows.append(alive, added)
        self.cached = rows.width
        logits: torch.Tensor = output.logits
        return logits[:, -keep:]

    def feed_tree(self, tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        """Feed the one row's committed tokens the cache lacks, then ``tree``'s nodes in one
        forward (positions by depth; each node sees the committed columns and its ancestors);
        return (1, N + 1, V) logits: entry 0 after the newest committed token, entry i + 1
        after node i. ``keep_path`` then keeps the accepted nodes' columns. Needs the ragged
        layout (``shiftable``) and a batch of one."""
        rows = self.rows
        if rows is None or tokens.shape[0] != 1:
            raise RuntimeError(f"{self.name}: a token tree needs a shiftable model, one row")
        self._leave_static()
        device = tokens.device
        if rows.alive is None:
            rows.start(1, device)
        assert rows.alive is not None
        if rows.width == 0:
            self.cache = new_cache(self.model)
        pending = tokens.shape[1] - padding.lefts[0] - rows.lengths[0]  # >= 1: the newest
        n = tree.size
        ids = torch.cat([tokens[:, tokens.shape[1] - pending :], tree.tokens.view(1, n)], dim=1)
        count = pending + n
        depths = torch.tensor(tree.depths, dtype=torch.int64)
        positions = torch.cat([torch.arange(pending), pending - 1 + depths]) + rows.lengths[0]
        positions = positions.to(device).view(1, count)
        if self.max_context is not None:
            positions = positions.clamp_max(self.max_context - 1)
        # (count, width + count): a committed column is seen where the row has it, the new
        # pending tokens causally, a node sees every pending token and its own ancestors.
        seen = torch.zeros((count, rows.width + count), dtype=torch.bool, device=device)
        seen[:, : rows.width] = rows.alive[0]
        block = seen[:, rows.width :]
        block[:pending, :pending] = torch.ones((pending, pending), dtype=torch.bool).tril()
        block[pending:, :pending] = True
        block[pending:, pending:] = tree.ancestor_mask(device)
        dtype = _activation_dtype(self.model)
        mask = torch.zeros(seen.shape, dtype=dtype, device=device)
        mask.masked_fill_(~seen, torch.finfo(dtype).min)
        kwargs: dict[str, Any] = {
            self.signature.cache_arg: self.cache,
            "use_cache": True,
            "position_ids": positions,
            "attention_mask": mask.view(1, 1, *seen.shape),
        }
        if self.signature.logits_to_keep:
            kwargs["logits_to_keep"] = n + 1
        with self._span:
            output = self.model(input_ids=ids, **kwargs)
        rows.append(torch.ones((1, count), dtype=torch.bool, device=device), [count])
        self.cached = rows.width
        self._tree_nodes = (rows.width - n, n)
        logits: torch.Tensor = output.logits
        return logits[:, -(n + 1) :]

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``feed_tree``: the row keeps the columns of the nodes ``path`` (depth 1
        first), moved next to its committed columns; the other nodes' columns are cut."""
        rows = self.rows
        assert rows is not None and rows.alive is not None and self._tree_nodes is not None
        start, n = self._tree_nodes
        self._tree_nodes = None
        move_columns(self.cache, [start + i for i in path], start)
        end = start + len(path)
        rows.alive[0, end:] = False
        rows.lengths = [rows.lengths[0] - n + len(path)]
        self._crop_rows(rows.width - end)

    def forward(self, input_ids: torch.Tensor, padding: Padding, keep: int) -> torch.Tensor:
        """Feed the columns after ``cached``; return the last ``keep`` logits, (B, keep, V).

        Column-aligned: column j of ``input_ids`` is column ``cached + j`` of the batch, padding
        where ``padding`` says so (the prompt's layout)."""
        if self.rows is not None:
            if self.rows.alive is None:
                self.rows.start(input_ids.shape[0], input_ids.device)
            start, length = self.cached, input_ids.shape[1]
            dead = [min(max(left - start, 0), length) for left in padding.lefts]
            with self._span:
                return self._rows_forward(input_ids, dead, keep)
        if not self.support.chunked_exact and self.cached > 0 and input_ids.shape[1] > 1:
            # This family's multi-token forward after a cached state is not exact: feed tokens
            # one at a time (only drafters get here; such targets are refused).
            steps = [
                self._forward(input_ids[:, j : j + 1], padding, 1)
                for j in range(input_ids.shape[1])
            ]
            return torch.cat(steps[-keep:], dim=1)
        return self._forward(input_ids, padding, keep)

    def _forward(self, input_ids: torch.Tensor, padding: Padding, keep: int) -> torch.Tensor:
        with self._span:
            return self._model_forward(input_ids, padding, keep)

    def _model_forward(self, input_ids: torch.Tensor, padding: Padding, keep: int) -> torch.Tensor:
        start, length = self.cached, input_ids.shape[1]
        kwargs: dict[str, Any] = {self.signature.cache_arg: self.cache, "use_cache": True}
        if self.signature.position_ids:
            positions = padding.position_ids(start, length)
            longest = start + length - padding.min_left  # the longest row's positions
            if self.max_context is not None and longest > self.max_context:
                # A row nearer its context limit than the row the round is sized for gets
                # columns past the limit; they are never emitted for it (the engine cuts each
                # row at its own limit), and clamped they index no missing position embedding.
                positions = positions.clamp_max(self.max_context - 1)
            kwargs["position_ids"] = positions
        if self.signature.attention_mask and padding.any:
            kwargs["attention_mask"] = padding.attention_mask(start + length)
        if self.signature.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        # The cache object is updated in place (every transformers release since 4.56).
        output = self.model(input_ids=input_ids, **kwargs)
        self.cached = start + length
        logits: torch.Tensor = output.logits
        return logits[:, -keep:]

    def rollback(self, valid: int) -> None:
        """Keep only the first ``valid`` columns in the cache (no-op if it holds fewer).

        Column-aligned (see ``forward``); ragged batches use ``keep_rows``.

        A stateful model goes back to the state copy marked at ``valid`` (``mark``); without
        one the cache is emptied and the next forward starts from the first column, which is
        exact (a drafter's catch-up). Conv-only state crops like attention.
        """
        if not self.support.stateful:
            if self.cached > valid:
                crop_cache(self.cache, self.cached - valid)
                if self.rows is not None and self.rows.alive is not None:
                    self.rows.crop(self.cached - valid)
                    self.rows.lengths = self.rows.alive.sum(dim=1).tolist()
                self.cached = valid
            elif self._sliding:
                # Sliding layers keep every state until a crop (so rollbacks work); trim them.
                crop_cache(self.cache, 0)
            return
        if self.cached > valid:
            mark = self._marks.get(valid)
            if mark is not None:
                restore_snapshot(self.cache, mark, self.cached)
                self.cached = valid
            elif not has_recurrent_state(self.cache):
                crop_cache(self.cache, self.cached - valid)
                self.cached = valid
            else:
                self.reset()
        crop_attention(self.cache, 0)
        trim_conv(self.cache)
        self._marks.clear()

    def mark(self) -> None:
        """Copy a stateful model's state at the current column, for ``rollback`` to return to
        (no-op for attention-only models, which crop)."""
        if self.support.stateful:
            self._marks[self.cached] = take_snapshot(self.cache, self.cached)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished rows leave the batch)."""
        self._leave_static()
        if self.cached > 0:
            select_attention_rows(self.cache, index)
            select_state_rows(self.cache, index)
        if self.rows is not None and self.rows.alive is not None:
            self._crop_rows(self.rows.select(index, index.tolist()))
            self._compact()

    # Ragged batches (``shiftable`` models only; see ``flashspec._layout``).

    def keep_rows(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` tokens in the cache (at most what it holds)."""
        rows = self.rows
        if rows is None:
            raise RuntimeError(f"{self.name}: keep_rows needs a shiftable model's cache")
        if rows.alive is None:
            return  # nothing read yet
        self._crop_rows(rows.keep(lengths))
        self._compact()

    def _crop_rows(self, count: int) -> None:
        if count > 0 and self.rows is not None:
            crop_cache(self.cache, count)
            self.rows.crop(count)
            self.cached = self.rows.width
            if self.cached == 0 and not self._static:
                # No columns left, but the layers' empty tensors still have the old batch size,
                # which a later change of rows would not update (nothing to select or append).
                self.cache = new_cache(self.model)

    def _compact(self) -> None:
        rows = self.rows
        plan = rows.compaction() if rows is not None else None
        if plan is not None:
            source, width = plan
            gather_columns(self.cache, source)
            self.cached = width

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """New rows (``tokens`` (n, L), right-aligned, laid out by ``padding``) join the batch.
        A cache that holds tokens reads all but each new row's newest now, so that the next
        forward feeds them no more than the others; an empty one reads them with the others."""
        rows = self.rows
        if rows is None:
            raise RuntimeError(f"{self.name}: rows can only join a shiftable model's batch")
        self._leave_static()
        if rows.alive is None:
            return  # nothing read yet: the first forward reads every row
        if self.cached == 0:
            self.cache = new_cache(self.model)  # no tensor of the old batch size stays
            rows.alive = rows.alive.new_zeros((rows.alive.shape[0] + tokens.shape[0], 0))
            rows.lengths = [*rows.lengths, *([0] * tokens.shape[0])]
            return
        if all(tokens.shape[1] - 1 - left <= 0 for left in padding.lefts):
            fresh_rows = RowLayout()  # one-token prompts: nothing to read before the round
            fresh_rows.start(tokens.shape[0], tokens.device)
            fresh_rows.pad(self.cached)
            rows.extend(fresh_rows)
            append_zero_rows(self.cache, tokens.shape[0])
            return
        saved = (self.cache, self.cached, rows)
        self.cache, self.cached, self.rows = new_cache(self.model), 0, RowLayout()
        try:
            self.feed(tokens[:, :-1], padding, keep=1)
            fresh, fresh_rows = self.cache, self.rows
        finally:
            self.cache, self.cached, self.rows = saved
        width = max(rows.width, fresh_rows.width)
        pad_columns(self.cache, width - rows.width)
        rows.pad(width - rows.width)
        pad_columns(fresh, width - fresh_rows.width)
        fresh_rows.pad(width - fresh_rows.width)
        append_rows(self.cache, fresh)
        rows.extend(fresh_rows)
        self.cached = width


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
    few-row products (``flashspec._linear``; ``FLASHSPEC_TUNE_LINEAR=0`` leaves them as they
    are).
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
        self._feature_hook: Any = None
        self._fresh: list[torch.Tensor] = []
        # Hidden states, by column of the token matrix (column-aligned caches) or, in a cache
        # whose rows keep their own columns (``rows``), by each row's own token index, which
        # stays put when the rows' layout in the token matrix moves.
        self._feature_buffer: torch.Tensor | None = None
        self._feature_columns = 0  # column-aligned: columns written
        self._feature_lengths: list[int] = []  # by row: states written per row
        self._tree_hidden: tuple[torch.Tensor, int] | None = None  # verify_tree's, pending

    def reset(self) -> None:
        """Start a new generation: empty cache (and no hidden states kept)."""
        super().reset()
        self._feature_buffer = None
        self._feature_columns = 0
        self._feature_lengths = []
        self._fresh.clear()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (and their hidden states)."""
        super().select_rows(index)
        if self._feature_buffer is not None:
            self._feature_buffer = self._feature_buffer.index_select(0, index)
            if self._feature_lengths:
                self._feature_lengths = [self._feature_lengths[i] for i in index.tolist()]

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """New rows join the batch (``CausalLM.add_rows``), with the hidden states of what is
        read of them now."""
        if self._feature_hook is None:
            super().add_rows(tokens, padding)
            return
        self._fresh.clear()
        super().add_rows(tokens, padding)
        rows, width = tokens.shape[0], tokens.shape[1] - 1  # all but each row's newest read
        hidden = self._take_fresh()
        if self._feature_buffer is None:
            return  # nothing kept yet: the next verification reads every row
        buffer = self._feature_buffer
        lengths = [0] * rows
        joined = buffer.new_zeros((rows, 0, buffer.shape[2]))
        if hidden is not None:
            lengths = [max(width - left, 0) for left in padding.lefts]
            joined = buffer.new_zeros((rows, max(lengths), buffer.shape[2]))
            for row, n in enumerate(lengths):
                joined[row, :n] = hidden[row, hidden.shape[1] - n :]
        buffer = self._grown(buffer, joined.shape[1])
        room = buffer.new_zeros((rows, buffer.shape[1], buffer.shape[2]))
        room[:, : joined.shape[1]] = joined[:, : buffer.shape[1]]
        self._feature_buffer = torch.cat([buffer, room])
        self._feature_lengths = [*self._feature_lengths, *lengths]

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
        if self._feature_hook is None:
            return self._verify(tokens, drafts, padding, tails)
        self._fresh.clear()
        if self.rows is None:
            logits = self._verify(tokens, drafts, padding)
            self._keep_features(tokens.shape[1] + drafts.shape[1])
            return logits
        held = self.rows.lengths or [0] * tokens.shape[0]
        counts = [tokens.shape[1] - left for left in padding.lefts]  # each row's tokens
        logits = self._verify(tokens, drafts, padding, tails)
        self._keep_row_features(counts, held, g, tails)
        return logits

    def verify_tree(self, tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        """``feed_tree`` (the one row's pending committed tokens, then ``tree``'s nodes):
        (1, N + 1, V) logits, entry 0 after the newest committed token, entry i + 1 after node
        i. ``keep_path`` commits the accepted nodes (and their hidden states)."""
        if self._feature_hook is None:
            return self.feed_tree(tokens, padding, tree)
        self._fresh.clear()
        held = self.rows.lengths[0] if self.rows is not None and self.rows.lengths else 0
        count = tokens.shape[1] - padding.lefts[0]
        logits = self.feed_tree(tokens, padding, tree)
        hidden = self._take_fresh()
        assert hidden is not None
        self._tree_hidden = (hidden, count - min(held, count))
        return logits

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``verify_tree``: keep the nodes ``path``'s columns, and their hidden states
        after the row's committed ones."""
        super().keep_path(path)
        kept, self._tree_hidden = self._tree_hidden, None
        if kept is None:
            return
        hidden, pending = kept  # (1, pending + N, d): the pending committed tokens, the nodes
        columns = [*range(pending), *(pending + i for i in path)]
        chosen = hidden[:, torch.tensor(columns, device=hidden.device)]
        assert self.rows is not None
        end = self.rows.lengths[0]
        buffer = self._buffer_for(hidden, end)
        buffer[:, end - len(columns) : end] = chosen
        self._feature_lengths = [end]

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
        return self._feature_hook is not None

    def track_features(self) -> None:
        """From now on keep the final hidden state (what the LM head reads) at every column
        verification reads: ``features`` after a round holds it for every committed column but
        the newest, the columns whose inputs were all committed tokens.

        Raises:
            UnsupportedModelError: the target keeps recurrent state, or its final norm cannot
                be found (the message names the model class).
        """
        if self._feature_hook is not None:
            return
        if self.support.stateful:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} keeps recurrent state; a drafter that reads the "
                "target's hidden states works with attention-only targets. Use a ModelDrafter "
                "or prompt lookup with this target"
            )
        norm = final_norm(self.model)
        self._feature_hook = norm.register_forward_hook(self._record_features)

    def _record_features(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._fresh.append(output if isinstance(output, torch.Tensor) else output[0])

    def _take_fresh(self) -> torch.Tensor | None:
        fresh, self._fresh = self._fresh, []
        if not fresh:
            return None
        return fresh[0] if len(fresh) == 1 else torch.cat(fresh, dim=1)

    def _buffer_for(self, hidden: torch.Tensor, end: int) -> torch.Tensor:
        """The buffer, with room for ``end`` states per row of ``hidden``'s batch."""
        buffer = self._feature_buffer
        if buffer is None or buffer.shape[0] != hidden.shape[0]:
            buffer = hidden.new_zeros((hidden.shape[0], max(2 * end, 64), hidden.shape[2]))
        self._feature_buffer = buffer = self._grown(buffer, end)
        return buffer

    @staticmethod
    def _grown(buffer: torch.Tensor, end: int) -> torch.Tensor:
        """``buffer`` with room for ``end`` states per row; it doubles, so that a long
        generation copies its states a logarithmic number of times."""
        if buffer.shape[1] >= end:
            return buffer
        grown = buffer.new_zeros((buffer.shape[0], max(2 * end, 64), buffer.shape[2]))
        grown[:, : buffer.shape[1]] = buffer
        return grown

    def _keep_features(self, end: int) -> None:
        """Column-aligned: verification's forwards read the last columns up to ``end`` (of the
        committed tokens followed by the drafts); write their states there."""
        hidden = self._take_fresh()
        assert hidden is not None
        buffer = self._buffer_for(hidden, end)
        buffer[:, end - hidden.shape[1] : end] = hidden
        self._feature_columns = end

    def _keep_row_features(
        self, counts: list[int], held: list[int], drafts: int, tails: list[int] | None = None
    ) -> None:
        """Rows with their own columns: row b held ``held[b]`` of its ``counts[b]`` tokens, so
        the forward read its tokens from there on, then its drafts, which end ``tails[b]``
        columns before the rectangle's right end (``CausalLM.feed``)."""
        hidden = self._take_fresh()
        assert hidden is not None
        tails = tails or [0] * len(counts)
        ends = [n + drafts - t for n, t in zip(counts, tails, strict=True)]
        buffer = self._buffer_for(hidden, max(ends))
        width = hidden.shape[1]
        for row, (n, h, end, t) in enumerate(zip(counts, held, ends, tails, strict=True)):
            read = end - min(h, n)
            buffer[row, end - read : end] = hidden[row, width - t - read : width - t]
        self._feature_lengths = ends

    def feature_counts(self, padding: Padding) -> list[int] | None:
        """How many of each row's first tokens have their hidden state kept (at least all its
        committed tokens but the newest after a round), or None before any."""
        if self._feature_buffer is None:
            return None
        if self.rows is None:
            return [self._feature_columns - left for left in padding.lefts]
        return list(self._feature_lengths)

    def gather_features(self, index: torch.Tensor, padding: Padding) -> torch.Tensor:
        """(B, n, hidden): row b's hidden states at its token indices ``index[b]`` (B, n) (a
        row's first token has index 0; indices past ``feature_counts`` are not its states)."""
        buffer = self._feature_buffer
        if buffer is None:
            raise RuntimeError(f"{self.name}: no hidden states kept yet (track_features)")
        if self.rows is None:
            index = index + torch.tensor(padding.lefts, device=index.device).unsqueeze(1)
        index = index.clamp(0, buffer.shape[1] - 1)
        return buffer.gather(1, index.unsqueeze(-1).expand(-1, -1, buffer.shape[2]))

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


FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
"""Where HuggingFace decoders keep the norm whose output their LM head reads."""


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's attention scores take (an additive mask's): its first floating
    parameter's (quantized models keep float32 norms and activations)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


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


def check_same_vocabulary(target: CausalLM, drafter: CausalLM) -> None:
    """Refuse a drafter whose vocabulary differs from the target's.

    Raises:
        ValueError: naming both models, both sizes and what to use instead.
    """
    hint = (
        "a model drafter must use the target's tokenizer and vocabulary; pick a drafter "
        "from the same "
        "model family, or use the prompt-lookup drafter, which needs no model"
    )
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {drafter.name!r} has a vocabulary of {drafter.vocab_size} tokens but "
            f"target {target.name!r} has {target.vocab_size}; {hint}"
        )
    both = target.tokenizer is not None and drafter.tokenizer is not None
    if both and _vocab(target.tokenizer) != _vocab(drafter.tokenizer):
        raise ValueError(
            f"drafter {drafter.name!r} and target {target.name!r} have vocabularies of the same "
            f"size ({target.vocab_size}) but different tokens; {hint}"
        )


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return dict(get_vocab()) if callable(get_vocab) else None


def as_id_list(value: int | Sequence[int] | None) -> list[int]:
    """``None`` -> [], ``5`` -> [5], ``[5, 7]`` -> [5, 7]."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
