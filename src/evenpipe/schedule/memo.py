"""A bounded memo for the pure layers' caches of derived values (bounds, stage costs): computed once per key,
forgotten all at once when full (a planner search asks for a few thousand keys; the bound keeps a long-lived
process from growing without end)."""

from __future__ import annotations

from typing import Callable, Generic, Hashable, TypeVar

__all__ = ["Memo"]

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
