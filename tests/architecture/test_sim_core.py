"""Pin the simulator core's shape: one dispatcher over evaluators that share a rule table and a kernel, no
evaluator reaching into another, no imports hidden inside functions, and short functions."""

from __future__ import annotations

import ast
import pathlib

from evenpipe.schedule import build_schedule
from evenpipe.sim import SimCosts, simulate
from evenpipe.sim.dispatch import EVALUATORS

SIM = pathlib.Path(__file__).resolve().parents[2] / "src" / "evenpipe" / "sim"
EVALUATOR_MODULES = {"engine", "fast", "free", "links"}
MAX_LINES = 80


def _tree(name: str) -> ast.Module:
    return ast.parse((SIM / f"{name}.py").read_text())


def _sim_imports(tree: ast.Module) -> set[str]:
    """The ``evenpipe.sim`` modules a module imports (``from evenpipe.sim import x`` counts ``x``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("evenpipe.sim"):
            if node.module == "evenpipe.sim":
                out.update(a.name for a in node.names)
            else:
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[2] for a in node.names if a.name.startswith("evenpipe.sim."))
    return out


def test_no_evaluator_imports_another() -> None:
    for name in EVALUATOR_MODULES:
        assert not _sim_imports(_tree(name)) & (EVALUATOR_MODULES - {name}), name


def test_no_imports_inside_functions_and_no_long_functions() -> None:
    for path in sorted(SIM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                assert lines <= MAX_LINES, f"{path.name}: {node.name} has {lines} lines"
                inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not inner, f"{path.name}: {node.name} imports inside a function"


def test_dispatcher_lists_every_evaluator_with_the_reference_last() -> None:
    assert [e.name for e in EVALUATORS] == ["free", "links", "fast", "events"]
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    assert EVALUATORS[-1].applies(sched, SimCosts.uniform(num_stages=2))
    assert simulate(sched, SimCosts.uniform(num_stages=2)).evaluator == "free"
