"""The simulator on small hand-built schedules: timing, links, exposure, memory and error paths."""

from __future__ import annotations

import pytest

from evenpipe.errors import ConfigError, ScheduleValidationError
from evenpipe.schedule.bpipe import held_units
from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.sim import Link, SimCosts, StageCosts, simulate

from ._handmade import one_f_one_b

K = ActionKind


def _sched(text: str) -> Schedule:
    return Schedule.from_text(text)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8), (3, 2)])
@pytest.mark.parametrize("gpipe", [False, True])
def test_handmade_pipelines_match_closed_forms(p: int, m: int, gpipe: bool) -> None:
    trace = simulate(one_f_one_b(p, m, gpipe=gpipe), SimCosts.uniform(num_stages=p, forward=1, backward=2))
    assert trace.step_time == pytest.approx(3 * (m + p - 1))
    assert trace.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    expected = [m] * p if gpipe else [min(p - s, m) for s in range(p)]
    assert trace.peak_activations == pytest.approx(expected)


def test_every_action_gets_times_in_order() -> None:
    sched = one_f_one_b(3, 4)
    trace = simulate(sched, SimCosts.uniform(num_stages=3))
    for r, acts in enumerate(sched.actions):
        recs = trace.records(r)
        assert [rec.action for rec in recs] == list(acts)
        computes = [rec for rec in recs if rec.action.kind.is_compute]
        for a, b in zip(computes, computes[1:]):
            assert a.end <= b.start  # one compute at a time
    assert trace.num_actions == sum(len(a) for a in sched.actions)


def test_transfer_time_latency_and_bandwidth() -> None:
    sched = _sched("# t ranks=2 microbatches=1 layout=0,1\n0: 0F0 0SEND_F0@1 0RECV_B0@1 0B0\n"
                   "1: 1RECV_F0@0 1F0 1B0 1SEND_B0@0")
    stage = StageCosts(forward=1, backward_input=2, output_bytes=100)
    costs = SimCosts.from_stages([stage, stage], default_link=Link(latency_s=0.5, bandwidth_bytes_per_s=50))
    trace = simulate(sched, costs)
    # F0 [0,1], send 1 -> 3.5, 1F0 [3.5,4.5], 1B0 [4.5,6.5], grad 6.5 -> 9, 0B0 [9,11]
    assert trace.step_time == pytest.approx(11.0)
    fwd = next(t for t in trace.transfers if t.kind is K.SEND_F)
    assert (fwd.start, fwd.end, fwd.num_bytes) == pytest.approx((1.0, 3.5, 100))
    assert fwd.exposed_s == pytest.approx(2.5)
    assert trace.exposed_transfer_time == pytest.approx(5.0)
    assert trace.exposed_transfers[0].exposed_s == pytest.approx(2.5)


def test_one_transfer_at_a_time_per_direction() -> None:
    # two forwards sent back to back on one link of 2 s per message: the second waits for the first
    sched = _sched("# t ranks=2 microbatches=2 layout=0,1\n"
                   "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0RECV_B0@1 0B0 0RECV_B1@1 0B1\n"
                   "1: 1RECV_F0@0 1RECV_F1@0 1F0 1F1 1B0 1SEND_B0@0 1B1 1SEND_B1@0")
    stage = StageCosts(forward=0.5, backward_input=1, output_bytes=2)
    trace = simulate(sched, SimCosts.from_stages([stage, stage], default_link=Link(bandwidth_bytes_per_s=1)))
    f0, f1 = sorted((t for t in trace.transfers if t.kind is K.SEND_F), key=lambda t: t.microbatch)
    assert (f0.start, f0.end) == pytest.approx((0.5, 2.5))
    assert (f1.start, f1.end) == pytest.approx((2.5, 4.5))  # ready at 1.0 but the link was busy
    b0, b1 = sorted((t for t in trace.transfers if t.kind is K.SEND_B), key=lambda t: t.microbatch)
    assert b0.start >= f1.end or b0.src != f1.src  # the reverse direction is a separate link
    assert b0.start == pytest.approx(4.5 + 0.5 + 1)  # 1F1 ends 5.0, 1B0 ends 6.0


