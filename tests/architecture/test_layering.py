"""Pin the layering: the pure core imports neither torch nor matplotlib, every floor of ``evenpipe`` imports only
the floors below it, and no two modules import each other, directly or round a ring.

A *floor* is a sub-package (``schedule``, ``sim``, ...) or a top-level module (``cli``, ``errors``, ...). Imports
are read from the source (``ast``) wherever they stand: at the top, inside functions, under ``if TYPE_CHECKING``,
and ``importlib.import_module`` with a literal (or f-string) ``"evenpipe...."`` prefix.

- Floors: every import counts, type-only ones included -- a lower floor that names a higher floor's type in an
  annotation depends on it as much as one that calls it.
- Circles: imports under ``if TYPE_CHECKING`` do not count, since they never run; an import inside a function
  does (it runs on the first call; a ring held apart by such imports is still a ring).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "evenpipe"
PURE = ["schedule", "sim", "cost", "plan"]
FORBIDDEN_IN_PURE = {"torch", "matplotlib", "numpy"}
# layer -> layers it may import (besides itself, errors and the package root)
ALLOWED = {
    "schedule": set(),
    "sim": {"schedule"},
    "cost": {"schedule", "sim"},
    "plan": {"schedule", "sim", "cost"},
}

ROOT = "evenpipe"
"""The package root's floor name (``evenpipe/__init__.py``); it may import only ``errors``."""
_CORE = {"errors", "schedule", "sim", "cost", "plan"}
_ENGINES = _CORE | {"report", "models", "runtime", "dataset"}
FLOORS: dict[str, set[str]] = {
    ROOT: {"errors"},
    "errors": set(),
    "schedule": {"errors"},
    "sim": {"errors", "schedule"},
    "cost": {"errors", "schedule", "sim"},
    "plan": {"errors", "schedule", "sim", "cost"},
    "dataset": {"errors"},  # documents as they come (numpy, no torch)
    "report": _CORE,  # presentation of schedules, traces, estimates and plans (matplotlib)
    "models": _CORE,  # reference models as pipeline parts (torch)
    "runtime": _CORE | {"report", "models", "dataset"},  # the only torch.distributed; writes its trace through report
    "training": _ENGINES,  # job config, loop, launcher and workers, checkpoints, faults
    "pipeline": _ENGINES,  # the library's Pipeline over models and runtime
    "commands": _ENGINES | {"training", "pipeline"},  # one module per CLI subcommand
    "demo": _ENGINES | {"training", "pipeline", "commands"},
    "cli": {"errors", "commands"},
    "__main__": {"cli"},
}
"""Floor -> the floors it may import (besides itself and the package root). A floor not listed fails the test."""

UPWARD_ALLOWLIST: set[tuple[str, str]] = set()
"""(importer, imported) pairs that break :data:`FLOORS` today, each commented with its owner; each must still
exist, so none goes stale. Empty: keep it so."""

CIRCLE_ALLOWLIST: list[set[str]] = []
"""Import circles (strongly connected modules) that exist today; each must match a circle exactly, so a removed
or changed circle fails the test until its entry is removed or updated."""


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", PURE)
def test_pure_layer_imports(layer: str) -> None:
    for path in (SRC / layer).rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN_IN_PURE, f"{path} imports {name}"
            if top == "evenpipe" and "." in name:
                sub = name.split(".")[1]
                if sub in ("errors",) or sub == layer:
                    continue
                assert sub in ALLOWED[layer], f"{path} ({layer}) imports evenpipe.{sub}"


def test_planning_imports_without_torch() -> None:
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'matplotlib'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import pkgutil, importlib, evenpipe\n"
        "for layer in ('schedule', 'sim', 'cost', 'plan', 'dataset'):\n"
        "    pkg = importlib.import_module('evenpipe.' + layer)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "import evenpipe.cli\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the module graph ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Edge:
    """One import of a package module by another, as written at ``line`` of the importer."""

    importer: str
    imported: str
    line: int
    type_only: bool


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of ``package`` (a package is its ``__init__.py``)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _dynamic_target(node: ast.Call) -> str | None:
    """The literal ``evenpipe....`` prefix of ``import_module("...")`` / ``import_module(f"....{x}")``."""
    func = node.func
    if getattr(func, "attr", getattr(func, "id", None)) != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.JoinedStr):
        arg = arg.values[0] if arg.values else arg
        text = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else ""
        return text.rsplit(".", 1)[0] or None
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def _targets(node: ast.AST, package_of: str, known: dict[str, pathlib.Path]) -> list[str]:
    """Dotted names ``node`` imports: relative imports resolved, ``from pkg import sub`` read as the submodule."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = package_of.split(".")[: len(package_of.split(".")) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        return [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
    if isinstance(node, ast.Call):
        target = _dynamic_target(node)
        return [target] if target else []
    return []


def import_edges(package: pathlib.Path) -> list[Edge]:
    """Every import of one of ``package``'s modules by another, anywhere in the importer."""
    known, root = modules(package), package.name
    edges = []
    for name, path in sorted(known.items()):
        tree = ast.parse(path.read_text())
        type_only = _type_checking_nodes(tree)
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            resolved = set()
            for target in _targets(node, package_of, known):
                if target.split(".")[0] != root:
                    continue
                while target not in known:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                resolved.add(target)
            for target in sorted(resolved - {name}):
                edges.append(Edge(name, target, getattr(node, "lineno", 0), id(node) in type_only))
    return edges


