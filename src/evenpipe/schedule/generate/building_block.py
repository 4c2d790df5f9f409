"""Building-block scheduling: V-Min's generator (Qi et al. 2024b, "Pipeline Parallelism with Controllable Memory").

The paper builds a schedule from one micro-batch's passes laid out in time, its *building block*, repeated every
``T`` time units with no two passes of one rank overlapping (modulo ``T``); the peak activation memory of a rank
is then set by how long each chunk's activations live in the block (from its ``F`` to its ``W``) over ``T``. The
shortest-lived block gives the least memory.

This module lays the block out greedily on the V placement (stage ``s`` on rank ``s`` for ``s < P``, else on
rank ``2P - 1 - s``), with integer durations of ``F``, ``I`` and ``W`` and ``T = 2 (F + I + W)``, the work one
micro-batch brings to a rank:

1. the critical chain first, each pass at the earliest time its input is ready and its rank's slots (mod ``T``)
   are free: the forwards down the stages, then the input gradients back up;
2. then every ``W``, at the earliest free slot after its ``I`` (it only frees memory, nothing waits for it).

Each rank's program order is its passes of all micro-batches sorted by block time plus ``T`` times the
micro-batch. The ramps are those of the repeated block (no reordering of warm-up and cool-down), and
transfers are taken as free when laying it out; the result is a fixed program order, validated like any other.
With unit durations this holds about ``(P + 4) / 3`` micro-batches per rank, the paper's V-Min, with less bubble
than 1F1B.
"""

from __future__ import annotations

from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule.generate.ordering import Work, compute_schedule
from evenpipe.schedule.ir import ActionKind, Schedule

__all__ = ["building_block_v"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


class _Slots:
    """Occupied time slots of each rank, modulo the block period."""

    def __init__(self, num_ranks: int, period: int) -> None:
        self.period = period
        self.used: list[set[int]] = [set() for _ in range(num_ranks)]

    def place(self, rank: int, ready: int, duration: int) -> int | None:
        """The earliest start ``>= ready`` whose ``duration`` slots are free on ``rank`` (marked used), or
        ``None`` when no window of the period has room (its free slots are scattered)."""
        for t in range(ready, ready + self.period):
            if not any((t + k) % self.period in self.used[rank] for k in range(duration)):
                self.used[rank].update((t + k) % self.period for k in range(duration))
                return t
        return None


def _try_block(stage_to_rank: Sequence[int], durations: tuple[int, int, int],
               period: int) -> dict[tuple[ActionKind, int], int] | None:
    """Start time of every pass of one micro-batch with this period, or ``None`` if some pass finds no room."""
    f, i, w = durations
    S = len(stage_to_rank)
    slots = _Slots(max(stage_to_rank) + 1, period)
    start: dict[tuple[ActionKind, int], int] = {}
    chain = [(_F, s, f) for s in range(S)] + [(_I, s, i) for s in reversed(range(S))]
    ready = 0
    for kind, s, d in chain:
        t = slots.place(stage_to_rank[s], ready, d)
        if t is None:
            return None
        start[(kind, s)] = t
        ready = t + d
    for s in reversed(range(S)):
        t = slots.place(stage_to_rank[s], start[(_I, s)] + i, w)
        if t is None:
            return None
        start[(_W, s)] = t
    return start


def _block(stage_to_rank: Sequence[int], durations: tuple[int, int, int]) -> tuple[dict[tuple[ActionKind, int], int], int]:
    """The block (see the module docstring) and its period: ``2 (F + I + W)``, or longer when passes of unequal
    durations leave a rank's free slots too scattered (a long enough period always has room: no wrap-around)."""
    period = 2 * sum(durations)
    while True:
        start = _try_block(stage_to_rank, durations, period)
        if start is not None:
            return start, period
        period += 1


def building_block_v(name: str, *, num_ranks: int, num_microbatches: int, stage_to_rank: Sequence[int],
                     durations: tuple[int, int, int] = (1, 1, 1), meta: dict[str, object] | None = None) -> Schedule:
    """Compute-only schedule repeating one micro-batch's greedy building block (see the module docstring).

    ``stage_to_rank`` must give every rank two stages (the V placement). ``ConfigError`` otherwise.
    """
    P, M = num_ranks, num_microbatches
    per_rank = [sum(1 for r in stage_to_rank if r == rank) for rank in range(P)]
    if per_rank != [2] * P:
        raise ConfigError(f"{name}: the building block needs two stages on every rank, got {per_rank}")
    start, period = _block(stage_to_rank, durations)
    timed: list[list[tuple[int, Work]]] = [[] for _ in range(P)]
    for (kind, s), t in start.items():
        for m in range(M):
            timed[stage_to_rank[s]].append((t + period * m, (kind, s, m)))
    work = [[w for _, w in sorted(events)] for events in timed]
    return compute_schedule(name, num_ranks=P, num_microbatches=M, stage_to_rank=stage_to_rank, work=work,
                            meta={**(meta or {}), "block_period": period})
