"""Pin the layering: the pure core imports neither torch nor matplotlib, and lower layers never import higher ones."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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
        "for layer in ('schedule', 'sim', 'cost', 'plan'):\n"
        "    pkg = importlib.import_module('evenpipe.' + layer)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "import evenpipe.cli\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
