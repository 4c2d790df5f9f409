"""The options table of every ``docs/commands/<command>.md`` equals the one generated from the live parser, and
every command of the CLI has its page."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest

from evenpipe.cli import SUBCOMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
REGENERATE = "regenerate with `PYTHONPATH=src python docs/gen_options.py`"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "docs" / "gen_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_options", module)
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_options_table_matches_the_parser(name: str) -> None:
    page = ROOT / "docs" / "commands" / f"{name}.md"
    assert page.exists(), f"`evenpipe {name}` has no page {page.relative_to(ROOT)}; write one with the markers " \
        f"{gen.BEGIN!r} and {gen.END!r}, then {REGENERATE}"
    text = page.read_text()
    assert gen.render_page(text, name) == text, f"{page.relative_to(ROOT)}: options table is stale; {REGENERATE}"


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_option_of_the_parser_is_in_the_table(name: str) -> None:
    block = gen.options_markdown(name)
    for action in gen.command_parser(name)._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}" in block, f"{flag} of `evenpipe {name}` missing from its table"


def test_a_changed_help_makes_the_page_stale() -> None:
    name = next(iter(SUBCOMMANDS))
    text = (ROOT / "docs" / "commands" / f"{name}.md").read_text()
    start = text.index(gen.BEGIN) + len(gen.BEGIN)
    edited = text[:start] + "\n| `--made-up` | – | not an option |" + text[start:]
    assert gen.render_page(edited, name) == text
