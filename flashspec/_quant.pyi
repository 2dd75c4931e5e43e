"""Types for the native extension flashspec._quant (ext/_quant.c)."""

from typing import Any

from numpy.typing import NDArray
from typing_extensions import Buffer

_Buf = Buffer | NDArray[Any]

def qmatmul(x: _Buf, w: _Buf, qtype: int, n: int, k: int, out: _Buf | None = None) -> Any:
    """y = x @ W.T for W (n, k) kept as GGUF blocks of GGML type ``qtype`` in the bytes ``w``.

    ``x`` is float32 (m, k) or (k,); ``out`` float32 (m, n) or (n,) (a new NumPy array when
    None). Every weight takes exactly its dequantized value; sums are float32. ValueError or
    TypeError, naming the argument, on bad buffers.
    """

def dequantize(w: _Buf, qtype: int, n: int, k: int, out: _Buf | None = None) -> Any:
    """W as float32 (n, k): gguf-py's values."""

def repack(w: _Buf, qtype: int, n: int, k: int) -> Any:
    """W (n, k) in Q5_0, Q4_K or Q6_K blocks as a new uint8 (n, row bytes) array in another
    layout the SIMD kernels run (Q8_0, Q4_KR, Q6_KR): every weight's value bit-identical.

    Loads repack Q4_K and Q6_K only: Q5_0 has SIMD kernels over its own blocks."""

def dequantize_rows(w: _Buf, qtype: int, k: int, rows: _Buf, out: _Buf | None = None) -> Any:
    """Rows ``rows`` (int64) of W as float32 (len(rows), k): an embedding lookup."""

def formats() -> dict[int, tuple[str, int, int]]:
    """{GGML type id: (name, block elements, block bytes)}."""

def backend() -> str:
    """The backend in use: 'scalar', 'avx2' or 'avx512'."""

def available_backends() -> list[str]:
    """Backends this build and CPU can run, slowest first."""

def set_backend(name: str, /) -> None:
    """Switch backend for this process; ValueError if it is not available."""

def threads() -> int:
    """Threads a large call uses."""

def set_threads(n: int, /) -> None:
    """Threads a large call uses (1..8)."""

def fma_probe(rounds: int, /) -> int:
    """Run the backend's float32 multiply-add probe (independent FMAs on zeros) ``rounds``
    times on each of ``threads()`` cores at once; return the multiply-adds done. Timed by the
    caller, it measures the machine's multiply-add peak."""

def cpu_features() -> dict[str, bool]:
    """CPUID/XGETBV facts behind the dispatch."""

def abi_version() -> int:
    """Version of the module interface and kernel contract."""

def decoder_plan(
    layers: list[tuple[Any, ...]],
    dim: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    eps: float,
    scaling: float,
) -> Any:
    """A Llama decoder's quantized layers for ``decoder_step`` (an opaque capsule).

    ``layers``: one tuple per layer, (input norm, post-attention norm, then blocks and qtype
    of q, k, v, o, gate, up, down). The plan holds their buffers for its life.
    """

def decoder_step(
    plan: Any, hidden: _Buf, cos: _Buf, sin: _Buf, kv: _Buf, past: int, mask: _Buf | None = None
) -> None:
    """Every layer of ``plan`` for m new positions of each row, in place (ext/quant_step.h).

    ``hidden`` (batch * m, dim) float32 in and out; ``cos``/``sin`` (batch * m, head_dim);
    ``kv`` float32 (layers, 2, kv_heads, capacity, head_dim) for one row, or (layers, 2, batch,
    kv_heads, capacity, head_dim), with columns ``past`` .. ``past + m - 1`` written; ``mask``
    None (every column visible), (batch, >= past + m) bytes (one row for all of a batch row's
    positions), or (batch * m, >= past + m) bytes (a row for each position, row j being batch
    row j // m's position j % m: a token tree's ancestors), nonzero where a key column is
    visible. Position i never sees a column past ``past + i``, and one whose own column its
    mask row hides is dead (skipped, its cache slots zeroed). ValueError or TypeError, naming
    the argument, on bad buffers.
    """
