"""Lazy re-exports (PEP 562): a package's public names, imported on first use.

Keeps ``import flashspec`` (and ``flashspec.bench``, ``flashspec.serve``) free of torch and
FastAPI until a name that needs them is used. Standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module whose globals are ``namespace``: ``exports``
    maps each public name to the (relative) module that defines it."""
    package = str(namespace["__name__"])

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
