"""Every import points down: the floors of docs/architecture.md, read from the source with ``ast``.

A module may import its own package and the packages of the floors below its own; never a package beside it
on its floor, never one above. Imports inside functions and under ``TYPE_CHECKING`` count as well: a late
import hides a circle from the interpreter, not from the reader. Tests may import anything and are not read.
"""

from __future__ import annotations

import ast
import builtins
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FLOORS: tuple[tuple[str, ...], ...] = (
    ("poolgate.kernel",),
    ("agent", "simworker"),
    ("extproc", "controller"),
    ("poolgate",),
    ("bench",),
)
"""The floors, ground first, and the packages on each: the kernel every program shares; the node's programs
(the agent beside each engine, the simulated engine); the services (the request path and the fleet's
control plane); the application (the ``poolgate`` CLI, ``up``, ``status``, the generators); the tools that
drive all of it (benchmarks). ``poolgate.kernel`` is a package of its own that only happens to sit in
``poolgate/``: the longest name that matches decides a module's package."""



@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def package_of(module: str) -> str | None:
    """The floor package ``module`` belongs to (the longest declared name it starts with), or None."""
    best = None
    for floor in FLOORS:
        for package in floor:
            if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best)):
                best = package
    return best


def floor_of(package: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if package in floor)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the floors' packages by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for top in sorted({package.split(".")[0] for floor in FLOORS for package in floor}):
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(known: Mapping[str, Path]) -> Iterator[Import]:
    """Each import of a known module by a known module, ``from a import b`` read as ``a.b`` where that is one."""
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
                submodules = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in submodules if t in known] or [base]
            else:
                continue
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    yield Import(module, target, node.lineno)


def upward(found: Iterable[Import]) -> list[Import]:
    """Imports of a package on the importer's floor or above (its own package excepted)."""
    wrong = []
    for edge in found:
        here, there = package_of(edge.importer), package_of(edge.imported)
        if here is None or there is None or here == there:
            continue
        if floor_of(there) >= floor_of(here):
            wrong.append(edge)
    return wrong


def circles(edges: Iterable[tuple[str, str]]) -> list[frozenset[str]]:
    """The strongly connected parts of more than one node (Tarjan's, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.add(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(frozenset(part))
    return found


def package_circles(found: Iterable[Import]) -> list[frozenset[str]]:
    return circles((package_of(e.importer) or "", package_of(e.imported) or "") for e in found
                   if package_of(e.importer) != package_of(e.imported))


def module_circles(found: Iterable[Import]) -> list[frozenset[str]]:
    return circles((e.importer, e.imported) for e in found)


def circle_edges(found: Iterable[Import], every: Iterable[frozenset[str]]) -> list[Import]:
    """The imports that close ``every`` circle: between two of its modules, or two of its packages."""
    every = list(every)
    edges = []
    for edge in found:
        packages = {package_of(edge.importer), package_of(edge.imported)}
        if any({edge.importer, edge.imported} <= circle or (len(packages) == 2 and packages <= circle)
               for circle in every):
            edges.append(edge)
    return edges


def _explain(edges: Iterable[Import]) -> str:
    return "\n".join(f"  {e.importer} (line {e.line}) imports {e.imported}" for e in edges)


def test_every_import_points_down() -> None:
    wrong = upward(imports(modules()))
    assert not wrong, "imports that run up or sideways (move the shared code down a floor):\n" + _explain(wrong)


def test_no_import_circles() -> None:
    found = list(imports(modules()))
    every = package_circles(found) + module_circles(found)
    assert not every, (f"import circles (one side must stop importing the other): {[sorted(c) for c in every]}\n"
                       + _explain(circle_edges(found, every)))


def test_one_exception_tree() -> None:
    # Every exception poolgate defines derives from ``PoolgateError`` (beside a built-in one it may also be,
    # such as ``ValueError``), so a caller tells poolgate's errors from library and programming errors.
    builtin = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}
    classes = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = ([b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                                      for b in node.bases], path)
    in_tree = {"PoolgateError"}
    while grown := {name for name, (bases, _) in classes.items() if name not in in_tree and in_tree & set(bases)}:
        in_tree |= grown
    outside = sorted(f"{path.relative_to(ROOT)}: {name}" for name, (bases, path) in classes.items()
                     if builtin & set(bases) and name not in in_tree)
    assert not outside, f"exceptions outside the PoolgateError tree: {outside}"


def test_the_application_package_imports_nothing_when_the_kernel_is_imported() -> None:
    # Importing ``poolgate.kernel.x`` runs ``poolgate/__init__.py`` first: it must stay empty of imports, or
    # every program would load the application's modules with the kernel.
    tree = ast.parse((ROOT / "poolgate" / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_every_module_sits_on_a_floor() -> None:
    assert all(package_of(module) is not None for module in modules())


def test_the_reader_sees_what_runs_up_and_what_circles() -> None:
    # The checks above are only as good as the reader: a made-up tree with one import up and one circle.
    known = {"poolgate.kernel.a": Path("a"), "controller.b": Path("b"), "controller.c": Path("c"),
             "extproc.d": Path("d")}
    edges = [Import("poolgate.kernel.a", "controller.b", 1), Import("controller.b", "controller.c", 1),
             Import("controller.c", "controller.b", 2), Import("controller.b", "poolgate.kernel.a", 3),
             Import("extproc.d", "controller.c", 4)]
    assert set(known) >= {e.importer for e in edges}
    assert [(e.importer, e.imported) for e in upward(edges)] == [("poolgate.kernel.a", "controller.b"),
                                                                 ("extproc.d", "controller.c")]
    assert module_circles(edges) == [frozenset({"controller.b", "controller.c", "poolgate.kernel.a"})]
    assert package_circles(edges) == [frozenset({"poolgate.kernel", "controller"})]
    assert [(e.importer, e.imported) for e in circle_edges(edges, package_circles(edges))] == [
        ("poolgate.kernel.a", "controller.b"), ("controller.b", "poolgate.kernel.a")]


def test_the_reader_finds_late_relative_and_type_checking_imports(tmp_path: Path) -> None:
    # An import inside a function, a relative one and one under TYPE_CHECKING each run up as surely as one at
    # the top of the module.
    files = {
        "poolgate/__init__.py": "",
        "poolgate/kernel/__init__.py": "",
        "poolgate/kernel/clock.py": "def now():\n    from controller.xds import build\n    return build\n",
        "poolgate/kernel/names.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import extproc.pick\n",
        "poolgate/kernel/keys.py": "from . import names\n",
        "controller/__init__.py": "",
        "controller/xds/__init__.py": "",
        "controller/xds/build.py": "from . import cache\nfrom poolgate import up\n",
        "controller/xds/cache.py": "",
        "extproc/__init__.py": "",
        "extproc/pick.py": "from poolgate.kernel.keys import *\n",
        "poolgate/up.py": "import controller.xds.build\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = list(imports(modules(tmp_path)))
    assert sorted((e.importer, e.imported, e.line) for e in upward(found)) == [
        ("controller.xds.build", "poolgate.up", 2),
        ("poolgate.kernel.clock", "controller.xds.build", 2),
        ("poolgate.kernel.names", "extproc.pick", 3),
    ]
    assert ("poolgate.kernel.keys", "poolgate.kernel.names") in {(e.importer, e.imported) for e in found}
    assert ("controller.xds.build", "controller.xds.cache") in {(e.importer, e.imported) for e in found}
    assert set(module_circles(found)) == {frozenset({"controller.xds.build", "poolgate.up"}),
                                          frozenset({"extproc.pick", "poolgate.kernel.keys", "poolgate.kernel.names"})}
