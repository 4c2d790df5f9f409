"""``make demo`` (``python -m evenpipe.demo --out demo_out``): BPipe against 1F1B on one pipeline.

Part one simulates both schedules at P=4, M=8 with a realistic link, prints per-rank peak activations, step time
and bubble side by side, and writes each one's pictures under ``OUT/1f1b`` and ``OUT/bpipe``. Later parts (a real
training run) plug in as further ``run_*`` functions called from :func:`main`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from evenpipe.report.tables import comparison_table, format_bytes
from evenpipe.schedule import build_schedule
from evenpipe.schedule.ir import ActionKind
from evenpipe.sim import Link, SimCosts, Trace, simulate

__all__ = ["main", "demo_costs", "simulate_pair", "run_simulation", "DEMO_RANKS", "DEMO_MICROBATCHES"]

DEMO_RANKS = 4
DEMO_MICROBATCHES = 8
DEMO_SCHEDULES = ("1f1b", "bpipe")

# One rank's share of a ~13B GPT (40 layers / 4 ranks, hidden 5120, sequence 2048, micro-batch 1, bf16) on an
# A100-class GPU. Activations per layer follow Korthikanti et al. 2022 (34*s*b*h bytes without recompute, plus
# attention scores 5*a*s^2*b): ~1.9 GiB per micro-batch per layer-group is rounded to 2 GiB. Times are ~45% MFU.
_FORWARD_S = 0.060
_BACKWARD_S = 0.120
_ACTIVATION_BYTES = 2.0 * 2**30
_OUTPUT_BYTES = 2048 * 5120 * 2  # one micro-batch's hidden states in bf16 (20 MiB)
# NVLink-class point-to-point link between neighbouring GPUs: ~100 GB/s achieved, ~10 us per message.
DEMO_LINK = Link(latency_s=10e-6, bandwidth_bytes_per_s=100e9)


def demo_costs(num_stages: int, link: Link = DEMO_LINK) -> SimCosts:
    """Uniform stages with the constants above."""
    return SimCosts.uniform(num_stages=num_stages, forward=_FORWARD_S, backward=_BACKWARD_S,
                            activation_bytes=_ACTIVATION_BYTES, output_bytes=_OUTPUT_BYTES, link=link)


def simulate_pair(num_ranks: int = DEMO_RANKS, num_microbatches: int = DEMO_MICROBATCHES,
                  link: Link = DEMO_LINK) -> dict[str, Trace]:
    """Simulated traces of 1F1B and BPipe on the same pipeline and costs."""
    traces = {}
    for name in DEMO_SCHEDULES:
        sched = build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches)
        traces[name] = simulate(sched, demo_costs(sched.num_stages, link))
    return traces


def run_simulation(out: pathlib.Path) -> dict[str, Trace]:
    """Part one: simulate, print the comparison, write the pictures; returns the traces."""
    from evenpipe.report.bundle import write_bundle  # matplotlib

    traces = simulate_pair()
    bpipe = traces["bpipe"]
    print(f"== simulated: P={DEMO_RANKS} M={DEMO_MICROBATCHES}, forward {_FORWARD_S * 1e3:g} ms, backward "
          f"{_BACKWARD_S * 1e3:g} ms, {format_bytes(_ACTIVATION_BYTES)} activations per micro-batch per rank, "
          f"link {DEMO_LINK.bandwidth_bytes_per_s / 1e9:g} GB/s")
    print(f"   BPipe budget: {bpipe.schedule.meta.get('budget')} activation units per rank (own + hosted)\n")
    print(comparison_table(traces))
    for name, trace in traces.items():
        paths = write_bundle(trace, out / name)
        print(f"\nwrote {', '.join(str(p) for p in paths)}")
    budget = bpipe.schedule.meta.get("budget")
    if isinstance(budget, int):
        over = [_time_above(bpipe, r, budget) for r in range(bpipe.num_ranks)]
        if any(over):  # evictions land before the next F; an acceptor can still host a unit before one goes back
            print(f"\nwarning: BPipe ranks above the budget of {budget} units: "
                  + ", ".join(f"rank {r} for {t * 1e3:.3g} ms" for r, t in enumerate(over) if t > 0))
    moved = sum(t.num_bytes for t in bpipe.transfers if t.kind is ActionKind.EVICT)
    exposed: dict[str, float] = {}
    for t in bpipe.exposed_transfers:
        exposed[t.kind.token] = exposed.get(t.kind.token, 0.0) + t.exposed_s
    by_kind = ", ".join(f"{kind} {sec * 1e3:.3g} ms" for kind, sec in exposed.items())
    print(f"\nBPipe moves {format_bytes(moved)} per step (evictions; the same comes back as loads); "
          f"exposed transfer time {bpipe.exposed_transfer_time * 1e3:.3g} ms" + (f" ({by_kind})" if by_kind else ""))
    return traces


def _time_above(trace: Trace, rank: int, budget_units: float) -> float:
    """Seconds rank ``rank`` holds more than ``budget_units`` activation units."""
    mem, unit = trace.memory[rank], trace.unit_bytes[rank]
    ends = [t for t, _ in mem.points[1:]] + [trace.step_time]
    return sum(end - t for (t, b), end in zip(mem.points, ends) if unit > 0 and b / unit > budget_units + 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evenpipe.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo_out", help="folder for the pictures (default demo_out)")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_simulation(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
