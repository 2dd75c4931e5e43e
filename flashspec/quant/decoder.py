"""A quantized Llama decoder's layers in one C call: ``flashspec._quant.decoder_step``.

Once the products read GGUF blocks, most of a small model's decoding step is the ~1,100 torch
operations around them (norms, RoPE, the cache's concatenation, attention, residuals) and the
Python that calls them. ``FusedDecoder`` runs every layer of a plain Llama decoder whose
projections are all ``QuantLinear`` in one call that releases the GIL: the same operations in
transformers' order, only float32 sums in another order (logits agree to rounding, as between
kernel backends; greedy output follows the tie rule of ``flashspec._greedy``).

The lean forward (``flashspec._lean``) takes it for the calls it fits: a ``DynamicCache`` of
plain ``DynamicLayer``s and no mask, a 2-D one over the cache's columns and the new ones, or a
token tree's 4-D one over the same columns (any number of new positions: a prompt's prefill
included, its products read the blocks in passes of 16 rows, which measured faster here than
dequantizing the weights for the BLAS). A batch's rows share every product (the weights are
read once for all of them), and the 2-D mask hides each row's dead columns (its padding and
rejected drafts, ``flashspec.kv.layout``) from its attention; a tree's mask (B, 1, m, past + m)
comes as a row per query instead, each node seeing the committed columns and its ancestors
only. Keys and values then live in one preallocated buffer per cache (``_KVStore``) and each
layer's ``keys``/``values`` are prefix views of it, so a step writes its new positions in
place instead of copying the whole cache, and a rollback (``crop``: a shorter view) needs no
copy either. Anything that replaced the views (a batch's compaction or change of rows,
another path's ``torch.cat``) is noticed by pointer and copied back in before the next fused
step.

Set ``FLASHSPEC_QUANT_DECODER=0`` to keep the per-operation forward.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from .layers import QuantLinear
from .ops import kernels

ENV = "FLASHSPEC_QUANT_DECODER"
"""Set to ``0`` to run a quantized model's layers operation by operation."""

_STORE_ATTR = "_flashspec_kv"
_GROW_POSITIONS = 256
CHUNK_ROWS = 256
"""Most positions one C call takes (a longer prompt runs in pieces of this many)."""


