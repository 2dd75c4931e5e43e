"""The quantized matmul as torch sees it: ``qmatmul(x, blocks, qtype, n, k)``.

Eager calls go straight to the extension (``flashspec._quant``): a few hundred of them make one
decoding step, and the dispatcher's cost per call would be a visible share of it. Under
``torch.compile`` the same function is the custom op ``flashspec::qmatmul`` with a fake
implementation, so a compiled graph calls the kernel as one opaque node.

Rows of ``x`` beyond ``DENSE_ROWS`` (a prompt's prefill) take the other road: the weights are
dequantized to their exact float32 values and torch's BLAS multiplies them; a kernel that reads
the blocks once per 12 rows would redo the unpacking for every pass.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import numpy.typing as npt
import torch

DENSE_ROWS = 48
"""More rows than this in one product: dequantize the weights and call torch's matmul."""
DENSE_CHUNK_BYTES = 8 << 20
"""Float32 weights dequantized at once on that road."""


@functools.lru_cache(maxsize=1)
def kernels() -> ModuleType:
    """``flashspec._quant``, imported once.

    Raises:
        ImportError: the extension is not built in this installation.
    """
    from .. import _quant

    return _quant


def available() -> bool:
    """Whether the quantized kernels are built and importable here."""
    try:
        kernels()
    except ImportError:
        return False
    return True


def backend() -> str:
    """The kernels' active backend (``scalar``, ``avx2`` or ``avx512``), as result files record.

    Raises:
        ImportError: the extension is not built in this installation.
    """
    return str(kernels().backend())


def threads() -> int:
    """Threads the kernels split each product over.

    Raises:
        ImportError: the extension is not built in this installation.
    """
    return int(kernels().threads())


def formats() -> dict[int, tuple[str, int, int]]:
    """{GGML type id: (name, block elements, block bytes)} of the formats the kernels take."""
    return dict(kernels().formats())


REPACKED = {12: 268, 14: 270}
"""GGML types a load repacks, and the layout each goes into (``ext/quant.h``): Q4_K -> Q4_KR,
Q6_K -> Q6_KR. The SIMD kernels run those, every weight's value unchanged. Q5_0 is not among
them: it has SIMD kernels of its own over the file's 22-byte blocks, so a load keeps its
layers memory-mapped as the file holds them."""

REPACK_LAYOUTS = {6: 8, **REPACKED}
"""What ``repack`` turns each type it takes into: ``REPACKED``, and Q5_0 -> Q8_0 (the same
``d``, int8 ``q - 16``), which loads no longer use."""

NATIVE_SIMD = frozenset({2, 3, 6, 8})
"""GGML types the AVX2/AVX-512 kernels run as the file stores them: Q4_0, Q4_1, Q5_0, Q8_0."""


def fast_formats() -> frozenset[int]:
    """GGML types whose kernel in the active backend beats dense float32 layers here: the
    SIMD ones (Q4_0, Q4_1, Q5_0, Q8_0 on AVX2/AVX-512 as the file stores them, and Q4_K/Q6_K
    through their repacked layouts: what a Q4_K_M file holds). The portable C kernels were
    measured slower than torch's float32 product (``flashspec bench quant``), so without SIMD
    a model loads every layer dense."""
    if kernels().backend() == "scalar":
        return frozenset()
    return frozenset({*NATIVE_SIMD, *REPACKED, *REPACKED.values()})


def repack(rows: npt.NDArray[np.uint8], qtype: int, n: int, k: int) -> npt.NDArray[np.uint8]:
    """The (n, k) weights of ``rows`` (Q5_0, Q4_K or Q6_K blocks) in the layout
    ``REPACK_LAYOUTS[qtype]``, a new array; gguf-py's dequantized values are kept bit for bit.
    Loads repack only ``REPACKED``'s types (Q5_0 runs natively)."""
    out: npt.NDArray[np.uint8] = kernels().repack(rows, qtype, n, k)
    return out


def dequantize(blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The (n, k) float32 weights of ``blocks``: exactly gguf-py's ``dequantize``."""
    return torch.from_numpy(kernels().dequantize(blocks.numpy(), qtype, n, k))


def qmatmul_eager(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int
) -> torch.Tensor:
    """(m, k) float32 ``x`` times the (n, k) quantized weights transposed: (m, n) float32."""
    if x.requires_grad:
        x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.shape[0] == 0:
        return x.new_empty((0, n))
    if x.shape[0] > DENSE_ROWS:
        return _dense_product(x, blocks, qtype, n, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    kernels().qmatmul(x.numpy(), blocks.numpy(), qtype, n, k, out.numpy())
    return out


def _dense_product(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int
) -> torch.Tensor:
    """``x @ W.T`` with W dequantized a slice of rows at a time: a large layer (a 49,152-row
    head is 113 MB in float32) never exists whole, so a prefill leaves no such allocation
    behind in the process."""
    rows = max(1, DENSE_CHUNK_BYTES // (4 * k))
    if rows >= n:
        return x @ dequantize(blocks, qtype, n, k).T
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        weights = dequantize(blocks[start:stop], qtype, stop - start, k)
        torch.matmul(x, weights.T, out=out[:, start:stop])
    return out


@torch.library.custom_op("flashspec::qmatmul", mutates_args=())
def qmatmul_op(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """``qmatmul_eager`` as a torch custom op (what compiled graphs call)."""
    return qmatmul_eager(x, blocks, qtype, n, k)


@qmatmul_op.register_fake
def _qmatmul_fake(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int
) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """``x @ W.T`` for (m, k) float32 ``x``; the custom op while compiling, else the kernel."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = qmatmul_op(x, blocks, qtype, n, k)
        return out
    return qmatmul_eager(x, blocks, qtype, n, k)


def embed_eager(ids: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Rows ``ids`` (1-D int64) of the quantized (n, k) weights: (len(ids), k) float32."""
    rows = ids.to(torch.int64).contiguous()
    return torch.from_numpy(kernels().dequantize_rows(blocks.numpy(), qtype, k, rows.numpy()))


@torch.library.custom_op("flashspec::qembed", mutates_args=())
def embed_op(ids: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``embed_eager`` as a torch custom op (what compiled graphs call)."""
    return embed_eager(ids, blocks, qtype, k)


@embed_op.register_fake
def _embed_fake(ids: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    return blocks.new_empty((ids.shape[0], k), dtype=torch.float32)


def embed(ids: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """An embedding lookup over quantized rows; the custom op while compiling."""
    if torch.compiler.is_compiling():
        out: torch.Tensor = embed_op(ids, blocks, qtype, k)
        return out
    return embed_eager(ids, blocks, qtype, k)
