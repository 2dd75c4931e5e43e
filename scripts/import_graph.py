"""flashspec's module import graph: its cycles, and the private names ``benchmarks/`` uses.

    python scripts/import_graph.py            # cycles, then private imports; exit 1 if any
    python scripts/import_graph.py --edges    # also every edge, with where it is made

Every import counts, wherever it is written: at the top of a module, inside a function (a
deferred import still runs, and a cycle through one only waits for the first call to bite),
and the dynamic ones whose module is a string in the source (``importlib.import_module``, a
package's ``lazy_exports`` table, ``bench.commands``' ``COMMANDS``). Only imports under
``if TYPE_CHECKING:`` are left out: they never run. ``from pkg import name`` is an edge to the
submodule ``pkg.name`` when there is one, else to ``pkg`` itself. Importing ``a.b.c`` runs
``a.b``'s ``__init__`` first, so it is an edge to each parent package too, except the packages
the importing module is itself inside: those ran before it did (and counting them would make
every package that re-exports a submodule a cycle). Standard library only, and nothing under
flashspec/ is imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "flashspec"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target``, at ``line`` of ``source``'s file."""

    source: str
    target: str
    line: int


@dataclass(frozen=True)
class PrivateImport:
    """An import in ``path`` (at ``line``) of ``name``, a flashspec module or name that starts
    with an underscore."""

    path: Path
    line: int
    name: str


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every Python module of ``package`` under ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def extension_modules(root: Path = ROOT, package: str = PACKAGE) -> set[str]:
    """Compiled modules (``_residual``, ``_quant``): nodes an import can reach, with no edges."""
    names = set()
    for path in (root / package).rglob("*"):
        if path.suffix in {".so", ".pyd", ".pyi"}:
            stem = path.name.split(".")[0]
            names.add(".".join([*path.relative_to(root).parent.parts, stem]))
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _string_tables(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = {key: "module", ...}`` (or ``NAME: T = ...``) dicts whose values
    are all strings: the tables dynamic imports look their modules up in."""
    tables: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Dict):
            continue
        strings = [
            v.value
            for v in value.values
            if isinstance(v, ast.Constant) and isinstance(v.value, str)
        ]
        if strings and len(strings) == len(value.values):
            tables[target.id] = strings
    return tables


def _dynamic_modules(call: ast.Call, tables: dict[str, list[str]]) -> list[str]:
    """The module strings a dynamic import ``call`` may load: ``import_module(X, ...)`` or
    ``lazy_exports(namespace, X)``, with X a string or a lookup in (or all of) a string table."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name == "import_module" and call.args:
        arg = call.args[0]
    elif name == "lazy_exports" and len(call.args) >= 2:
        arg = call.args[1]
    else:
        return []
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.Subscript):
        arg = arg.value
    if isinstance(arg, ast.Name):
        return tables.get(arg.id, [])
    return []


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: -(level - 1)]
    return ".".join([*base, *([name] if name else [])])


def module_edges(module: str, path: Path, known: set[str], package: str = PACKAGE) -> list[Edge]:
    """The imports of ``package`` modules that ``module`` (in ``path``) makes when it runs.

    ``known`` holds every module name of the package: it tells a submodule (``from . import
    cli``) from a name defined in the package (``from .. import __version__``).
    """
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    tables = _string_tables(tree)
    edges: list[Edge] = []

    def add(target: str, line: int) -> None:
        # Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first (then ``a.b.c``): an edge to
        # each parent package, except those this module is inside, which ran before it did.
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            inside = module == name or module.startswith(name + ".")
            if depth < len(parts) and (inside or name not in known):
                continue
            edge = Edge(module, name, line)
            in_package = name == package or name.startswith(package + ".")
            if in_package and name != module and edge not in edges:
                edges.append(edge)

    def add_from(base: str, names: Iterable[str], line: int) -> None:
        for name in names:
            sub = f"{base}.{name}"
            add(sub if sub in known else base, line)

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            add_from(base, (alias.name for alias in node.names), node.lineno)
        elif isinstance(node, ast.Call):
            for target in _dynamic_modules(node, tables):
                name = target.lstrip(".")
                level = len(target) - len(name)
                add(_resolve(module, is_package, level, name or None), node.lineno)
    return edges


def import_edges(root: Path = ROOT, package: str = PACKAGE) -> list[Edge]:
    """Every runtime import between ``package``'s modules (see the module docstring)."""
    files = module_files(root, package)
    known = set(files) | extension_modules(root, package)
    edges: list[Edge] = []
    for module, path in files.items():
        edges.extend(module_edges(module, path, known, package))
    return edges


def strongly_connected(nodes: Iterable[str], edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of the graph (Tarjan's algorithm, iterative), each
    sorted; only those with more than one module, the import cycles, largest first."""
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def cycles(root: Path = ROOT, package: str = PACKAGE) -> list[list[str]]:
    """``package``'s import cycles: strongly connected components of more than one module."""
    return strongly_connected(module_files(root, package), import_edges(root, package))


def private_imports(paths: Iterable[Path], package: str = PACKAGE) -> list[PrivateImport]:
    """Imports in ``paths`` of a ``package`` module, or a name from one, that is private: any
    dotted part or imported name starting with ``_`` (``flashspec._greedy``,
    ``from flashspec import _quant``, ``from flashspec.x import _helper``)."""
    found: list[PrivateImport] = []
    for path in paths:
        # Type-only imports count here too: a script's annotations are still on private API.
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == package and any(part.startswith("_") for part in parts[1:]):
                    found.append(PrivateImport(path, node.lineno, name))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Print the cycles and the private imports of ``benchmarks/*.py``; 1 if there are any."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every edge too")
    args = parser.parse_args(argv)
    edges = import_edges()
    if args.edges:
        for edge in sorted(edges, key=lambda e: (e.source, e.target, e.line)):
            print(f"{edge.source} -> {edge.target}  (line {edge.line})")
    found = strongly_connected(module_files(), edges)
    for component in found:
        members = set(component)
        print(f"cycle of {len(component)}: {', '.join(component)}")
        for edge in sorted(edges, key=lambda e: (e.source, e.target, e.line)):
            if edge.source in members and edge.target in members:
                print(f"    {edge.source} -> {edge.target}  (line {edge.line})")
    private = private_imports(sorted((ROOT / "benchmarks").glob("*.py")))
    for item in private:
        print(f"private: {item.path.relative_to(ROOT)}:{item.line}: {item.name}")
    if not found and not private:
        print("no import cycles; benchmarks/ imports no private names")
    return 1 if found or private else 0


if __name__ == "__main__":
    sys.exit(main())