class _KVStore:
    """Every layer's keys and values in one float32 buffer, [2 * layers, rows, kv_heads, cap,
    hd] (keys of layer l at 2l, values at 2l + 1), the front of ``flat``.

    ``spare``: an earlier store's ``flat`` that no layer reads any more, reused when it holds
    at least ``cap`` columns for these rows (the capacity is then all it holds): a batch whose
    rows join and leave (the server's continuous batching) changes its row count every few
    rounds, and a fresh buffer of a few hundred MB costs its page faults each time."""

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        cap: int,
        spare: torch.Tensor | None = None,
    ) -> None:
        column = 2 * layers * rows * kv_heads * head_dim  # floats of one column
        if spare is not None and spare.numel() >= column * cap:
            flat, capacity = spare, spare.numel() // column
        else:
            flat, capacity = torch.empty(column * cap), cap
        self.flat = flat
        self.capacity = capacity
        self.rows = rows
        self.buf = flat[: column * capacity].view(2 * layers, rows, kv_heads, capacity, head_dim)
        self.array = self.buf.view(layers, 2, rows, kv_heads, capacity, head_dim).numpy()
        self.pointers = [self.buf[i].data_ptr() for i in range(2 * layers)]
        self.strides = (kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
        self.bound: tuple[list[Any], int] | None = None
        """What the last step left: per layer ``(layer, keys, values)`` (the store's prefix
        views it set), and the columns they hold. While every layer still holds those very
        tensors, they are the store's views and nothing needs checking: transformers' layers
        and flashspec's layout only ever replace a layer's tensors (``cat``, slicing, index
        selection), never resize them in place."""


class FusedDecoder:
    """The C plan of one ``LlamaModel``'s layers; ``step`` runs them (see the module text)."""

    def __init__(self, model: Any) -> None:
        config = model.config
        layers = list(model.layers[: config.num_hidden_layers])
        first = layers[0]
        self.layers = len(layers)
        self.dim = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(first.self_attn.head_dim)
        self.ffn = int(config.intermediate_size)
        eps = float(first.input_layernorm.variance_epsilon)
        rows = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            row: list[Any] = [
                _norm_array(layer.input_layernorm),
                _norm_array(layer.post_attention_layernorm),
            ]
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                           mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # fmt: skip
                row += [linear._raw(), linear.qtype]
            rows.append(tuple(row))
        self.plan = kernels().decoder_plan(
            rows, self.dim, self.heads, self.kv_heads, self.head_dim, self.ffn, eps,
            float(first.self_attn.scaling),
        )  # fmt: skip

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        # The plan points into this model's blocks: a copied model builds its own (attach).
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _no_plan, ()

    def step(
        self,
        cache: Any,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> bool:
        """Run every layer over ``hidden`` (B, m, dim), contiguous, in place, with the rotary
        tables ``cos``/``sin`` (B or 1, m, head_dim), appending to ``cache``. ``mask``: None
        (every column visible to every row), (B, past + m) (one row for all of a batch row's
        positions) or (B, m, past + m) (a row for each position: a token tree, each node
        seeing the committed columns and its ancestors), nonzero where a position sees a
        column; position i never sees a column past ``past + i`` either way. False, touching
        nothing the caller reads, when the cache or mask is not one this path takes (the
        caller then runs the layers itself)."""
        batch, m = int(hidden.shape[0]), int(hidden.shape[1])
        if mask is not None and mask.dim() not in (2, 3):
            return False
        past = self._bind(cache, batch, m)
        if past is None:
            return False
        keys_mask: torch.Tensor | None = None
        if mask is not None:
            want = (batch, past + m) if mask.dim() == 2 else (batch, m, past + m)
            if tuple(mask.shape) != want:
                return False
            keys_mask = mask.to(torch.uint8).contiguous()
        store: _KVStore = cache.__dict__[_STORE_ATTR]
        shape = (batch, m, self.head_dim)
        cos = cos.expand(shape).contiguous()
        sin = sin.expand(shape).contiguous()
        step = kernels().decoder_step
        # A long prompt in pieces of positions (bounded scratch), every row at once.
        chunk = max(1, CHUNK_ROWS // batch)
        for start in range(0, m, chunk):
            stop = min(m, start + chunk)
            if start == 0 and stop == m:
                part, c, s = hidden, cos, sin
            else:
                part = hidden[:, start:stop].contiguous()
                c, s = cos[:, start:stop].contiguous(), sin[:, start:stop].contiguous()
            rows = batch * (stop - start)
            step(self.plan, part.view(rows, self.dim).numpy(),
                 c.view(rows, self.head_dim).numpy(), s.view(rows, self.head_dim).numpy(),
                 store.array, past + start, _mask_rows(keys_mask, start, stop))  # fmt: skip
            if part is not hidden:
                hidden[:, start:stop] = part
        views = store.buf[:, :, :, : past + m].unbind(0)
        held = []
        for index, layer in enumerate(cache.layers):
            keys, values = views[2 * index], views[2 * index + 1]
            layer.keys, layer.values = keys, values
            held.append((layer, keys, values))
        store.bound = (held, past + m)
        return True

    def _bind(self, cache: Any, batch: int, m: int) -> int | None:
        """The cached length after making the store hold every layer's keys and values for
        ``batch`` rows (with room for ``m`` more columns), or None when the cache is not one
        this path keeps."""
        layers: list[Any] = cache.layers
        if len(layers) != self.layers or getattr(cache, "offloading", False):
            return None
        old: _KVStore | None = cache.__dict__.get(_STORE_ATTR)
        bound = None if old is None or old.rows != batch else old.bound
        if bound is not None and old is not None and bound[1] + m <= old.capacity:
            held, past = bound
            if all(
                layer is was and layer.keys is keys and layer.values is values
                for layer, (was, keys, values) in zip(layers, held, strict=True)
            ):
                return past  # every layer still holds the views the last step left
        from ..kv.store import plain_layer_types

        plain = plain_layer_types()  # a store layer adopts the views it finds
        if any(type(layer) not in plain for layer in layers):
            return None
        fresh = [getattr(layer, "keys", None) is None for layer in layers]
        if all(fresh):  # a new cache: every layer initialized empty, as its update would
            empty = torch.empty((batch, self.kv_heads, 0, self.head_dim))
            for layer in layers:
                layer.update(empty, empty)
        elif any(fresh):
            return None
        first_keys: Any = layers[0].keys
        past = int(first_keys.shape[-2]) if first_keys.dim() == 4 else 0
        store = old
        if store is None or store.rows != batch or store.capacity < past + m:
            # Grow geometrically: copies stay O(1) a position over a long generation. Rows that
            # joined or left come as the layers' own tensors: the old buffer is free again.
            headroom = old.capacity // 2 if old is not None and old.rows == batch else 0
            wanted = past + m + max(_GROW_POSITIONS, headroom)
            spare = None if old is None or _reads(layers, old.flat) else old.flat
            store = _KVStore(self.layers, batch, self.kv_heads, self.head_dim, wanted, spare)
        shape = (batch, self.kv_heads, past, self.head_dim)
        for index, layer in enumerate(layers):
            keys: Any = layer.keys
            values: Any = layer.values
            if (
                keys.data_ptr() == store.pointers[2 * index]
                and values.data_ptr() == store.pointers[2 * index + 1]
                and keys.stride() == store.strides
                and values.stride() == store.strides
                and keys.shape[-2] == past
                and values.shape[-2] == past
            ):
                continue  # already the store's prefix views
            if past == 0 and keys.numel() == 0 and values.numel() == 0:
                continue
            if (
                tuple(keys.shape) != shape
                or tuple(values.shape) != shape
                or keys.dtype != torch.float32
                or values.dtype != torch.float32
            ):
                return None
            store.buf[2 * index, :, :, :past].copy_(keys)
            store.buf[2 * index + 1, :, :, :past].copy_(values)
        cache.__dict__[_STORE_ATTR] = store
        return past


def _mask_rows(mask: torch.Tensor | None, start: int, stop: int) -> Any:
    """The C step's mask for positions ``start`` .. ``stop - 1``: a batch mask (B, columns) as
    it is (the piece's queries see the same row); a per-query one (B, m, columns) cut to the
    piece's queries, (B * (stop - start), columns), row j being position j % (stop - start)
    of batch row j // (stop - start), as ``decoder_step`` reads it."""
    if mask is None:
        return None
    if mask.dim() == 2:
        return mask.numpy()
    piece = mask[:, start:stop]
    return piece.reshape(-1, mask.shape[-1]).contiguous().numpy()


def _reads(layers: list[Any], flat: torch.Tensor) -> bool:
    """Whether any layer's keys or values lie in ``flat``."""
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    for layer in layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None and tensor.numel() and start <= tensor.data_ptr() < end:
                return True
    return False


def _classes(model: Any) -> tuple[type, type] | None:
    """The decoder-layer and norm classes of ``model`` if it is a Llama decoder the C step
    repeats (transformers' ``LlamaModel`` or flashspec's own), else None. transformers'
    modeling code is imported only for a model that is transformers'."""
    from .llama import DecoderLayer, FusedLlamaModel, RMSNorm

    if type(model) is FusedLlamaModel:
        return DecoderLayer, RMSNorm
    if not type(model).__module__.startswith("transformers.models.llama"):
        return None
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:
        return None
    if type(model) is not llama.LlamaModel:
        return None
    return llama.LlamaDecoderLayer, llama.LlamaRMSNorm


def llama_decoder(module: Any) -> bool:
    """Whether ``module`` is a Llama decoder (transformers' ``LlamaModel`` or flashspec's
    ``FusedLlamaModel``), without importing transformers' modeling code for anything else."""
    return _classes(module) is not None


def _is_silu(act: Any) -> bool:
    # torch's module, or transformers' own (ACT2FN["silu"]), which calls F.silu.
    if type(act) is torch.nn.SiLU:
        return True
    silu = getattr(importlib.import_module("transformers.activations"), "SiLUActivation", None)
    return silu is not None and type(act) is silu


def _no_plan() -> None:
    return None


def _norm_array(norm: Any) -> Any:
    weight = norm.weight.detach()
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("the fused decoder takes contiguous float32 norm weights")
    return weight.numpy()


def fused_decoder(model: Any) -> FusedDecoder | None:
    """A ``FusedDecoder`` for ``model`` (a transformers ``LlamaModel``, or flashspec's own
    ``FusedLlamaModel``) when every part of its layers is one the C step repeats exactly, else
    None: all seven projections ``QuantLinear`` without bias, SiLU, RMSNorm with float32
    weights and one epsilon, standard attention."""
    if os.environ.get(ENV, "").strip() == "0":
        return None
    classes = _classes(model)
    if classes is None or getattr(model.config, "pretraining_tp", 1) > 1:
        return None
    layer_class: Any = classes[0]
    norm_class: Any = classes[1]
    config = model.config
    layers: list[Any] = list(model.layers[: config.num_hidden_layers])
    if not layers or config._attn_implementation not in ("sdpa", "eager"):
        return None
    eps = layers[0].input_layernorm.variance_epsilon
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not layer_class or not _is_silu(mlp.act_fn):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not norm_class or n.variance_epsilon != eps for n in norms):
            return None
        if any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
            return None
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                       mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # fmt: skip
            if type(linear) is not QuantLinear or linear.bias is not None:
                return None
    try:
        return FusedDecoder(model)
    except (ValueError, TypeError):  # a shape the plan refuses: keep the torch path
        return None


def attach(model: torch.nn.Module) -> int:
    """Give every eligible ``LlamaModel`` inside ``model`` its fused decoder; returns how many."""
    count = 0
    for module in model.modules():
        fused = fused_decoder(module)
        if fused is not None:
            module.__dict__["_flashspec_fused"] = fused
            count += 1
    return count


def packs_dead_columns(model: Any) -> bool:
    """Whether ``model``'s decoder runs the C step, which skips the dead columns of a batch's
    forward (padding, drafts a row did not make) instead of computing them."""
    modules = getattr(model, "modules", None)
    return modules is not None and any(fused_of(m) is not None for m in modules())


def fused_of(module: torch.nn.Module) -> FusedDecoder | None:
    """The fused decoder ``attach`` gave ``module``, if any."""
    fused: FusedDecoder | None = module.__dict__.get("_flashspec_fused")
    return fused


__all__ = [
    "ENV",
    "FusedDecoder",
    "attach",
    "fused_decoder",
    "fused_of",
    "llama_decoder",
    "packs_dead_columns",
]
