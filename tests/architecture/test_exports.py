"""Every name a package exports resolves, whether bound at import or loaded on first access (PEP 562), and the
names loaded lazily are not loaded by importing the package."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ("evenpipe.schedule", "evenpipe.sim", "evenpipe.cost", "evenpipe.plan")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package} exports names it cannot give: {missing}"
    assert set(module.__all__) <= set(dir(module))


def test_an_unknown_name_is_an_attribute_error() -> None:
    plan = importlib.import_module("evenpipe.plan")
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        getattr(plan, "nothing_here")


def test_explain_modules_load_only_when_asked() -> None:
    code = ("import sys, evenpipe.plan, evenpipe.schedule; "
            "print('evenpipe.plan.explain' in sys.modules, 'evenpipe.plan.levers' in sys.modules); "
            "from evenpipe.plan import explain_bpipe; print('evenpipe.plan.explain' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]
