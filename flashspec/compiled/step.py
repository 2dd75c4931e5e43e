"""One model's forward on a static cache, compiled once per shape and replayed.

A forward of ``k`` tokens writes columns ``start .. start + k - 1`` of the static buffers and
attends causally to every column before its own: the static path runs a batch of one, whose
``RowLayout`` columns are all alive (a batch of one never keeps dead columns). Shapes are fixed
per (rows, tokens, capacity), so each is one graph. The lengths a round uses are compiled
(``lengths``); a shorter forward is padded up to the next of them (the padding columns come
after every real token, so no real token sees them, and the next forward writes over them); a
slightly longer one runs as several; anything longer (prefill) runs eager on the same buffers
with the same mask.

A ragged batch (``batch``) runs on a static cache of fixed slots (``flashspec.kv.slots``): its
graphs are per slot bucket, not per batch size, and take the columns each row owns as an input
(``batch_mask``), so rows finishing, joining and dead columns never change a graph.

A token tree (``tree``) is one more kind of forward: its new columns see each other as a
boolean ``block`` (count, count) says (a node its ancestors and itself), every column before
them as a chain's do. Its graphs, one per padded node count (``tree_lengths``), are a compiled
copy of their own, so that a chain's graphs and guards never see a block.

Compiling is counted: ``compile_seconds`` (first calls of each shape), ``graphs`` (shapes
compiled) and ``recompiles`` (a shape compiled again after its first call, which should never
happen; ``FLASHSPEC_COMPILE_DEBUG=1`` makes it an error and logs dynamo's reasons).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..quant.layers import QuantLinear
from ..quant.threads import torch_threads
from .static import initialized, static_capacity

LOG = logging.getLogger("flashspec")

CHUNKS = 3
"""A forward up to this many times the longest compiled length runs as compiled pieces; a
longer one runs eager."""


def debug_recompiles() -> bool:
    """Whether ``FLASHSPEC_COMPILE_DEBUG`` asks for recompiles to be errors."""
    return os.environ.get("FLASHSPEC_COMPILE_DEBUG", "") not in ("", "0")


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RecompileError(RuntimeError):
    """A compiled shape was compiled again after warm-up (``FLASHSPEC_COMPILE_DEBUG``)."""


class CompiledForward:
    """``model``'s forward on a static cache: compiled for the token counts ``lengths``, eager
    otherwise (see the module docstring).

    Args:
        model: the HuggingFace causal LM (attention-only, positions and a mask as arguments).
        lengths: token counts to compile (e.g. ``(1,)`` for a drafter's step, ``(5,)`` for a
            target verifying 4 drafts).
        name: a label for log lines.
        cache_arg: the name of the forward's cache argument (``cache``, or ``past_key_values``
            in older transformers).

    Attributes:
        compile_seconds: seconds spent in the first call of each compiled shape.
        graphs: the (rows, tokens, capacity) shapes compiled for chains.
        tree_lengths: token counts a tree's forward is compiled for (``compile_trees``).
        tree_graphs: the (rows, tokens, capacity) shapes compiled for trees.
        batch_graphs: the (slots, tokens, capacity) shapes compiled for batches (``batch``).
        recompiles: compiles of a shape after its first call.
        failed: why compiling was given up (the forward then runs eager), or None.
        compiled_calls, eager_calls: forwards run each way.
    """

    def __init__(
        self, model: torch.nn.Module, lengths: Sequence[int], name: str, cache_arg: str = "cache"
    ) -> None:
        if not lengths or any(int(n) < 1 for n in lengths):
            raise ValueError(f"lengths must be token counts >= 1, got {list(lengths)!r}")
        self.model = model
        self.lengths = sorted({int(n) for n in lengths})
        self.name = name
        self.cache_arg = cache_arg
        config: Any = getattr(model, "config", None)
        self._additive = getattr(config, "_attn_implementation", "sdpa") == "eager"
        cuda = next(model.parameters()).device.type == "cuda"
        # CUDA graphs replay the whole step on a GPU; on a CPU inductor's fused code is the gain.
        mode = "reduce-overhead" if cuda else "default"
        # Dynamo keeps its graphs per code object, and every CompiledForward would share
        # ``_step``'s: a drafter's and a target's graphs would count as recompiles of one
        # another and exhaust the recompile limit together. A copy of the code per instance
        # keeps each model's graphs, and its recompile count, its own.
        # Each kind of forward (a chain's, a tree's, a batch's) gets a copy too: one kind's
        # graphs never meet another kind's inputs.
        self._compiled: dict[str, Callable[..., torch.Tensor]] = {}
        for kind, method in _KINDS.items():
            code = types.FunctionType(method.__code__.replace(), method.__globals__)
            self._compiled[kind] = torch.compile(
                types.MethodType(code, self), fullgraph=True, dynamic=False, mode=mode
            )
        self.tree_lengths: list[int] = []
        self.compile_seconds = 0.0
        self.graphs: set[tuple[int, int, int]] = set()
        self.tree_graphs: set[tuple[int, int, int]] = set()
        self.batch_graphs: set[tuple[int, int, int]] = set()
        self._graphs = {"chain": self.graphs, "tree": self.tree_graphs, "batch": self.batch_graphs}
        self.recompiles = 0
        self.failed: str | None = None
        self.compiled_calls = 0
        self.eager_calls = 0
        self._weights: tuple[torch.dtype, torch.device] | None = None
        # A quantized model's kernels bring their own threads: its compiled graph runs torch's
        # code on one thread, as its eager forward does (flashspec.quant.threads).
        self._threads = 1 if any(isinstance(m, QuantLinear) for m in model.modules()) else None
        if debug_recompiles():
            logs: Any = importlib.import_module("torch._logging")
            logs.set_logs(recompiles=True)  # dynamo says which guard failed

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, start: int, cache: Any
    ) -> torch.Tensor:
        """Logits (B, k, V) of ``ids`` (B, k) at ``positions``, written from column ``start``
        after ``start`` columns every row attends to."""
        capacity = static_capacity(cache)
        if capacity is None:
            raise TypeError("CompiledForward needs a static cache (flashspec.compiled.static)")
        count = ids.shape[1]
        longest = self.lengths[-1]
        if self.failed is not None or not initialized(cache) or count > CHUNKS * longest:
            return self._eager(ids, positions, start, cache, capacity)
        if count > longest:
            pieces = [
                self(ids[:, b : b + longest], positions[:, b : b + longest], start + b, cache)
                for b in range(0, count, longest)
            ]
            return torch.cat(pieces, dim=1)
        length = next(n for n in self.lengths if n >= count)
        if start + length > capacity:
            return self._eager(ids, positions, start, cache, capacity)
        if length > count:
            extra = length - count
            ids = torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1)
            steps = torch.arange(1, extra + 1, device=positions.device).unsqueeze(0)
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        logits = self._run(ids, positions, start, cache, capacity)
        return logits[:, :count]

    def compile_trees(self, nodes: int) -> None:
        """Compile token trees of up to ``nodes`` nodes (plus the newest committed token
        before them): a smaller tree is padded up to that count, one graph per capacity."""
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.tree_lengths = sorted({*self.tree_lengths, nodes + 1})

    def tree(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        cache: Any,
        block: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (1, k, V) of a token tree's forward: ``ids`` (1, k) at ``positions``, written
        from column ``start``; query i sees every column before ``start`` and new column j
        where ``block[i, j]`` (a (k, k) boolean: its ancestors and itself)."""
        capacity = static_capacity(cache)
        if capacity is None:
            raise TypeError("CompiledForward needs a static cache (flashspec.compiled.static)")
        count = ids.shape[1]
        length = next((n for n in self.tree_lengths if n >= count), None)
        fits = length is not None and start + length <= capacity
        if self.failed is not None or not initialized(cache) or not fits:
            return self._eager(ids, positions, start, cache, capacity, "tree", block)
        assert length is not None
        if length > count:
            # Padding queries come after every real one and no real query sees them; their
            # columns are cut with the tree's other nodes.
            extra = length - count
            ids = torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1)
            steps = torch.arange(1, extra + 1, device=positions.device).unsqueeze(0)
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
            padded = torch.ones((length, length), dtype=torch.bool, device=block.device).tril()
            padded[:count, :count] = block
            padded[:count, count:] = False
            block = padded
        logits = self._run(ids, positions, start, cache, capacity, "tree", block)
        return logits[:, :count]

    def batch(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        cache: Any,
        alive: torch.Tensor | None,
        slots: int,
    ) -> torch.Tensor:
        """Logits (B, k, V) of a ragged batch's forward on a static cache of ``slots`` rows
        (``flashspec.kv.slots``): ``ids`` (B, k) at ``positions``, written from column
        ``start`` of slots 0..B-1; ``alive`` (B, start + k), nonzero where a row owns a column
        (None: every column is every row's). Query i of row b sees the columns up to
        ``start + i`` that row b owns. The spare slots read a spare token at position 0."""
        capacity = static_capacity(cache)
        if capacity is None:
            raise TypeError("CompiledForward needs a static cache (flashspec.compiled.static)")
        rows, count = ids.shape
        if rows > slots:
            raise ValueError(f"{self.name}: a batch of {rows} rows does not fit {slots} slots")
        longest = self.lengths[-1]
        if longest < count <= CHUNKS * longest and self.failed is None and initialized(cache):
            pieces = []
            for b in range(0, count, longest):
                owns = None if alive is None else alive[:, : start + b + longest]
                part = slice(b, b + longest)
                pieces.append(
                    self.batch(ids[:, part], positions[:, part], start + b, cache, owns, slots)
                )
            return torch.cat(pieces, dim=1)
        device = ids.device
        owned = torch.zeros((slots, capacity), dtype=torch.bool, device=device)
        if alive is None:
            owned[:rows, : start + count] = True
        else:
            owned[:rows, : start + count] = alive.to(torch.bool)
        owned[rows:, start : start + count] = True  # a spare slot's queries see themselves
        if rows < slots:
            spare = slots - rows
            ids = torch.cat([ids, ids.new_zeros((spare, count))])
            positions = torch.cat([positions, positions.new_zeros((spare, count))])
        length = next((n for n in self.lengths if n >= count), None)
        fits = length is not None and start + length <= capacity
        if self.failed is not None or not initialized(cache) or not fits:
            logits = self._eager(ids, positions, start, cache, capacity, "batch", owned)
            return logits[:rows]
        assert length is not None
        if length > count:
            # Padding columns come after every real one: causality hides them from real
            # queries, and the next forward writes over them.
            extra = length - count
            ids = torch.cat([ids, ids[:, -1:].expand(-1, extra)], dim=1)
            steps = torch.arange(1, extra + 1, device=device).unsqueeze(0)
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
            owned[:, start + count : start + length] = True
        logits = self._run(ids, positions, start, cache, capacity, "batch", owned)
        return logits[:rows, :count]

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        cache: Any,
        capacity: int,
        kind: str = "chain",
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = (ids.shape[0], ids.shape[1], capacity)
        seen = self._graphs[kind]
        first = shape not in seen
        self._check_model()
        before = _graph_count()
        began = time.perf_counter()
        where = torch.tensor(start, dtype=torch.int64, device=ids.device)
        # Strides are part of a graph's guards, even those of size-1 dimensions, which
        # ``contiguous()`` leaves as they are: slices of the token matrix would recompile.
        ids, positions = _dense(ids), _dense(positions)
        threads = torch_threads(self._threads) if self._threads else contextlib.nullcontext()
        try:
            with threads:
                inputs = () if extra is None else (_dense(extra),)
                logits = self._call_compiled(first, kind, ids, positions, where, cache, *inputs)
        except Exception as exc:  # any compiler failure leaves the eager path
            if isinstance(exc, RecompileError):
                raise
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            LOG.warning(
                "flashspec: compiling %s failed (%s); it runs eager from now on",
                self.name,
                self.failed,
            )
            return self._eager(ids, positions, start, cache, capacity, kind, extra)
        self.compiled_calls += 1
        if first:
            seen.add(shape)
            seconds = time.perf_counter() - began
            self.compile_seconds += seconds
            LOG.info(
                "flashspec: compiled %s for %d row(s) x %d token(s)%s, %d columns in %.1f s",
                self.name,
                shape[0],
                shape[1],
                {"chain": "", "tree": " of a tree", "batch": " of a batch"}[kind],
                shape[2],
                seconds,
            )
        elif _graph_count() != before:
            self.recompiles += 1
            message = (
                f"flashspec: {self.name} was compiled again for {shape[0]} row(s) x "
                f"{shape[1]} token(s), {shape[2]} columns after its first call"
            )
            if debug_recompiles():
                raise RecompileError(message)
            LOG.warning("%s (set FLASHSPEC_COMPILE_DEBUG=1 to see why)", message)
        return logits

    def _call_compiled(
        self, first: bool, kind: str, ids: torch.Tensor, positions: torch.Tensor,
        where: torch.Tensor, cache: Any, *extra: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        compiled = self._compiled[kind]
        if first:
            return compiled(ids, positions, where, cache, *extra)
        # Every input is built here with the shapes, dtypes and strides of the graph's first
        # call, and the model is checked above (``_check_model``), so only the guards that tell
        # this model's graphs apart need to run: a full evaluation costs up to a millisecond.
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return compiled(ids, positions, where, cache, *extra)

    def _check_model(self) -> None:
        """The graphs were compiled for the model's parameters as they were; a model moved to
        another dtype or device after that needs new ones (a new engine)."""
        weight = next(self.model.parameters())
        seen = (weight.dtype, weight.device)
        if self._weights is None:
            self._weights = seen
        elif seen != self._weights:
            raise RuntimeError(
                f"{self.name} moved from {self._weights[0]} on {self._weights[1]} to "
                f"{seen[0]} on {seen[1]} after it was compiled; build a new engine for it"
            )

    def _eager(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        cache: Any,
        capacity: int,
        kind: str = "chain",
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.eager_calls += 1
        if start + ids.shape[1] > capacity:
            raise RuntimeError(
                f"{self.name}: a forward of {ids.shape[1]} token(s) from column {start} does not "
                f"fit a static cache of {capacity} columns"
            )
        where = torch.tensor(start, dtype=torch.int64, device=ids.device)
        if kind == "tree" and extra is not None:
            return self._tree_step(ids, positions, where, cache, extra)
        if kind == "batch" and extra is not None:
            return self._batch_step(ids, positions, where, cache, extra)
        return self._step(ids, positions, where, cache)

    def _step(
        self, ids: torch.Tensor, positions: torch.Tensor, start: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        capacity = cache.layers[0].max_cache_len
        mask = causal_mask(start, ids.shape[1], capacity, ids.device)
        return self._forward(ids, positions, start, cache, mask)

    def _tree_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: torch.Tensor,
        cache: Any,
        block: torch.Tensor,
    ) -> torch.Tensor:
        capacity = cache.layers[0].max_cache_len
        mask = tree_mask(start, block, capacity)
        return self._forward(ids, positions, start, cache, mask)

    def _batch_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: torch.Tensor,
        cache: Any,
        owned: torch.Tensor,
    ) -> torch.Tensor:
        mask = batch_mask(start, ids.shape[1], owned)
        return self._forward(ids, positions, start, cache, mask)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        start: torch.Tensor,
        cache: Any,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        for layer in cache.layers:
            layer.cumulative_length.copy_(start)  # where this forward writes
        mask = mask.expand(ids.shape[0], -1, -1, -1)
        if self._additive:
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        kwargs: dict[str, Any] = {self.cache_arg: cache, "use_cache": True}
        output = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, **kwargs)
        logits: torch.Tensor = output.logits
        return logits


