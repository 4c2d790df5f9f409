"""README.md's five-minute tour runs as written: every command in its ``sh`` blocks, in order, in an empty
directory, exits 0, and the first line of each ``text`` block (the output to expect) still appears in what the
commands before it printed, numbers aside."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
TOUR_HEADING = "## Five-minute tour"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_NUMBER = re.compile(r"[-+]?\d[\d.,]*(e[-+]?\d+)?")


@dataclass
class Step:
    """The commands of one ``sh`` block and the first line of the ``text`` block after it, if any."""

    commands: list[list[str]]
    expect: str | None = None
    printed: list[str] = field(default_factory=list)


def tour_section(text: str) -> str:
    """The README's text from the tour heading to the next ``## `` heading."""
    start = text.index(TOUR_HEADING)
    end = text.find("\n## ", start + len(TOUR_HEADING))
    return text[start:] if end < 0 else text[start:end]


def _commands(block: str) -> list[list[str]]:
    joined = re.sub(r"\\\n", " ", block)
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def tour_steps(section: str) -> list[Step]:
    steps: list[Step] = []
    for match in _FENCE.finditer(section):
        lang, body = match.group(1), match.group(2)
        if lang == "sh":
            steps.append(Step(_commands(body)))
        elif lang == "text" and steps and steps[-1].expect is None:
            steps[-1].expect = next(line for line in body.splitlines() if line.strip())
    return steps


def numbers_aside(line: str) -> str:
    """A line with every number replaced by ``#`` and runs of spaces by one."""
    return " ".join(_NUMBER.sub("#", line).split())


def test_the_tour_is_found_and_covers_plan_simulate_train_compare() -> None:
    steps = tour_steps(tour_section(README.read_text()))
    words = [cmd[:2] for step in steps for cmd in step.commands]
    assert all(w[0] == "evenpipe" for w in words), words
    assert {w[1] for w in words} >= {"plan", "simulate", "profile", "train", "compare"}, words
    assert all(step.expect for step in steps), "every tour block shows the output to expect"


def test_numbers_aside_keeps_the_words() -> None:
    assert numbers_aside("step time   4.89086   bubble 31.74%  P=8") == "step time # bubble #% P=#"


@pytest.mark.slow
def test_the_tour_runs_as_written(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for step in tour_steps(tour_section(README.read_text())):
        printed = []
        for cmd in step.commands:
            done = subprocess.run([sys.executable, "-m", "evenpipe", *cmd[1:]], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"README tour: `{shlex.join(cmd)}` exited {done.returncode}:\n{done.stderr}"
            printed += done.stdout.splitlines() + done.stderr.splitlines()
        assert step.expect is not None
        assert numbers_aside(step.expect) in {numbers_aside(line) for line in printed}, (
            f"README tour: `{shlex.join(step.commands[-1])}` no longer prints a line like {step.expect!r}")
