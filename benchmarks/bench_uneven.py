"""A slow rank, noticed and re-planned, and a slow link, measured on this machine (issue 35 points 5 and 6).

    .venv/bin/python benchmarks/bench_uneven.py --out bench_uneven_out --json          # profiles gpt-mini first
    .venv/bin/python benchmarks/bench_uneven.py --profile profile.json --quick         # a short check that it runs

Side by side in one run (P=4 local processes, ``train --predict PROFILE`` each):

1. **baseline**: the even layout, no slowdown; ``--false-alarm-steps`` steps (200 by default) -- every slow-rank
   alarm it raises is a false alarm.
2. **slow, even layout**: rank ``--slow-rank`` emulated ``--factor`` times slower (``--emulate-slow-rank``) from step
   ``--slow-from``; the steps to detection are the slowed steps until the rank is named; ``replan.json`` gives
   the re-planned layout.
3. **slow, re-planned**: the same slowdown from the first step on the re-planned layout (what ``--resume
   --layout`` from the last checkpoint runs).

Recovery = (slow_even - slow_replanned) / (slow_even - baseline), from the median steps (the slowest rank's step;
for run 2 only the slowed steps after detection). Each run's predicted step is the simulator's with the profile's
costs, the slow rank's computes multiplied by the factor (its optimizer step is not slowed, as in the emulation).

4. **slow link**: ``--emulate-link-delay`` between ranks P/2-1 and P/2, with 1f1b, zb-h1 and latency-aware; the gain
   is (best of 1f1b and zb-h1 - latency-aware) / best. Latency-aware runs here in its free-link order; one ordered
   for the delay (``--plan-link-latency``) on every link is ``benchmarks/bench_latency_measured.py``. (Since
   2026-12-05 an emulated link lands each message late without holding its sender.)

Timing needs a quiet host with a core per process; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any


def _load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise SystemExit(f"`{' '.join(cmd[2:])}` exited {proc.returncode}:\n{tail}")


def profile(args: argparse.Namespace, out: pathlib.Path) -> pathlib.Path:
    path = out / "profile.json"
    _run([sys.executable, "-m", "evenpipe", "profile", "--model", args.model, "--microbatch-sizes",
          args.profile_sizes, "--processes", str(args.stages), "--device", "cpu", "--out", str(path),
          "--no-progress"])
    return path


def train(args: argparse.Namespace, out: pathlib.Path, name: str, steps: int, *extra: str) -> dict[str, Any]:
    """One ``evenpipe train`` run in ``out/name``; its --json-out summary (plus ``replan`` when one was written)."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "evenpipe", "train", "--model", args.model, "--stages", str(args.stages),
          "--microbatches", str(args.microbatches), "--microbatch-size", str(args.microbatch_size),
          "--steps", str(steps), "--random-tokens", "--predict", str(args.profile), "--json-out",
          str(d / "run.json"), *extra])
    summary = json.loads((d / "run.json").read_text())
    replan = d / "replan.json"
    summary["replan"] = json.loads(replan.read_text()) if replan.exists() else None
    return summary


def predicted_step(args: argparse.Namespace, summary: dict[str, Any], slow: bool) -> tuple[float, list[int]]:
    """The simulator's step for the run's schedule and layout, the slow rank's computes times the factor; the
    layout."""
    from evenpipe.cost.profile_fit import ProfileModel, StepPrediction
    from evenpipe.plan.predict import check_profile_for_training
    from evenpipe.runtime.stages import stage_block_counts
    from evenpipe.sim.dispatch import simulate
    from evenpipe.training.config import TrainConfig
    config = TrainConfig.from_dict(summary["config"])
    schedule = config.schedule.build()
    model_config = config.model.resolve()
    layout = stage_block_counts(model_config, schedule.num_stages, config.schedule.layout)
    model = ProfileModel(check_profile_for_training(str(args.profile), model_name=config.model.name,
                                                    model_config=model_config))
    costs = model.sim_costs(schedule, microbatch_size=args.microbatch_size, layout=layout)
    if slow:
        f = args.factor
        stages = tuple(dataclasses.replace(st, forward=st.forward * f, backward_input=st.backward_input * f,
                                           backward_weight=st.backward_weight * f,
                                           recompute=None if st.recompute is None else st.recompute * f)
                       if schedule.rank_of(s) == args.slow_rank else st for s, st in enumerate(costs.stages))
        costs = dataclasses.replace(costs, stages=stages)
    pred = StepPrediction(trace=simulate(schedule, costs), optimizer_s=model.optimizer_s(schedule, layout),
                          overhead_s=model.profile.step_overhead_s)
    return pred.step_time, list(layout)


