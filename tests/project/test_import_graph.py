"""flashspec's modules import each other without cycles (deferred imports included), and the
research scripts in ``benchmarks/`` use public names only (``scripts/import_graph.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.import_graph import load_import_graph

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_graph.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="no scripts/ in this tree")


@pytest.fixture(scope="module")
def graph() -> ModuleType:
    return load_import_graph()


def test_no_import_cycles(graph: ModuleType) -> None:
    assert graph.cycles() == []


def test_benchmarks_import_no_private_names(graph: ModuleType) -> None:
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    assert scripts
    assert [f"{p.path.name}:{p.line}: {p.name}" for p in graph.private_imports(scripts)] == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "flashspec" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_deferred_relative_and_lazy_imports_are_edges(graph: ModuleType, tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from ._lazy import lazy_exports\n"
            "_EXPORTS = {'Thing': '.b'}\n"
            "__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)\n",
            "_lazy.py": "",
            "a.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from . import c\n"  # never runs: no edge
            "def f():\n    from .sub import d\n",  # deferred, and d is a submodule
            "b.py": "import importlib\n"
            "TABLE = {'x': '.a'}\n"
            "def g(k):\n    return importlib.import_module(TABLE[k], __package__)\n",
            "c.py": "",
            "sub/__init__.py": "",
            "sub/d.py": "from .. import b\n",
        },
    )
    edges = {(e.source, e.target) for e in graph.import_edges(root)}
    assert ("flashspec.a", "flashspec.sub.d") in edges
    assert ("flashspec.sub.d", "flashspec.b") in edges
    assert ("flashspec.b", "flashspec.a") in edges
    assert ("flashspec", "flashspec.b") in edges
    assert not any(target == "flashspec.c" for _, target in edges)
    assert graph.cycles(root) == [["flashspec.a", "flashspec.b", "flashspec.sub.d"]]


def test_importing_a_submodule_runs_its_parent_packages_init(
    graph: ModuleType, tmp_path: Path
) -> None:
    # The cycle models -> loading (its __init__) -> loading.drafts -> drafters -> models, which
    # only the parent package's __init__ closes: models imports loading.pretrained alone.
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "models.py": "from .loading.pretrained import load\n",
            "loading/__init__.py": "from .pretrained import load\nfrom .drafts import make\n",
            "loading/helper.py": "",
            "loading/pretrained.py": "from .helper import x\nimport flashspec.loading.helper\n",
            "loading/drafts.py": "def make():\n    from ..drafters import Drafter\n",
            "drafters.py": "from .models import load\n",
        },
    )
    edges = {(e.source, e.target) for e in graph.import_edges(root)}
    assert ("flashspec.models", "flashspec.loading") in edges
    assert ("flashspec.models", "flashspec.loading.pretrained") in edges
    # A module's own packages ran before it: no edge back to them.
    assert not any(
        source.startswith("flashspec.loading.") and target in {"flashspec", "flashspec.loading"}
        for source, target in edges
    )
    assert ("flashspec.loading.pretrained", "flashspec.loading.helper") in edges
    assert graph.cycles(root) == [
        ["flashspec.drafters", "flashspec.loading", "flashspec.loading.drafts", "flashspec.models"]
    ]


def test_a_cycle_added_on_purpose_is_found(graph: ModuleType, tmp_path: Path) -> None:
    # A copy of the real package, with bench.chat.command importing bench.engine back in a
    # function.
    def not_python(folder: str, names: list[str]) -> set[str]:  # .pyi: the compiled modules
        return {
            n for n in names if not n.endswith((".py", ".pyi")) and not Path(folder, n).is_dir()
        }

    shutil.copytree(ROOT / "flashspec", tmp_path / "flashspec", ignore=not_python)
    chat = tmp_path / "flashspec" / "bench" / "chat" / "command.py"
    chat.write_text(chat.read_text() + "\n\ndef _back() -> None:\n    from .. import engine\n")
    assert graph.cycles(tmp_path) == [["flashspec.bench.chat.command", "flashspec.bench.engine"]]


def test_private_imports_are_found(graph: ModuleType, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        "import flashspec._greedy\n"
        "from flashspec import _quant\n"
        "from flashspec.bench.common import _git_sha, write_json\n"
        "from torch._dynamo import config\n"  # not flashspec: not this check's business
        "def f():\n    from flashspec._lean import hf_forward\n"
    )
    found = [(p.line, p.name) for p in graph.private_imports([script])]
    assert found == [
        (1, "flashspec._greedy"),
        (2, "flashspec._quant"),
        (3, "flashspec.bench.common._git_sha"),
        (6, "flashspec._lean.hf_forward"),
    ]