def test_deadlock_raises_with_grid() -> None:
    sched = _sched("# t ranks=2 microbatches=1 layout=0,1\n0: 0RECV_B0@1 0B0 0F0 0SEND_F0@1\n"
                   "1: 1RECV_F0@0 1F0 1B0 1SEND_B0@0")
    with pytest.raises(ScheduleValidationError, match="deadlock") as err:
        simulate(sched, SimCosts.uniform(num_stages=2))
    assert "[0B0]" in str(err.value) and "[1F0]" in str(err.value)


def test_unmatched_send_is_rejected() -> None:
    sched = _sched("# t ranks=2 microbatches=1 layout=0,1\n0: 0F0 0SEND_F0@1 0RECV_B0@1 0B0\n"
                   "1: 1F0 1B0 1SEND_B0@0")
    with pytest.raises(ScheduleValidationError, match="no matching RECV_F"):
        simulate(sched, SimCosts.uniform(num_stages=2))


def test_costs_must_cover_every_stage() -> None:
    with pytest.raises(ConfigError, match="3 stages"):
        simulate(one_f_one_b(2, 2), SimCosts.uniform(num_stages=3))


def test_compute_only_schedule_uses_implicit_transfers() -> None:
    sched = one_f_one_b(4, 6)
    costs = SimCosts.uniform(num_stages=4)
    full, bare = simulate(sched, costs), simulate(sched.compute_only(), costs)
    assert bare.step_time == pytest.approx(full.step_time)
    assert bare.peak_activations == pytest.approx(full.peak_activations)
    assert bare.transfers == ()


def test_split_backward_and_recompute_memory() -> None:
    sched = _sched("# t ranks=1 microbatches=2 layout=0\n0: 0F0 0F1 0R0 0I0 0W0 0R1 0I1 0W1")
    stage = StageCosts(forward=1, backward_input=1, backward_weight=1, activation_bytes=10, checkpoint_bytes=2,
                       weight_grad_bytes=3)
    trace = simulate(sched, SimCosts.from_stages([stage]))
    levels = [b for _, b in trace.memory[0].points]
    # F0,F1 keep checkpoints (2 each); R0 rebuilds 8 more; I0 keeps 3; W0 frees them as R1 adds 8 (both at t=5);
    # I1 keeps 3; W1 frees
    assert levels == pytest.approx([0, 2, 4, 12, 5, 10, 3, 0])
    assert [t for t, _ in trace.memory[0].points] == pytest.approx([0, 0, 1, 2, 4, 5, 7, 8])
    assert trace.peak_activation_bytes == (12.0,)
    assert trace.peak_activations == pytest.approx((1.2,))


def test_bpipe_evict_accept_return_load_memory() -> None:
    text = ("# bp ranks=2 microbatches=2 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0EVICT1@1 0RECV_B0@1 0B0 0LOAD1@1 0RECV_B1@1 0B1\n"
            "1: 0ACCEPT1@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 0RETURN1@0 1F1 1B1 1SEND_B1@0")
    costs = SimCosts.uniform(num_stages=2)
    trace = simulate(Schedule.from_text(text), costs)
    # rank 0: F0, F1, mb 1 leaves at t=2; LOAD1's transfer starts at 6 (charged then) as B0 frees mb 0; B1 at 9
    assert trace.memory[0].points == ((0, 0), (0, 1), (1, 2), (2, 1), (6, 1), (9, 0))
    # rank 1: ACCEPT1 is posted at 0 but charged when the eviction starts (2); own F0 at 1; at 4 B0 frees as F1
    # allocates (a forward does not wait for the RETURN before it); RETURN1 frees the hosted unit when it lands
    # (6, once rank 0 posts LOAD1)
    assert trace.memory[1].points == ((0, 0), (1, 1), (2, 2), (4, 2), (6, 1), (7, 0))
    kinds = {t.kind for t in trace.transfers}
    assert {K.EVICT, K.RETURN} <= kinds
    assert trace.memory[0].points[-1][1] == trace.memory[1].points[-1][1] == 0.0


