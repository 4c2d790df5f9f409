"""Host offload in built schedules (``build_schedule(offload_ranks=)``, ``train --offload``): which ranks move what,
with every kind of family, and the text form of a rank set."""

from __future__ import annotations

import pytest

from evenpipe.errors import ConfigError
from evenpipe.schedule import ActionKind, build_schedule
from evenpipe.schedule.rank_set import parse_rank_set, rank_set_text

_K = ActionKind
FAMILIES = [("1f1b", 1, False), ("gpipe", 1, False), ("interleaved", 2, False), ("zb-h1", 1, False),
            ("zb-v", 2, False), ("dualpipev", 2, False), ("latency-aware", 1, False), ("bpipe", 1, False),
            ("interleaved", 2, True), ("zb-h1", 1, True)]


def _round_trips(acts) -> list[tuple[int, int, int]]:
    """Per OFFLOAD: (position, position of its RELOAD, computes between them)."""
    out = []
    for i, a in enumerate(acts):
        if a.kind is _K.OFFLOAD:
            j = next(j for j in range(i + 1, len(acts)) if acts[j].kind is _K.RELOAD and acts[j].key == a.key)
            out.append((i, j, sum(1 for b in acts[i + 1:j] if b.kind.is_compute)))
    return out


@pytest.mark.parametrize("family,chunks,bpipe", FAMILIES)
def test_offload_stays_on_its_ranks_and_every_round_trip_spans_a_compute(family: str, chunks: int,
                                                                         bpipe: bool) -> None:
    ranks = frozenset({0, 1})
    plain = build_schedule(family, num_ranks=4, num_microbatches=8, num_chunks=chunks, bpipe=bpipe)
    sched = build_schedule(family, num_ranks=4, num_microbatches=8, num_chunks=chunks, bpipe=bpipe,
                           offload_ranks=ranks)  # validated by the build
    moving = {r for r, acts in enumerate(sched.actions) if any(a.kind is _K.OFFLOAD for a in acts)}
    assert moving == set(ranks)
    for r, acts in enumerate(sched.actions):
        trips = _round_trips(acts)
        assert all(between >= 1 for _, _, between in trips), (r, trips)
        assert len(trips) == sum(1 for a in acts if a.kind is _K.RELOAD)
        evicted = {a.key for a in acts if a.kind is _K.EVICT}
        assert not evicted & {a.key for a in acts if a.kind is _K.OFFLOAD}  # BPipe's units go to the partner
        computes = [a for a in acts if a.kind.is_compute]
        assert computes == [a for a in plain.actions[r] if a.kind.is_compute]  # offload reorders nothing


def test_bpipe_keeps_its_evictions_beside_offload() -> None:
    plain = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    both = build_schedule("bpipe", num_ranks=4, num_microbatches=8, offload_ranks=frozenset(range(4)))
    evicts = [[a for a in acts if a.kind in (_K.EVICT, _K.LOAD)] for acts in plain.actions]
    assert evicts == [[a for a in acts if a.kind in (_K.EVICT, _K.LOAD)] for acts in both.actions]
    assert both.meta["budget"] == plain.meta["budget"]


@pytest.mark.parametrize("text,ranks", [("all", {0, 1, 2, 3}), ("0", {0}), ("0-1", {0, 1}), ("0,2-3", {0, 2, 3}),
                                        (" 3 , 1 ", {1, 3})])
def test_rank_sets_parse_and_print_back(text: str, ranks: set[int]) -> None:
    got = parse_rank_set(text, option="--offload", num_ranks=4)
    assert got == ranks
    assert parse_rank_set(rank_set_text(got, 4), option="--offload", num_ranks=4) == ranks


@pytest.mark.parametrize("text,needle", [("4", "rank 4 is not a pipeline rank of 4"), ("2-1", "runs backwards"),
                                         ("", "'' is not a rank"), ("0,,1", "'' is not a rank"),
                                         ("first", "'first' is not a rank")])
def test_bad_rank_sets_name_the_value_and_what_is_allowed(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        parse_rank_set(text, option="--offload", num_ranks=4)
    assert str(e.value).startswith(f"--offload {text!r}") and "'all' or pipeline ranks 0..3" in str(e.value)
