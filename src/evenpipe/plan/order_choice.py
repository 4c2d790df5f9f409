"""The order of one step's micro-batches, chosen by simulating candidates (issue 34 point 5, PipeWeaver's idea with
evenpipe's simulator).

With micro-batches of unequal work, the order they enter the pipeline moves the step: the fill waits for the first
micro-batch's forwards through every stage and the drain for the last one's backwards, so cheap micro-batches belong
at the ends (:func:`~evenpipe.plan.microbatch.pipeline_order`); where the schedule hides a long micro-batch best
depends on the family and the costs, which only a simulation says. :func:`choose_order` simulates a fixed list of
candidate orders (the given one, the cheap-ends order and its mirror, longest and shortest first), then improves the
best by swapping neighbours, and returns the fastest predicted with the given order's prediction beside it.

Deterministic by design: the number of simulations is capped by ``max_evaluations``, never by a clock, so every rank
of a pipeline that runs the chooser on the same plan picks the same order without a message. ``budget_s``
additionally stops early where a caller wants a wall-clock bound (one process only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule.ir import Schedule
from evenpipe.sim.costs import Link, SimCosts, StageCosts, FREE_LINK
from evenpipe.sim.dispatch import simulate

if TYPE_CHECKING:
    from evenpipe.plan.microbatch import Microbatch

__all__ = ["MicrobatchOrderer", "OrderChoice", "candidate_orders", "choose_order"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderChoice:
    """The chosen order of one step's micro-batches."""

    order: tuple[int, ...]
    """``order[k]`` is the index (into the given rows) of the micro-batch that runs k-th."""
    predicted_s: float
    """The chosen order's simulated step."""
    given_s: float
    """The given order's simulated step."""
    evaluations: int
    """Orders simulated."""
    seconds: float
    """Process time the choice took."""

    @property
    def gain(self) -> float:
        """``given_s / predicted_s - 1`` (0 when the given order was kept)."""
        return self.given_s / self.predicted_s - 1.0 if self.predicted_s > 0 else 0.0


def _work(row: Sequence[StageCosts]) -> float:
    return sum(c.forward + c.backward for c in row)


def candidate_orders(rows: Sequence[Sequence[StageCosts]]) -> list[tuple[int, ...]]:
    """The fixed candidates, given order first, duplicates dropped: cheap ends with the most expensive in the middle
    (and its mirror), most expensive first, cheapest first."""
    n = len(rows)
    ranked = sorted(range(n), key=lambda i: (_work(rows[i]), i))
    front, back = ranked[0::2], ranked[1::2]
    ends = tuple(front + back[::-1])
    cands = [tuple(range(n)), ends, ends[::-1], tuple(ranked[::-1]), tuple(ranked)]
    return list(dict.fromkeys(cands))


def _step(schedule: Schedule, rows: Sequence[Sequence[StageCosts]], order: Sequence[int], link: Link,
          links: dict[tuple[int, int], Link]) -> float:
    costs = SimCosts.per_microbatch([rows[i] for i in order], default_link=link, links=links)
    return simulate(schedule, costs).step_time


def choose_order(schedule: Schedule, rows: Sequence[Sequence[StageCosts]], *, link: Link = FREE_LINK,
                 links: dict[tuple[int, int], Link] | None = None, max_evaluations: int = 8,
                 budget_s: float | None = None,
                 clock: Callable[[], float] = time.process_time) -> OrderChoice:
    """The fastest simulated order of ``rows`` (``rows[m][s]``: stage ``s``'s costs for micro-batch ``m``) under
    ``schedule``, from at most ``max_evaluations`` simulations: the fixed candidates, then neighbour swaps of the
    best so far. A tie keeps the earlier candidate (the given order first). ConfigError for rows that do not match
    the schedule or a cap below 1."""
    if max_evaluations < 1:
        raise ConfigError(f"max_evaluations must be >= 1, got {max_evaluations}")
    if len(rows) != schedule.num_microbatches:
        raise ConfigError(f"the schedule runs {schedule.num_microbatches} micro-batches, got costs for {len(rows)}")
    links = dict(links or {})
    t0 = clock()
    seen: dict[tuple[int, ...], float] = {}

    def out_of_time() -> bool:
        return len(seen) >= max_evaluations or (budget_s is not None and clock() - t0 >= budget_s)

    def evaluate(order: tuple[int, ...]) -> float:
        if order not in seen:
            seen[order] = _step(schedule, rows, order, link, links)
        return seen[order]

    given = tuple(range(len(rows)))
    best, best_s = given, evaluate(given)
    for cand in candidate_orders(rows)[1:]:
        if out_of_time():
            break
        s = evaluate(cand)
        if s < best_s:
            best, best_s = cand, s
    improved = True
    while improved and not out_of_time():
        improved = False
        for k in range(len(best) - 1):
            if out_of_time():
                break
            swapped = best[:k] + (best[k + 1], best[k]) + best[k + 2:]
            if swapped in seen:
                continue
            s = evaluate(swapped)
            if s < best_s:
                best, best_s, improved = swapped, s, True
                break
    return OrderChoice(order=best, predicted_s=best_s, given_s=seen[given], evaluations=len(seen),
                       seconds=clock() - t0)


@dataclass(frozen=True, slots=True)
class MicrobatchOrderer:
    """Chooses each step's order of one replica's planned micro-batches for ``schedule`` (``train
    --microbatch-order simulated``): a micro-batch's predicted time (:class:`~evenpipe.plan.microbatch.Microbatch`
    ``.time``, any unit) is spread evenly over the stages, its backward twice its forward (input and weight
    gradients alike), its bytes likewise."""

    schedule: Schedule
    max_evaluations: int = 8

    def choose(self, mbs: "Sequence[Microbatch]") -> OrderChoice:
        """The chosen order of ``mbs`` (indices into it)."""
        S = self.schedule.num_stages
        rows = [[StageCosts(forward=m.time / S, backward_input=m.time / S, backward_weight=m.time / S,
                            activation_bytes=m.bytes / S) for _ in range(S)] for m in mbs]
        return choose_order(self.schedule, rows, max_evaluations=self.max_evaluations)