def test_moves_are_charged_when_their_transfer_starts_and_freed_when_it_lands() -> None:
    text = ("# bp ranks=2 microbatches=2 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0EVICT0@1 0F1 0SEND_F1@1 0RECV_B1@1 0B1 0LOAD0@1 0RECV_B0@1 0B0\n"
            "1: 0ACCEPT0@0 1RECV_F0@0 1F0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 0RETURN0@0 1B0 1SEND_B0@0")
    saves = StageCosts(forward=1, backward_input=2, activation_bytes=4)
    keeps_nothing = StageCosts(forward=1, backward_input=2, activation_bytes=0)  # rank 1 shows hosted bytes only
    trace = simulate(Schedule.from_text(text), SimCosts.from_stages(
        [saves, keeps_nothing], default_link=Link(bandwidth_bytes_per_s=1)))
    evict = next(t for t in trace.transfers if t.kind is K.EVICT)
    back = next(t for t in trace.transfers if t.kind is K.RETURN)
    assert (evict.start, evict.end, back.start, back.end) == pytest.approx((1.0, 5.0, 11.0, 15.0))
    # ACCEPT0 posted at 0, charged at 1 when the bytes start to arrive, freed at 15 when RETURN0 lands
    assert trace.memory[1].points == ((0, 0), (1, 4), (15, 0))
    # EVICT0 frees at 5 (as F1 allocates); LOAD0 is charged at 11 when RETURN0 starts (as B1 frees), not at 15
    assert trace.memory[0].points == ((0, 0), (0, 4), (5, 4), (11, 4), (17, 0))


# Allocation rules: an evictor's F/R and LOAD transfers wait for its earlier EVICTs to land; an acceptor's ACCEPT
# transfers wait for its earlier RETURNs (and ACCEPTs). Then an evictor never holds more than held_units says and
# an acceptor never more than its own peak plus its hosted peak.
_RETURN_THEN_ACCEPT = ("# bp ranks=2 microbatches=2 layout=0,1\n"
                       "0: 0F0 0SEND_F0@1 0EVICT0@1 0F1 0SEND_F1@1 0LOAD0@1 0EVICT1@1 0RECV_B0@1 0B0 0LOAD1@1 "
                       "0RECV_B1@1 0B1\n"
                       "1: 0ACCEPT0@0 1RECV_F0@0 1F0 1RECV_F1@0 0RETURN0@0 0ACCEPT1@0 1F1 1B0 1SEND_B0@0 0RETURN1@0 "
                       "1B1 1SEND_B1@0")
_EVICT_THEN_LOAD = ("# bp ranks=2 microbatches=2 layout=0,1\n"
                    "0: 0F0 0SEND_F0@1 0EVICT0@1 0F1 0SEND_F1@1 0EVICT1@1 0LOAD0@1 0RECV_B0@1 0B0 0LOAD1@1 "
                    "0RECV_B1@1 0B1\n"
                    "1: 0ACCEPT0@0 1RECV_F0@0 1F0 0ACCEPT1@0 0RETURN0@0 1RECV_F1@0 1F1 1B0 1SEND_B0@0 0RETURN1@0 "
                    "1B1 1SEND_B1@0")


def _unit_costs(slow: tuple[int, int]) -> SimCosts:
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=4, output_bytes=0)
    return SimCosts.from_stages([stage, stage], links={slow: Link(bandwidth_bytes_per_s=1)})


def test_accept_waits_for_the_return_before_it() -> None:
    sched = Schedule.from_text(_RETURN_THEN_ACCEPT)
    trace = simulate(sched, _unit_costs(slow=(1, 0)))  # returns take 4, evictions are instant
    back0 = next(t for t in trace.transfers if t.kind is K.RETURN and t.microbatch == 0)
    evict1 = next(t for t in trace.transfers if t.kind is K.EVICT and t.microbatch == 1)
    f1 = next(rec for rec in trace.records(1) if str(rec.action) == "1F1")
    assert (back0.start, back0.end) == pytest.approx((2.0, 6.0))
    assert evict1.start == pytest.approx(6.0)  # posted at 2 on both ranks; starts when RETURN0 has landed
    assert f1.start == pytest.approx(2.0)  # the forward itself does not wait for RETURN0
    assert held_units(sched) == [2, 3]
    # rank 1 holds F0, F1 and the unit RETURN0 is still sending (own peak 2 + hosted peak 1), never also mb 1
    assert trace.peak_activation_bytes == pytest.approx((8.0, 12.0))
    assert trace.memory[1].points == ((0, 0), (1, 8), (2, 12), (5, 8), (6, 8), (7, 4), (12, 0))


