"""The named-collective and flat-buffer helpers every gradient and loss reduction goes through."""

from __future__ import annotations

import pytest
import torch

from evenpipe.runtime import comm
from evenpipe.runtime.comm import PeerFailure, collective, through_flat


def test_through_flat_runs_once_on_one_buffer_and_copies_back_in_place() -> None:
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([10.0, 20.0])
    seen: list[torch.Tensor] = []

    def double(flat: torch.Tensor) -> None:
        seen.append(flat.clone())
        flat *= 2

    ids = (id(a), id(b))
    through_flat([a, b], double)
    assert len(seen) == 1 and seen[0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
    assert (id(a), id(b)) == ids
    assert a.tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]] and b.tolist() == [20.0, 40.0]


def test_through_flat_reduces_in_the_given_dtype_and_keeps_each_tensors_own() -> None:
    half = torch.full((4,), 1.0 + 2.0 ** -8, dtype=torch.bfloat16)  # not representable: rounds to 1.0 in bf16
    dtypes: list[torch.dtype] = []

    def record(flat: torch.Tensor) -> None:
        dtypes.append(flat.dtype)
        flat += 0.5

    through_flat([half], record, dtype=torch.float32)
    assert dtypes == [torch.float32] and half.dtype == torch.bfloat16 and half.tolist() == [1.5] * 4
    through_flat([], record)  # nothing to reduce: the collective is not run
    assert dtypes == [torch.float32]


def test_collective_names_the_failed_call_and_reports_its_wait() -> None:
    events: list[tuple[str, str, int]] = []

    class Observer:
        def begin_wait(self, what: str, peer: int) -> None:
            events.append(("begin", what, peer))

        def end_wait(self) -> None:
            events.append(("end", "", -1))

    comm.observe_waits(Observer())
    try:
        with collective("the loss broadcast", 3):
            pass
        with pytest.raises(PeerFailure, match=r"^rank 0: the loss broadcast failed: Connection closed by peer$"):
            with collective("the loss broadcast", 3):
                raise RuntimeError("Connection closed by peer\nC++ stack ...")
        with pytest.raises(PeerFailure, match="^already named$"):  # a PeerFailure passes through as it is
            with collective("the loss broadcast"):
                raise PeerFailure("already named")
    finally:
        comm.observe_waits(None)
    assert events[:2] == [("begin", "the loss broadcast", 3), ("end", "", -1)]
    assert events[2] == ("begin", "the loss broadcast", 3)


class _Work:
    """A gloo-like work: completes when waited, or when told it arrived."""

    def __init__(self, name: str, log: list[str], *, arrived: bool = False) -> None:
        self.name, self.log, self.arrived = name, log, arrived

    def wait(self, timeout: object = None) -> bool:
        self.log.append(self.name)
        self.arrived = True
        return True

    def is_completed(self) -> bool:
        return self.arrived


def _batch(log: list[str]) -> tuple[comm.PendingBatch, torch.Tensor, torch.Tensor]:
    now, later = torch.empty(2), torch.empty(2)
    transfers = [comm.Transfer(send=False, tensor=now, peer=1, group=None, what="RECV_B stage 1 mb 0"),
                 comm.Transfer(send=False, tensor=later, peer=1, group=None, what="RECV_F stage 1 mb 3")]
    return comm.PendingBatch([_Work("now", log), _Work("later", log)], transfers, 60.0), now, later


def test_a_receive_waits_for_itself_not_for_the_batch_it_was_posted_in() -> None:
    """Two receives posted together (one for the next compute, one for a later one): taking the first must not
    wait for the second's sender; the batch reports completion once both have arrived."""
    log: list[str] = []
    batch, now, later = _batch(log)
    stamps: list[tuple[float, float]] = []
    batch.observe(lambda start, end: stamps.append((start, end)))
    batch.wait_for(now)
    assert log == ["now"] and not batch.done and stamps == []
    batch.works[1].arrived = True  # the later message lands; the next poll sees the batch complete
    batch.wait_for(later)
    assert log == ["now", "later"] and len(stamps) == 1


def test_a_coalesced_batch_or_an_unknown_buffer_is_waited_whole() -> None:
    log: list[str] = []
    batch, now, _ = _batch(log)
    batch.wait_for(torch.empty(2))  # not one of its buffers
    assert log == ["now", "later"] and batch.done
    log2: list[str] = []
    one = comm.PendingBatch([_Work("all", log2)], _batch([])[0].transfers, 60.0)  # NCCL: one work for all
    one.wait_for(one.transfers[0].tensor)
    assert log2 == ["all"] and one.done


def test_a_receives_observer_fires_when_that_receive_is_waited_not_when_its_batch_completes() -> None:
    """gloo reports a send complete only once it is waited, which the executor does a compute later than it
    waits for a receive of the same batch: a trace that stamped the receive when the whole batch completed put
    its arrival after the compute that consumed it, and that compute's wait counted as computing."""
    log: list[str] = []
    send_buf, recv_buf = torch.empty(2), torch.empty(2)
    transfers = [comm.Transfer(send=True, tensor=send_buf, peer=1, group=None, what="SEND_F stage 0 mb 1"),
                 comm.Transfer(send=False, tensor=recv_buf, peer=1, group=None, what="RECV_B stage 0 mb 0")]
    batch = comm.PendingBatch([_Work("send", log), _Work("recv", log)], transfers, 60.0)
    recv_stamps: list[tuple[float, float]] = []
    whole: list[tuple[float, float]] = []
    batch.observe(lambda start, end: recv_stamps.append((start, end)), recv_buf)
    batch.observe(lambda start, end: whole.append((start, end)))
    batch.wait_for(recv_buf)
    assert log == ["recv"] and len(recv_stamps) == 1 and whole == []
    start, end = recv_stamps[0]
    assert start <= end
    batch.wait_sends()  # a compute later: the send is waited, the batch is now complete
    assert batch.is_completed() and len(whole) == 1 and len(recv_stamps) == 1 and whole[0][1] >= end
