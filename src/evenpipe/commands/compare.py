"""``evenpipe compare PREDICTED MEASURED``: two evenpipe trace JSON files of one schedule (from ``simulate --out`` /
``--profile`` and ``train --trace-json``), compared figure by figure, with both timelines in one picture."""

from __future__ import annotations

import argparse
import pathlib

from evenpipe.errors import ConfigError
from evenpipe.sim.compare import compare_traces
from evenpipe.sim.trace import Trace

__all__ = ["add_arguments", "run", "read_trace"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("predicted", help="trace JSON of the prediction (evenpipe simulate --out DIR: DIR/trace.evenpipe.json)")
    p.add_argument("measured", help="trace JSON of the measured run (evenpipe train --trace-json PATH)")
    p.add_argument("--out", default="compare.png", help="picture of both timelines (default compare.png)")


def read_trace(path: str) -> Trace:
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"trace file {str(p)!r} does not exist")
    try:
        return Trace.from_json(p.read_text())
    except ConfigError as e:
        raise ConfigError(f"{str(p)!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from evenpipe.commands.output_paths import check_picture_file
    check_picture_file(args.out, "--out")
    predicted, measured = read_trace(args.predicted), read_trace(args.measured)
    cmp = compare_traces(predicted, measured)
    from evenpipe.report.compare import comparison_text, save_comparison  # matplotlib
    print(comparison_text(cmp))
    out = save_comparison(predicted, measured, args.out)
    print(f"\nwrote {out}")
    return 0
