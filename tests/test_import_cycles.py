"""No import cycles between corpusforge's modules: the package's import graph, read with `ast`, is walked for cycles.

What counts as an edge from module M to module T (both inside corpusforge):
  - `import a.b.c`, `from a.b import c` (T = a.b.c when that is a module, else a.b), relative imports resolved
    against M's package, `from pkg import *` (T = pkg).
  - The packages above T that M is not inside: importing corpusforge.a.b runs corpusforge/a/__init__.py first.
    A package's face that imports its submodules is therefore not a cycle with those submodules when they import
    each other directly; a submodule that imports its own package's face (`from corpusforge.a import x` in
    corpusforge/a/b.py, with a/__init__.py importing b) is one.
  - Not the imports under `if TYPE_CHECKING:`: they never run, and are how a type-only reference is written.

Module-level imports (including those in class bodies and try blocks) run when M is imported: a cycle among them
is a hard failure, whatever its order happens to make work today. Imports inside functions run later and cannot
break an import, but they are coupling all the same ("no import cycles between modules"): a cycle that needs one
fails too, unless every function-level edge it needs is in ALLOWED_FUNCTION_LEVEL below, each with its reason.

Example (what a failure says; iobench had one like it, through runner.py, before results.py):
    2 modules import each other: corpusforge.iobench.objstore, corpusforge.iobench.patterns; one cycle:
    corpusforge.iobench.objstore
      -> corpusforge.iobench.patterns (corpusforge/iobench/objstore.py:19)
      -> corpusforge.iobench.objstore (corpusforge/iobench/patterns.py:384, in a function)
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "corpusforge"

# (importer, imported): why this function-level import may close a cycle. Keep it short; an entry that no longer
# matches an edge fails test_allow_list_is_current, so the list cannot outlive its reason.
ALLOWED_FUNCTION_LEVEL: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # path relative to the package's parent folder, and line
    in_function: bool


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package at `root`, by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(statements: list[ast.stmt], in_function: bool = False):
    """(import node, inside a function) for every import that can run, skipping `if TYPE_CHECKING:` bodies. An
    import is a statement: only statement lists are walked (bodies, else and finally blocks, handlers, match
    cases), not expressions, which keeps the whole package under a second."""
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse, in_function)
            continue
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, name, ()):
                yield from _imports(
                    child.body if isinstance(child, (ast.excepthandler, ast.match_case)) else [child], nested
                )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of `known` that `node`, written in `module`, names (before adding the packages above them)."""

    def longest_known(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := longest_known(alias.name))]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if alias.name != "*" and sub in known:
            out.append(sub)  # `from pkg import submodule`: the submodule, not the package's face
        elif t := longest_known(base):
            out.append(t)
    return out


def import_graph(root: Path = PACKAGE) -> list[Edge]:
    """Every edge between the package's modules (see the module docstring for what counts)."""
    names = module_names(root)
    known = set(names)
    edges = []
    for module, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}  # M and the packages M is inside
        for node, in_function in _imports(tree.body):
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            for target in _targets(node, module, is_package, known):
                parts = target.split(".")
                for k in range(1, len(parts) + 1):  # the packages above the target run first; the target last
                    name = ".".join(parts[:k])
                    if name != module and (name == target or name not in own):
                        edges.append(Edge(module, name, where, in_function))
    return edges


