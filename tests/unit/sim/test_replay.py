"""Replay: a measured trace's schedule simulated with its own compute times and the cost model's links."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import build_schedule
from evenpipe.sim import Link, SimCosts, StageCosts, Trace, simulate
from evenpipe.sim.replay import replay

LINK = Link(latency_s=0.3, bandwidth_bytes_per_s=100.0)


def _costs(num_stages: int, *, slow_stage: int = -1, split: bool = False) -> SimCosts:
    stages = [StageCosts(forward=1.0 + 0.1 * s + (2.0 if s == slow_stage else 0.0),
                         backward_input=2.0 if not split else 1.2, backward_weight=0.0 if not split else 0.8,
                         activation_bytes=10.0, output_bytes=20.0, weight_grad_bytes=4.0)
              for s in range(num_stages)]
    return SimCosts.from_stages(stages, default_link=LINK)


def _ends(trace) -> list[list[tuple[float, float]]]:  # type: ignore[no-untyped-def]
    return [[(round(a.start, 9), round(a.end, 9)) for a in acts] for acts in trace.actions]


@pytest.mark.parametrize("family, chunks, split", [("1f1b", 1, False), ("gpipe", 1, False),
                                                   ("interleaved", 2, False), ("zb-h1", 1, True),
                                                   ("bpipe", 1, False)])
def test_replaying_a_simulated_step_gives_it_back(family: str, chunks: int, split: bool) -> None:
    sched = build_schedule(family, num_ranks=4, num_microbatches=8, num_chunks=chunks)
    costs = _costs(sched.num_stages, split=split)
    sim = simulate(sched, costs)
    again = replay(sim, costs)
    assert again.step_time == pytest.approx(sim.step_time, rel=1e-12)
    assert _ends(again) == _ends(sim)
    assert again.peak_activation_bytes == sim.peak_activation_bytes


def test_the_measured_times_win_over_the_costs() -> None:
    """A 'measured' step whose stage 1 forwards took 2 s longer replays as that step, though the costs it is
    replayed with say otherwise; the links and bytes are the costs'."""
    sched = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    measured = simulate(sched, _costs(4, slow_stage=1))
    assigned = _costs(4)
    assert simulate(sched, assigned).step_time < measured.step_time - 1.0
    again = replay(measured, assigned)
    assert _ends(again) == _ends(measured)
    slower_links = dataclasses.replace(assigned, default_link=Link(latency_s=1.0, bandwidth_bytes_per_s=100.0))
    assert replay(measured, slower_links).step_time > measured.step_time + 1.0


def test_a_trace_missing_a_compute_is_refused() -> None:
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    sim = simulate(sched, _costs(2))
    cut = tuple(tuple(a for a in acts if not (a.rank == 1 and str(a.action) == "1B3")) for acts in sim.actions)
    assert sum(map(len, cut)) == sum(map(len, sim.actions)) - 1
    partial = Trace(schedule=sched, transfers=sim.transfers, memory=sim.memory, unit_bytes=sim.unit_bytes,
                    step_time=sim.step_time, source="measured", actions=cut)
    with pytest.raises(ConfigError, match="no 1B3 on rank 1"):
        replay(partial, _costs(2))
