"""The building blocks every generator shares: layouts, the warm-up/steady/cool-down ordering, and assembly."""

from __future__ import annotations

from typing import Callable, Sequence

from evenpipe.schedule.columns import Columns
from evenpipe.schedule.ir import Action, ActionKind, Schedule

__all__ = ["Work", "linear_layout", "looped_layout", "warmup_then_alternate", "unit_time_order", "compute_schedule"]

_CODE = {k: k.code for k in ActionKind}

Work = tuple[ActionKind, int, int]
"""One compute step before it becomes an :class:`Action`: ``(kind, stage, microbatch)``."""


def linear_layout(num_ranks: int) -> tuple[int, ...]:
    """One stage per rank: stage ``s`` on rank ``s``."""
    return tuple(range(num_ranks))


def looped_layout(num_ranks: int, num_chunks: int) -> tuple[int, ...]:
    """V chunks per rank, Megatron's placement: rank ``r`` holds stages ``r, r+P, r+2P, ...``."""
    return tuple(s % num_ranks for s in range(num_ranks * num_chunks))


def warmup_then_alternate(forwards: Sequence[tuple[int, int]], backwards: Sequence[tuple[int, int]],
                          num_warmup: int) -> list[Work]:
    """Run ``num_warmup`` forwards, then alternate one forward and one backward, then the remaining backwards.

    ``forwards`` and ``backwards`` are ``(stage, microbatch)`` in the order the rank runs them. With
    ``num_warmup == len(forwards)`` this is GPipe's all-forward-then-all-backward; with ``P - r - 1`` it is 1F1B.
    """
    assert len(forwards) == len(backwards), "every forward needs its backward"
    num_warmup = max(0, min(num_warmup, len(forwards)))
    fwd, bwd = ActionKind.FORWARD, ActionKind.BACKWARD
    out: list[Work] = [(fwd, s, m) for s, m in forwards[:num_warmup]]
    num_steady = len(forwards) - num_warmup
    steady: list[Work] = [(fwd, 0, 0)] * (2 * num_steady)  # F, B, F, B, ... filled by slices
    steady[::2] = [(fwd, s, m) for s, m in forwards[num_warmup:]]
    steady[1::2] = [(bwd, s, m) for s, m in backwards[:num_steady]]
    out += steady
    out.extend((bwd, s, m) for s, m in backwards[num_steady:])
    return out


def unit_time_order(name: str, num_ranks: int, num_actions: int, start: Callable[[int, int], Work | None]
                    ) -> list[list[Work]]:
    """Per rank, the actions a unit-time list simulation starts: at every step ``t``, each rank in turn asks
    ``start(rank, t)`` for the action it begins then (``None``: it idles; ``start`` keeps its own state, e.g. when
    each action's result becomes ready, ``t + 1``), until ``num_actions`` have started. Every action takes one
    step, so a step in which no rank starts anything can never be followed by progress: a cyclic wait."""
    work: list[list[Work]] = [[] for _ in range(num_ranks)]
    remaining = num_actions
    t = 0
    while remaining:
        progressed = False
        for r in range(num_ranks):
            step = start(r, t)
            if step is not None:
                work[r].append(step)
                remaining -= 1
                progressed = True
        assert progressed, f"{name}: unit simulation stalled at t={t}"
        t += 1
    return work


def compute_schedule(name: str, *, num_ranks: int, num_microbatches: int, stage_to_rank: Sequence[int],
                     work: Sequence[Sequence[Work]], meta: dict[str, object] | None = None) -> Schedule:
    """Assemble per-rank work lists into a compute-only :class:`Schedule` (in the integer form; ``Action``
    objects are made only if a consumer asks for them)."""
    kinds, stages, mbs, peers = [], [], [], []
    for rank_work in work:
        k, s, m = (list(col) for col in zip(*rank_work)) if rank_work else ([], [], [])
        if s and (min(s) < 0 or min(m) < 0) or any(kind.is_transfer for kind in set(k)):
            for item in rank_work:
                Action(*item)  # raises ScheduleFormatError naming the bad value
        kinds.append(list(map(_CODE.__getitem__, k)))
        stages.append(s)
        mbs.append(m)
        peers.append([-1] * len(s))
    cols = Columns(kinds=tuple(kinds), stages=tuple(stages), microbatches=tuple(mbs), peers=tuple(peers))
    return Schedule(name=name, num_ranks=num_ranks, num_microbatches=num_microbatches,
                    stage_to_rank=tuple(stage_to_rank), columns=cols, meta=dict(meta or {}))
