"""What a failed rank's one line says it was doing when a peer went away."""

from __future__ import annotations

from evenpipe.runtime.comm import PeerFailure
from evenpipe.training.fault import Watchdog


def test_a_failure_while_waiting_names_the_wait_and_the_reason() -> None:
    dog = Watchdog(rank=1, timeout_s=60.0, status_dir=None)
    dog.begin_wait("RECV_B stage 1 mb 0", 2)
    line = dog.describe_failure(PeerFailure("Connection closed by peer"))
    assert line.startswith("waited 0 s for RECV_B stage 1 mb 0 from rank 2") and "the peer closed" in line


def test_a_failure_while_posting_names_the_transfer_posted() -> None:
    """A send to a peer that is gone fails as it is posted: no wait is pending, so the line names the post."""
    dog = Watchdog(rank=1, timeout_s=60.0, status_dir=None)
    error = PeerFailure("posting SEND_F stage 1 mb 3 to rank 2 failed: Connection reset by peer",
                        posting="SEND_F stage 1 mb 3 to rank 2")
    assert dog.describe_failure(error) == "posting SEND_F stage 1 mb 3 to rank 2 failed (the peer closed the connection)"
    assert dog.describe_failure(PeerFailure("Broken pipe")) == "the peer closed the connection"


def test_a_collective_is_not_named_after_rank_minus_one() -> None:
    watch = Watchdog(rank=1, timeout_s=10.0, status_dir=None)
    watch.begin_wait("the gradient-norm all-reduce", -1)
    watch.end_wait()
    assert watch.describe().endswith("after the gradient-norm all-reduce (in a collective)"), watch.describe()
    watch.begin_wait("RECV_F stage 1 mb 0", 0)
    watch.end_wait()
    assert "after RECV_F stage 1 mb 0 (rank 0)" in watch.describe()
