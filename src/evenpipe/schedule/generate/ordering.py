"""The building blocks every generator shares: layouts, the warm-up/steady/cool-down ordering, and assembly."""

from __future__ import annotations

from typing import Sequence

from evenpipe.schedule.ir import Action, ActionKind, Schedule

__all__ = ["Work", "linear_layout", "looped_layout", "warmup_then_alternate", "compute_schedule"]

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
    out: list[Work] = [(ActionKind.FORWARD, s, m) for s, m in forwards[:num_warmup]]
    num_steady = len(forwards) - num_warmup
    for i in range(num_steady):
        out.append((ActionKind.FORWARD, *forwards[num_warmup + i]))
        out.append((ActionKind.BACKWARD, *backwards[i]))
    out.extend((ActionKind.BACKWARD, s, m) for s, m in backwards[num_steady:])
    return out


def compute_schedule(name: str, *, num_ranks: int, num_microbatches: int, stage_to_rank: Sequence[int],
                     work: Sequence[Sequence[Work]], meta: dict[str, object] | None = None) -> Schedule:
    """Assemble per-rank work lists into a compute-only :class:`Schedule`."""
    actions = tuple(tuple(Action(kind, s, m) for kind, s, m in rank_work) for rank_work in work)
    return Schedule(name=name, num_ranks=num_ranks, num_microbatches=num_microbatches,
                    stage_to_rank=tuple(stage_to_rank), actions=actions, meta=dict(meta or {}))
