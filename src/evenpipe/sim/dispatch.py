"""The simulator's one entry: an ordered list of evaluators; the first that applies and vouches for its answer wins.

Every evaluator computes the event engine's trace (:mod:`evenpipe.sim.engine`, the reference) exactly, by a
quicker route where the schedule and costs allow one: ``free`` times instant links over computes alone
(:mod:`evenpipe.sim.free`), ``links`` evaluates a validated schedule in one pass (:mod:`evenpipe.sim.links`),
``fast`` evaluates a compiled dataflow (:mod:`evenpipe.sim.fast`), and ``events`` runs the event engine, which
answers everything. ``applies`` is a cheap look at the schedule and costs; an evaluator may still decline while it
runs (:class:`~evenpipe.sim.kernel.CannotVouch`). The trace names its evaluator (``Trace.evaluator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from evenpipe.schedule.ir import Schedule
from evenpipe.sim import engine, fast, free, links
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.kernel import CannotVouch, gc_paused
from evenpipe.sim.trace import Trace

__all__ = ["Evaluator", "EVALUATORS", "simulate"]


@dataclass(frozen=True, slots=True)
class Evaluator:
    """One way to compute a schedule's trace."""

    name: str
    """Its name in ``Trace.evaluator``."""
    applies: Callable[[Schedule, SimCosts], bool]
    """Whether it takes this schedule under these costs (a cheap check)."""
    run: Callable[[Schedule, SimCosts], Trace]
    """The trace; raises :class:`~evenpipe.sim.kernel.CannotVouch` where it cannot vouch for the engine's."""


def _always(schedule: Schedule, costs: SimCosts) -> bool:
    return True


EVALUATORS: tuple[Evaluator, ...] = (
    Evaluator(free.NAME, free.applies, free.run),
    Evaluator(links.NAME, links.applies, links.run),
    Evaluator(fast.NAME, fast.applies, fast.run),
    Evaluator(engine.NAME, _always, engine.run),
)
"""In the order they are tried: quickest first, the reference last."""


def simulate(schedule: Schedule, costs: SimCosts) -> Trace:
    """Simulate one step of ``schedule`` and return its :class:`~evenpipe.sim.trace.Trace`, made by the first
    evaluator of :data:`EVALUATORS` that applies and vouches for its answer.

    Raises :class:`~evenpipe.errors.ScheduleValidationError` for unmatched transfers or a schedule that deadlocks,
    and :class:`~evenpipe.errors.ConfigError` when ``costs`` does not describe every stage.
    """
    with gc_paused():  # first, before anything allocates: no collection starts inside a simulation
        engine.check_costs(schedule, costs)
        for evaluator in EVALUATORS:
            if evaluator.applies(schedule, costs):
                try:
                    return evaluator.run(schedule, costs)
                except CannotVouch:
                    continue
    raise AssertionError("the event engine answers every schedule")
