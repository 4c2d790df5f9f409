"""torch 2.13's own schedule classes: their compute orders import through the CSV form, validate and simulate."""

from __future__ import annotations

import pytest

from evenpipe.errors import ConfigError
from evenpipe.runtime.torch_orders import TorchSchedule, torch_compute_order
from evenpipe.schedule import ScheduleFamily, compute_order, derive_communication, held_units, validate
from evenpipe.sim import SimCosts, simulate


@pytest.mark.parametrize("which", list(TorchSchedule))
@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 16)])
def test_torch_orders_validate_and_simulate(which: TorchSchedule, p: int, m: int) -> None:
    compute = torch_compute_order(which, num_ranks=p, num_microbatches=m)
    assert compute.num_stages == 2 * p and compute.stage_to_rank == which.placement.stage_to_rank(p, 2)
    full = derive_communication(compute)
    validate(full)
    trace = simulate(full, SimCosts.uniform(num_stages=2 * p, num_chunks=2, forward=1, backward=1, weight=1))
    assert trace.step_time > 0 and min(trace.peak_activations) > 0


@pytest.mark.parametrize("p,m", [(3, 6), (4, 16)])
def test_torch_interleaved_1f1b_and_dualpipev_are_ours(p: int, m: int) -> None:
    """Megatron's interleaving and DeepSeek's DualPipeV are fixed orders: torch's and ours coincide."""
    ours = compute_order(ScheduleFamily.INTERLEAVED, num_ranks=p, num_microbatches=m, num_chunks=2)
    assert torch_compute_order("Interleaved1F1B", num_ranks=p, num_microbatches=m).actions == ours.actions
    ours = compute_order(ScheduleFamily.DUALPIPE_V, num_ranks=p, num_microbatches=m)
    theirs = torch_compute_order("dualpipev", num_ranks=p, num_microbatches=m)
    assert theirs.actions == ours.actions
    assert held_units(derive_communication(theirs)) == [2 * p + 1] * p


def test_torch_refusal_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="DualPipeV|dualpipev"):
        torch_compute_order(TorchSchedule.DUALPIPE_V, num_ranks=4, num_microbatches=4)
    with pytest.raises(ConfigError, match="unknown torch schedule 'gpipe'"):
        torch_compute_order("gpipe", num_ranks=2, num_microbatches=2)
