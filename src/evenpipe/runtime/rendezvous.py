"""The rendezvous of a job's worker processes: whether torchrun already placed this process, and a store that
the launching process hosts for its workers (used by ``evenpipe train``'s launcher and by the profiler).

As torchrun's agent does, the launching process hosts the workers' rendezvous store, on a port the kernel picks
when the store binds it, and every worker, rank 0 included, joins it as a client. No other process can take the
port between its choice and its use, which it could when rank 0 listened on a port found free a moment before.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Iterator

__all__ = ["under_torchrun", "hosted_rendezvous", "AGENT_STORE_ENV"]


def under_torchrun() -> bool:
    """True when torchrun (or another launcher) already set this process's RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's switch (read by its ``env://`` and ``tcp://`` rendezvous) that makes every rank a client of a store
hosted elsewhere."""


@contextlib.contextmanager
def hosted_rendezvous(world_size: int) -> Iterator[int]:
    """Host a rendezvous store for ``world_size`` workers in this process while the block runs; yields its port.

    The store binds a port the kernel picks and keeps it; while the block runs, this process's environment sets
    :data:`AGENT_STORE_ENV`, so the workers started inside (which inherit it) join the store as clients instead
    of rank 0 listening on the port itself. The environment is restored afterwards."""
    import torch.distributed as dist
    store: Any = dist.TCPStore("127.0.0.1", 0, world_size=world_size, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=600))
    before = os.environ.get(AGENT_STORE_ENV)
    os.environ[AGENT_STORE_ENV] = "True"
    try:
        yield int(store.port)
    finally:
        if before is None:
            os.environ.pop(AGENT_STORE_ENV, None)
        else:
            os.environ[AGENT_STORE_ENV] = before
        del store