def circles(edges: list[Edge]) -> list[set[str]]:
    """The strongly connected sets of two or more modules, over the imports that run (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.imported, set())
        if not e.type_only:
            graph.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set(stack[stack.index(node):])
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def describe_circle(component: set[str], edges: list[Edge]) -> str:
    """One ring through ``component``, each import with its line: ``a:12 -> b:30 -> a``."""
    within = {}
    for e in edges:
        if not e.type_only and e.importer in component and e.imported in component:
            within.setdefault(e.importer, {}).setdefault(e.imported, e.line)
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first, back to start
        node = frontier.pop(0)
        for nxt in sorted(within.get(node, {})):
            if nxt == start:
                ring = paths[node] + [start]
                return " -> ".join(f"{a}:{within[a][b]}" for a, b in zip(ring, ring[1:])) + f" -> {start}"
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                frontier.append(nxt)
    raise AssertionError(f"{sorted(component)} is not a circle")


def floor(module: str) -> str:
    """``evenpipe.sim.engine`` -> ``sim``; ``evenpipe.cli`` -> ``cli``; ``evenpipe`` -> the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def upward(edges: list[Edge], floors: dict[str, set[str]]) -> list[Edge]:
    """The imports that leave their floor for one it may not import (type-only ones included)."""
    return [e for e in edges if floor(e.imported) not in floors[floor(e.importer)] | {floor(e.importer), ROOT}]


# --- the tests over evenpipe ------------------------------------------------------------------------------------

def test_every_floor_is_pinned() -> None:
    assert {floor(m) for m in modules(SRC)} == set(FLOORS), "add the new floor to FLOORS (or remove the stale one)"
    for name, allowed in FLOORS.items():
        assert allowed <= set(FLOORS), f"{name} may import an unknown floor"


def test_no_floor_imports_a_higher_one() -> None:
    found = upward(import_edges(SRC), FLOORS)
    bad = [f"{e.importer}:{e.line} imports {e.imported}" for e in found
           if (e.importer, e.imported) not in UPWARD_ALLOWLIST]
    assert not bad, "imports that run up a floor:\n" + "\n".join(bad)
    stale = UPWARD_ALLOWLIST - {(e.importer, e.imported) for e in found}
    assert not stale, f"gone, remove it from UPWARD_ALLOWLIST: {sorted(stale)}"


def test_no_import_circles() -> None:
    edges = import_edges(SRC)
    found = circles(edges)
    bad = [describe_circle(c, edges) for c in found if c not in CIRCLE_ALLOWLIST]
    assert not bad, "import circles:\n" + "\n".join(bad)
    stale = [sorted(c) for c in CIRCLE_ALLOWLIST if c not in found]
    assert not stale, f"gone or changed, remove (or update) it in CIRCLE_ALLOWLIST: {stale}"


# --- the checker itself finds what it should --------------------------------------------------------------------

_TOY = {
    "__init__.py": "",
    "low/__init__.py": "from toy.low.a import A\n",
    "low/a.py": "A = 1\ndef f():\n    from . import b\n",  # a -> b inside a function
    "low/b.py": "from toy.low.a import A\n",  # b -> a: a ring of two
    "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.high import H\n",  # type-only
    "high.py": "import importlib\nimportlib.import_module(f'toy.low.{1}')\nH = 1\n",
    "top.py": "from toy import low\nfrom .high import H\n",
}


@pytest.fixture
def toy(tmp_path: pathlib.Path) -> pathlib.Path:
    for rel, text in _TOY.items():
        (tmp_path / "toy" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toy" / rel).write_text(text)
    return tmp_path / "toy"


def test_the_checker_reads_every_kind_of_import(toy: pathlib.Path) -> None:
    got = {(e.importer, e.imported, e.type_only) for e in import_edges(toy)}
    assert got == {("toy.low", "toy.low.a", False), ("toy.low.a", "toy.low.b", False),
                   ("toy.low.b", "toy.low.a", False), ("toy.low.c", "toy.high", True),
                   ("toy.high", "toy.low", False), ("toy.top", "toy.low", False), ("toy.top", "toy.high", False)}


def test_the_checker_finds_rings_and_upward_imports(toy: pathlib.Path) -> None:
    edges = import_edges(toy)
    assert circles(edges) == [{"toy.low.a", "toy.low.b"}]
    assert describe_circle({"toy.low.a", "toy.low.b"}, edges) == "toy.low.a:3 -> toy.low.b:1 -> toy.low.a"
    floors = {ROOT: set(), "low": set(), "high": {"low"}, "top": {"low", "high"}}
    assert [(e.importer, e.imported) for e in upward(edges, floors)] == [("toy.low.c", "toy.high")]
    with_type_only = edges + [Edge("toy.high", "toy.low.c", 1, False)]
    assert circles(with_type_only) == [{"toy.low.a", "toy.low.b"}]  # low.c -> high is type-only: no ring
