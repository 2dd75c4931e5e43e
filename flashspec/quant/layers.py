"""Linear and embedding layers over GGUF blocks kept as they are in the file.

``QuantLinear`` replaces a model's ``nn.Linear``: its weight is the raw blocks (one row of
blocks per output feature, memory-mapped from the file where the rows need no reordering), and
its forward multiplies float32 activations by every weight's exact dequantized value
(``flashspec.quant.ops``). ``QuantEmbedding`` replaces ``nn.Embedding`` and dequantizes only
the rows it looks up; a tied model's head is a ``QuantLinear`` over the same blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import DENSE_ROWS, dequantize, embed, embed_eager, formats, kernels, qmatmul


def _check_blocks(blocks: torch.Tensor, qtype: int, rows: int, features: int) -> str:
    """The format's name, after checking ``blocks`` holds ``rows`` rows of ``features``."""
    known = formats()
    if qtype not in known:
        names = ", ".join(f"{number} ({name})" for number, (name, _, _) in sorted(known.items()))
        raise ValueError(f"qtype {qtype} is not a GGML type the kernels take; they take {names}")
    name, elems, size = known[qtype]
    if features % elems:
        raise ValueError(f"{name} rows hold multiples of {elems} weights; got {features}")
    expected = (rows, features // elems * size)
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
        raise ValueError(
            f"blocks must be a uint8 tensor of shape {expected} ({rows} rows of {name} blocks); "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if not blocks.is_contiguous() or blocks.device.type != "cpu":
        raise ValueError("blocks must be a contiguous CPU tensor")
    return name


class QuantLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with W kept as GGUF blocks; float32 activations and sums.

    Args:
        blocks: (out_features, row bytes) uint8, row j the blocks of output feature j.
        qtype: the GGML type id of the blocks (``flashspec.quant.formats()``).
        in_features: weights per row.
        bias: (out_features,) float32, or None.
    """

    blocks: torch.Tensor

    def __init__(
        self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.format = _check_blocks(blocks, qtype, int(blocks.shape[0]), in_features)
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = int(blocks.shape[0])
        self.register_buffer("blocks", blocks, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._raw_of: torch.Tensor | None = None
        self._raw_array: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) float32 to (..., out_features) float32."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(
                f"{type(self).__name__} takes float32 CPU activations, got {x.dtype} on "
                f"{x.device}; a quantized model runs in float32 on the CPU (load with "
                "dtype='float32' or 'bfloat16' for dense weights elsewhere)"
            )
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features
        if rows == 0:
            y = x.new_empty((*lead, self.out_features))
        elif rows <= DENSE_ROWS and not torch.compiler.is_compiling():
            # A decoding step makes ~200 of these calls: the kernel directly, no wrappers.
            x = x.detach().contiguous()
            y = torch.empty((*lead, self.out_features), dtype=torch.float32)
            kernels().qmatmul(x.view(rows, self.in_features).numpy(), self._raw(), self.qtype,
                              self.out_features, self.in_features,
                              y.view(rows, self.out_features).numpy())  # fmt: skip
        else:
            y = qmatmul(x.reshape(rows, self.in_features), self.blocks, self.qtype,
                        self.out_features, self.in_features)  # fmt: skip
            y = y.view(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y

    def _raw(self) -> Any:
        """The blocks as a NumPy array, made once (again if the buffer was replaced)."""
        blocks = self.blocks
        if self._raw_of is not blocks:
            self._raw_of, self._raw_array = blocks, blocks.numpy()
        return self._raw_array

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), in_features) float32: rows ``ids`` of W at their exact values."""
        return embed_eager(ids.reshape(-1), self.blocks, self.qtype, self.in_features)

    def subset(self, ids: torch.Tensor) -> QuantLinear:
        """A layer over rows ``ids`` of this one (their blocks copied; no bias)."""
        rows = self.blocks[ids.to(torch.int64).reshape(-1)].contiguous()
        return QuantLinear(rows, self.qtype, self.in_features)

    def dense_weight(self) -> torch.Tensor:
        """The whole (out_features, in_features) float32 weight (a new tensor)."""
        return dequantize(self.blocks, self.qtype, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"{self.in_features} -> {self.out_features}, {self.format}, bias={bias}"


class QuantEmbedding(torch.nn.Module):
    """A token embedding over GGUF blocks: each looked-up row dequantized exactly.

    Args:
        blocks: (num_embeddings, row bytes) uint8.
        qtype: the GGML type id of the blocks.
        embedding_dim: weights per row.
        padding_idx: kept for code that reads it (a GGUF file's rows are used as they are).
    """

    blocks: torch.Tensor

    def __init__(
        self, blocks: torch.Tensor, qtype: int, embedding_dim: int, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.format = _check_blocks(blocks, qtype, int(blocks.shape[0]), embedding_dim)
        self.qtype = qtype
        self.num_embeddings = int(blocks.shape[0])
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """(...) int64 token ids to (..., embedding_dim) float32."""
        rows = embed(ids.reshape(-1), self.blocks, self.qtype, self.embedding_dim)
        return rows.view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The tied LM head over the same blocks (no copy)."""
        return QuantLinear(self.blocks, self.qtype, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.format}"
