"""The test suite's own layout (issue #39, item 7): tests live in folders that mirror flashspec's
packages, shared code lives in tests/helpers/ only, and no test module imports another one.

The rules, for every new test file:

- a test module ``test_*.py`` lives in ``tests/<folder>/``, where ``<folder>`` is the flashspec
  package (or module) it tests: ``tests/engine/`` for ``flashspec.engine``, ``tests/serve/`` for
  ``flashspec.serve``...; two folders are not named after one: ``kernels`` (the native
  extensions, ``ext/`` and ``asm/``, and their C harness) and ``project`` (the repository as a
  whole: docs, packaging, deploy/, the import graph, earlier names, this file);
- anything a second test module needs goes into ``tests/helpers/<name>.py`` and is imported as
  ``tests.helpers.<name>``; fixtures go into a ``conftest.py``;
- every folder holding Python is a package (``__init__.py``): pytest then names a module
  ``tests.<folder>.<module>`` and puts the repository root on ``sys.path``, so
  ``tests.helpers`` imports from anywhere and no test folder shadows a top-level package.

Each check is a function of the tests folder, so ``test_the_checks_catch_the_old_layout`` can run
them on a small copy of the layout before this one, where every rule fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FLASHSPEC = TESTS.parent / "flashspec"
HELPERS = "helpers"
# Test folders that are not named after a flashspec package or module.
NOT_PACKAGES = {"kernels", "project"}
MIN_FOLDERS = 5


def python_files(tests: Path) -> list[Path]:
    return sorted(path for path in tests.rglob("*.py") if "__pycache__" not in path.parts)


def is_test_module(path: Path) -> bool:
    return path.name.startswith("test_")


def module_name(tests: Path, path: Path) -> str:
    """The dotted name pytest gives ``path`` when every folder is a package: ``tests.a.b``."""
    parts = path.relative_to(tests.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tests: Path, path: Path) -> list[tuple[int, list[str]]]:
    """(line, candidates) for every import in ``path``, nested and deferred ones included,
    relative ones resolved: ``import a, b`` gives ``[a]`` and ``[b]``; ``from a import b, c``
    gives ``[a, a.b, a.c]`` (``b`` may be a module)."""
    package = module_name(tests, path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, [base, *(f"{base}.{alias.name}" for alias in node.names)]))
    return found


def names_a_test_module(name: str) -> bool:
    """Whether the dotted ``name`` is (or lies inside) a test module or a conftest: a top-level
    ``test_x``/``conftest`` (the flat layout) or ``tests.<...>.test_x``/``tests.<...>.conftest``."""
    parts = name.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    elif len(parts) > 1 or not name:
        return False  # another project's module (pytest, flashspec.x, ...)
    return any(part.startswith("test_") or part == "conftest" for part in parts)


def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import of a test module or a conftest, in any Python file under ``tests``: one line
    per import, naming the first test module it reaches."""
    problems = []
    for path in python_files(tests):
        for line, candidates in sorted(imported_modules(tests, path)):
            bad = [name for name in candidates if names_a_test_module(name)]
            if bad:
                problems.append(f"{path.relative_to(tests.parent)}:{line} imports {bad[0]}")
    return problems


def folders_with_tests(tests: Path) -> list[str]:
    """The folders under ``tests`` (nested ones as a/b) that hold test modules."""
    return sorted(
        {
            path.parent.relative_to(tests).as_posix()
            for path in python_files(tests)
            if is_test_module(path) and path.parent != tests
        }
    )


def misplaced_modules(tests: Path) -> list[str]:
    """Python files outside the layout: a helper anywhere but tests/helpers/, a test module at
    the top or among the helpers, a folder that is not a package."""
    problems = []
    for path in python_files(tests):
        where = path.relative_to(tests)
        in_helpers = where.parts[0] == HELPERS and len(where.parts) > 1
        if path.name in ("__init__.py", "conftest.py"):
            pass
        elif is_test_module(path) and in_helpers:
            problems.append(f"{where}: a test module among the helpers")
        elif is_test_module(path) and len(where.parts) == 1:
            problems.append(f"{where}: a test module outside a folder")
        elif not is_test_module(path) and not in_helpers:
            problems.append(f"{where}: a helper outside tests/{HELPERS}/")
        if not (path.parent / "__init__.py").exists():
            problems.append(f"{where}: its folder has no __init__.py")
    return sorted(set(problems))


