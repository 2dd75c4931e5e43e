"""``CausalLM``: a HuggingFace causal LM with its KV cache, the bookkeeping the target and the
model drafters share.

The cache holds ``cached`` leading columns of the committed token matrix. Every forward reads
the columns after ``cached``, and goes through one method (``_read``, whose one model call is
``_call``): ``feed`` reads what the cache lacks of the committed tokens, then a round's drafts;
``forward`` reads given columns; ``feed_tree`` reads a token tree. Rolling back after a
rejection is a crop to the columns still valid (a stateful model's snapshot, ``kv.state``).
Nothing is ever recomputed from the start of the prompt. A model whose rows can keep their own
columns (``shiftable``) keeps its cache in a ``kv.cache.RowCache``, so that rows commit their
own counts (ragged batches).

A model runs leaner than transformers ships it (``make_lean``: the same operations without the
module overhead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._families import check_family, padded_batch_refusal
from .._lean import lean_logits, make_lean
from ..compiled.static import (
    MIN_COLUMNS,
    capacity_for,
    initialized,
    new_static_cache,
    static_capacity,
    to_dynamic,
)
from ..compiled.step import CompiledForward
from ..kv.cache import RowCache
from ..kv.compat import ForwardSignature, crop_cache, has_sliding_layers, new_cache
from ..kv.layout import RowLayout, column_window, shiftable
from ..kv.slots import SLOT_BUCKETS, grow_slots, slot_count
from ..kv.state import (
    CacheSupport,
    Snapshot,
    StateMode,
    check_support,
    crop_attention,
    has_recurrent_state,
    restore_snapshot,
    select_attention_rows,
    select_state_rows,
    state_mode,
    take_snapshot,
    trim_conv,
)
from ..profiling import span
from ..quant.threads import forward_threads
from ..trees.tree import TokenTree
from .padding import Padding
from .vocab import eos_ids


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
    (recurrent state, see ``flashspec.kv.state``).

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
            (``flashspec.kv.layout.column_window``), or None.
        padded_batches: why rows of different lengths (left padded) cannot share a batch
            (``flashspec._families.padded_batch_refusal``), or None when they can.
        shiftable: whether rows of a batch can keep their own columns (ragged batches): a plain
            attention cache, positions and a mask taken, no ``window``, and padded rows exact.
        cached: committed columns whose keys/values are in ``cache``.
        support: whether the cache holds recurrent/conv state, and whether a multi-token
            forward after a cached state is exact.
        state_mode: rollback policy of a stateful model (``flashspec.kv.state.state_mode``; read
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
        # Rows can keep their own columns (ragged batches, ``flashspec.kv.layout``) only in a
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
        # The cache, in either layout: ``rows`` says which (read from ``kv`` when ragged).
        self.kv = RowCache(self._new_cache, self.max_context)
        self._ragged = False
        self.cached = 0
        self._sliding = False
        # Stateful models: state copies by committed column, kept within one round.
        self._marks: dict[int, Snapshot] = {}
        self.replays = 0
        self.replayed_tokens = 0
        self.replay_seconds = 0.0
        self._span = span("target_forward" if role == "target" else "forward")
        self.compiled: CompiledForward | None = None
        # Static caches by (capacity, slots), kept across generations.
        self._statics: dict[tuple[int, int], Any] = {}
        # After ``warm_up(freeze=True)``: the (capacity, slots) buckets it compiled, the only
        # ones a generation may take (another runs eager rather than wait for a compile).
        self._frozen: frozenset[tuple[int, int]] | None = None
        self._tree_nodes: tuple[int, int] | None = None  # a tree's (first column, nodes)

    def _new_cache(self) -> Any:
        return new_cache(self.model)

    @property
    def cache(self) -> Any:
        """The model's cache object (a static one on the compiled path)."""
        return self.kv.cache

    @cache.setter
    def cache(self, value: Any) -> None:
        self.kv.cache = value

    @property
    def rows(self) -> RowLayout | None:
        """Which columns are each row's tokens, in a cache whose rows keep their own columns
        (``shiftable``, after ``reset``); None in a column-aligned cache."""
        return self.kv.rows if self._ragged else None

    # The compiled path (``flashspec.compiled``).

    def compile_steps(self, lengths: Sequence[int]) -> None:
        """Run forwards of ``lengths`` tokens compiled on a static cache from now on (models
        ``flashspec.compiled.policy.obstacle`` accepts)."""
        self.compiled = CompiledForward(self.model, lengths, self.name, self.signature.cache_arg)

    def reserve(self, rows: int, columns: int) -> None:
        """After ``reset``: a generation of ``rows`` rows needs up to ``columns`` columns. On
        the compiled path it takes a static cache of that size's bucket, with the slot bucket
        of its rows (``flashspec.kv.slots``); too many rows for any bucket run eager."""
        slots = slot_count(rows)
        if self.compiled is None or slots is None or self.rows is None:
            return
        capacity = capacity_for(columns)
        if self.max_context is not None:
            capacity = min(capacity, max(self.max_context, columns))
        if not self._compiled_bucket(capacity, slots):
            return
        cache = self._statics.get((capacity, slots))
        if cache is None:
            cache = self._statics[capacity, slots] = new_static_cache(self.model, capacity)
        self.kv.cache = cache
        self.kv.static = True
        self.kv.slots = slots

    def _compiled_bucket(self, capacity: int, slots: int) -> bool:
        """Whether a generation may run in the static cache of ``capacity`` columns and
        ``slots`` slots: always, unless ``warm_up(freeze=True)`` compiled other buckets only."""
        return self._frozen is None or (capacity, slots) in self._frozen

    @property
    def frozen_buckets(self) -> frozenset[tuple[int, int]] | None:
        """The (capacity, slots) buckets that ``warm_up(freeze=True)`` compiled, the only
        ones generations run compiled in; None when nothing is frozen."""
        return self._frozen

    def warm_up(self, rows: int = 1, freeze: bool = False) -> None:
        """Compile every compiled length now, in the smallest capacity bucket (a server does
        this before it listens, so that no request waits for a compile), for batches of
        ``rows`` rows (their slot bucket's graphs) when that is more than one. ``freeze``:
        nothing is compiled after this; a generation that needs another bucket (a longer
        context, more slots) runs eager, since a compile while serving stalls every stream
        for seconds."""
        if self.compiled is None:
            return
        self._warm_up(rows)
        if freeze:
            self._frozen = frozenset(self._statics)

    def _warm_up(self, rows: int) -> None:
        assert self.compiled is not None
        capacity = MIN_COLUMNS
        if self.max_context is not None:
            capacity = min(capacity, self.max_context)
        largest = slot_count(min(rows, SLOT_BUCKETS[-1])) or 1
        for slots in SLOT_BUCKETS:
            if 1 < slots <= largest:
                self._warm_up_slots(capacity, slots)
        cache = self._statics.get((capacity, 1))
        if cache is None:
            cache = self._statics[capacity, 1] = new_static_cache(self.model, capacity)
        device = self.device
        start = 2
        with torch.inference_mode():
            ids = torch.zeros((1, start), dtype=torch.int64, device=device)
            self.compiled(ids, torch.arange(start, device=device)[None], 0, cache)  # buffers
            for n in self.compiled.lengths:
                ids = torch.zeros((1, n), dtype=torch.int64, device=device)
                positions = torch.arange(start, start + n, device=device)[None]
                self.compiled(ids, positions, start, cache)
            for n in self.compiled.tree_lengths:
                ids = torch.zeros((1, n), dtype=torch.int64, device=device)
                positions = torch.arange(start, start + n, device=device)[None]
                block = torch.ones((n, n), dtype=torch.bool, device=device).tril()
                self.compiled.tree(ids, positions, start, cache, block)

    def _warm_up_slots(self, capacity: int, slots: int) -> None:
        assert self.compiled is not None
        cache = self._statics.get((capacity, slots))
        if cache is None:
            cache = self._statics[capacity, slots] = new_static_cache(self.model, capacity)
        device = self.device
        start = 2
        with torch.inference_mode():
            ids = torch.zeros((slots, start), dtype=torch.int64, device=device)
            positions = torch.arange(start, device=device).expand(slots, -1)
            self.compiled.batch(ids, positions, 0, cache, None, slots)  # buffers
            for n in self.compiled.lengths:
                ids = torch.zeros((slots, n), dtype=torch.int64, device=device)
                positions = torch.arange(start, start + n, device=device).expand(slots, -1)
                self.compiled.batch(ids, positions, start, cache, None, slots)

    @property
    def static(self) -> bool:
        """Whether this generation's cache is a static one (the compiled path)."""
        return self.kv.static

    def _leave_static(self) -> None:
        """Continue eager on a dynamic cache with the same columns (what the static cache has
        no room for: more rows than slots, more columns than its capacity)."""
        if self.kv.static:
            rows = len(self.kv.rows.lengths) if self.kv.started else 0
            self.kv.cache = to_dynamic(self.kv.cache, self.cached, self.model, rows)
            self.kv.static = False
            self.kv.slots = 0

    def _slotted(self, rows: int, columns: int) -> bool:
        """Whether this generation runs on a static cache of several slots for ``rows`` rows
        and ``columns`` columns: the one it has, or a larger one its rows move into (more rows
        than slots, more columns than the capacity: a larger bucket of either). A batch no
        bucket holds continues on a dynamic cache."""
        if not self.kv.static:
            return False
        capacity = static_capacity(self.kv.cache)
        if capacity is None:
            return False
        if rows <= self.kv.slots and columns <= capacity:
            return self.kv.slots > 1
        slots = slot_count(max(rows, self.kv.slots))
        wider = capacity
        if columns > capacity:
            wider = capacity_for(columns)
            if self.max_context is not None:
                wider = min(wider, max(self.max_context, columns))
        if (
            slots is None
            or not initialized(self.kv.cache)
            or not self._compiled_bucket(wider, slots)
        ):
            self._leave_static()
            return False
        cache = self._statics.get((wider, slots))
        if cache is None:
            cache = self._statics[wider, slots] = new_static_cache(self.model, wider)
        held = len(self.kv.rows.lengths) if self.kv.started else 0
        grow_slots(self.kv.cache, cache, held, self.cached, slots)
        self.kv.cache = cache
        self.kv.slots = slots
        return slots > 1

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
        return eos_ids(getattr(self.model, "generation_config", None), self.config, self.tokenizer)

    def reset(self) -> None:
        """Start a new generation: empty cache."""
        self.kv.reset()
        self._ragged = self.shiftable
        self.cached = 0
        self._sliding = has_sliding_layers(self.cache)
        self._marks.clear()
        self.replays = 0
        self.replayed_tokens = 0
        self.replay_seconds = 0.0

    # Forwards: what to read (``feed``, ``forward``, ``feed_tree``), read by ``_read``.

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
            return self._read(ids, padding, keep)
        if not self.kv.started:
            self.kv.start(tokens.shape[0], tokens.device)
        width = tokens.shape[1]
        # A row may hold more than its committed tokens (a drafter's own drafts): none to feed.
        held = self.kv.rows.lengths
        need = [max(width - left - n, 0) for left, n in zip(padding.lefts, held, strict=True)]
        count = max(need, default=0)
        ids = tokens[:, width - count :]
        if extra is not None and extra.shape[1]:
            ids = torch.cat([ids, extra], dim=1)
        return self._read(ids, padding, keep, [count - n for n in need], tails)

    def forward(self, input_ids: torch.Tensor, padding: Padding, keep: int) -> torch.Tensor:
        """Feed the columns after ``cached``; return the last ``keep`` logits, (B, keep, V).

        Column-aligned: column j of ``input_ids`` is column ``cached + j`` of the batch, padding
        where ``padding`` says so (the prompt's layout)."""
        if self.rows is None:
            return self._read(input_ids, padding, keep)
        if not self.kv.started:
            self.kv.start(input_ids.shape[0], input_ids.device)
        start, length = self.cached, input_ids.shape[1]
        dead = [min(max(left - start, 0), length) for left in padding.lefts]
        return self._read(input_ids, padding, keep, dead)

    def _read(
        self,
        ids: torch.Tensor,
        padding: Padding,
        keep: int,
        dead: list[int] | None = None,
        tails: list[int] | None = None,
    ) -> torch.Tensor:
        """Read ``ids`` (B, n), the next columns: laid out by ``padding`` in a column-aligned
        cache, or, in the ragged layout, the first ``dead[b]`` and the last ``tails[b]`` dead
        in row b (the rest are its next tokens). The last ``keep`` logits, (B, keep, V)."""
        if dead is not None:
            logits = self.kv.forward(
                lambda positions, mask: self._call(ids, positions, mask, keep),
                ids.shape[1],
                dead,
                ids.device,
                tails,
            )
            self.cached = self.kv.width
            return logits
        if not self.support.chunked_exact and self.cached > 0 and ids.shape[1] > 1:
            # This family's multi-token forward after a cached state is not exact: feed tokens
            # one at a time (only drafters get here; such targets are refused).
            steps = [self._read(ids[:, j : j + 1], padding, 1) for j in range(ids.shape[1])]
            return torch.cat(steps[-keep:], dim=1)
        start, length = self.cached, ids.shape[1]
        positions = mask = None
        if self.signature.position_ids:
            positions = padding.position_ids(start, length)
            longest = start + length - padding.min_left  # the longest row's positions
            if self.max_context is not None and longest > self.max_context:
                # A row nearer its context limit than the row the round is sized for gets
                # columns past the limit; they are never emitted for it (the engine cuts each
                # row at its own limit), and clamped they index no missing position embedding.
                positions = positions.clamp_max(self.max_context - 1)
        if self.signature.attention_mask and padding.any:
            mask = padding.attention_mask(start + length)
        logits = self._call(ids, positions, mask, keep)
        self.cached = start + length
        return logits

    def _call(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        mask: torch.Tensor | None,
        keep: int,
    ) -> torch.Tensor:
        """The model's forward of ``ids`` (B, n) after the cache's columns, which it updates in
        place (every transformers release since 4.56): the last ``keep`` logits, (B, keep, V).
        ``positions`` (B, n) and ``mask`` (2-D over every column, or an additive 4-D one) are
        left out when None."""
        slotted = self._slotted(ids.shape[0], self.cached + ids.shape[1])
        if not slotted and self.kv.static and (mask is not None or ids.shape[0] != 1):
            self._leave_static()  # a one-slot static cache: a batch of one, every column alive
        with self._span:
            if slotted:
                assert self.compiled is not None and positions is not None
                batch = self.compiled.batch(
                    ids, positions, self.cached, self.cache, mask, self.kv.slots
                )
                return batch[:, -keep:]
            if self.kv.static:
                assert self.compiled is not None and positions is not None
                scores: torch.Tensor = self.compiled(ids, positions, self.cached, self.cache)
                return scores[:, -keep:]
            if self.signature.logits_to_keep:
                # A fused quantized Llama: its parts called directly (the same operations).
                with forward_threads(self.model, ids.numel(), int(ids.shape[0])):
                    direct = lean_logits(self.model, ids, positions, mask, self.cache, keep)
                if direct is not None:
                    return direct
            kwargs: dict[str, Any] = {self.signature.cache_arg: self.cache, "use_cache": True}
            if positions is not None:
                kwargs["position_ids"] = positions
            if mask is not None:
                kwargs["attention_mask"] = mask
            if self.signature.logits_to_keep:
                kwargs["logits_to_keep"] = keep
            output = self.model(input_ids=ids, **kwargs)
        logits: torch.Tensor = output.logits
        return logits[:, -keep:]

    def feed_tree(self, tokens: torch.Tensor, padding: Padding, tree: TokenTree) -> torch.Tensor:
        """Feed the one row's committed tokens the cache lacks, then ``tree``'s nodes in one
        forward (positions by depth; each node sees the committed columns and its ancestors);
        return (1, N + 1, V) logits: entry 0 after the newest committed token, entry i + 1
        after node i. ``keep_path`` then keeps the accepted nodes' columns. Needs the ragged
        layout (``shiftable``) and a batch of one. On the compiled path the tree runs on the
        static cache (``CompiledForward.tree``), whose columns are all alive."""
        rows = self.rows
        if rows is None or tokens.shape[0] != 1:
            raise RuntimeError(f"{self.name}: a token tree needs a shiftable model, one row")
        device = tokens.device
        if rows.alive is None:
            rows.start(1, device)
        assert rows.alive is not None
        static = (
            self.kv.static
            and self.kv.slots == 1
            and self.compiled is not None
            and bool(rows.alive.all())
        )
        if not static:
            self._leave_static()
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
        if static:
            assert self.compiled is not None
            with self._span:
                scores = self.compiled.tree(ids, positions, rows.width, self.cache, block)
            logits = scores[:, -(n + 1) :]
        else:
            dtype = _activation_dtype(self.model)
            mask = torch.zeros(seen.shape, dtype=dtype, device=device)
            mask.masked_fill_(~seen, torch.finfo(dtype).min)
            logits = self._call(ids, positions, mask.view(1, 1, *seen.shape), n + 1)
        rows.append(torch.ones((1, count), dtype=torch.bool, device=device), [count])
        self.cached = rows.width
        self._tree_nodes = (rows.width - n, n)
        return logits

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``feed_tree``: the row keeps the columns of the nodes ``path`` (depth 1
        first), moved next to its committed columns; the other nodes' columns are cut."""
        assert self.rows is not None and self._tree_nodes is not None
        start, n = self._tree_nodes
        self._tree_nodes = None
        self.kv.keep_path(start, n, path)
        self.cached = self.kv.width

    # Rolling back, and rows leaving, keeping their own counts and joining.

    def rollback(self, valid: int) -> None:
        """Keep only the first ``valid`` columns in the cache (no-op if it holds fewer).

        Column-aligned (see ``forward``); ragged batches use ``keep_rows``.

        A stateful model goes back to the state copy marked at ``valid`` (``mark``); without
        one the cache is emptied and the next forward starts from the first column, which is
        exact (a drafter's catch-up). Conv-only state crops like attention.
        """
        if not self.support.stateful:
            if self.cached > valid:
                if self.rows is not None and self.kv.started:
                    self.kv.truncate(valid)
                else:
                    crop_cache(self.cache, self.cached - valid)
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
        if not self._slotted(int(index.numel()), self.cached):
            self._leave_static()
        if self.rows is not None and self.kv.started:
            self.kv.select(index)
            self.cached = self.kv.width
        elif self.cached > 0:
            select_attention_rows(self.cache, index)
            select_state_rows(self.cache, index)

    def keep_rows(self, lengths: Sequence[int]) -> None:
        """Row b keeps its first ``lengths[b]`` tokens in the cache (at most what it holds)."""
        if self.rows is None:
            raise RuntimeError(f"{self.name}: keep_rows needs a shiftable model's cache")
        if not self.kv.started:
            return  # nothing read yet
        self.kv.keep(lengths)
        self.cached = self.kv.width

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """New rows (``tokens`` (n, L), right-aligned, laid out by ``padding``) join the batch.
        A cache that holds tokens reads all but each new row's newest now, so that the next
        forward feeds them no more than the others; an empty one reads them with the others."""
        if self.rows is None:
            raise RuntimeError(f"{self.name}: rows can only join a shiftable model's batch")
        held = len(self.kv.rows.lengths) if self.kv.started else 0
        if not self._slotted(held + tokens.shape[0], max(self.cached, tokens.shape[1])):
            self._leave_static()
        if not self.kv.started:
            return  # nothing read yet: the first forward reads every row
        if self.cached == 0 or all(tokens.shape[1] - 1 - left <= 0 for left in padding.lefts):
            # Nothing cached, or one-token prompts: nothing to read before the round.
            self.kv.add_empty(tokens.shape[0], tokens.device)
            return
        # Columns that are padding in every joining row are not read: ``join`` pads the new
        # rows' cache in front to the batch's width (a prompt joining a long-running batch
        # would otherwise be read at the batch's width, mostly dead columns).
        cut = min(padding.min_left, tokens.shape[1] - 1)
        saved = self.kv, self.cached
        self.kv, self.cached = RowCache(self._new_cache, self.max_context), 0
        self.kv.reset()
        try:
            self.feed(tokens[:, cut:-1], padding.dropped(cut), keep=1)
            joined = self.kv
        finally:
            self.kv, self.cached = saved
        self.kv.join(joined)
        self.cached = self.kv.width


def _activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's attention scores take (an additive mask's): its first floating
    parameter's (quantized models keep float32 norms and activations)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
