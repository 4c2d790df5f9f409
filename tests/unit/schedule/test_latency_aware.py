"""The latency-aware family: valid for the validator at every size and cap, within its cap in the simulator, and
faster than 1F1B, interleaved and ZB-H1 on slow links at their memory (issue 35 point 4)."""

from __future__ import annotations

import pathlib
import random
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenpipe.errors import ConfigError
from evenpipe.schedule import ActionKind, LinkPlan, build_schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim import Link, SimCosts, simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_latency  # noqa: E402

K = ActionKind
FAMILY = "latency-aware"


def _plan(rng: random.Random, P: int, cap: float | None) -> tuple[LinkPlan, SimCosts, SimCosts]:
    """A random plan (times, per-pair latencies) and the simulator's costs for one and two stages per rank."""
    f, i, w = (rng.choice((0.5, 1.0, 1.5)) for _ in range(3))
    lat = [[0.0 if a == b else rng.choice((0.0, 0.1, 0.5, 1.0, 2.0)) for b in range(P)] for a in range(P)]
    slowdown = tuple(rng.choice((1.0, 1.0, 1.5, 3.0)) for _ in range(P))
    plan = LinkPlan(forward=f, backward_input=i, backward_weight=w, message=tuple(map(tuple, lat)), cap=cap,
                    slowdown=slowdown)
    links = {(a, b): Link(latency_s=lat[a][b]) for a in range(P) for b in range(P) if a != b}
    costs = [SimCosts.from_stages(SimCosts.uniform(num_stages=P * v, num_chunks=v, forward=f, backward=i,
                                                   weight=w).stages, links=links) for v in (1, 2)]
    return plan, costs[0], costs[1]


def _check(P: int, M: int, V: int, cap: float, seed: int) -> None:
    rng = random.Random(seed)
    plan, costs1, costs2 = _plan(rng, P, cap)
    s = build_schedule(FAMILY, num_ranks=P, num_microbatches=M, num_chunks=V, link_plan=plan)
    assert passed_validation(s)
    computes = [(a.kind, a.stage, a.microbatch) for acts in s.actions for a in acts if a.kind.is_compute]
    assert len(computes) == len(set(computes)) == 3 * P * V * M  # every F, I and W once
    trace = simulate(s, costs1 if V == 1 else costs2)
    assert max(trace.peak_activations) <= cap + 1e-9, (trace.peak_activations, cap)


@pytest.mark.parametrize("V", [1, 2])
@pytest.mark.parametrize("P", range(2, 9))
def test_every_cap_validates_small_m(P: int, V: int) -> None:
    """M in {P, 2P} (M = P from P = 6), caps from P down to the minimum (one activation unit)."""
    for M in (P, 2 * P) if P < 6 else (P,):
        for cap in range(P, 0, -1):
            _check(P, M, V, float(cap), seed=P * 1000 + M * 10 + cap)


@settings(max_examples=30, deadline=None)
@given(P=st.integers(2, 8), k=st.sampled_from([1, 2, 4, 8]), V=st.sampled_from([1, 2]), data=st.data())
def test_random_sizes_caps_and_links_validate(P: int, k: int, V: int, data: st.DataObject) -> None:
    """M in {P, 2P, 4P, 8P}, any cap from P down to 1 (also fractional), random per-pair latencies and times."""
    cap = data.draw(st.sampled_from([float(c) for c in range(1, P + 1)] + [P - 0.5, 1.5]))
    _check(P, k * P, V, cap, seed=data.draw(st.integers(0, 10**6)))


def test_cap_below_one_unit_is_refused() -> None:
    with pytest.raises(ConfigError, match="allowed: cap >= 1"):
        build_schedule(FAMILY, num_ranks=4, num_microbatches=8, num_chunks=2, link_plan=LinkPlan(cap=0.5))
    with pytest.raises(ConfigError, match="allowed: 1, 2"):
        build_schedule(FAMILY, num_ranks=4, num_microbatches=8, num_chunks=3)
    with pytest.raises(ConfigError, match="message times for 3 ranks"):
        build_schedule(FAMILY, num_ranks=4, num_microbatches=8, link_plan=LinkPlan.uniform(num_ranks=3, latency=1))
    with pytest.raises(ConfigError, match="latency-aware plan: forward"):
        LinkPlan(forward=float("nan"))
    with pytest.raises(ConfigError, match="slowdowns must be finite numbers > 0"):
        LinkPlan(slowdown=(1.0, 0.0))
    with pytest.raises(ConfigError, match="slowdowns for 2 ranks"):
        build_schedule(FAMILY, num_ranks=4, num_microbatches=8, link_plan=LinkPlan(slowdown=(1.0, 2.0)))


def test_link_plan_on_another_family_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_schedule("1f1b", num_ranks=2, num_microbatches=2, link_plan=LinkPlan())
    assert any("no effect" in str(w.message) for w in caught)


