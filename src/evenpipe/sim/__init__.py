"""Pure-Python simulation of pipeline schedules: time, transfers and activation memory (no torch)."""

from evenpipe.sim.costs import Link, SimCosts, StageCosts
from evenpipe.sim.dispatch import simulate
from evenpipe.sim.trace import ActionRecord, MemoryTimeline, SimResult, Trace, TransferRecord

__all__ = ["Link", "SimCosts", "StageCosts", "simulate", "ActionRecord", "MemoryTimeline", "SimResult", "Trace",
           "TransferRecord"]
