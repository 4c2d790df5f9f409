"""Derived communication: one message per cross-rank edge, nothing for same-rank neighbours, idempotent."""

from __future__ import annotations

import pytest

from evenpipe.schedule import ActionKind, build_schedule, derive_communication, message_key, validate

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
