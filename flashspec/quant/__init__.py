"""Exact quantized layers: GGUF blocks multiplied as they are (``flashspec._quant``).

``QuantLinear``/``QuantEmbedding`` hold a GGUF file's blocks and use every weight at exactly
its dequantized value (float32 activations and sums, no activation quantization), so a model
built from them computes what transformers' dequantized model computes, reading 5x fewer
bytes. ``build_quantized_model`` makes such a model from a file; ``flashspec.loading`` uses it
for ``.gguf`` targets and drafts on a CPU by default.
"""

from __future__ import annotations

from .layers import QuantEmbedding, QuantLinear
from .load import QuantizedLoad, build_quantized_model
from .ops import available, backend, formats, qmatmul
from .ops import threads as kernel_threads  # ``flashspec.quant.threads`` is the module

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedLoad",
    "available",
    "backend",
    "build_quantized_model",
    "formats",
    "kernel_threads",
    "qmatmul",
]
