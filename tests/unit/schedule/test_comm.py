"""Derived communication: one message per cross-rank edge, nothing for same-rank neighbours, idempotent."""

from __future__ import annotations

import pytest

from evenpipe.schedule import ActionKind, build_schedule, derive_communication, message_key, validate
from evenpipe.schedule.witness import witness_timing

K = ActionKind


@pytest.mark.parametrize("family,V", [("1f1b", 1), ("interleaved", 2), ("looped-bfs", 3), ("zb-h1", 1),
                                      ("bpipe", 1)])
def test_one_message_per_cross_rank_edge(family: str, V: int) -> None:
    P, M = 4, 8
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V)
    S = s.num_stages
    sends = [(r, a) for r, _, a in s.iter_actions() if a.kind in (K.SEND_F, K.SEND_B)]
    recvs = [(r, a) for r, _, a in s.iter_actions() if a.kind in (K.RECV_F, K.RECV_B)]
    assert len(sends) == len(recvs) == 2 * (S - 1) * M  # every boundary is cross-rank when P > 1
    assert sorted(message_key(r, a) for r, a in sends) == sorted(message_key(r, a) for r, a in recvs)
    for r, a in sends:
        if a.kind is K.SEND_F:
            assert a.peer == s.rank_of(a.stage + 1)
        else:
            assert a.peer == s.rank_of(a.stage - 1)


def test_same_rank_neighbours_need_no_message() -> None:
    s = build_schedule("looped-bfs", num_ranks=1, num_microbatches=3, num_chunks=4)
    assert s.num_stages == 4 and all(a.kind.is_compute for acts in s.actions for a in acts)


def test_idempotent_and_keeps_compute_order() -> None:
    full = build_schedule("bpipe", num_ranks=5, num_microbatches=9)
    again = derive_communication(full)
    assert again.actions == full.actions
    one = build_schedule("1f1b", num_ranks=3, num_microbatches=5)
    derived = derive_communication(one.compute_only())
    assert derived.actions == one.actions and derived.compute_only().actions == one.compute_only().actions


def test_sends_follow_producer_and_receives_precede_consumer() -> None:
    s = build_schedule("interleaved", num_ranks=3, num_microbatches=6, num_chunks=2)
    for acts in s.actions:
        index = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.kind is K.RECV_F:
                assert i < index[(K.FORWARD, a.stage, a.microbatch)]
            if a.kind is K.SEND_F:
                assert i > index[(K.FORWARD, a.stage, a.microbatch)]
            if a.kind is K.RECV_B:
                assert i < index[(K.BACKWARD, a.stage, a.microbatch)]


def test_derived_bpipe_keeps_evict_after_forward_send() -> None:
    s = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    acts = s.actions[0]
    for i, a in enumerate(acts):
        if a.kind is K.EVICT:
            before = [str(b) for b in acts[:i]]
            assert f"0SEND_F{a.microbatch}@1" in before
    validate(s)


GOLDEN_1F1B_P2_M3 = """\
# 1f1b ranks=2 microbatches=3 layout=0,1
0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0RECV_B0@1 0B0 0F2 0SEND_F2@1 0RECV_B1@1 0B1 0RECV_B2@1 0B2
1: 1RECV_F0@0 1F0 1RECV_F1@0 1B0 1SEND_B0@0 1F1 1B1 1RECV_F2@0 1SEND_B1@0 1F2 1B2 1SEND_B2@0
"""

GOLDEN_BPIPE_P4_M4_RANK0 = ("0F0 0SEND_F0@1 0F1 0SEND_F1@1 0F2 0SEND_F2@1 0EVICT2@3 0F3 0SEND_F3@1 0RECV_B0@1 "
                            "0EVICT3@3 0B0 0RECV_B1@1 0LOAD2@3 0B1 0RECV_B2@1 0LOAD3@3 0B2 0RECV_B3@1 0B3")


