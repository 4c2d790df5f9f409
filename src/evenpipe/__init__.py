"""evenpipe: pipeline-parallel training with balanced activation memory (BPipe), one schedule IR driving a
runtime, a validator, a simulator and a planner.

The planning parts (``evenpipe.schedule``, ``evenpipe.sim``, ``evenpipe.cost``, ``evenpipe.plan``) import
without torch; torch lives in ``evenpipe.runtime`` and ``evenpipe.models``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__version__ = "0.1.0"


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose names in ``where`` (name -> the module defining it)
    are imported on first access (PEP 562): a package exports them without loading them for callers who never
    ask. Each is bound in the package once loaded."""

    def get(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def names() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return get, names
