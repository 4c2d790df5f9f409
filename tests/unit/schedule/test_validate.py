"""Planted faults are rejected under the right rule, with a rank-by-step grid marking the stuck action."""

from __future__ import annotations

import pytest

from evenpipe.errors import ScheduleValidationError
from evenpipe.schedule import ActionKind, Schedule, build_schedule, derive_communication, validate, witness_timing

K = ActionKind


def edit(schedule: Schedule, rank: int, new_tokens: list[str]) -> Schedule:
    """Replace one rank's list, given as text tokens."""
    rows = [list(acts) for acts in schedule.actions]
    rows[rank] = list(Schedule.from_text(f"# x ranks=1 microbatches={schedule.num_microbatches} layout="
                                         + ",".join("0" for _ in schedule.stage_to_rank) + "\n0: "
                                         + " ".join(new_tokens)).actions[0])
    return schedule.with_actions(rows)


def tokens(schedule: Schedule, rank: int) -> list[str]:
    return [str(a) for a in schedule.actions[rank]]


def reject(schedule: Schedule, rule: str) -> ScheduleValidationError:
    with pytest.raises(ScheduleValidationError) as info:
        validate(schedule)
    err = info.value
    assert err.rule == rule, str(err)
    assert err.grid and err.grid in str(err) and f"[{rule}]" in str(err)
    assert ">" in err.grid and "<" in err.grid  # the marked action
    return err


def test_good_schedules_pass() -> None:
    for family in ("gpipe", "1f1b", "zb-h1", "bpipe"):
        validate(build_schedule(family, num_ranks=4, num_microbatches=6))


def test_dropped_backward() -> None:
    s = build_schedule("1f1b", num_ranks=3, num_microbatches=4)
    row = [t for t in tokens(s, 1) if t not in ("1B2", "1SEND_B2@0")]
    s = edit(s, 1, row)
    rows = [list(acts) for acts in s.actions]
    rows[0] = [a for a in rows[0] if str(a) != "0RECV_B2@1"]
    rows[2] = [a for a in rows[2] if str(a) != "2SEND_B2@1"]
    err = reject(s.with_actions(rows), "completeness")
    assert "stage 1 micro-batch 2" in str(err)
    assert ">1F2<" in err.grid


def test_dropped_backward_alone_is_still_named() -> None:
    s = build_schedule("1f1b", num_ranks=3, num_microbatches=4)
    reject(edit(s, 1, [t for t in tokens(s, 1) if t != "1B2"]), "completeness")


def test_swapped_send_order_deadlocks() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    row = tokens(s, 1)
    # rank 1 receives F1 before sending B0; rank 0 sends F1 before receiving B0. Make rank 1 send first.
    assert row.index("1RECV_F1@0") < row.index("1SEND_B0@0")
    row.remove("1RECV_F1@0")
    row.insert(row.index("1SEND_B0@0") + 1, "1RECV_F1@0")
    bad = edit(s, 1, row)
    err = reject(bad, "deadlock")
    assert "rank 0 at 0SEND_F1@1" in str(err) and "rank 1 at 1SEND_B0@0" in str(err)
    assert ">0SEND_F1@1<" in err.grid and ">1SEND_B0@0<" in err.grid


def test_load_after_its_backward() -> None:
    s = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    row = tokens(s, 0)
    load = row.index("0LOAD2@3")
    row.pop(load)
    row.insert(row.index("0B2") + 1, "0LOAD2@3")
    err = reject(edit(s, 0, row), "dependency")
    assert "0B2 uses activations sent away (0EVICT2" in str(err)
    assert ">0B2<" in err.grid


def test_action_on_wrong_rank() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    err = reject(edit(s, 0, ["1F0"] + tokens(s, 0)), "placement")
    assert "lives on rank 1" in str(err)


def test_wrong_peer() -> None:
    s = build_schedule("1f1b", num_ranks=3, num_microbatches=2)
    row = [t.replace("0SEND_F0@1", "0SEND_F0@2") for t in tokens(s, 0)]
    reject(edit(s, 0, row), "placement")


def test_forward_before_its_input() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    row = tokens(s, 1)
    i, j = row.index("1RECV_F0@0"), row.index("1F0")
    row[i], row[j] = row[j], row[i]
    err = reject(edit(s, 1, row), "dependency")
    assert "1F0 runs before 1RECV_F0" in str(err)


def test_unmatched_receive() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    rows = [list(acts) for acts in s.actions]
    rows[1] = [a for a in rows[1] if str(a) != "1SEND_B1@0"]
    err = reject(s.with_actions(rows), "matching")
    assert "0RECV_B1@1 has no matching SEND_B on rank 1" in str(err)


def test_duplicate_forward() -> None:
    s = build_schedule("gpipe", num_ranks=1, num_microbatches=2)
    reject(edit(s, 0, ["0F0"] + tokens(s, 0)), "duplicate")


def test_cyclic_compute_order_is_caught_by_derivation() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2).compute_only()
    bad = edit(s, 0, ["0F0", "0B0", "0F1", "0B1"])  # rank 0 waits for B0 before sending F1
    bad = edit(bad, 1, ["1F1", "1B1", "1F0", "1B0"])  # rank 1 wants F1 first
    with pytest.raises(ScheduleValidationError) as info:
        derive_communication(bad)
    assert info.value.rule == "deadlock" and ">0B0<" in info.value.grid and ">1F1<" in info.value.grid
    with pytest.raises(ScheduleValidationError):
        witness_timing(bad)


def test_long_schedule_grid_is_a_window() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=64)
    row = tokens(s, 1)
    row.remove("1RECV_F40@0")
    row.insert(row.index("1SEND_B39@0") + 1, "1RECV_F40@0")
    err = reject(edit(s, 1, row), "deadlock")
    lines = err.grid.splitlines()
    assert len(lines) == 2 and all(len(line.split()) < 20 for line in lines)
    assert "@" in lines[0]  # the window says where it starts


def test_offload_and_reload_are_kept_and_checked() -> None:
    s = Schedule.from_text("# x ranks=2 microbatches=2 layout=0,1\n"
                           "0: 0F0 0OFFLOAD0 0F1 0RELOAD0 0B0 0B1\n1: 1F0 1B0 1F1 1B1\n")
    full = derive_communication(s)
    validate(full)
    assert [str(a) for a in full.compute_only().actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert "0OFFLOAD0" in [str(a) for a in full.actions[0]] and "0RELOAD0" in [str(a) for a in full.actions[0]]
    assert derive_communication(full).actions == full.actions
    no_reload = full.with_actions([[a for a in full.actions[0] if a.kind is not K.RELOAD], full.actions[1]])
    err = reject(no_reload, "dependency")
    assert "0B0 uses activations sent away" in str(err)
