"""Bounded memos for the pure layers' caches of derived values.

:class:`Memo` keys by value (bounds, stage costs): computed once per key, forgotten all at once when full (a
planner search asks for a few thousand keys; the bound keeps a long-lived process from growing without end).
:class:`ObjectMemo` keys by an immutable object's identity (a schedule) plus a value: the witness timing, BPipe's
transform and pair plans, memory states and the simulator's compiled shape are each asked for again of the very
schedule object they were computed from, and keep only the most recently used few.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

__all__ = ["Memo", "ObjectMemo"]

V = TypeVar("V")


class Memo(Generic[V]):
    """``get(key, make)``: the value remembered for ``key``, else ``make()`` remembered; starts over at ``limit``."""

    __slots__ = ("limit", "values")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: dict[Hashable, V] = {}

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        values = self.values
        if key in values:
            return values[key]
        if len(values) >= self.limit:
            values.clear()
        value = values[key] = make()
        return value


class ObjectMemo(Generic[V]):
    """``get(obj, key, make)``: the value remembered for this very ``obj`` (by identity: each entry holds its
    object, so the id cannot be reused while it is remembered) and ``key``, else ``make()`` remembered.

    Keeps the ``size`` most recently used entries; with ``weight`` and ``budget``, older ones too while the
    weights of all kept entries' objects add up to at most ``budget`` (big schedules are few, small ones many).
    """

    __slots__ = ("size", "weight", "budget", "entries")

    def __init__(self, size: int, *, weight: Callable[[Any], int] | None = None, budget: int = 0) -> None:
        self.size, self.weight, self.budget = size, weight, budget
        self.entries: OrderedDict[tuple[int, Hashable], tuple[object, V, int]] = OrderedDict()

    def get(self, obj: object, key: Hashable, make: Callable[[], V]) -> V:
        entries = self.entries
        k = (id(obj), key)
        hit = entries.get(k)
        if hit is not None and hit[0] is obj:
            entries.move_to_end(k)
            return hit[1]
        value = make()
        entries[k] = (obj, value, self.weight(obj) if self.weight is not None else 0)
        entries.move_to_end(k)
        if len(entries) > self.size:
            self._shrink()
        return value

    def clear(self) -> None:
        self.entries.clear()

    def _shrink(self) -> None:
        """Drop the least recently used entries beyond ``size`` (beyond the budget, with weights)."""
        entries = self.entries
        if self.weight is None:
            while len(entries) > self.size:
                entries.popitem(last=False)
            return
        held, keep = 0, 0
        for obj, _, w in reversed(entries.values()):  # most recent first
            held += w
            if keep >= self.size and held > self.budget:
                break
            keep += 1
        while len(entries) > keep:
            entries.popitem(last=False)
