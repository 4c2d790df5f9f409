"""A rendezvous port taken between the launcher picking it and rank 0 binding it (another program or a parallel
job got it first) starts the job again on another port instead of failing it; any other failure does not."""

from __future__ import annotations

import pathlib
import socket
from typing import Iterator

import pytest

import evenpipe.runtime.launch as launch
from evenpipe.cli import main

pytestmark = pytest.mark.distributed

_TRAIN = ["train", "--model", "gpt-tiny", "--seq-len", "16", "--stages", "2", "--microbatches", "2", "--steps", "1",
          "--random-tokens", "--backend", "gloo", "--timeout", "60"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process is listening on."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _first_port_taken(monkeypatch: pytest.MonkeyPatch, port: int) -> list[int]:
    handed: list[int] = []
    free = launch.free_port

    def pick() -> int:
        handed.append(port if not handed else free())
        return handed[-1]
    monkeypatch.setattr(launch, "free_port", pick)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return handed


def test_a_taken_port_starts_the_job_again(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
                                           taken_port: int) -> None:
    handed = _first_port_taken(monkeypatch, taken_port)
    assert main(_TRAIN) == 0
    err = capfd.readouterr().err
    assert len(handed) == 2 and handed[0] == taken_port != handed[1]
    assert "rendezvous port was taken before rank 0 could listen on it (attempt 1 of 3)" in err


def test_every_port_taken_fails_after_the_last_attempt(monkeypatch: pytest.MonkeyPatch,
                                                       capfd: pytest.CaptureFixture[str], taken_port: int) -> None:
    monkeypatch.setattr(launch, "free_port", lambda: taken_port)
    monkeypatch.setattr(launch, "PORT_ATTEMPTS", 2)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(_TRAIN) == 1
    err = capfd.readouterr().err
    assert err.count("starting again on another port") == 1
    rank0 = [line for line in err.splitlines() if line.startswith("evenpipe train: rank 0 ")]
    assert len(rank0) == 1 and "EADDRINUSE" in rank0[0], err


def test_a_failure_that_is_not_the_port_is_not_retried(tmp_path: pathlib.Path) -> None:
    status = tmp_path
    (status / "rank0.fault").write_text("rank 0 step 1: raised RuntimeError: boom")
    assert not launch._lost_port(str(status), 2)
    (status / "rank0.fault").write_text("rank 0 step 1: raised DistNetworkError: ... EADDRINUSE, address in use")
    assert launch._lost_port(str(status), 2)
    (status / "rank1.step").write_text("1")
    assert not launch._lost_port(str(status), 2)
