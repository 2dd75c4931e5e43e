"""Types for the native extension flashspec._residual (ext/_residual.c)."""

from typing import Any, overload

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Buffer

def residual_dist(p: Buffer, q: Buffer, /, out: Buffer | None = None) -> Any:
    """Row-wise max(0, p - q) / sum(max(0, p - q)) over float32 (V,) or (B, V) buffers.

    Returns ``out`` (or a new float32 NumPy array when ``out`` is None). A row with
    p <= q everywhere is p renormalised. Raises ValueError naming the argument on
    NaN/inf, bad shapes, overlap or read-only ``out``; TypeError on a wrong dtype.
    """

@overload
def residual_sample(p: Buffer, q: Buffer, u: float) -> int: ...
@overload
def residual_sample(p: Buffer, q: Buffer, u: Buffer) -> NDArray[np.int64]: ...
def backend() -> str:
    """The kernel backend in use: 'scalar', 'avx2' or 'avx512'."""

def available_backends() -> list[str]:
    """Backends this build and CPU can run, slowest first."""

def set_backend(name: str, /) -> None:
    """Switch backend for this process; ValueError if it is not available."""

def cpu_features() -> dict[str, bool | int]:
    """CPUID/XGETBV facts behind the dispatch."""

def abi_version() -> int:
    """Version of the module interface and kernel contract."""
