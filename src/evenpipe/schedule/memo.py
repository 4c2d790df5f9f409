"""Bounded memos for the pure layers' caches of derived values.

:class:`Memo` keys by value (bounds, stage costs): computed once per key, forgotten all at once when full (a
planner search asks for a few thousand keys; the bound keeps a long-lived process from growing without end).
:class:`RecentMemo` keeps the most recently used values (optionally within a weight budget), and
:class:`ObjectMemo` is one keyed by an immutable object's identity (a schedule) plus a value: the witness timing, BPipe's
transform and pair plans, memory states and the simulator's compiled shape are each asked for again of the very
schedule object they were computed from, and keep only the most recently used few. :class:`KeyEnum` is an enum
cheap to hash, for the enums these keys hold.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

__all__ = ["KeyEnum", "Memo", "ObjectMemo", "RecentMemo"]

V = TypeVar("V")


class KeyEnum(enum.Enum):
    """An enum whose members hash by identity (they are singletons, compared by identity): a C-level hash, where
    Enum's own runs Python code on every look-up, and a planner search hashes memo keys holding a schedule family,
    recomputation or attention kernel some 10^5 times."""

    __hash__ = object.__hash__


class Memo(Generic[V]):
    """``get(key, make)``: the value remembered for ``key``, else ``make()`` remembered; starts over at ``limit``."""

    __slots__ = ("limit", "values")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: dict[Hashable, V] = {}

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        values = self.values
        try:
            return values[key]  # one hash of the key when it is known (the usual case)
        except KeyError:
            pass
        if len(values) >= self.limit:
            values.clear()
        value = values[key] = make()
        return value


class RecentMemo(Generic[V]):
    """``get(key, make)``: the value remembered for ``key``, else ``make()`` remembered; keeps the ``size`` most
    recently used entries and, with ``weight`` and ``budget``, older ones too while the weights of all kept values
    add up to at most ``budget`` (big schedules are few, small ones many)."""

    __slots__ = ("size", "weight", "budget", "entries")

    def __init__(self, size: int, *, weight: Callable[[V], int] | None = None, budget: int = 0) -> None:
        self.size, self.weight, self.budget = size, weight, budget
        self.entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        entries = self.entries
        hit = entries.get(key)
        if hit is not None:
            entries.move_to_end(key)
            return hit[0]
        value = make()
        entries[key] = (value, self.weight(value) if self.weight is not None else 0)
        if len(entries) > self.size:
            self._shrink()
        return value

    def clear(self) -> None:
        self.entries.clear()

    def _shrink(self) -> None:
        """Drop the least recently used entries beyond ``size`` (beyond the budget, with weights)."""
        entries = self.entries
        keep = self.size
        if self.weight is not None:
            held, keep = 0, 0
            for _, w in reversed(entries.values()):  # most recent first
                held += w
                if keep >= self.size and held > self.budget:
                    break
                keep += 1
        while len(entries) > keep:
            entries.popitem(last=False)


class ObjectMemo(Generic[V]):
    """``get(obj, key, make)``: the value remembered for this very ``obj`` (by identity: each entry holds its
    object, so the id cannot be reused while it is remembered) and ``key``, else ``make()`` remembered; a
    :class:`RecentMemo` whose ``weight`` weighs the object."""

    __slots__ = ("memo",)

    def __init__(self, size: int, *, weight: Callable[[Any], int] | None = None, budget: int = 0) -> None:
        self.memo: RecentMemo[tuple[object, V]] = RecentMemo(
            size, weight=None if weight is None else (lambda pair: weight(pair[0])), budget=budget)

    def get(self, obj: object, key: Hashable, make: Callable[[], V]) -> V:
        return self.memo.get((id(obj), key), lambda: (obj, make()))[1]

    @property
    def entries(self) -> OrderedDict[Hashable, tuple[object, V, int]]:
        """(object, value, weight) of each entry, least recently used first (for inspection)."""
        return OrderedDict((k, (pair[0], pair[1], w)) for k, (pair, w) in self.memo.entries.items())

    def clear(self) -> None:
        self.memo.clear()
