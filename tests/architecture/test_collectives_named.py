"""Every blocking collective of the runtime and the training loop runs inside ``with collective("...")``.

A collective outside one fails, when a peer dies, with gloo's bare ``RuntimeError``: the rank's fault line then
says "raised RuntimeError: the peer closed the connection" instead of what it was waiting for, and the watchdog
cannot name a collective that hangs. (The slow-rank all-gather was such a call: a SIGKILLed peer left the others
with anonymous lines.) The profiler is exempt: it reports its own failures, outside a training job.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "evenpipe"
CHECKED = ["runtime", "training"]
EXEMPT = {"runtime/profile.py", "runtime/comm.py"}
COLLECTIVES = {"barrier", "all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce_scatter_tensor",
               "all_gather_into_tensor", "gather", "scatter", "reduce", "all_to_all", "gather_object",
               "broadcast_object_list", "all_gather_object", "scatter_object_list", "monitored_barrier"}


def _named_withs(tree: ast.AST) -> set[int]:
    """ids of the nodes lexically inside a ``with collective(...)`` or ``with observed(...)`` block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Name)
                and i.context_expr.func.id in ("collective", "observed") for i in node.items):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def unnamed_collectives() -> list[str]:
    found = []
    for floor in CHECKED:
        for path in sorted((SRC / floor).rglob("*.py")):
            rel = path.relative_to(SRC).as_posix()
            if rel in EXEMPT:
                continue
            tree = ast.parse(path.read_text())
            inside = _named_withs(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                        and node.func.attr in COLLECTIVES and id(node) not in inside):
                    found.append(f"{rel}:{node.lineno} dist.{node.func.attr}")
    return found


def test_every_collective_is_named() -> None:
    assert unnamed_collectives() == []


def test_the_check_sees_an_unnamed_collective(tmp_path: pathlib.Path) -> None:
    """The walk itself: a bare call is found, a wrapped one is not."""
    tree = ast.parse("def f():\n    dist.barrier()\n    with collective('x'):\n        dist.barrier()\n")
    inside = _named_withs(tree)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert [id(c) in inside for c in sorted(calls, key=lambda c: c.lineno)] == [False, True]