def test_recompute_keeps_it_valid() -> None:
    s = build_schedule(FAMILY, num_ranks=4, num_microbatches=8, num_chunks=2, recompute=True,
                       link_plan=LinkPlan.uniform(num_ranks=4, latency=0.5))
    assert passed_validation(s)
    assert sum(a.kind is K.RECOMPUTE for acts in s.actions for a in acts) == 4 * 2 * 8


def _gain(P: int, M: int, latency: float, chunks: int, between_datacenters: bool = False
          ) -> tuple[float, float, float, float]:
    """Latency-aware (capped at the baselines' smallest peak) against the best baseline: its step and peak, the
    best baseline's step and that smallest peak, all at F = I = W = 1 (``benchmarks/bench_latency.py``)."""
    base, ours = bench_latency.compare(P, M, latency, between_datacenters)
    step, peak = ours[chunks - 1]
    return step, peak, min(t for t, _ in base), min(p for _, p in base)


def test_fifteen_percent_faster_on_slow_links_at_equal_memory() -> None:
    """Issue 35's acceptance point: link latency of at least a quarter of a stage's forward (here one forward),
    P = M = 8, the cap at the baselines' smallest peak: at least 15% shorter than the best baseline."""
    step, peak, base_step, base_peak = _gain(8, 8, 1.0, 1)
    assert peak <= base_peak
    assert step <= 0.85 * base_step, (step, base_step)


def test_quarter_forward_latency_gains_at_least_ten_percent() -> None:
    """At exactly a quarter of a forward the V (two chunks per rank) gains 12.7% here, short of 15% (see
    BENCHMARKS.md); pinned so that it does not slip."""
    step, peak, base_step, base_peak = _gain(8, 8, 0.25, 2)
    assert peak <= base_peak
    assert step <= 0.90 * base_step, (step, base_step)


def test_fifteen_percent_faster_across_a_slow_datacenter_link() -> None:
    """CrossPipe's case: only the link between two datacenters (ranks 3 and 4) is slow, one forward per message;
    P = 8, M = 4P, at the baselines' smallest peak: at least 15% shorter (19.9% with one stage per rank)."""
    step, peak, base_step, base_peak = _gain(8, 32, 1.0, 1, between_datacenters=True)
    assert peak <= base_peak
    assert step <= 0.85 * base_step, (step, base_step)


@pytest.mark.parametrize("P,M", [(4, 4), (4, 16), (8, 16)])
@pytest.mark.parametrize("latency", [0.0, 0.5, 1.0])
def test_one_stage_per_rank_never_slower_than_zb_h1(P: int, M: int, latency: float) -> None:
    """ZB-H1's own order is one of the candidates (with messages placed by the plan), so the family never loses
    to it at its memory."""
    plan = LinkPlan.uniform(num_ranks=P, latency=latency)
    step, peak = bench_latency.run(FAMILY, P, M, latency, 1, plan)
    zb_step, zb_peak = bench_latency.run("zb-h1", P, M, latency)
    assert peak <= zb_peak and step <= zb_step + 1e-9


@pytest.mark.parametrize("P,k", [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4), (16, 1), (16, 2)])
@pytest.mark.parametrize("latency", [0.25, 0.5, 1.0])
def test_grid_validates_within_the_baselines_memory(P: int, k: int, latency: float) -> None:
    """Every link slow, the cap at the baselines' smallest peak, both placements: the schedule passes the validator
    (build_schedule validates), holds at most the cap and is never slower than the best baseline."""
    base, ours = bench_latency.compare(P, k * P, latency)
    cap = min(p for _, p in base)
    for step, peak in ours:
        assert peak <= cap + 1e-9
    assert min(t for t, _ in ours) <= min(t for t, _ in base)


def test_quarter_forward_at_two_and_four_microbatches_per_rank() -> None:
    """Latency-aware shifts the zero-bubble V order left into the latency gaps: at a quarter of a forward on every
    link, P = 8, it gains 9.0% at M = 2P and 8.4% at M = 4P (the bound allows 11.0% and 9.5%)."""
    for M, floor in ((16, 0.085), (32, 0.08)):
        step, peak, base_step, base_peak = _gain(8, M, 0.25, 2)
        assert peak <= base_peak
        assert step <= (1 - floor) * base_step, (M, step, base_step)


@pytest.mark.parametrize("P,latency,between_datacenters", [(8, 0.25, True), (16, 0.25, True), (16, 0.5, False)])
def test_fifteen_percent_at_a_quarter_across_datacenters_and_half_everywhere(P: int, latency: float,
                                                                            between_datacenters: bool) -> None:
    """Issue 35's acceptance where it is reachable at M = P: one datacenter link a quarter of a forward slow
    (15.0% at P = 8, 16.4% at P = 16), every link half a forward slow at P = 16 (15.2%); the V, at the
    baselines' smallest peak."""
    step, peak, base_step, base_peak = _gain(P, P, latency, 2, between_datacenters)
    assert peak <= base_peak
    assert step <= 0.85 * base_step, (step, base_step)