def measured(summary: dict[str, Any], first: int = 1) -> float:
    """Median over 0-based steps >= ``first`` (>= 1) of the slowest rank's step."""
    steps = summary["prediction"]["measured_steps_s"]  # steps 1.. (0-based), the slowest rank's each
    return statistics.median(steps[first - 1:])


def uneven(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    """The three runs; without a named rank, the re-planned run is skipped and recovery and detection are None."""
    slow = f"{args.slow_rank}:{args.factor}@{args.slow_from}"
    base = train(args, out, "baseline", args.false_alarm_steps)
    even = train(args, out, "slow_even", args.steps, "--emulate-slow-rank", slow)
    replan = even["replan"]
    cases = [("baseline", base, measured(base), False)]
    if replan is None:
        cases.append(("slow_even", even, measured(even, max(args.slow_from, 1)), True))
    else:
        fixed = train(args, out, "slow_replanned", args.steps, "--emulate-slow-rank",
                      f"{args.slow_rank}:{args.factor}", "--layout", replan["layout_arg"])
        cases += [("slow_even", even, measured(even, replan["step"]), True),
                  ("slow_replanned", fixed, measured(fixed), True)]
    runs = {}
    for name, s, m, is_slow in cases:
        p, layout = predicted_step(args, s, is_slow)
        runs[name] = {"measured_step_s": m, "predicted_step_s": p, "error": (p - m) / m, "layout": layout}
    b, e = runs["baseline"]["measured_step_s"], runs["slow_even"]["measured_step_s"]
    r = runs["slow_replanned"]["measured_step_s"] if replan is not None else None
    return {"runs": runs, "recovery": (e - r) / (e - b) if r is not None and e > b else None,  # None: not measurable
            "replanned_layout": replan and replan["layout"],
            "detected_after_steps": replan and replan["step"] - args.slow_from,  # slowed steps until named
            "detected_rank": replan and replan["rank"], "detected_factor": replan and replan["factor"],
            "slow_even_alarms": even["slow_ranks"]["alarms"],
            "false_alarms": len(base["slow_ranks"]["alarms"]), "false_alarm_steps": args.false_alarm_steps}


def latency(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    mid = args.stages // 2
    link = f"{mid - 1}-{mid}:{args.link_delay_ms}"
    steps = {}
    for family in ("1f1b", "zb-h1", "latency-aware"):
        s = train(args, out, f"link_{family}", args.link_steps, "--schedule", family, "--emulate-link-delay", link)
        steps[family] = measured(s)
    best = min(steps["1f1b"], steps["zb-h1"])
    return {"link": link, "measured_step_s": steps, "gain": (best - steps["latency-aware"]) / best}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps of the slowed runs")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--factor", type=float, default=1.5)
    p.add_argument("--slow-from", type=int, default=10, help="0-based step the slowdown starts (after the warm-up)")
    p.add_argument("--false-alarm-steps", type=int, default=200)
    p.add_argument("--link-delay-ms", type=float, default=5.0)
    p.add_argument("--link-steps", type=int, default=20)
    p.add_argument("--profile", type=pathlib.Path, default=None, help="reuse a profile (default: profile first)")
    p.add_argument("--profile-sizes", default="1,2,4", help="micro-batch sizes to profile")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_uneven_out"))
    p.add_argument("--quick", action="store_true", help="a short check that it runs (few steps; numbers noisy)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args()
    if args.quick:
        args.steps, args.false_alarm_steps, args.link_steps, args.slow_from = 18, 12, 6, 7
        args.profile_sizes = str(args.microbatch_size)
    args.out.mkdir(parents=True, exist_ok=True)
    load0, t0 = _load(), time.perf_counter()
    args.profile = args.profile or profile(args, args.out)
    result = {"model": args.model, "stages": args.stages, "microbatches": args.microbatches,
              "slow_rank": args.slow_rank, "factor": args.factor, "slow_from": args.slow_from,
              **uneven(args, args.out), "latency": latency(args, args.out),
              "load_before": load0, "load_after": _load(), "seconds": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, run in result["runs"].items():
        print(f"{name:15s} measured {run['measured_step_s'] * 1e3:8.1f} ms  predicted "
              f"{run['predicted_step_s'] * 1e3:8.1f} ms ({run['error']:+.1%})")
    recovery = "-" if result["recovery"] is None else f"{result['recovery']:.0%}"
    named = ("not named" if result["detected_rank"] is None else f"rank {result['detected_rank']} named after "
             f"{result['detected_after_steps']} slowed steps at {result['detected_factor']:.2f}x")
    print(f"recovery {recovery}; {named}; false alarms "
          f"{result['false_alarms']} in {result['false_alarm_steps']} steps; latency-aware gain "
          f"{result['latency']['gain']:+.1%} ({result['latency']['link']} ms); load {load0} -> {result['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
