"""``Estimate.limited_by`` names the largest share of the critical rank's step (memory when it does not fit)."""

from __future__ import annotations

import pytest

from evenpipe.cost import ParallelConfig, Recompute, estimate, hardware_preset, model_preset
from evenpipe.cost.estimate import TimeBreakdown, _limit


def _bd(**parts: float) -> TimeBreakdown:
    zero = dict(compute=0.0, tp_comm=0.0, recompute=0.0, pp_comm=0.0, bpipe_transfer=0.0, bubble=0.0, dp_comm=0.0,
                optimizer=0.0)
    return TimeBreakdown(**{**zero, **parts})


@pytest.mark.parametrize(("parts", "expected"), [
    # 80% compute with 12% exposed communication: compute, not communication (issue 31)
    (dict(compute=5.6, recompute=2.4, tp_comm=1.2, bubble=0.8), "compute"),
    (dict(compute=3.0, tp_comm=2.0, pp_comm=1.0, dp_comm=0.5, bpipe_transfer=0.5), "communication"),
    (dict(compute=3.0, bubble=4.0, tp_comm=2.0), "bubble"),
    (dict(compute=1.0, optimizer=1.0, recompute=1.0, bubble=2.9), "compute"),  # optimizer and recompute count
])
def test_the_largest_share_names_the_limit(parts: dict[str, float], expected: str) -> None:
    assert _limit(True, 10.0, 80.0, _bd(**parts)) == expected


def test_memory_when_it_does_not_fit_or_compute_bound_near_the_budget() -> None:
    comm_bound = _bd(compute=1.0, tp_comm=3.0)
    assert _limit(False, 90.0, 80.0, comm_bound) == "memory"
    assert _limit(True, 75.0, 80.0, comm_bound) == "communication"
    assert _limit(True, 75.0, 80.0, _bd(compute=3.0, tp_comm=1.0)) == "memory"
    assert _limit(True, 50.0, 80.0, _bd(compute=3.0, tp_comm=1.0)) == "compute"


def test_a_mostly_compute_step_is_not_called_communication_bound() -> None:
    cfg = ParallelConfig(tp=8, pp=16, dp=8, global_batch=1536, recompute=Recompute.FULL)
    est = estimate(model_preset("gpt3-175b"), hardware_preset("a100-80gb"), cfg)
    bd = est.breakdown
    assert (bd.compute + bd.recompute) / est.step_time_s > 0.7 and bd.tp_comm / est.step_time_s > 0.1
    assert est.fits and est.limited_by == "compute"
