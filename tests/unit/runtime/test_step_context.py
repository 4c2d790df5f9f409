"""The executor's handler registry and message tags (runtime/step_context.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from evenpipe.runtime.bpipe import BPIPE_KINDS  # noqa: E402
from evenpipe.runtime.executor import _dispatch  # noqa: E402
from evenpipe.runtime.step_context import (HANDSHAKE_TAG, Handler, Phase, message_tag,  # noqa: E402
                                           register_handler)
from evenpipe.schedule import ActionKind, build_schedule  # noqa: E402
from evenpipe.schedule.ir import MATCHING_RECV  # noqa: E402

K = ActionKind
_PIPE = {K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B}


def test_every_kind_has_one_handler_of_its_owner() -> None:
    table = _dispatch()
    for k in ActionKind:
        h = table[k.code]
        assert h is not None, k
        assert h.owner == ("bpipe" if k in BPIPE_KINDS else "executor"), k
        assert h.phase.posts == k.is_transfer, k  # messages are posted; computes and host moves run
        assert (h.phase is Phase.PIPE_MESSAGE) == (k in _PIPE), k


def test_a_kind_registers_once_and_a_handler_matches_its_phase() -> None:
    with pytest.raises(AssertionError, match="registered twice"):
        register_handler(K.FORWARD, Handler(owner="test", phase=Phase.COMPUTE, run=lambda a, ctx: None))
    with pytest.raises(AssertionError, match="post only"):
        Handler(owner="test", phase=Phase.PIPE_MESSAGE, run=lambda a, ctx: None)
    with pytest.raises(AssertionError, match="run only"):
        Handler(owner="test", phase=Phase.COMPUTE, post=lambda a, ctx: [])


@pytest.mark.parametrize("family,V", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("bpipe", 1)])
def test_tags_pair_each_send_with_its_receive_and_no_other(family: str, V: int) -> None:
    """Per sender, receiver and part, a tag names exactly one message, and the receive it names is the send's
    matching receive (the other kind of the same channel, on the peer)."""
    P, M, parts = 4, 6, 3
    s = build_schedule(family, num_ranks=P, num_microbatches=M, num_chunks=V)
    sent: dict[tuple[int, int, int], object] = {}
    received: dict[tuple[int, int, int], object] = {}
    for r, _, a in s.iter_actions():
        if not a.kind.is_transfer:
            continue
        for part in range(parts):
            tag = message_tag(a, rank=r, num_stages=s.num_stages, num_microbatches=M, part=part, num_parts=parts)
            assert 0 <= tag < HANDSHAKE_TAG
            assert a.peer is not None
            src, dst = (r, a.peer) if a.kind in MATCHING_RECV else (a.peer, r)
            book = sent if a.kind in MATCHING_RECV else received
            assert (src, dst, tag) not in book, f"{a} on rank {r} reuses tag {tag} of {book[(src, dst, tag)]}"
            book[(src, dst, tag)] = (r, a)
    assert sent.keys() == received.keys()
    for key, (r, a) in sent.items():  # type: ignore[misc]
        rr, ra = received[key]  # type: ignore[misc]
        assert MATCHING_RECV[a.kind] is ra.kind and rr == a.peer and ra.microbatch == a.microbatch


def test_tag_parts_stay_inside_their_message() -> None:
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    a = next(a for a in s.actions[0] if a.kind is K.SEND_F)
    with pytest.raises(AssertionError):
        message_tag(a, rank=0, num_stages=2, num_microbatches=2, part=1, num_parts=1)
