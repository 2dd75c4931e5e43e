"""``scripts/import_graph.py`` loaded as a module, for the tests that read the import graph."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_graph.py"


def load_import_graph() -> ModuleType:
    """The script as a module (registered in ``sys.modules``: dataclasses look their module
    up while the class is made)."""
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
