"""Profile and predict: profile a model on this machine, then train it with each schedule and print the profile's
prediction of step time and per-rank peak activation memory against the measurement, side by side.

    .venv/bin/python benchmarks/bench_predict.py --out bench_predict_out            # profiles gpt-mini first
    .venv/bin/python benchmarks/bench_predict.py --profile profile.json             # reuse a profile
    .venv/bin/python benchmarks/bench_predict.py --out DIR --reprofile              # and profile again after

Each case is one ``evenpipe train ... --predict PROFILE --json-out`` run (P=2 local processes, one per core);
the measured step is the median over the steps after the first of the slowest rank's step (pipeline plus
optimizer). Timing is only meaningful on a quiet machine: the 1-minute load average is printed before and after,
and so is the host probe of ``host_probe.py`` (how much slower two concurrent processes compute than one alone:
on a shared virtual machine this drifts between 1x and 2x within seconds, which no load average shows).

``--rounds N`` runs every case N times, the cases in turn (round 2 starts when round 1 has run every case), and
measures each case by the median over all its runs' steps after the first. A host whose speed drifts by more than
a prediction's tolerance from one minute to the next (``host_probe.py --drift``) then weighs on a case through
several minutes instead of one, and on every case alike; one run per case (the default) measures each case in its
own minute.

``--bracket`` profiles again before every run and once after the last, and predicts each run by the mean of the
predictions of the two profiles around it (a case's prediction is the mean over its runs). A host whose speed
moves by tens of percent between minutes (a neighbour on the same cores) then moves the prediction with the run,
and a miss measures the model, not the host; the table says which profiles each prediction comes from. A case
then compares the mean of its runs' predictions with the mean of its runs' medians (each run against its own
prediction; the median of steps pooled from runs at different host speeds would not be).

After the table, "where the step went" sets each run's traced last step against the profile's simulated schedule:
per rank, its computes' time over the profile's (``busy``: where this moves from run to run, the host's speed moved)
and its extra idle time (waits the model did not predict).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_probe import concurrent_slowdown, host_line, steal_seconds  # noqa: E402

CASES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("bpipe", 1))
"""(schedule, chunks V) of the acceptance table."""


def _load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise SystemExit(f"`{' '.join(cmd[2:])}` exited {proc.returncode}:\n{tail}")
    return proc


def profile(args: argparse.Namespace, out: pathlib.Path, name: str = "profile.json", *,
            quiet: bool = False) -> pathlib.Path:
    path = out / name
    cmd = [sys.executable, "-m", "evenpipe", "profile", *(["--hf-config", args.hf_config] if args.hf_config else
                                                           ["--model", args.model]),
           "--microbatch-sizes", args.profile_sizes, "--processes", str(args.stages), "--repeats", str(args.repeats),
           "--device", args.device, "--dtype", args.dtype, "--out", str(path), "--no-progress"] \
        + (["--seq-len", str(args.seq_len)] if args.seq_len else [])
    t0 = time.perf_counter()
    proc = _run(cmd, 3600)
    if not quiet:
        print(proc.stdout)
    print(f"({name}: profiled in {time.perf_counter() - t0:.0f} s)" + ("" if quiet else "\n"), flush=True)
    return path


def bracket(args: argparse.Namespace, out: pathlib.Path, runs: dict[tuple[str, int, int], list[dict]],
            before: dict[tuple[tuple[str, int, int], int], pathlib.Path]) -> None:
    """Profile once more after the last run, then predict each run by the mean of the predictions of the
    profiles before it (its ``train --predict``) and after it (the next run's profile)."""
    order = list(before)  # (case, round) in the order they ran
    last = profile(args, out, f"profile_{len(order)}.json", quiet=True)
    print(f"\n{'schedule':12s} {'V':>2s} {'b':>2s} {'round':>5s} {'pred before':>12s} {'pred after':>11s} "
          f"{'meas step':>10s} {'error':>7s}   (profiles)")
    for n, (case, round_) in enumerate(order):
        after = before[order[n + 1]] if n + 1 < len(order) else last
        doc = runs[case][round_]
        early = doc["predicted_step_s"]
        late = predict_from(args, after, *case)
        doc["predicted_step_s"] = (early + late) / 2
        meas = statistics.median(doc["measured_steps_s"])
        print(f"{case[0]:12s} {case[1]:2d} {case[2]:2d} {round_ + 1:5d} {early * 1e3:10.1f}ms {late * 1e3:9.1f}ms "
              f"{meas * 1e3:8.1f}ms {(doc['predicted_step_s'] - meas) / meas:+7.1%}   "
              f"({before[(case, round_)].name}, {after.name})")


def _tag(args: argparse.Namespace, schedule: str, b: int, round_: int) -> str:
    return f"{schedule}_b{b}" + (f"_r{round_ + 1}" if args.rounds > 1 else "")


def train(args: argparse.Namespace, out: pathlib.Path, prof: pathlib.Path, schedule: str, chunks: int,
          b: int, round_: int = 0) -> dict:
    tag = _tag(args, schedule, b, round_)
    summary, trace = out / f"{tag}.json", out / f"{tag}_trace.evenpipe.json"
    model = ["--hf-config", args.hf_config] if args.hf_config else ["--model", args.model]
    cmd = [sys.executable, "-m", "evenpipe", "train", *model, "--schedule", schedule, "--stages", str(args.stages),
           "--chunks", str(chunks), "--microbatches", str(args.microbatches), "--microbatch-size", str(b),
           "--steps", str(args.steps), "--dtype", args.dtype, "--random-tokens", "--json-out", str(summary), "--trace-json", str(trace),
           "--predict", str(prof)] + (["--backend", "nccl"] if args.device == "cuda" else ["--backend", "gloo"]) \
        + (["--seq-len", str(args.seq_len)] if args.seq_len else [])
    _run(cmd, 1800)
    doc = json.loads(summary.read_text())
    return doc["prediction"]


def where_it_went(args: argparse.Namespace, out: pathlib.Path,
                  profile_of: Callable[[tuple[str, int, int], int], pathlib.Path],
                  rows: list[tuple[str, int, int, dict]]) -> None:
    """Each case's traced step (the last of each run) against the simulated schedule of the profile, medians over
    its runs: the pipeline's error; the error of its replay (the schedule simulated with each compute's measured
    time and the profile's links: what the communication model leaves); per rank, how much longer its computes
    took than profiled (busy; where this moves from run to run it is the host's speed, not the model) and how much
    longer it idled (waits)."""
    from evenpipe.cost.profile import Profile
    from evenpipe.cost.profile_fit import ProfileModel
    from evenpipe.sim import SimCosts, Trace
    from evenpipe.sim.compare import compare_traces
    from evenpipe.sim.replay import replay
    print("\nwhere the step went (each run's traced last step against the simulated schedule, and against its replay "
          "with the measured compute times; medians over runs)")
    head = (f"{'schedule':12s} {'V':>2s} {'b':>2s} {'pipeline':>8s} {'replay':>7s}   "
            + "   ".join(f"{'r' + str(r) + ' busy':>8s} {'r' + str(r) + ' idle +ms':>11s}" for r in range(args.stages)))
    print(head)
    print("-" * len(head))
    for schedule, chunks, b, _ in rows:
        per_run = []
        predicted: dict[pathlib.Path, tuple[Trace, SimCosts]] = {}  # per profile: its simulation and costs
        for round_ in range(args.rounds):
            prof = profile_of((schedule, chunks, b), round_)
            if prof not in predicted:
                sim_dir = out / f"sim_{schedule}_b{b}_{prof.stem}"
                _run([sys.executable, "-m", "evenpipe", "simulate", "--profile", str(prof), "--schedule", schedule,
                      "--stages", str(args.stages), "--chunks", str(chunks), "--microbatches",
                      str(args.microbatches), "--microbatch-size", str(b), "--out", str(sim_dir)], 600)
                sim = Trace.from_json((sim_dir / "trace.evenpipe.json").read_text())
                model = ProfileModel(Profile.from_json(prof.read_text()))
                predicted[prof] = sim, model.sim_costs(sim.schedule, microbatch_size=b)
            pred, costs = predicted[prof]
            tag = _tag(args, schedule, b, round_)
            meas = Trace.from_json((out / f"{tag}_trace.evenpipe.json").read_text())
            c = compare_traces(pred, meas)
            row = [c.step.error or 0.0, compare_traces(replay(meas, costs), meas).step.error or 0.0]
            for r in range(args.stages):
                busy, idle = c.per_rank[r][1], c.per_rank[r][2]
                row += [busy.measured / busy.predicted, idle.measured - idle.predicted]
            per_run.append(row)
        med = [statistics.median(col) for col in zip(*per_run)]
        line = f"{schedule:12s} {chunks:2d} {b:2d} {med[0]:+8.1%} {med[1]:+7.1%}   "
        line += "   ".join(f"{med[2 + 2 * r]:8.3f} {med[3 + 2 * r] * 1e3:+11.1f}" for r in range(args.stages))
        print(line)


def pooled(preds: list[dict], *, per_run: bool = False) -> dict:
    """One case's runs as one: the median over every run's steps after the first and the runs' prediction, or
    with ``per_run`` (each run has its own prediction, ``--bracket``) the mean of the runs' medians and the mean of
    their predictions; and the largest peak bytes."""
    if len(preds) == 1:
        return preds[0]
    out = dict(preds[0])
    out["predicted_step_s"] = statistics.mean(p["predicted_step_s"] for p in preds)
    out["measured_steps_s"] = [t for p in preds for t in p["measured_steps_s"]]
    out["measured_step_s"] = (statistics.mean(statistics.median(p["measured_steps_s"]) for p in preds) if per_run
                              else statistics.median(out["measured_steps_s"]))
    out["measured_peak_bytes"] = [max(col) for col in zip(*(p["measured_peak_bytes"] for p in preds))]
    out["num_steps"] = len(out["measured_steps_s"])
    return out


def predict_from(args: argparse.Namespace, prof: pathlib.Path, schedule: str, chunks: int, b: int) -> float:
    """The step time ``evenpipe simulate --profile`` predicts for one case (what ``train --predict`` prints)."""
    cmd = [sys.executable, "-m", "evenpipe", "simulate", "--profile", str(prof), "--schedule", schedule,
           "--stages", str(args.stages), "--chunks", str(chunks), "--microbatches", str(args.microbatches),
           "--microbatch-size", str(b), "--json"]
    return float(json.loads(_run(cmd, 600).stdout)["step_time"])


def drift_table(args: argparse.Namespace, out: pathlib.Path, prof: pathlib.Path,
                rows: list[tuple[str, int, int, dict]]) -> None:
    """Profile again after the runs and predict every case from both profiles: how far the host drifted while
    it trained, next to each prediction's error (a miss the second profile shares is the host's, not the model's)."""
    after = profile(args, out, "profile_after.json")
    print(f"{'schedule':12s} {'V':>2s} {'b':>2s} {'meas step':>10s} {'pred before':>12s} {'error':>7s} "
          f"{'pred after':>11s} {'error':>7s} {'drift':>7s}")
    for schedule, chunks, b, p in rows:
        meas, before = p["measured_step_s"], p["predicted_step_s"]
        again = predict_from(args, prof, schedule, chunks, b)
        if abs(again - before) > 1e-9 * before:
            print(f"  (simulate --profile gives {again * 1e3:.3f} ms where train --predict gave {before * 1e3:.3f})")
        late = predict_from(args, after, schedule, chunks, b)
        print(f"{schedule:12s} {chunks:2d} {b:2d} {meas * 1e3:8.1f}ms {before * 1e3:10.1f}ms "
              f"{(before - meas) / meas:+7.1%} {late * 1e3:9.1f}ms {(late - meas) / meas:+7.1%} "
              f"{(late - before) / before:+7.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--hf-config", default=None, help="profile and train a model from this HF config.json")
    ap.add_argument("--profile", default=None, help="reuse this profile instead of measuring")
    ap.add_argument("--profile-sizes", default="1,2,4")
    ap.add_argument("--sizes", default="1", help="profiled micro-batch sizes to train every schedule with")
    ap.add_argument("--unprofiled", default="3", help="unprofiled sizes to train 1f1b with (empty: none)")
    ap.add_argument("--schedules", default=",".join(s for s, _ in CASES))
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="bench_predict_out")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every case this many times, in turn, and pool each case's steps (see the module)")
    ap.add_argument("--bracket", action="store_true",
                    help="profile before every run and after the last; predict each run from the two around it")
    ap.add_argument("--reprofile", action="store_true",
                    help="profile again after the runs and predict every case from both profiles (host drift)")
    ap.add_argument("--no-host-probe", action="store_true",
                    help="skip the CPU host probe (GPU runs, where it measures nothing that matters, and dry runs)")
    args = ap.parse_args(argv)
    if args.bracket and (args.profile or args.reprofile):
        raise SystemExit("--bracket measures its own profiles, after the runs too; leave out --profile and "
                         "--reprofile")
    probe = (lambda: print(host_line(), flush=True)) if not args.no_host_probe else (lambda: None)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average (1 min) at start: {_load()}")
    probe()
    prof = pathlib.Path(args.profile) if args.profile else profile(args, out)
    wanted = args.schedules.split(",")
    cases = [(s, v, int(b)) for b in args.sizes.split(",") if b for s, v in CASES if s in wanted]
    cases += [("1f1b", 1, int(b)) for b in args.unprofiled.split(",") if b]
    runs: dict[tuple[str, int, int], list[dict]] = {case: [] for case in cases}
    before: dict[tuple[tuple[str, int, int], int], pathlib.Path] = {}  # (case, round) -> profile before its run
    for round_ in range(args.rounds):
        for schedule, chunks, b in cases:
            if args.bracket and before:
                prof = profile(args, out, f"profile_{len(before)}.json", quiet=True)
            before[((schedule, chunks, b), round_)] = prof
            t0, stolen = time.perf_counter(), steal_seconds()
            runs[(schedule, chunks, b)].append(train(args, out, prof, schedule, chunks, b, round_))
            wall, stolen = time.perf_counter() - t0, steal_seconds() - stolen
            after = ""
            if not args.no_host_probe:
                host = concurrent_slowdown(1.0, args.stages)
                after = f"; host probe after: {host[0]:.2f}x median, {host[1]:.2f}x p90"
            what = f" round {round_ + 1}" if args.rounds > 1 else ""
            print(f"  {schedule:12s} b={b}{what} done in {wall:5.1f} s (load {_load()}; vCPU time stolen by the "
                  f"host during the run {stolen:.1f} s{after})", flush=True)
    if args.bracket:
        bracket(args, out, runs, before)
    rows = [(schedule, chunks, b, pooled(runs[(schedule, chunks, b)], per_run=args.bracket))
            for schedule, chunks, b in cases]
    print(f"\nP={args.stages} M={args.microbatches}, {args.steps} steps per run, {args.rounds} run(s) per case "
          f"(median of every run's steps after the first)"
          + ("; each run predicted by the mean of the profiles before and after it, a case by the mean of its "
             "runs' predictions and medians" if args.bracket else ""))
    head = (f"{'schedule':12s} {'V':>2s} {'b':>2s} {'pred step':>10s} {'meas step':>10s} {'error':>7s}   "
            + "   ".join(f"{'r' + str(r) + ' pred MiB':>12s} {'meas MiB':>9s} {'error':>7s}" for r in range(args.stages)))
    print(head)
    print("-" * len(head))
    worst_t = worst_m = 0.0
    for schedule, chunks, b, p in rows:
        et = (p["predicted_step_s"] - p["measured_step_s"]) / p["measured_step_s"]
        worst_t = max(worst_t, abs(et))
        line = (f"{schedule:12s} {chunks:2d} {b:2d} {p['predicted_step_s'] * 1e3:8.1f}ms {p['measured_step_s'] * 1e3:8.1f}ms "
                f"{et:+7.1%}")
        for pb, mb in zip(p["predicted_peak_bytes"], p["measured_peak_bytes"]):
            em = (pb - mb) / mb if mb else 0.0
            worst_m = max(worst_m, abs(em))
            line += f"   {pb / 2**20:12.2f} {mb / 2**20:9.2f} {em:+7.1%}"
        print(line)
    print(f"\nworst |error|: step time {worst_t:.1%}, peak activation bytes {worst_m:.1%}")
    where_it_went(args, out, lambda case, round_: before[(case, round_)], rows)
    if args.reprofile:
        print("\nprofiled again after the runs (drift: the second profile's prediction against the first's):")
        drift_table(args, out, prof, rows)
    print(f"load average (1 min) at end: {_load()}")
    probe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