def test_load_waits_for_the_eviction_before_it() -> None:
    sched = Schedule.from_text(_EVICT_THEN_LOAD)
    trace = simulate(sched, _unit_costs(slow=(0, 1)))  # evictions take 4, returns are instant
    evict1 = next(t for t in trace.transfers if t.kind is K.EVICT and t.microbatch == 1)
    back0 = next(t for t in trace.transfers if t.kind is K.RETURN and t.microbatch == 0)
    assert (evict1.start, evict1.end) == pytest.approx((6.0, 10.0))
    assert back0.start == pytest.approx(10.0)  # both sides posted by 6, data there at 5
    assert held_units(sched) == [1, 3]
    # rank 0: 1 unit, not 2; rank 1 runs F1 while RETURN0 is in flight: its own peak 2 plus hosted peak 2
    assert trace.peak_activation_bytes == pytest.approx((4.0, 16.0))


def test_slow_eviction_is_exposed_and_slower() -> None:
    text = ("# bp ranks=2 microbatches=2 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0EVICT1@1 0RECV_B0@1 0B0 0LOAD1@1 0RECV_B1@1 0B1\n"
            "1: 0ACCEPT1@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 0RETURN1@0 1F1 1B1 1SEND_B1@0")
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=4, output_bytes=0)
    fast = simulate(Schedule.from_text(text), SimCosts.from_stages([stage, stage]))
    slow = simulate(Schedule.from_text(text),
                    SimCosts.from_stages([stage, stage], default_link=Link(bandwidth_bytes_per_s=1)))
    assert slow.step_time > fast.step_time
    exposed = slow.exposed_transfers
    assert exposed and exposed[0].kind is K.RETURN and exposed[0].exposed_s > 0


def test_offload_reload_use_the_host_link() -> None:
    sched = _sched("# t ranks=1 microbatches=2 layout=0\n0: 0F0 0OFFLOAD0 0F1 0B1 0RELOAD0 0B0")
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=3)
    host = Link(bandwidth_bytes_per_s=1.0)
    trace = simulate(sched, SimCosts.from_stages([stage], links={(0, 0): host}))
    off, back = sorted(trace.transfers, key=lambda t: t.start)
    assert (off.start, off.end) == pytest.approx((1.0, 4.0))
    assert (back.start, back.end) == pytest.approx((4.0, 7.0))  # waits for the offload to land
    assert trace.step_time == pytest.approx(9.0)
    assert trace.peak_activation_bytes == (6.0,)


def test_reload_without_offload_is_rejected() -> None:
    with pytest.raises(ScheduleValidationError, match="never offloaded"):
        simulate(_sched("# t ranks=1 microbatches=1 layout=0\n0: 0F0 0RELOAD0 0B0"), SimCosts.uniform(num_stages=1))


def test_backward_of_evicted_microbatch_without_load_is_rejected() -> None:
    text = ("# bp ranks=2 microbatches=1 layout=0,1\n0: 0F0 0SEND_F0@1 0EVICT0@1 0RECV_B0@1 0B0 0LOAD0@1\n"
            "1: 0ACCEPT0@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 0RETURN0@0")
    with pytest.raises(ScheduleValidationError, match="no load brings back"):
        simulate(Schedule.from_text(text), SimCosts.uniform(num_stages=2))


# BPipe rule shared with the runtime: a rank's EVICTs land (sent, local copy freed) before its next F or R.
_EVICT_THEN_F = ("# bp ranks=2 microbatches=2 layout=0,1\n"
                 "0: 0F0 0SEND_F0@1 0EVICT0@1 0F1 0SEND_F1@1 0RECV_B1@1 0B1 0LOAD0@1 0RECV_B0@1 0B0\n"
                 "1: 0ACCEPT0@0 1RECV_F0@0 1F0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 0RETURN0@0 1B0 1SEND_B0@0")


