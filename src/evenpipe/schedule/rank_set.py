"""A set of pipeline ranks as the command line writes it: ``all``, or ranks and ranges separated by commas
(``0,1``, ``0-1``, ``0,2-3``); :func:`rank_set_text` writes the shortest such form back."""

from __future__ import annotations

from typing import Collection

from evenpipe.errors import ConfigError

__all__ = ["parse_rank_set", "rank_set_text"]


def parse_rank_set(text: str, *, option: str, num_ranks: int) -> frozenset[int]:
    """The ranks ``text`` names among ``0..num_ranks-1``; ``ConfigError`` naming ``option``, the value and what
    is allowed otherwise (an empty set, a rank out of range, a reversed range or a word other than ``all``)."""
    value = text.strip()
    allowed = f"'all' or pipeline ranks 0..{num_ranks - 1} as a list or ranges, e.g. 0,1 or 0-1"
    if value.lower() == "all":
        return frozenset(range(num_ranks))
    ranks: set[int] = set()
    for item in value.split(","):
        lo, sep, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ConfigError(f"{option} {text!r}: {item.strip()!r} is not a rank or a range; give {allowed}") \
                from None
        if first > last:
            raise ConfigError(f"{option} {text!r}: range {item.strip()} runs backwards; give {allowed}")
        bad = [r for r in (first, last) if not 0 <= r < num_ranks]
        if bad:
            raise ConfigError(f"{option} {text!r}: rank {bad[0]} is not a pipeline rank of {num_ranks}; give "
                              f"{allowed}")
        ranks.update(range(first, last + 1))
    return frozenset(ranks)


def rank_set_text(ranks: Collection[int], num_ranks: int) -> str:
    """``ranks`` in :func:`parse_rank_set`'s form: ``all``, or sorted runs (``0-2,5``)."""
    order = sorted(set(ranks))
    if order == list(range(num_ranks)):
        return "all"
    runs: list[list[int]] = []
    for r in order:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