def find_cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """(the modules, one shortest cycle through them) for each strongly connected component of two or more modules
    (Tarjan, then a BFS from its first module)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        best = graph.setdefault(e.source, {}).get(e.target)
        if best is None or (best.in_function and not e.in_function):  # a module-level edge says more
            graph[e.source][e.target] = e
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in sorted(components):
        inside, start = set(component), component[0]
        back: dict[str, Edge] = {}
        frontier = [start]
        while frontier and start not in back:  # BFS from start until an edge comes back to it
            nxt = []
            for v in frontier:
                for w, e in sorted(graph.get(v, {}).items()):
                    if w in inside and w not in back:
                        back[w] = e
                        nxt.append(w)
            frontier = nxt
        cycle, v = [], start
        while True:
            e = back[v]
            cycle.append(e)
            v = e.source
            if v == start:
                break
        cycles.append((component, cycle[::-1]))
    return cycles


def describe(component: list[str], cycle: list[Edge]) -> str:
    lines = [f"{len(component)} modules import each other: {', '.join(component)}; one cycle:", cycle[0].source]
    for e in cycle:
        lines.append(f"  -> {e.target} ({e.where}{', in a function' if e.in_function else ''})")
    return "\n".join(lines)


@functools.cache
def package_graph() -> list[Edge]:
    """corpusforge's graph, read once for the three tests below."""
    return import_graph(PACKAGE)


def test_no_module_level_import_cycle():
    cycles = find_cycles([e for e in package_graph() if not e.in_function])
    assert not cycles, "import cycles at module level:\n" + "\n".join(describe(*c) for c in cycles)


def test_no_import_cycle_through_imports_inside_functions():
    edges = [e for e in package_graph() if not (e.in_function and (e.source, e.target) in ALLOWED_FUNCTION_LEVEL)]
    cycles = find_cycles(edges)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(describe(*c) for c in cycles)


def test_allow_list_is_current():
    function_edges = {(e.source, e.target) for e in package_graph() if e.in_function}
    stale = sorted(set(ALLOWED_FUNCTION_LEVEL) - function_edges)
    assert not stale, f"ALLOWED_FUNCTION_LEVEL names edges that are gone: {stale}"


# -- the checker itself, on small packages written here ------------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _cycles(root: Path, in_functions: bool = True) -> list[list[str]]:
    edges = [e for e in import_graph(root) if in_functions or not e.in_function]
    return [[e.source for e in cycle] for _, cycle in find_cycles(edges)]


def test_a_face_over_submodules_that_import_each_other_is_not_a_cycle(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "fam/__init__.py": "from pkg.fam.a import A\nfrom pkg.fam import b\nfrom .c import C\n",
            "fam/a.py": "from pkg.fam.b import B\nA = 1\n",
            "fam/b.py": "from . import c\nB = 2\n",
            "fam/c.py": "C = 3\n",
            "user.py": "from pkg.fam import A\n",  # through the face, from outside the family: fine
        },
    )
    assert _cycles(root) == []


@pytest.mark.parametrize(
    "line",
    [
        "from pkg.fam import A\n",  # its own package's face
        "from . import A\n",  # the same, relative
        "import pkg.fam\n",
    ],
)
def test_a_submodule_that_imports_its_own_face_is_a_cycle(tmp_path, line):
    root = _package(tmp_path, {"__init__.py": "", "fam/__init__.py": "from pkg.fam.a import A\n", "fam/a.py": line})
    assert _cycles(root) == [["pkg.fam", "pkg.fam.a"]]


def test_cycles_found_relative_deep_and_through_a_package_above_the_target(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "x.py": "from .sub.y import f\n",
            "sub/__init__.py": "",
            "sub/y.py": "from .. import z\n",
            "z.py": "import pkg.x as x\n",
            "fam/__init__.py": "from pkg import w\n",
            "fam/leaf.py": "",
            "w.py": "def f():\n    from pkg.fam.leaf import g\n",  # runs fam/__init__ first, which imports w
        },
    )
    assert _cycles(root) == [["pkg.fam", "pkg.w"], ["pkg.sub.y", "pkg.z", "pkg.x"]]
    assert _cycles(root, in_functions=False) == [["pkg.sub.y", "pkg.z", "pkg.x"]]


def test_type_checking_imports_and_their_else_branch(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        },
    )
    assert _cycles(root) == []
    (root / "b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from pkg import a\n")
    assert _cycles(root) == [["pkg.a", "pkg.b"]]
