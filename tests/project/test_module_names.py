"""A package's attribute never hides one of its submodules: ``import flashspec.quant.threads
as t`` binds whatever ``flashspec.quant.threads`` names, so a function re-exported under a
submodule's name turns that import into the function (CI caught this once)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import flashspec


def _submodules() -> list[str]:
    return [
        info.name
        for info in pkgutil.walk_packages(flashspec.__path__, "flashspec.")
        if not info.name.endswith("__main__")  # runs the command line when imported
    ]


def test_every_submodule_is_its_packages_attribute() -> None:
    names = []
    for name in _submodules():
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency (ray, triton) this machine lacks
            continue
        names.append(name)
    assert len(names) > 50
    hidden = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        attribute = getattr(importlib.import_module(parent), leaf, None)
        if not (isinstance(attribute, ModuleType) and attribute.__name__ == name):
            hidden.append(f"{name} is hidden by {type(attribute).__name__} {leaf!r}")
    assert hidden == []