def _evict_costs(bandwidth: float) -> SimCosts:
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=4, output_bytes=0)
    return SimCosts.from_stages([stage, stage], default_link=Link(bandwidth_bytes_per_s=bandwidth))


def test_forward_waits_for_the_eviction_before_it() -> None:
    trace = simulate(Schedule.from_text(_EVICT_THEN_F), _evict_costs(1.0))
    evict = next(t for t in trace.transfers if t.kind is K.EVICT)
    assert (evict.start, evict.end) == pytest.approx((1.0, 5.0))  # 4 bytes at 1 B/s after 0F0
    f1 = next(rec for rec in trace.records(0) if str(rec.action) == "0F1")
    assert f1.start == pytest.approx(5.0)  # not 1.0: the room is made first
    assert evict.exposed_s == pytest.approx(4.0)
    assert trace.exposed_transfers[0] == evict
    assert trace.peak_activation_bytes[0] == pytest.approx(4.0)  # one unit at a time, never two
    assert trace.memory[0].points[:3] == ((0, 0), (0, 4), (5, 4))  # freed and re-allocated at 5


def test_free_eviction_costs_no_time() -> None:
    trace = simulate(Schedule.from_text(_EVICT_THEN_F), _evict_costs(float("inf")))
    f1 = next(rec for rec in trace.records(0) if str(rec.action) == "0F1")
    assert f1.start == pytest.approx(1.0)
    assert trace.exposed_transfer_time == 0.0
    assert trace.peak_activation_bytes[0] == pytest.approx(4.0)


def test_eviction_overlaps_backward() -> None:
    # EVICT1 is followed by a backward, which does not wait for it; only the later F2 does
    text = ("# bp ranks=2 microbatches=3 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0EVICT1@1 0RECV_B0@1 0B0 0F2 0SEND_F2@1 0LOAD1@1 0RECV_B1@1 0B1 "
            "0RECV_B2@1 0B2\n"
            "1: 0ACCEPT1@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 0RETURN1@0 1RECV_F2@0 1F2 1B2 "
            "1SEND_B2@0")
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=6, output_bytes=0)
    trace = simulate(Schedule.from_text(text), SimCosts.from_stages([stage, stage],
                                                                    default_link=Link(bandwidth_bytes_per_s=1)))
    recs = {str(rec.action): rec for rec in trace.records(0)}
    evict = next(t for t in trace.transfers if t.kind is K.EVICT)
    assert (evict.start, evict.end) == pytest.approx((2.0, 8.0))
    assert recs["0B0"].start == pytest.approx(4.0)  # 1F0 [1,2], 1B0 [2,4]: B0 runs during the eviction
    assert recs["0B0"].end < evict.end
    assert recs["0F2"].start == pytest.approx(8.0)  # B0 ends at 6; F2 waits two more for the eviction
    assert evict.exposed_s == pytest.approx(2.0)


@pytest.mark.parametrize("act_latency,exposed", [(0.0, (1.5, 1.5)), (2.5, (0.0, 0.5)), (4.0, (0.0, 0.0))])
def test_gate_delay_is_split_among_evictions_and_not_charged_for_late_inputs(
        act_latency: float, exposed: tuple[float, float]) -> None:
    # rank 1 evicts two units to rank 0 back to back (one link, so they queue), then runs F2
    text = ("# bp ranks=2 microbatches=3 layout=0,1\n"
            "0: 1ACCEPT0@1 1ACCEPT1@1 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0F2 0SEND_F2@1 1RETURN0@1 1RETURN1@1 "
            "0RECV_B2@1 0B2 0RECV_B0@1 0B0 0RECV_B1@1 0B1\n"
            "1: 1RECV_F0@0 1F0 1RECV_F1@0 1F1 1EVICT0@0 1EVICT1@0 1RECV_F2@0 1F2 1B2 1SEND_B2@0 1LOAD0@0 1LOAD1@0 "
            "1B0 1SEND_B0@0 1B1 1SEND_B1@0")
    first = StageCosts(forward=1, backward_input=1, activation_bytes=0, output_bytes=0)
    second = StageCosts(forward=1, backward_input=1, activation_bytes=1.5, output_bytes=0)
    links = {(0, 1): Link(latency_s=act_latency)}  # activations 0 -> 1; evictions 1 -> 0 take 1.5 each
    trace = simulate(Schedule.from_text(text), SimCosts.from_stages(
        [first, second], default_link=Link(bandwidth_bytes_per_s=1), links=links))
    recs = {str(rec.action): rec for rec in trace.records(1)}
    e0, e1 = sorted((t for t in trace.transfers if t.kind is K.EVICT), key=lambda t: t.microbatch)
    input_at = next(t.end for t in trace.transfers if t.kind is K.SEND_F and t.microbatch == 2)
    assert e1.start == pytest.approx(e0.end) and e1.end - e1.start == pytest.approx(1.5)
    assert recs["1F2"].start == pytest.approx(max(e1.end, input_at))
    # (a receive moves only once posted, i.e. after the rank's previous compute)
    # latency 0: input at 3, evictions [3,4.5] [4.5,6]: the 3 s wait is split 1.5 + 1.5, not 1.5 + 3;
    # latency 2.5: input at 10.5, evictions [8,9.5] [9.5,11]: only the last 0.5 s is the evictions' fault;
    # latency 4: input at 15 after both evictions landed (at 14): nothing is theirs
    assert (e0.exposed_s, e1.exposed_s) == pytest.approx(exposed)
    assert recs["1F2"].start - max(recs["1F1"].end, input_at) == pytest.approx(sum(exposed))


