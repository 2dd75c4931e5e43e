"""A transformers model built from a GGUF file with its quantized layers kept as blocks.

transformers' own GGUF load (``from_pretrained(..., gguf_file=...)``) dequantizes every tensor.
``build_quantized_model`` builds the same model from the same config (transformers' class, or
for a plain Llama ``flashspec.quant.llama``'s, which runs the same operations without importing
transformers' modeling code), then fills it from the file itself: each linear layer (and the
token embedding, and a tied head) whose blocks are in a format the kernels take becomes a
``QuantLinear``/``QuantEmbedding`` over those blocks,
memory-mapped (Q4_0, Q4_1, Q5_0 and Q8_0 as the file holds them; Q4_K and Q6_K repacked in
memory into layouts the SIMD kernels run, with the same values); every other tensor (norms,
biases, formats the kernels lack) is dequantized the way transformers does it. transformers'
tensor names and its per-architecture processing are used as they are: a processor that only
reorders a weight's rows (Llama's q/k permutation) has the rows of blocks reordered the same
way; any other processing of a quantized layer is applied to its dequantized values and the
layer stays dense.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .decoder import attach
from .gguf_file import read_tensors
from .layers import QuantEmbedding, QuantLinear
from .llama import FusedLlamaForCausalLM, fits, wanted
from .ops import REPACKED, formats, repack
from .threads import share_cores


@dataclass
class QuantizedLoad:
    """What ``build_quantized_model`` kept as blocks and what it dequantized."""

    quantized: dict[str, str] = field(default_factory=dict)
    """Module name -> the format its blocks stay in."""
    dense: list[str] = field(default_factory=list)
    """Parameters filled with dequantized (or float) values."""
    tied_head: bool = False
    repacked: dict[str, str] = field(default_factory=dict)
    """Module name -> the file's format, for layers repacked into another layout on load."""

    def summary(self) -> str:
        """One line: how many layers run on blocks, in which formats, and what is dense."""
        counts: dict[str, int] = {}
        for name in self.quantized.values():
            counts[name] = counts.get(name, 0) + 1
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items()))
        head = " (head tied to the embedding's blocks)" if self.tied_head else ""
        sources: dict[str, int] = {}
        for name in self.repacked.values():
            sources[name] = sources.get(name, 0) + 1
        repacked = ", ".join(f"{n} {fmt}" for fmt, n in sorted(sources.items()))
        repacked = f"; repacked from the file's {repacked}" if repacked else ""
        return (
            f"{len(self.quantized)} layers on GGUF blocks ({kinds}{repacked}){head}, "
            f"{len(self.dense)} tensors dense float32"
        )


def build_quantized_model(
    source: str | Path, config: Any, keep: Collection[int] | None = None
) -> tuple[torch.nn.Module, QuantizedLoad]:
    """The causal LM of ``config`` with its weights from the GGUF file ``source``.

    ``config`` is the file's transformers config (``AutoConfig.from_pretrained(folder,
    gguf_file=name)``). ``keep`` names the GGML types that stay blocks (default: every format
    the kernels take); layers in other formats are dequantized. Q4_K and Q6_K layers are
    repacked into layouts the SIMD kernels run (``REPACKED``; the same weight values, in
    memory rather than mapped from the file) when ``keep`` holds the repacked layout; Q5_0
    layers, like Q4_0/Q4_1/Q8_0, stay the file's blocks, memory-mapped.
    Returns the model (eval mode,
    float32 activations, CPU) and a record of which layers stayed quantized.

    Raises:
        ValueError: the file's tensors do not fill the model (an architecture whose GGUF
            processing the quantized load does not follow): load it with ``dtype='float32'``.
        ImportError: ``gguf``, ``accelerate`` or the kernels are missing.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    kinds = formats()
    if keep is not None:
        kinds = {qtype: kind for qtype, kind in kinds.items() if qtype in keep}
    metadata, tensors = read_tensors(source)
    architecture = str(metadata.get("general.architecture", ""))
    model: Any = _skeleton(config)
    settings = config.to_dict()
    processor: Any = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    processor = processor(config=settings)
    mapping = _names(model, processor)
    modules = dict(model.named_modules())
    record = QuantizedLoad()
    dense: dict[str, torch.Tensor] = {}
    blocks_of: dict[str, tuple[torch.Tensor, int, int]] = {}
    for tensor in tensors:
        qtype = int(tensor.tensor_type)
        target = mapping.get(tensor.name)
        owner = modules.get(target.rsplit(".", 1)[0]) if target is not None else None
        stays = (
            qtype in kinds
            and target is not None
            and target.endswith(".weight")
            and isinstance(owner, (torch.nn.Linear, torch.nn.Embedding))
        )
        order = _row_order(processor, tensor.name, int(tensor.data.shape[0]), mapping, settings)
        if stays and order is not False and target is not None:
            rows = np.asarray(tensor.data)
            if order is not None:
                rows = np.ascontiguousarray(rows[order])
            k = int(tensor.shape[0])  # GGUF lists dimensions innermost first
            if REPACKED.get(qtype) in kinds:
                record.repacked[target.rsplit(".", 1)[0]] = kinds[qtype][0]
                rows, qtype = repack(rows, qtype, int(rows.shape[0]), k), REPACKED[qtype]
            blocks_of[target.rsplit(".", 1)[0]] = (_as_tensor(rows), qtype, k)
            record.quantized[target.rsplit(".", 1)[0]] = kinds[qtype][0]
            continue
        name, values = _dense(processor, tensor, mapping, settings)
        if name is not None:
            dense[name] = values
    for name, (blocks, qtype, k) in blocks_of.items():
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        old = modules[name]
        layer: torch.nn.Module
        if isinstance(old, torch.nn.Embedding):
            layer = QuantEmbedding(blocks, qtype, k, old.padding_idx)
        else:
            layer = QuantLinear(blocks, qtype, k, dense.pop(name + ".bias", None))
        setattr(parent, child, layer)
    _tie_head(model, record)
    missing = model.load_state_dict(dense, strict=False, assign=True)
    record.dense = sorted(dense)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left or missing.unexpected_keys:
        raise ValueError(
            f"{Path(source).name}: the quantized load could not fill "
            f"{', '.join(left[:5]) or ', '.join(missing.unexpected_keys[:5])} "
            f"({architecture}); load it with dtype='float32' (transformers' dequantized model)"
        )
    fused = attach(model) > 0
    if isinstance(model, FusedLlamaForCausalLM) and not fused:
        # Some layer is not one the C step runs: every call would go to transformers' model.
        model = model.transformers_model()
    share_cores(model, fused=fused)
    return model.eval(), record


def _skeleton(config: Any) -> Any:
    """The model of ``config`` with its parameters on the meta device (buffers real): the
    Llama of ``flashspec.quant.llama`` where it fits, else transformers' class."""
    if wanted() and fits(config) is None:
        if getattr(config, "_attn_implementation", None) is None:
            config._attn_implementation = "sdpa"
        return FusedLlamaForCausalLM(config)
    from accelerate import init_empty_weights  # type: ignore[import-untyped]
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if type(config) is PretrainedConfig:  # read without its class (``flashspec.loading``)
        settings = config.to_dict()
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )


def _names(model: Any, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, by transformers' own mapping.

    transformers walks every submodule and rebuilds gguf-py's name table for each (hundreds of
    times for a 30-layer model, seconds of work); the table depends only on the architecture
    and depth, so it is built once while the mapping runs.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        mapping: dict[str, str] = get_gguf_hf_weights_map(model, processor)
    finally:
        gguf.get_tensor_name_map = original
    return mapping


def _as_tensor(rows: npt.NDArray[np.uint8]) -> torch.Tensor:
    """A uint8 tensor over the same memory (a read-only memory map stays one: nothing writes
    to blocks, so torch's warning about non-writable arrays does not apply)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _row_order(
    processor: Any, name: str, n: int, mapping: dict[str, str], settings: dict[str, Any]
) -> npt.NDArray[np.int64] | bool | None:
    """How transformers' processing moves the rows of tensor ``name`` (n rows): None when it
    leaves them, the new order when it only reorders them, False when it does anything else
    (the tensor must then be processed as dense values)."""
    probe = np.repeat(np.arange(n, dtype=np.float32)[:, None], 2, axis=1)
    scratch: dict[str, Any] = {"tensors": {}, "config": dict(settings)}
    result = processor.process(
        weights=probe.copy(), name=name, tensor_key_mapping=mapping, parsed_parameters=scratch
    )
    moved = getattr(result, "weights", None)
    if getattr(result, "name", None) != name or not isinstance(moved, np.ndarray):
        return False
    if moved.shape != probe.shape or not np.array_equal(moved[:, 0], moved[:, 1]):
        return False
    order = moved[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(n)):
        return False
    return None if np.array_equal(order, np.arange(n)) else order


def _dense(
    processor: Any, tensor: Any, mapping: dict[str, str], settings: dict[str, Any]
) -> tuple[str | None, torch.Tensor]:
    """A tensor dequantized and processed as transformers' GGUF load does it."""
    from gguf import GGMLQuantizationType, dequantize

    weights = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    scratch: dict[str, Any] = {"tensors": {}, "config": dict(settings)}
    result = processor.process(
        weights=weights, name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=scratch
    )
    target = mapping.get(result.name) if result.name is not None else None
    if target is None or result.weights is None:
        return None, torch.empty(0)
    return target, torch.from_numpy(np.array(result.weights, dtype=np.float32))


def _tie_head(model: Any, record: QuantizedLoad) -> None:
    """Give a tied model's head the embedding's blocks (the file holds one copy)."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    unfilled = isinstance(weight, torch.Tensor) and weight.is_meta
    quantized_embedding = isinstance(embed, QuantEmbedding) and isinstance(head, torch.nn.Linear)
    if quantized_embedding and (tied or unfilled):
        model.set_output_embeddings(embed.as_linear())
        record.tied_head = True
