"""The columnar form of a schedule: per rank, parallel lists of ints (kind code, stage, micro-batch, peer).

A schedule of 10^5-10^6 actions costs a Python object per :class:`~evenpipe.schedule.ir.Action`; the hot paths
(building, validating, simulating) read these columns instead, and a :class:`~evenpipe.schedule.ir.Schedule`
built from columns materialises its ``Action`` objects only when a consumer asks for ``schedule.actions``
(renderers, the executor, the text forms). Both forms describe the same schedule: ``peer`` is ``-1`` where an
action has none, and a kind is its ``ActionKind.code``. This module sits below :mod:`evenpipe.schedule.ir` (it
reads only :mod:`evenpipe.schedule.action`), so a schedule converts between the forms without an import circle.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from evenpipe.schedule.action import Action, ActionKind

__all__ = ["Columns", "columns_of_actions", "actions_of_columns"]

_KINDS = tuple(ActionKind)
_CODE_OF = {k: k.code for k in ActionKind}
_KIND_OF, _STAGE_OF, _MB_OF, _PEER_OF = (operator.attrgetter(n) for n in ("kind", "stage", "microbatch", "peer"))
_new = object.__new__
_set_kind, _set_stage, _set_mb, _set_peer = (getattr(Action, n).__set__ for n in ("kind", "stage", "microbatch",
                                                                                      "peer"))


@dataclass(frozen=True, slots=True)
class Columns:
    """Per rank ``r``: ``kinds[r][i]``, ``stages[r][i]``, ``microbatches[r][i]``, ``peers[r][i]`` describe action
    ``i`` of rank ``r`` (``peers`` is -1 for no peer). The lists are never mutated once the columns exist."""

    kinds: tuple[list[int], ...]
    """Kind codes (``ActionKind.code``)."""
    stages: tuple[list[int], ...]
    microbatches: tuple[list[int], ...]
    peers: tuple[list[int], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.kinds)

    @property
    def num_actions(self) -> int:
        return sum(map(len, self.kinds))


def columns_of_actions(actions: Sequence[Sequence[Action]]) -> Columns:
    """The columns of per-rank action lists (C-level maps: no Python loop per action)."""
    return Columns(
        kinds=tuple(list(map(_CODE_OF.__getitem__, map(_KIND_OF, acts))) for acts in actions),
        stages=tuple(list(map(_STAGE_OF, acts)) for acts in actions),
        microbatches=tuple(list(map(_MB_OF, acts)) for acts in actions),
        peers=tuple([-1 if p is None else p for p in map(_PEER_OF, acts)] for acts in actions))


def _action(kind: ActionKind, stage: int, microbatch: int, peer: int) -> Action:
    """An :class:`Action` from trusted column values (they were checked when the columns were made)."""
    a = _new(Action)
    _set_kind(a, kind)
    _set_stage(a, stage)
    _set_mb(a, microbatch)
    _set_peer(a, None if peer < 0 else peer)
    return a


def actions_of_columns(cols: Columns) -> tuple[tuple[Action, ...], ...]:
    """The ``Action`` objects the columns describe, per rank."""
    kinds = _KINDS
    return tuple(tuple(map(_action, map(kinds.__getitem__, k), s, m, p))
                 for k, s, m, p in zip(cols.kinds, cols.stages, cols.microbatches, cols.peers))

