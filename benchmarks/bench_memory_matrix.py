"""Memory to the byte over the whole matrix (issue 31): for every combination of the axes below, train a couple of
steps on CPU (gloo, world pp·tp·dp) and compare what ``train --json-out`` measures under
``peak_bytes_by_category`` with what ``estimate --json`` predicts for the same command, per category and pipeline
rank. Model states (exact counts) must agree within 2%, the rest within 5%; a combination the runtime refuses must
be refused in one line (exit 2), by ``train`` and ``estimate`` alike.

The estimate's source is a profile of the model measured here in the run's dtype (``estimate --profile``), made
once per model and dtype under ``--out``. An axis is a name, its values and the ``train``/``estimate`` flags each
value adds (:data:`AXES`); host offload is one (``--only offload=none,all`` runs it; by default only ``none``).

Run: ``nice -n 5 .venv/bin/python benchmarks/bench_memory_matrix.py [--quick] [--json] [--only AXIS=V[,V]]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

from evenpipe.cost.categories import MEMORY_CATEGORIES, STATE_CATEGORIES

STATE_TOLERANCE, OTHER_TOLERANCE = 0.02, 0.05
PP, DP, MICROBATCHES, GLOBAL_BATCH, STEPS = 2, 2, 4, 8, 2


@dataclass(frozen=True)
class Axis:
    """One dimension of the matrix: ``flags[value]`` is what the value adds to both commands."""

    name: str
    values: tuple[str, ...]
    flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    quick: tuple[str, ...] = ()
    """The values ``--quick`` keeps (all when empty)."""
    default: tuple[str, ...] = ()
    """The values run unless ``--only`` names the axis (all when empty)."""

    def args(self, value: str) -> tuple[str, ...]:
        return self.flags.get(value, (f"--{self.name}", value))


AXES = (
    Axis("model", ("gpt-tiny", "llama-tiny"), quick=("gpt-tiny", "llama-tiny")),
    Axis("dtype", ("float32", "bfloat16")),
    Axis("tp", ("1", "2")),
    Axis("sharding", ("none", "optimizer", "full")),
    Axis("schedule", ("1f1b", "zb-h1", "interleaved", "bpipe"),
         flags={"interleaved": ("--schedule", "interleaved", "--chunks", "2")}, quick=("1f1b", "interleaved")),
    Axis("offload", ("none", "all"), flags={"none": (), "all": ("--offload", "all")}, default=("none",)),
)
QUICK = {"dtype": ("bfloat16",), "sharding": ("none", "full")}
"""Further restrictions of ``--quick`` (with each axis's own ``quick``)."""


@dataclass
class Outcome:
    """One combination: its worst relative error per category (over ranks), or why it did not run."""

    combo: dict[str, str]
    errors: dict[str, float] = field(default_factory=dict)
    refused: str | None = None
    failure: str | None = None
    detail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if self.failure is not None:
            return False
        return all(e <= (STATE_TOLERANCE if c in STATE_CATEGORIES else OTHER_TOLERANCE)
                   for c, e in self.errors.items())


def relative_error(measured: int, predicted: int) -> float:
    """|predicted - measured| / measured; 0 when both are 0, inf when only the measurement is."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return abs(predicted - measured) / measured


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "evenpipe", *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout_s)


def _refusal(proc: subprocess.CompletedProcess[str]) -> str | None:
    """The one-line refusal of an exit-2 run (None if it ran); a refusal that is not one line is a failure."""
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    if proc.returncode == 2 and len(lines) == 1:
        return lines[0]
    raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")


def profile_for(out: pathlib.Path, model: str, dtype: str) -> pathlib.Path:
    """A profile of ``model`` in ``dtype`` measured here (made once)."""
    path = out / f"profile-{model}-{dtype}.json"
    if not path.exists():
        proc = _run(["profile", "--model", model, "--microbatch-sizes", "1,2", "--dtype", dtype, "--repeats", "1",
                     "--warmup", "1", "--processes", "1", "--no-progress", "--out", str(path), "--plot",
                     str(out / f"profile-{model}-{dtype}.png")], 600)
        if proc.returncode != 0:
            raise RuntimeError(f"profile {model} {dtype}: {proc.stderr[-1500:]}")
    return path


def run_combo(combo: dict[str, str], out: pathlib.Path, steps: int) -> Outcome:
    """Train and estimate one combination and compare them."""
    result = Outcome(combo)
    shape = [a for axis in AXES for a in axis.args(combo[axis.name]) if axis.name != "model"]
    label = "-".join(combo.values())
    b = GLOBAL_BATCH // (MICROBATCHES * DP)
    try:
        est = _run(["estimate", "--profile", str(profile_for(out, combo["model"], combo["dtype"])), "--pp", str(PP),
                    "--dp", str(DP), *shape, "--microbatch-size", str(b), "--global-batch", str(GLOBAL_BATCH),
                    "--json"], 300)
        train = _run(["train", "--model", combo["model"], "--stages", str(PP), "--dp", str(DP), *shape,
                      "--microbatches", str(MICROBATCHES), "--global-batch", str(GLOBAL_BATCH), "--steps", str(steps),
                      "--random-tokens", "--timeout", "120", "--json-out", str(out / f"{label}.json")], 900)
        refused = _refusal(train), _refusal(est)
        if any(r is not None for r in refused):
            if None in refused:
                result.failure = f"refused by one command only: train {refused[0]!r}, estimate {refused[1]!r}"
            result.refused = refused[0] or refused[1]
            return result
        measured = json.loads((out / f"{label}.json").read_text())["peak_bytes_by_category"]
        predicted = json.loads(est.stdout)["peak_bytes_by_category"]
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        result.failure = str(e).replace("\n", " | ")[-600:]
        return result
    for c in MEMORY_CATEGORIES:
        per_rank = [relative_error(m.get(c, 0), p.get(c, 0)) for m, p in zip(measured, predicted, strict=True)]
        result.errors[c] = max(per_rank)
        result.detail += [f"rank {r} {c}: measured {m.get(c, 0)}, predicted {p.get(c, 0)}"
                          for r, (m, p) in enumerate(zip(measured, predicted)) if m.get(c, 0) != p.get(c, 0)]
    return result


def combos(quick: bool, only: dict[str, set[str]]) -> list[dict[str, str]]:
    values = []
    for axis in AXES:
        vals = [v for v in axis.values if not quick or ((not axis.quick or v in axis.quick)
                                                        and v in QUICK.get(axis.name, axis.values))]
        wanted = only.get(axis.name, set(axis.default or axis.values))
        values.append([v for v in vals if v in wanted])
    return [dict(zip((a.name for a in AXES), vs)) for vs in itertools.product(*values)]


def _pct(e: float) -> str:
    return "   inf" if math.isinf(e) else f"{100 * e:5.1f}%"


def table(outcomes: list[Outcome]) -> str:
    """Worst relative error per category per combination, then the worst per category over the grid."""
    short = {c: c.replace("_activations", "_act").replace("communication_buffers", "comm")
             .replace("optimizer_state", "optim").replace("master_weights", "master")[:10] for c in MEMORY_CATEGORIES}
    width = max(len(" ".join(o.combo.values())) for o in outcomes)
    lines = [f"{'combination':{width}}  " + " ".join(f"{short[c]:>10}" for c in MEMORY_CATEGORIES) + "  verdict"]
    for o in outcomes:
        name = " ".join(o.combo.values())
        if o.refused is not None or o.failure is not None:
            lines.append(f"{name:{width}}  {'FAILED: ' + o.failure if o.failure else 'refused: ' + str(o.refused)}")
            continue
        lines.append(f"{name:{width}}  " + " ".join(f"{_pct(o.errors[c]):>10}" for c in MEMORY_CATEGORIES)
                     + ("  ok" if o.ok else "  OUT"))
    ran = [o for o in outcomes if o.errors]
    if ran:
        lines.append(f"{'worst':{width}}  " + " ".join(f"{_pct(max(o.errors[c] for o in ran)):>10}"
                                                       for c in MEMORY_CATEGORIES))
    lines.append(f"{len(outcomes)} combinations: {sum(o.ok and o.refused is None for o in outcomes)} within "
                 f"{100 * STATE_TOLERANCE:g}%/{100 * OTHER_TOLERANCE:g}%, "
                 f"{sum(o.refused is not None and o.failure is None for o in outcomes)} refused in one line, "
                 f"{sum(not o.ok for o in outcomes)} out of bounds or failed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="a subset: bfloat16, sharding none and full, "
                        "1f1b and interleaved")
    parser.add_argument("--only", action="append", default=[], metavar="AXIS=V[,V]",
                        help="restrict an axis (" + ", ".join(a.name for a in AXES) + ")")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/memory_matrix"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    only = {}
    for spec in args.only:
        name, _, vals = spec.partition("=")
        if name not in {a.name for a in AXES} or not vals:
            parser.error(f"--only {spec}: expected AXIS=V[,V] with AXIS one of {[a.name for a in AXES]}")
        only[name] = set(vals.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    t0 = time.perf_counter()
    for combo in combos(args.quick, only):
        outcomes.append(run_combo(combo, args.out, args.steps))
        o = outcomes[-1]
        print(f"[{time.perf_counter() - t0:6.0f} s] {' '.join(combo.values())}: "
              f"{o.failure or o.refused or ('ok' if o.ok else 'OUT ' + '; '.join(o.detail[:4]))}",
              file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"combinations": [{"combo": o.combo, "errors": o.errors, "refused": o.refused,
                                            "failure": o.failure, "ok": o.ok, "detail": o.detail}
                                           for o in outcomes]}, default=str))
    else:
        print(table(outcomes))
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


if __name__ == "__main__":
    main()