GOLDEN_BPIPE_P5_M7_RANK4 = ("0ACCEPT2@0 4RECV_F0@3 0ACCEPT3@0 4F0 4RECV_F1@3 4B0 4SEND_B0@3 4F1 4B1 4RECV_F2@3 "
                            "4SEND_B1@3 4F2 4B2 4RECV_F3@3 4SEND_B2@3 4F3 4B3 4RECV_F4@3 4SEND_B3@3 4F4 0RETURN2@0 "
                            "0ACCEPT5@0 4B4 4RECV_F5@3 4SEND_B4@3 4F5 4B5 4RECV_F6@3 4SEND_B5@3 0RETURN3@0 4F6 4B6 "
                            "4SEND_B6@3 0RETURN5@0")


def test_golden_full_schedules() -> None:
    # pins the derived order the runtime executes; a change here is a change of wire protocol
    assert build_schedule("1f1b", num_ranks=2, num_microbatches=3).to_text() == GOLDEN_1F1B_P2_M3
    rank0 = build_schedule("bpipe", num_ranks=4, num_microbatches=4).actions[0]
    assert " ".join(str(a) for a in rank0) == GOLDEN_BPIPE_P4_M4_RANK0
    # an acceptor of an odd P: RETURN2/ACCEPT5 are posted ahead of 4B4, during which rank 0 evicts 5
    rank4 = build_schedule("bpipe", num_ranks=5, num_microbatches=7).actions[4]
    assert " ".join(str(a) for a in rank4) == GOLDEN_BPIPE_P5_M7_RANK4


@pytest.mark.parametrize("P,M", [(3, 7), (5, 10), (6, 13), (7, 15), (8, 20)])
def test_accept_is_posted_before_a_backward_running_when_the_eviction_is_due(P: int, M: int) -> None:
    # the evictor's next forward waits for its eviction to land, which needs the ACCEPT posted: the acceptor
    # must not sit in a backward (listed before the ACCEPT) at the witness time of the eviction
    s = build_schedule("bpipe", num_ranks=P, num_microbatches=M)
    timing = witness_timing(s)
    due: dict[tuple[int, int], int] = {}  # (stage, mb) -> witness start of the evictor's compute after EVICT
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind is K.EVICT:
                due[a.key] = next(timing.start[r][j] for j in range(i + 1, len(acts)) if acts[j].kind.is_compute)
    checked = 0
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if a.kind is not K.ACCEPT:
                continue
            t = due[a.key]
            for j in range(i):
                if acts[j].kind in (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
                    assert not timing.start[r][j] < t < timing.finish[r][j], (r, str(a), str(acts[j]))
            checked += 1
    assert checked > 0


def test_each_pair_posts_in_the_same_order() -> None:
    # FIFO point-to-point channels (gloo, NCCL) match the k-th send from a to b with the k-th receive on b
    for family, V, P in (("1f1b", 1, 5), ("interleaved", 3, 5), ("zb-h1", 1, 5), ("bpipe", 1, 5), ("bpipe", 1, 7),
                         ("looped-bfs", 2, 5)):
        s = build_schedule(family, num_ranks=P, num_microbatches=2 * P, num_chunks=V)
        sent: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        received: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for r, _, a in s.iter_actions():
            if a.kind.is_send:
                sent.setdefault((r, a.peer or 0), []).append(message_key(r, a))
            elif a.kind.is_recv:
                received.setdefault((a.peer or 0, r), []).append(message_key(r, a))
        assert sent == received


@pytest.mark.parametrize("family", ["bpipe", "1f1b", "zb-h1"])
def test_reused_witness_equals_timing_the_marked_schedule(family: str) -> None:
    # BPipe's markers change no compute's witness time: the remapped timing is what timing the marked schedule
    # from scratch gives, position for position; a different compute order is not reused
    from evenpipe.schedule.witness import WITNESS_DURATIONS, _witness_timing, reuse_witness

    full = build_schedule(family, num_ranks=4, num_microbatches=9)
    compute = full.compute_only()
    marked = full.with_actions([[a for a in acts if a.kind.is_compute or a.kind.value in ("EVICT", "LOAD")]
                                for acts in full.actions])
    assert reuse_witness(marked, compute)
    assert witness_timing(marked) == _witness_timing(marked, WITNESS_DURATIONS)
    swapped = compute.with_actions([list(acts[::-1]) if r == 1 else list(acts)
                                    for r, acts in enumerate(compute.actions)])
    assert not reuse_witness(swapped, compute)
