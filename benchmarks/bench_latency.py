"""Latency-aware schedules against 1F1B, interleaved and ZB-H1 on slow links (issue 35 point 4), simulated.

    .venv/bin/python benchmarks/bench_latency.py [--stages 4,8] [--per-rank 1,2,4] [--latencies 0,0.25,0.5,1,2]
                                                 [--between-datacenters]

For each P, M = k*P and link latency (in forwards: every rank-to-rank link takes that long per message; with
``--between-datacenters`` only the link between ranks P/2-1 and P/2, CrossPipe's two datacenters), one row:
the simulated step and the largest per-rank activation peak (units of a rank's layers) of each baseline, of
latency-aware with one stage per rank (V=1) and in a V (V=2), both capped at the baselines' smallest peak, and
the gain of the better latency-aware over the best baseline (1 - its step / best step), and the most any schedule of
either placement could gain at that memory (``bound``: 1 - the smaller of their step lower bounds,
:func:`~evenpipe.schedule.generate.latency_bound.step_lower_bound`, / best step). Costs F = I = W = 1 per rank
(1F1B's full backward B = I + W = 2), free bandwidth. Deterministic: no wall clock.
"""

from __future__ import annotations

import argparse

from evenpipe.schedule import LinkPlan, build_schedule
from evenpipe.schedule.generate.latency_aware import v_layout
from evenpipe.schedule.generate.latency_bound import step_lower_bound
from evenpipe.sim import Link, SimCosts, simulate

BASELINES = (("1f1b", None), ("interleaved", 2), ("zb-h1", None))


def latencies(P: int, latency: float, between_datacenters: bool = False) -> tuple[tuple[float, ...], ...]:
    """``[src][dst]`` message time: ``latency`` on every link, or only between ranks P/2-1 and P/2."""
    def slow(a: int, b: int) -> bool:
        return a != b and (not between_datacenters or {a, b} == {P // 2 - 1, P // 2})
    return tuple(tuple(latency if slow(a, b) else 0.0 for b in range(P)) for a in range(P))


def run(family: str, P: int, M: int, latency: float, chunks: int | None = None, plan: LinkPlan | None = None,
        between_datacenters: bool = False) -> tuple[float, float]:
    """Simulated step and largest per-rank activation peak."""
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=chunks, link_plan=plan)
    table = latencies(P, latency, between_datacenters)
    links = {(a, b): Link(latency_s=table[a][b]) for a in range(P) for b in range(P) if table[a][b] > 0}
    uniform = SimCosts.uniform(num_stages=s.num_stages, num_chunks=s.num_chunks, forward=1.0, backward=1.0,
                               weight=1.0)
    trace = simulate(s, SimCosts.from_stages(uniform.stages, links=links))
    return trace.step_time, max(trace.peak_activations)


def compare(P: int, M: int, latency: float, between_datacenters: bool = False
            ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(step, peak) of each baseline, and of latency-aware V=1 and V=2 capped at the baselines' smallest peak."""
    base = [run(f, P, M, latency, v, None, between_datacenters) for f, v in BASELINES]
    plan = LinkPlan(message=latencies(P, latency, between_datacenters), cap=min(p for _, p in base))
    return base, [run("latency-aware", P, M, latency, v, plan, between_datacenters) for v in (1, 2)]


def lower_bound(P: int, M: int, latency: float, cap: float, between_datacenters: bool = False) -> float:
    """The smaller step lower bound of the two placements (one stage per rank, the V) at ``cap``."""
    plan = LinkPlan(message=latencies(P, latency, between_datacenters), cap=cap)
    return min(step_lower_bound(num_microbatches=M, stage_to_rank=layout, plan=plan)
               for layout in (tuple(range(P)), v_layout(P)))


def row(P: int, M: int, latency: float, between_datacenters: bool) -> str:
    base, ours = compare(P, M, latency, between_datacenters)
    best = min(t for t, _ in base)
    gain = 1 - min(t for t, _ in ours) / best
    bound = 1 - lower_bound(P, M, latency, min(p for _, p in base), between_datacenters) / best
    cells = " ".join(f"{t:7.2f} {p:5.1f}" for t, p in base + ours)
    return f"{P:2d} {M:3d} {latency:5.2f} {cells} {gain:+7.1%} {bound:+6.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="4,8", help="pipeline sizes P (default 4,8)")
    ap.add_argument("--per-rank", default="1,2,4", help="M as multiples of P (default 1,2,4)")
    ap.add_argument("--latencies", default="0,0.25,0.5,1,2", help="link latency in forwards (default 0,0.25,0.5,1,2)")
    ap.add_argument("--between-datacenters", action="store_true",
                    help="only the link between ranks P/2-1 and P/2 is slow (two datacenters)")
    args = ap.parse_args()
    names = [f"{f}{'' if v is None else f' V={v}'}" for f, v in BASELINES] + ["latency V=1", "latency V=2"]
    print(f"{'P':>2s} {'M':>3s} {'lat':>5s} " + " ".join(f"{n[:13]:>13s}" for n in names) + "    gain  bound")
    print(" " * 12 + " ".join(f"{'step':>7s} {'peak':>5s}" for _ in names))
    for P in (int(x) for x in args.stages.split(",")):
        for k in (int(x) for x in args.per_rank.split(",")):
            for latency in (float(x) for x in args.latencies.split(",")):
                print(row(P, k * P, latency, args.between_datacenters), flush=True)


if __name__ == "__main__":
    main()
