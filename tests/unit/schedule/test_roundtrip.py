"""Our schedules -> torch CSV / text / JSON -> our schedules, lossless for compute actions."""

from __future__ import annotations

import pytest

from evenpipe.schedule import Schedule, ScheduleFamily, build_schedule


@pytest.mark.parametrize("family", list(ScheduleFamily))
def test_torch_csv_round_trip(family: ScheduleFamily) -> None:
    V = 2 if family.has_chunks else None
    s = build_schedule(family, num_ranks=4, num_microbatches=8, num_chunks=V)
    back = Schedule.from_torch_csv(s.to_torch_csv(), num_microbatches=8, stage_to_rank=s.stage_to_rank)
    assert back.compute_only().actions == s.compute_only().actions
    assert back.stage_to_rank == s.stage_to_rank


@pytest.mark.parametrize("family", list(ScheduleFamily))
def test_text_and_json_round_trip(family: ScheduleFamily) -> None:
    V = 3 if family.has_chunks else None
    s = build_schedule(family, num_ranks=3, num_microbatches=6, num_chunks=V, recompute=True)
    assert Schedule.from_text(s.to_text()).actions == s.actions
    assert Schedule.from_json(s.to_json()).actions == s.actions
    assert Schedule.from_json(s.to_json()).meta == s.meta
