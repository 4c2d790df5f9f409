"""Command-line entry point: ``evenpipe SUBCOMMAND ...``. Thin: parse, call, print.

Each subcommand lives in ``evenpipe.commands.<name>`` and provides ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported lazily so that planning commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from evenpipe.errors import EvenpipeError

__all__ = ["main", "entry", "SUBCOMMANDS"]

SUBCOMMANDS: dict[str, str] = {
    "simulate": "Simulate a schedule: timeline, bubble and per-rank activation memory.",
    "train": "Train a reference model with a pipeline schedule over torch.distributed.",
    "estimate": "Predict memory, step time and MFU of one parallel configuration.",
    "plan": "Search parallel configurations and schedules; explain whether BPipe pays.",
    "profile": "Measure a model's layers, optimizer and messages on this machine; fit and extrapolate.",
    "compare": "Compare a predicted and a measured trace of one schedule, with both timelines in one picture.",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"evenpipe: error: {message}\n")


def _chosen_command(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), before any parsing."""
    return next((a for a in argv if not a.startswith("-")), None)


def _build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = _Parser(prog="evenpipe", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = _chosen_command(argv)
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen command's module is imported (keeps torch out of planning)
            importlib.import_module(f"evenpipe.commands.{name.replace('-', '_')}").add_arguments(p)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, chosen = _build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f"evenpipe.commands.{args.command.replace('-', '_')}")
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print(f"evenpipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (``| head``): nothing more to say, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except EvenpipeError as e:
        first = str(e).splitlines()[0]
        print(f"evenpipe {args.command}: error: {first}", file=sys.stderr)
        rest = str(e).splitlines()[1:]
        if rest:
            print("\n".join(rest), file=sys.stderr)
        return 2


_QUICK_EXIT = frozenset({"simulate", "estimate", "plan"})
"""Commands that leave nothing to clean up when they return (no processes, sockets or open files; only caches of
pure values): their process ends without the interpreter's teardown, which would free the planner's and the
simulator's caches one object at a time (about 0.07 s after a ``plan``)."""


def entry() -> NoReturn:
    """The process entry point (``evenpipe`` and ``python -m evenpipe``): :func:`main`, then exit with its code."""
    argv = sys.argv[1:]
    code = main(argv)
    if _chosen_command(argv) in _QUICK_EXIT:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # a closed pipe: nothing more can be said
            pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
