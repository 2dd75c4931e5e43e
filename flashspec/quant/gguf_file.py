"""The tensors of a GGUF file, memory-mapped, without parsing its metadata.

``gguf.GGUFReader`` builds a NumPy view for every part of every metadata field (a tokenizer's
50,000 strings and merges included), which takes seconds; a quantized load needs only the
architecture's name and where each tensor lies. ``read_tensors`` walks the header once,
skipping values by their lengths, and maps the file read-only: the tensors are views of the
map, shaped as ``GGUFReader`` shapes them (quantized: (rows, row bytes) uint8).

Format (GGUF v2/v3, little-endian): magic, version, tensor count, key/value count; the
key/value pairs; per tensor its name, dimensions (innermost first), GGML type and offset; the
data, aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: fixed sizes (the others: 8 string, 9 array).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_SCALAR_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
# Float types GGUF stores as plain arrays (GGML type id -> NumPy dtype).
_PLAIN = {0: np.float32, 1: np.float16}  # F32, F16


@dataclass
class GGUFTensor:
    """One tensor of the file: ``data`` is a read-only view of the map."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    """Dimensions innermost first, as the file lists them."""
    data: np.ndarray[Any, Any]


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message says where."""


class _Cursor:
    def __init__(self, buffer: memoryview, where: Path) -> None:
        self.buffer = buffer
        self.pos = 0
        self.where = where

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buffer):
            raise GGUFFormatError(f"{self.where}: ends inside its header (at byte {self.pos})")
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise GGUFFormatError(f"{self.where}: a string runs past the end of the file")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def skip_string(self) -> None:
        length = self.take("<Q")  # read first: `pos += take()` would add to the old pos
        self.pos += length

    def value(self, kind: int, keep: bool) -> Any:
        """The value of type ``kind`` (scalars and strings when ``keep``), else skipped."""
        if kind in _FIXED:
            if keep:
                return self.take(_SCALAR_FORMAT[kind])
            self.pos += _FIXED[kind]
            return None
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == _ARRAY:
            inner, count = self.take("<I"), self.take("<Q")
            if inner in _FIXED:
                self.pos += _FIXED[inner] * count
            else:
                for _ in range(count):
                    self.value(inner, False)
            return None
        raise GGUFFormatError(f"{self.where}: unknown metadata value type {kind}")


def read_tensors(path: str | Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """``(scalar metadata, tensors)`` of the GGUF file at ``path``.

    The metadata dict holds the scalar and string values (arrays are skipped); each tensor's
    ``data`` views one read-only memory map of the file.

    Raises:
        GGUFFormatError: not a GGUF file, a truncated one, or one this reader cannot walk.
    """
    where = Path(path)
    mapped = np.memmap(where, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), where)  # type: ignore[arg-type]
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise GGUFFormatError(f"{where}: not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{where}: GGUF version {version}; this reader knows 2 and 3")
    count, pairs = cursor.take("<Q"), cursor.take("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(pairs):
        key = cursor.string()
        kind = cursor.take("<I")
        value = cursor.value(kind, keep=True)
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(count):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    return metadata, [_tensor(mapped, start, *info, where) for info in infos]


def _tensor(
    mapped: np.memmap[Any, Any], start: int, name: str, dims: tuple[int, ...], kind: int,
    offset: int, where: Path,
) -> GGUFTensor:  # fmt: skip
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    if kind in _PLAIN:
        dtype = np.dtype(_PLAIN[kind])
        nbytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        shape: tuple[int, ...] = tuple(reversed(dims))
    else:
        try:
            elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{where}: tensor {name} has unknown GGML type {kind}") from None
        if dims[0] % elems:
            raise GGUFFormatError(f"{where}: tensor {name}'s rows are not whole blocks")
        dtype = np.dtype(np.uint8)
        nbytes = rows * dims[0] // elems * size
        shape = (*reversed(dims[1:]), dims[0] // elems * size)
    begin = start + offset
    if begin + nbytes > mapped.shape[0]:
        raise GGUFFormatError(f"{where}: tensor {name} runs past the end of the file")
    data = np.ndarray(shape, dtype=dtype, buffer=mapped, offset=begin)
    return GGUFTensor(name, kind, dims, data)