def test_recompute_waits_for_the_eviction_before_it() -> None:
    text = ("# bp ranks=2 microbatches=2 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0EVICT1@1 0RECV_B0@1 0R0 0B0 0LOAD1@1 0RECV_B1@1 0R1 0B1\n"
            "1: 0ACCEPT1@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 0RETURN1@0")
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=8, checkpoint_bytes=8, output_bytes=0)
    trace = simulate(Schedule.from_text(text), SimCosts.from_stages([stage, stage],
                                                                    default_link=Link(bandwidth_bytes_per_s=1)))
    recs = {str(rec.action): rec for rec in trace.records(0)}
    evict = next(t for t in trace.transfers if t.kind is K.EVICT)
    assert (evict.start, evict.end) == pytest.approx((2.0, 10.0))  # the checkpoint: 8 bytes at 1 B/s
    assert recs["0R0"].start == pytest.approx(10.0)  # ready at 2 (R needs no message); waited for the eviction
    assert evict.exposed_s == pytest.approx(8.0)


_CHAIN = ("# t ranks=2 microbatches=1 layout=0,1\n0: 0F0 0SEND_F0@1 0RECV_B0@1 0B0\n"
          "1: 1RECV_F0@0 1F0 1B0 1SEND_B0@0")


@pytest.mark.parametrize("work", [0.0, 0.25, 1.0])
def test_transfer_cpu_work_delays_the_next_compute_on_both_ends(work: float) -> None:
    # a free link, but each end spends ``work`` seconds on the 100 bytes: F0 [0,1], the message charges both
    # ranks at 1, so 1F0 starts at 1 + work; the gradient at 1 + work + 3 charges both again before 0B0
    stage = StageCosts(forward=1, backward_input=2, output_bytes=100)
    costs = SimCosts.from_stages([stage, stage], default_link=Link(cpu_s_per_byte=work / 100))
    trace = simulate(Schedule.from_text(_CHAIN), costs)
    starts = {(rec.rank, rec.action.kind): rec.start for r in range(2) for rec in trace.records(r)}
    assert starts[(1, K.FORWARD)] == pytest.approx(1 + work)
    assert starts[(0, K.BACKWARD)] == pytest.approx(4 + 2 * work)
    assert trace.step_time == pytest.approx(6 + 2 * work)
    assert costs.charges_cpu == (work > 0)


