"""Every Python package in the source tree ships: pyproject.toml lists each one (setuptools
leaves out any it does not name, and an installed engine would then fail to import)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


@pytest.mark.skipif(not PYPROJECT.exists(), reason="no pyproject.toml in this tree")
def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "flashspec").rglob("__init__.py")
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
