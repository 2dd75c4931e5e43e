"""docs/architecture.md is true to the package: every module of ``flashspec/`` is named there,
every module it names exists, and its sentences on which area imports which hold in the import
graph (``scripts/import_graph.py``, deferred and lazy imports included)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.import_graph import load_import_graph

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "flashspec"
SCRIPT = ROOT / "scripts" / "import_graph.py"
pytestmark = pytest.mark.skipif(
    not (DOC.exists() and SCRIPT.exists()), reason="no docs/ or scripts/ in this tree"
)

# The doc's "Imports go one way" sentences: (importing areas, areas they must not import).
# An area is a top-level module or package of flashspec (``engine`` for flashspec.engine.*).
FORBIDDEN: list[tuple[set[str], set[str]]] = [
    ({"models", "drafters", "select"}, {"engine"}),
    ({"models", "drafters"}, {"select"}),
    ({"engine"}, {"serve", "cluster", "bench", "cli"}),
]
# Areas only these areas may import (besides themselves).
ONLY_FROM: dict[str, set[str]] = {
    "serve": {"cli", "cluster"},
    "bench": {"cli"},
    "cli": {"__main__"},
}


@pytest.fixture(scope="module")
def graph() -> ModuleType:
    return load_import_graph()


@pytest.fixture(scope="module")
def area_edges(graph: ModuleType) -> set[tuple[str, str]]:
    """(importing area, imported area) for every import between two different areas."""

    def area(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "flashspec"

    pairs = {(area(edge.source), area(edge.target)) for edge in graph.import_edges()}
    return {(a, b) for a, b in pairs if a != b}


def named_paths(text: str) -> set[str]:
    """Every backticked name on the page that looks like a path under ``flashspec/``."""
    names = set()
    for name in re.findall(r"`([^`\s]+)`", text):
        name = name.removeprefix("flashspec/")
        if name.endswith((".py", "/")):
            names.add(name)
    return names


def test_every_module_is_named_on_the_page() -> None:
    named = named_paths(DOC.read_text())
    folders = {name for name in named if name.endswith("/")}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        parent = relative.rpartition("/")[0] + "/"
        # A package's modules are named one by one, or the package as a whole (``bench/batch/``)
        # when one row says what it holds; an ``__init__.py`` is named by its package's heading.
        covered = relative in named or (
            parent != "/" and parent in folders and (
                relative.endswith("/__init__.py") or parent.count("/") > 1
            )
        )  # fmt: skip
        if not covered:
            missing.append(relative)
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_every_module_named_exists() -> None:
    text = DOC.read_text()
    # Every name in a table row's first cell (``bench/pair.py``, ``bench/runner.py``).
    rows = [
        name
        for cell in re.findall(r"^\| ([^|]+) \|", text, re.MULTILINE)
        for name in re.findall(r"`([^`]+)`", cell)
    ]
    assert len(rows) > 60, "the module tables were not found"
    absent = []
    for name in rows:
        paths = [PACKAGE / name, ROOT / name, PACKAGE / f"{name}.pyi"]  # `_quant`: an extension
        if not name.endswith(".so") and not any(path.exists() for path in paths):
            absent.append(name)
    assert not absent, f"docs/architecture.md names what does not exist: {sorted(set(absent))}"


@pytest.mark.parametrize(("sources", "targets"), FORBIDDEN, ids=str)
def test_imports_go_one_way(
    area_edges: set[tuple[str, str]], sources: set[str], targets: set[str]
) -> None:
    wrong = sorted((a, b) for a, b in area_edges if a in sources and b in targets)
    assert not wrong, wrong


def test_the_row_cache_imports_nothing_else(area_edges: set[tuple[str, str]]) -> None:
    assert not sorted(b for a, b in area_edges if a == "kv")


@pytest.mark.parametrize("area", sorted(ONLY_FROM))
def test_areas_imported_only_from_the_command_line(
    area_edges: set[tuple[str, str]], area: str
) -> None:
    importers = {a for a, b in area_edges if b == area}
    assert importers <= ONLY_FROM[area], sorted(importers - ONLY_FROM[area])
