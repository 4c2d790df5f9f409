"""What this machine can hold, checked before a command starts work it could never finish (pure: no torch).

A simulation keeps every action of the schedule and every event of its trace in memory; a schedule of 100,000
ranks and 100,000 micro-batches has about 7 x 10^10 actions and would be killed for memory after minutes. It is
refused at once instead, with the estimate.
"""

from __future__ import annotations

import os

from evenpipe.errors import ConfigError

__all__ = ["available_memory_bytes", "ACTIONS_PER_STAGE_MICROBATCH", "BYTES_PER_ACTION", "check_schedule_fits"]

ACTIONS_PER_STAGE_MICROBATCH = 7
"""Actions per (stage, micro-batch) pair: forward, input and weight backward, and the sends and receives around
them (measured: 6.0 for 1F1B and interleaved, 7.0 for zb-h1 at P=128, M=512)."""
BYTES_PER_ACTION = 300
"""Memory per action of a simulated schedule, its trace events included (measured: about 210 bytes for 1F1B,
P=128, M=512, 0.4 million actions; rounded up)."""


def available_memory_bytes() -> int:
    """Memory this machine can give now (MemAvailable; the physical memory where /proc is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_schedule_fits(*, num_ranks: int, num_chunks: int, num_microbatches: int) -> None:
    """Refuse (ConfigError, one line, with the estimate) a schedule whose simulation cannot fit in memory."""
    actions = ACTIONS_PER_STAGE_MICROBATCH * num_ranks * num_chunks * num_microbatches
    need, have = actions * BYTES_PER_ACTION, available_memory_bytes()
    if need > have:
        raise ConfigError(f"a schedule of {num_ranks} ranks x {num_chunks} chunk(s) x {num_microbatches} "
                          f"micro-batches is about {actions:.2g} actions, needing about {need / 2**30:,.0f} GiB to "
                          f"simulate, but this machine has {have / 2**30:.1f} GiB available; use fewer pipeline "
                          "ranks or micro-batches")
