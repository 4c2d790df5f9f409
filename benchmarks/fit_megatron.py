"""Fit the cost model's efficiency parameters to Megatron-LM 2021 (Narayanan et al., Table 1) and report the
leave-one-out error of each row.

    .venv/bin/python benchmarks/fit_megatron.py [--rounds 2] [--csv PATH]

Prints the fitted Efficiency (paste into ``evenpipe.cost.timing.Efficiency`` defaults), then one line per row:
our configuration assumptions, the measured TFLOP/s per GPU, the prediction with the current defaults, with the
all-rows fit, and with the fit that left that row out, and the leave-one-out error. Assumptions are in the
docstring of ``evenpipe.cost.fit``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from evenpipe.cost import Efficiency
from evenpipe.cost.fit import (FIT_FIELDS, PRIOR, fit_efficiency, leave_one_out, load_megatron_rows, predict_tflops,
                               row_setup)

REPO = pathlib.Path(__file__).resolve().parents[1]
CANDIDATES = (REPO.parent / "shared" / "reference" / "megatron2021_weak_scaling.csv",
              REPO / "tests" / "unit" / "cost" / "data" / "megatron2021_weak_scaling.csv")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=pathlib.Path, default=next((p for p in CANDIDATES if p.exists()), CANDIDATES[-1]))
    ap.add_argument("--rounds", type=int, default=2, help="surrogate recalibrations per fit")
    args = ap.parse_args(argv)
    rows = load_megatron_rows(args.csv)
    t0 = time.perf_counter()
    full = fit_efficiency(rows, start=PRIOR, rounds=args.rounds)
    fitted = {name: getattr(full.efficiency, name) for name in FIT_FIELDS}
    print("fitted on all rows: " + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
    current = {name: getattr(Efficiency(), name) for name in FIT_FIELDS}
    same = all(abs(current[k] - fitted[k]) <= 1e-3 * abs(fitted[k]) for k in fitted)
    print(f"Efficiency() defaults {'match' if same else 'DIFFER from'} the fit: "
          + ", ".join(f"{k}={v:.4g}" for k, v in current.items()))
    loo = dict(leave_one_out(rows, start=PRIOR, rounds=args.rounds))
    print()
    print(f"{'model':>8} {'tp':>2} {'pp':>3} {'dp':>3} {'v':>2} {'m':>4} {'measured':>8} {'defaults':>8} "
          f"{'all-fit':>8} {'LOO':>7} {'LOO err':>8}")
    errors = []
    for row in rows:
        _, _, cfg = row_setup(row)
        default_pred = predict_tflops(row, Efficiency())
        all_pred = predict_tflops(row, full.efficiency)
        err = loo[row] / row.tflops_per_gpu - 1.0
        errors.append(abs(err))
        print(f"{row.params_b:>7g}B {cfg.tp:>2} {cfg.pp:>3} {cfg.dp:>3} {cfg.chunks:>2} {cfg.num_microbatches:>4} "
              f"{row.tflops_per_gpu:>8.1f} {default_pred:>8.1f} {all_pred:>8.1f} {loo[row]:>7.1f} {100 * err:>+7.1f}%")
    print()
    print(f"in-sample MAE (all-rows fit): {100 * (full.mean_abs_error or 0.0):.2f}%")
    print(f"leave-one-out MAE: {100 * sum(errors) / len(errors):.2f}%  (max {100 * max(errors):.2f}%)")
    print(f"fit time: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
