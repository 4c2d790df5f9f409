"""build_schedule's contract: complete schedules, metadata, and one-line ConfigErrors for bad values."""

from __future__ import annotations

from typing import Any

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import ActionKind, ScheduleFamily, build_schedule, compute_order, validate


def test_unknown_family_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown schedule 'pipedream'.*gpipe, 1f1b, interleaved, looped-bfs"):
        build_schedule("pipedream", num_ranks=2, num_microbatches=2)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"num_ranks": 0, "num_microbatches": 4}, "num_ranks must be >= 1, got 0"),
    ({"num_ranks": 2, "num_microbatches": 0}, "num_microbatches must be >= 1, got 0"),
    ({"num_ranks": 2, "num_microbatches": 4, "num_chunks": 0}, "num_chunks must be >= 1, got 0"),
])
def test_bad_sizes(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_schedule("1f1b", **kwargs)


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb-h1", "bpipe"])
def test_chunks_for_a_family_without_chunks(family: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{family}' has one stage per rank; got num_chunks=2"):
        build_schedule(family, num_ranks=2, num_microbatches=4, num_chunks=2)


def test_interleaved_needs_equal_rounds() -> None:
    with pytest.raises(ConfigError, match=r"got M=9 for P=4 ranks \(nearby allowed: 5, 6, 7, 8, 10, 12\b"):
        build_schedule("interleaved", num_ranks=4, num_microbatches=9, num_chunks=2)
    for M in (1, 3, 4, 6, 7, 10, 12):  # one round when M < 2P, else rounds of M // (M // P)
        build_schedule("interleaved", num_ranks=4, num_microbatches=M, num_chunks=2)


def test_budget_on_other_family_warns() -> None:
    with pytest.warns(UserWarning, match="no effect"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=2, bpipe_budget=2)


def test_meta_and_name() -> None:
    s = build_schedule(ScheduleFamily.BPIPE, num_ranks=4, num_microbatches=8)
    assert s.name == "bpipe"
    assert s.meta["family"] == "bpipe" and s.meta["budget"] == 3 and s.meta["chunks"] == 1
    s = build_schedule("interleaved", num_ranks=2, num_microbatches=4, num_chunks=3)
    assert s.meta["chunks"] == 3 and s.num_chunks == 3 and s.stage_to_rank == (0, 1, 0, 1, 0, 1)


def test_recompute_right_before_every_backward() -> None:
    for family in ("1f1b", "zb-h1", "bpipe"):
        s = build_schedule(family, num_ranks=3, num_microbatches=5, recompute=True)
        validate(s)
        for acts in s.compute_only().actions:
            for prev, a in zip(acts, acts[1:]):
                if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
                    assert prev.kind is ActionKind.RECOMPUTE and prev.key == a.key
            assert sum(a.kind is ActionKind.RECOMPUTE for a in acts) == 5


def test_single_rank_has_no_transfers() -> None:
    for family in ScheduleFamily:
        s = build_schedule(family, num_ranks=1, num_microbatches=3)
        assert all(a.kind.is_compute for acts in s.actions for a in acts)


def test_compute_order_is_one_object_however_its_defaults_are_passed() -> None:
    """The planner's memory count passes fewer arguments than ``build_schedule`` does: both must get the same
    compute order object, so that BPipe's transform (remembered by that object) runs once for both."""
    bare = compute_order(ScheduleFamily.INTERLEAVED, num_ranks=4, num_microbatches=8)
    spelled = compute_order(ScheduleFamily.INTERLEAVED, num_ranks=4, num_microbatches=8, num_chunks=2,
                            plan_durations=None, link_plan=None)
    assert spelled is bare
    assert compute_order(ScheduleFamily.INTERLEAVED, num_ranks=4, num_microbatches=8, num_chunks=4) is not bare
