"""The bounded memos the pure layers cache derived values in, and the enum their keys hold."""

from __future__ import annotations

from evenpipe.schedule.memo import KeyEnum, Memo, ObjectMemo


class _Thing:
    def __init__(self, size: int) -> None:
        self.size = size


def test_memo_computes_once_per_key_and_starts_over_when_full() -> None:
    made: list[int] = []
    memo: Memo[int] = Memo(2)

    def make(k: int) -> int:
        made.append(k)
        return k * 10

    assert [memo.get(k, lambda k=k: make(k)) for k in (1, 2, 1)] == [10, 20, 10] and made == [1, 2]
    memo.get(3, lambda: make(3))  # full: forgets 1 and 2
    memo.get(1, lambda: make(1))
    assert made == [1, 2, 3, 1]


def test_object_memo_keys_by_identity_and_value() -> None:
    made: list[str] = []
    memo: ObjectMemo[str] = ObjectMemo(4)
    a, b = _Thing(1), _Thing(1)  # equal contents, different objects
    get = lambda obj, key: memo.get(obj, key, lambda: made.append(f"{id(obj)}/{key}") or f"{key}")  # noqa: E731
    get(a, "x"), get(a, "x"), get(b, "x"), get(a, "y")
    assert len(made) == 3


def test_object_memo_keeps_the_most_recently_used() -> None:
    memo: ObjectMemo[int] = ObjectMemo(2)
    things = [_Thing(1) for _ in range(3)]
    calls: list[int] = []
    for i in (0, 1, 0, 2, 0, 1):  # 2 pushes out 1 (0 was used later), then 1 comes back and pushes out 2
        memo.get(things[i], None, lambda i=i: calls.append(i) or i)
    assert calls == [0, 1, 2, 1]
    assert [obj for obj, _, _ in memo.entries.values()] == [things[0], things[1]]


def test_object_memo_keeps_more_small_objects_within_the_budget() -> None:
    memo: ObjectMemo[int] = ObjectMemo(1, weight=lambda t: t.size, budget=10)
    small = [_Thing(3) for _ in range(3)]
    for t in small:
        memo.get(t, None, lambda: 0)
    assert len(memo.entries) == 3  # 9 <= 10: all kept although size is 1
    big = _Thing(8)
    memo.get(big, None, lambda: 0)
    assert [obj for obj, _, _ in memo.entries.values()] == [big]  # 8 + 3 > 10: only the newest one stays


def test_key_enum_hashes_by_identity_and_keys_dicts_by_member() -> None:
    class Colour(KeyEnum):
        RED = "red"
        BLUE = "blue"

    assert hash(Colour.RED) == object.__hash__(Colour.RED) and hash(Colour.RED) != hash(Colour.BLUE)
    seen = {Colour.RED: 1, Colour.BLUE: 2}
    assert seen[Colour("red")] == 1 and Colour["BLUE"] in seen and "red" not in seen