def unmirrored_folders(tests: Path, flashspec: Path) -> list[str]:
    """Test folders named after no flashspec package or module (and not in NOT_PACKAGES)."""
    return [
        folder
        for folder in folders_with_tests(tests)
        if (top := folder.split("/")[0]) not in NOT_PACKAGES
        and not (flashspec / top / "__init__.py").exists()
        and not (flashspec / f"{top}.py").exists()
    ]


def test_no_test_module_imports_another() -> None:
    assert imports_of_test_modules(TESTS) == []


def test_tests_live_in_at_least_five_folders() -> None:
    folders = folders_with_tests(TESTS)
    assert len(folders) >= MIN_FOLDERS, f"test modules in {folders} only"


def test_helpers_live_in_tests_helpers_only() -> None:
    assert misplaced_modules(TESTS) == []


def test_folders_mirror_flashspecs_packages() -> None:
    if not FLASHSPEC.is_dir():  # a tests folder copied out of the checkout
        return
    assert unmirrored_folders(TESTS, FLASHSPEC) == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_the_old_layout(tmp_path: Path) -> None:
    """The flat layout this one replaced: test modules at the top importing each other and
    conftest, ``*_helpers.py`` beside them, one folder; every check reports it."""
    tests = tmp_path / "tests"
    write(
        tests,
        {
            "conftest.py": "import pytest\n",
            "chi2_helpers.py": "def chi_squared(): ...\n",
            "test_engine_greedy.py": "from conftest import build_llama\nPROMPTS = []\n",
            "test_engine_ragged.py": (
                "from chi2_helpers import chi_squared\n"
                "from test_engine_greedy import PROMPTS\n"
                "def test_x():\n    import test_engine_distribution as d\n"
            ),
            "trees/test_accept.py": "from chi2_helpers import chi_squared\n",
        },
    )
    write(tmp_path / "flashspec", {"__init__.py": "", "trees/__init__.py": ""})
    assert imports_of_test_modules(tests) == [
        "tests/test_engine_greedy.py:1 imports conftest",
        "tests/test_engine_ragged.py:2 imports test_engine_greedy",
        "tests/test_engine_ragged.py:4 imports test_engine_distribution",
    ]
    assert folders_with_tests(tests) == ["trees"]
    assert misplaced_modules(tests) == [
        "chi2_helpers.py: a helper outside tests/helpers/",
        "chi2_helpers.py: its folder has no __init__.py",
        "conftest.py: its folder has no __init__.py",
        "test_engine_greedy.py: a test module outside a folder",
        "test_engine_greedy.py: its folder has no __init__.py",
        "test_engine_ragged.py: a test module outside a folder",
        "test_engine_ragged.py: its folder has no __init__.py",
        "trees/test_accept.py: its folder has no __init__.py",
    ]
    assert unmirrored_folders(tests, tmp_path / "flashspec") == []


def test_the_checks_pass_the_layout_they_ask_for(tmp_path: Path) -> None:
    """A small tree that follows every rule passes every check, relative imports included; a
    folder named after nothing in flashspec, a helper in a test folder and a relative import of
    a sibling test module do not."""
    tests = tmp_path / "tests"
    folders = ["engine", "serve", "kernels", "project", "trees"]
    write(
        tests,
        {
            "__init__.py": "",
            "conftest.py": "from tests.helpers.models import build\n",
            "helpers/__init__.py": "",
            "helpers/models.py": "def build(): ...\n",
            "helpers/chi2.py": "from .models import build\n",
            **{f"{name}/__init__.py": "" for name in folders},
            **{f"{name}/test_{name}.py": "from tests.helpers import chi2\n" for name in folders},
            "engine/test_relative.py": "from ..helpers.models import build\nfrom . import _x\n",
        },
    )
    flashspec = tmp_path / "flashspec"
    write(flashspec, {"__init__.py": "", "engine/__init__.py": "", "serve.py": "", "trees.py": ""})
    assert imports_of_test_modules(tests) == []
    assert folders_with_tests(tests) == sorted(folders)
    assert misplaced_modules(tests) == []
    assert unmirrored_folders(tests, flashspec) == []

    write(
        tests,
        {
            "cache/__init__.py": "",
            "cache/test_cache.py": "from . import test_other\nfrom .test_other import X\n",
            "cache/test_other.py": "X = 1\n",
            "engine/tiny_helpers.py": "",
        },
    )
    assert imports_of_test_modules(tests) == [
        "tests/cache/test_cache.py:1 imports tests.cache.test_other",
        "tests/cache/test_cache.py:2 imports tests.cache.test_other",
    ]
    assert misplaced_modules(tests) == ["engine/tiny_helpers.py: a helper outside tests/helpers/"]
    assert unmirrored_folders(tests, flashspec) == ["cache"]