def test_transfer_cpu_work_waits_for_the_running_compute() -> None:
    # rank 1's forward takes 3 s; the second message lands at 2.5 while 1F0 runs [1.5, 4.5]: its 0.5 s of
    # copying on rank 1 comes after 1F0, so 1F1 starts at 5.0 (at 4.0 with a link that charges nothing)
    text = ("# t ranks=2 microbatches=2 layout=0,1\n"
            "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0RECV_B1@1 0B1 0RECV_B0@1 0B0\n"
            "1: 1RECV_F0@0 1F0 1RECV_F1@0 1F1 1B1 1SEND_B1@0 1B0 1SEND_B0@0")
    stages = [StageCosts(forward=1, backward_input=2, output_bytes=100),
              StageCosts(forward=3, backward_input=2, output_bytes=100)]

    def f1_start(link: Link) -> float:
        trace = simulate(Schedule.from_text(text), SimCosts.from_stages(stages, default_link=link))
        recs = [rec for rec in trace.records(1) if rec.action.kind is K.FORWARD]
        assert recs[0].start == pytest.approx(1.5 if link.cpu_s_per_byte else 1.0)
        return recs[1].start
    assert f1_start(Link()) == pytest.approx(4.0)  # 1F0 [1, 4], the second message arrived at 2
    assert f1_start(Link(cpu_s_per_byte=0.005)) == pytest.approx(5.0)


def test_cpu_charging_links_are_simulated_by_the_engine() -> None:
    sched = one_f_one_b(3, 5)
    costs = SimCosts.uniform(num_stages=3, output_bytes=10, link=Link(latency_s=0.1, cpu_s_per_byte=0.02))
    from evenpipe.sim.engine import simulate_events
    from evenpipe.sim.fast import simulate_fast
    from evenpipe.sim.free import simulate_free
    assert simulate_fast(sched, costs) is None and simulate_free(sched, costs) is None
    assert simulate(sched, costs).step_time == simulate_events(sched, costs).step_time
    free = simulate(sched, SimCosts.uniform(num_stages=3, output_bytes=10, link=Link(latency_s=0.1)))
    assert simulate(sched, costs).step_time > free.step_time


@pytest.mark.parametrize("bad", [-1e-9, float("inf"), float("nan")])
def test_bad_cpu_charge_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="cpu_s_per_byte"):
        Link(cpu_s_per_byte=bad)


@pytest.mark.parametrize("family, chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1),
                                            ("bpipe", 1)])
def test_a_receive_posted_after_its_send_costs_the_links_late_receive_time(family: str, chunks: int) -> None:
    """Every message whose receive was posted after its send takes ``late_receive_s`` longer than its link time,
    every other message exactly its link time; the step is no shorter for it."""
    from evenpipe.schedule import build_schedule
    sched = build_schedule(family, num_ranks=4, num_microbatches=8, num_chunks=chunks)
    stages = [StageCosts(forward=1.0 + 0.2 * (s % 3), backward_input=2.0, activation_bytes=10.0, output_bytes=20.0)
              for s in range(sched.num_stages)]
    plain = Link(latency_s=0.1, bandwidth_bytes_per_s=200.0)
    late = Link(latency_s=0.1, bandwidth_bytes_per_s=200.0, late_receive_s=0.7)
    trace = simulate(sched, SimCosts.from_stages(stages, default_link=late))
    posted = {}
    for acts in trace.actions:
        for rec in acts:
            if rec.action.kind.is_transfer:
                posted.setdefault((rec.rank, rec.end, rec.action.microbatch), []).append(rec)
    seen = {True: 0, False: 0}
    for x in trace.transfers:
        if x.src == x.dst:
            continue
        send = [r for r in posted[(x.src, x.end, x.microbatch)] if r.action.kind.name in
                ("SEND_F", "SEND_B", "EVICT", "RETURN")]
        recv = [r for r in posted[(x.dst, x.end, x.microbatch)] if r.action.kind.name in
                ("RECV_F", "RECV_B", "ACCEPT", "LOAD")]
        assert len(send) == 1 and len(recv) == 1, x
        was_late = recv[0].start > send[0].start
        seen[was_late] += 1
        assert x.end - x.start == pytest.approx(plain.transfer_time(x.num_bytes) + (0.7 if was_late else 0.0))
    assert seen[True] and seen[False]  # both kinds occur, so the test checks both
    assert trace.step_time >= simulate(sched, SimCosts.from_stages(stages, default_link=plain)).step_time


def test_a_negative_late_receive_time_is_refused() -> None:
    with pytest.raises(ConfigError, match="late_receive_s"):
        Link(late_receive_s=-1.0)