def causal_mask(
    start: torch.Tensor, count: int, capacity: int, device: torch.device
) -> torch.Tensor:
    """The (1, 1, count, capacity) boolean mask of a forward of ``count`` tokens written from
    column ``start`` of a static cache: query i sees the columns up to its own. The columns
    past it hold stale keys of earlier forwards; they stay hidden until written again."""
    columns = torch.arange(capacity, device=device).unsqueeze(0)
    query = (start + torch.arange(count, device=device)).unsqueeze(1)
    return (columns <= query)[None, None]


def batch_mask(start: torch.Tensor, count: int, owned: torch.Tensor) -> torch.Tensor:
    """The (slots, 1, count, capacity) boolean mask of a batch's forward of ``count`` tokens
    written from column ``start``: query i of slot b sees the columns up to ``start + i``
    that slot b owns (``owned`` (slots, capacity))."""
    columns = torch.arange(owned.shape[1], device=owned.device)
    query = start + torch.arange(count, device=owned.device)
    causal = columns.unsqueeze(0) <= query.unsqueeze(1)  # (count, capacity)
    return (owned.unsqueeze(1) & causal.unsqueeze(0)).unsqueeze(1)


def tree_mask(start: torch.Tensor, block: torch.Tensor, capacity: int) -> torch.Tensor:
    """The (1, 1, count, capacity) boolean mask of a token tree's forward of ``count`` tokens
    written from column ``start``: query i sees every column before ``start``, and column
    ``start + j`` where ``block[i, j]``; nothing after the tree."""
    count = block.shape[0]
    columns = torch.arange(capacity, device=block.device)
    offset = columns - start  # (capacity,): a column's place among the tree's, if it is one
    inside = (offset >= 0) & (offset < count)
    picked = block.index_select(1, offset.clamp(0, count - 1))  # (count, capacity)
    return ((columns < start).unsqueeze(0) | (inside.unsqueeze(0) & picked))[None, None]


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` with the standard strides of its shape."""
    return x.clone(memory_format=torch.contiguous_format)


_KINDS = {
    "chain": CompiledForward._step,
    "tree": CompiledForward._tree_step,
    "batch": CompiledForward._batch_step,
}
"""The step each kind of forward compiles (see ``CompiledForward.__init__``)."""
