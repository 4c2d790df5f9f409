"""The launcher hosts the workers' rendezvous store on a port it holds from before the first worker starts, so no
other process can take the port in between (with rank 0 binding a port the launcher had found free a moment
before, a parallel job once did, and the job failed with EADDRINUSE)."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

import evenpipe.runtime.rendezvous as rendezvous
import evenpipe.training.launch as launch
from evenpipe.cli import main

pytestmark = pytest.mark.distributed

_TRAIN = ["train", "--model", "gpt-tiny", "--seq-len", "16", "--stages", "2", "--microbatches", "2", "--steps", "1",
          "--random-tokens", "--backend", "gloo", "--timeout", "60"]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_store_listens_before_any_worker_starts_and_the_job_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen: list[tuple[int, bool, str | None]] = []
    start = launch._start

    def checked_start(config_path: str, status_dir: str, nproc: int, port: int, procs):  # type: ignore[no-untyped-def]
        seen.append((port, _listening(port), os.environ.get(rendezvous.AGENT_STORE_ENV)))
        return start(config_path, status_dir, nproc, port, procs)

    monkeypatch.setattr(launch, "_start", checked_start)
    assert main(_TRAIN) == 0
    assert len(seen) == 1 and seen[0][1:] == (True, "True"), seen
    assert not _listening(seen[0][0])  # the store went with the job
    assert rendezvous.AGENT_STORE_ENV not in os.environ  # and the launcher's environment is as it was


def test_a_worker_joins_the_hosted_store_as_a_client() -> None:
    with rendezvous.hosted_rendezvous(2) as port:
        client = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False,
                               timeout=datetime.timedelta(seconds=30))
        client.set("probe", "1")
        assert client.get("probe") == b"1"
        del client
    assert rendezvous.AGENT_STORE_ENV not in os.environ
    os.environ[rendezvous.AGENT_STORE_ENV] = "False"
    try:
        with rendezvous.hosted_rendezvous(1):
            assert os.environ[rendezvous.AGENT_STORE_ENV] == "True"
        assert os.environ[rendezvous.AGENT_STORE_ENV] == "False"  # a value set before is put back
    finally:
        del os.environ[rendezvous.AGENT_STORE_ENV]
