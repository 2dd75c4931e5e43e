"""Freed heap memory handed back to the operating system after a load.

Loading a GGUF model or a draft allocates and frees tens of MB of temporaries (the file's
metadata parsed by gguf-py, tokenizer conversion, reordered rows, float copies that become
blocks). glibc's allocator keeps freed pages in the process, so they count in its resident
memory for as long as it runs: 25 MB after loading SmolLM2 and its draft here. ``release``
asks glibc to return them (``malloc_trim``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

_LIBC: list[Any] = []


def _trim() -> Any:
    if not _LIBC:
        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        _LIBC.append(getattr(libc, "malloc_trim", None))
    return _LIBC[0]


def release() -> None:
    """Return the heap's freed pages to the operating system (glibc only; else a no-op)."""
    trim = _trim()
    if trim is not None:
        trim(0)


__all__ = ["release"]
