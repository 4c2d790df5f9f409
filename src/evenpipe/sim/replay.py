"""Replay a measured step: its schedule simulated with every compute taking the time it took when measured.

A prediction misses a measured step for two reasons: the computes took longer or shorter than the cost model
said (the host's speed, the model's fit), or the waits between them did (messages, the runtime's own work).
Replaying the measured compute times through the simulator, with the cost model's links and bytes, separates
them: the replay's error against the measurement is what the communication model leaves, and the prediction's
error against the replay is what the compute times do. Pure: no torch, no I/O.
"""

from __future__ import annotations

from evenpipe.errors import ConfigError
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.engine import simulate_events
from evenpipe.sim.trace import Trace

__all__ = ["replay"]


def replay(measured: Trace, costs: SimCosts) -> Trace:
    """Simulate ``measured.schedule`` under ``costs`` with each compute taking its measured duration.

    Raises :class:`ConfigError` when the trace lacks a compute of its schedule (a trace of another schedule)."""
    sched = measured.schedule
    took = {(rec.rank, rec.action): rec.end - rec.start
            for acts in measured.actions for rec in acts if not rec.action.kind.is_transfer}
    durations: dict[tuple[int, int], float] = {}
    for r, acts in enumerate(sched.actions):
        for i, a in enumerate(acts):
            if a.kind.is_transfer:
                continue
            if (r, a) not in took:
                raise ConfigError(f"the measured trace has no {a} on rank {r}: it is not a trace of schedule "
                                  f"{sched.name!r}")
            durations[(r, i)] = max(0.0, took[(r, a)])
    return simulate_events(sched, costs, durations=durations)
