"""The step lower bound of a placement under a link plan: below every schedule the simulator times (latency-aware
and the baselines alike), met by latency-aware at M = P, and what it says about issue 35's 15% at a quarter of a
forward."""

from __future__ import annotations

import pathlib
import random
import sys

import pytest

from evenpipe.schedule import LinkPlan, build_schedule
from evenpipe.schedule.generate.latency_aware import v_layout
from evenpipe.schedule.generate.latency_bound import step_lower_bound
from evenpipe.sim import Link, SimCosts, simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_latency  # noqa: E402


def _sim_step(family: str, P: int, M: int, V: int, plan: LinkPlan, link_plan: LinkPlan | None) -> tuple[float, float]:
    """Simulated step and largest per-rank activation peak under ``plan``'s times and latencies."""
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V, link_plan=link_plan)
    links = {(a, b): Link(latency_s=plan.message_time(a, b)) for a in range(P) for b in range(P) if a != b}
    stages = SimCosts.uniform(num_stages=P * V, num_chunks=V, forward=plan.forward, backward=plan.backward_input,
                              weight=plan.backward_weight).stages
    trace = simulate(s, SimCosts.from_stages(stages, links=links))
    return trace.step_time, max(trace.peak_activations)


@pytest.mark.parametrize("seed", range(12))
def test_no_simulated_schedule_beats_the_bound(seed: int) -> None:
    """Random sizes, times and per-pair latencies: latency-aware at a random cap, and the baselines at their own
    peak, never take less than the bound of their placement."""
    rng = random.Random(seed)
    P, k = rng.choice((2, 3, 4, 6)), rng.choice((1, 2, 3))
    M = k * P
    f, i, w = (rng.choice((0.5, 1.0, 2.0)) for _ in range(3))
    lat = tuple(tuple(0.0 if a == b else rng.choice((0.0, 0.1, 0.5, 2.0)) for b in range(P)) for a in range(P))
    plan = LinkPlan(forward=f, backward_input=i, backward_weight=w, message=lat, cap=float(rng.randint(1, P)))
    for V, layout in ((1, tuple(range(P))), (2, v_layout(P))):
        step, peak = _sim_step("latency-aware", P, M, V, plan, plan)
        assert peak <= plan.cap + 1e-9
        assert step >= step_lower_bound(num_microbatches=M, stage_to_rank=layout, plan=plan) - 1e-9
    for family, V, layout in (("1f1b", 1, tuple(range(P))), ("zb-h1", 1, tuple(range(P))),
                              ("zb-v", 2, v_layout(P))):
        step, peak = _sim_step(family, P, M, V, plan, None)
        at_peak = LinkPlan(forward=f, backward_input=i, backward_weight=w, message=lat, cap=peak)
        assert step >= step_lower_bound(num_microbatches=M, stage_to_rank=layout, plan=at_peak) - 1e-9, family


@pytest.mark.parametrize("P", [4, 8, 16])
def test_latency_aware_meets_the_bound_at_m_equal_p(P: int) -> None:
    """Every link a quarter of a forward, M = P, the cap at the baselines' smallest peak: the V's step is the
    bound, so no schedule of that placement does better."""
    base, ours = bench_latency.compare(P, P, 0.25)
    plan = LinkPlan(message=bench_latency.latencies(P, 0.25), cap=min(p for _, p in base))
    assert ours[1][0] == pytest.approx(step_lower_bound(num_microbatches=P, stage_to_rank=v_layout(P), plan=plan))


@pytest.mark.parametrize("P", [4, 8, 16])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_quarter_forward_on_every_link_caps_the_gain_below_fifteen_percent(P: int, k: int) -> None:
    """Why issue 35's 15% is not met at exactly a quarter of a forward on every link: at the baselines' memory no
    schedule of one stage per rank or of the V can be 15% shorter than the best baseline (here 8.8-13.9%)."""
    base, _ = bench_latency.compare(P, k * P, 0.25)
    best = min(t for t, _ in base)
    bound = bench_latency.lower_bound(P, k * P, 0.25, min(p for _, p in base))
    assert 1 - bound / best < 0.15
