"""``build_schedule``: a named family plus options -> a complete, validated schedule."""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Callable, Iterator

from evenpipe.errors import ConfigError
from evenpipe.schedule.bpipe import bpipe_transform
from evenpipe.schedule.comm import derive_communication
from evenpipe.schedule.family import ScheduleFamily
from evenpipe.schedule.generate import gpipe, interleaved, looped_bfs, one_f_one_b, zb_h1
from evenpipe.schedule.generate.interleaved import interleaved_round_size
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.validate import validate

__all__ = ["build_schedule", "add_offload", "add_recompute", "compute_order"]


def build_schedule(family: ScheduleFamily | str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1,
                   bpipe_budget: int | None = None, recompute: bool = False) -> Schedule:
    """A complete schedule (compute, SEND/RECV, and for bpipe EVICT/ACCEPT/RETURN/LOAD), already validated.

    ``num_chunks`` is V, the stages per rank, for ``interleaved`` and ``looped-bfs`` (others need 1).
    Interleaved takes micro-batches in equal rounds (``M % max(1, M // P) == 0``; any multiple of P gives
    Megatron's schedule exactly). ``bpipe_budget`` is the
    activation units a rank may hold under BPipe (default ``ceil((P+1)/2)``). ``recompute`` inserts ``R`` right
    before every backward (``B`` or ``I``). Bad values raise ``ConfigError``.
    """
    fam = ScheduleFamily.parse(family)
    with _gc_paused():
        return _build(fam, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                      bpipe_budget=bpipe_budget, recompute=recompute)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a large build allocates ~10^6 acyclic objects, and the collections
    this triggers cost about a fifth of the build time. Restores the previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build(fam: ScheduleFamily, *, num_ranks: int, num_microbatches: int, num_chunks: int,
           bpipe_budget: int | None, recompute: bool) -> Schedule:
    compute = compute_order(fam, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks)
    if bpipe_budget is not None and fam is not ScheduleFamily.BPIPE:
        warnings.warn(f"bpipe_budget={bpipe_budget} has no effect on schedule {fam.value!r}", stacklevel=3)
    if recompute:
        compute = add_recompute(compute)
    meta: dict[str, object] = {**compute.meta, "family": fam.value, "chunks": num_chunks, "recompute": recompute}
    if fam is ScheduleFamily.BPIPE:
        full = bpipe_transform(compute, budget=bpipe_budget)
        meta.update(full.meta)
        meta["family"] = fam.value
    else:
        full = derive_communication(compute)
    full = full.with_actions(full.actions, name=fam.value, meta=meta)
    validate(full)
    return full


def compute_order(family: ScheduleFamily, *, num_ranks: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """The compute-only schedule of ``family`` after checking the sizes (``ConfigError`` when out of range)."""
    P, M, V = num_ranks, num_microbatches, num_chunks
    if P < 1:
        raise ConfigError(f"num_ranks must be >= 1, got {P}")
    if M < 1:
        raise ConfigError(f"num_microbatches must be >= 1, got {M}")
    if V < 1:
        raise ConfigError(f"num_chunks must be >= 1, got {V}")
    if V != 1 and not family.has_chunks:
        raise ConfigError(f"schedule {family.value!r} has one stage per rank; got num_chunks={V}, allowed: 1 "
                          f"(use interleaved or looped-bfs for chunks)")
    if family is ScheduleFamily.INTERLEAVED and interleaved_round_size(P, M) is None:
        near = [m for m in range(max(1, M - P), M + P + 1) if interleaved_round_size(P, m) is not None]
        raise ConfigError(f"interleaved needs num_microbatches M with M % max(1, M // P) == 0 (equal rounds); "
                          f"got M={M} for P={P} ranks (nearby allowed: {', '.join(map(str, near))}; any multiple "
                          f"of {P} works)")
    return _GENERATORS[family](P, M, V)


_GENERATORS: dict[ScheduleFamily, Callable[[int, int, int], Schedule]] = {
    ScheduleFamily.GPIPE: lambda P, M, V: gpipe(num_ranks=P, num_microbatches=M),
    ScheduleFamily.ONE_F_ONE_B: lambda P, M, V: one_f_one_b(num_ranks=P, num_microbatches=M),
    ScheduleFamily.INTERLEAVED: lambda P, M, V: interleaved(num_ranks=P, num_microbatches=M, num_chunks=V),
    ScheduleFamily.LOOPED_BFS: lambda P, M, V: looped_bfs(num_ranks=P, num_microbatches=M, num_chunks=V),
    ScheduleFamily.ZB_H1: lambda P, M, V: zb_h1(num_ranks=P, num_microbatches=M),
    ScheduleFamily.BPIPE: lambda P, M, V: one_f_one_b(num_ranks=P, num_microbatches=M),  # transformed later
}
"""Compute order of each family from (ranks, micro-batches, chunks): the named presets."""


def add_recompute(schedule: Schedule) -> Schedule:
    """Insert ``R(s, m)`` right before every ``B``/``I`` of ``(s, m)`` that has none yet."""
    out = []
    for acts in schedule.actions:
        have = {a.key for a in acts if a.kind is ActionKind.RECOMPUTE}
        row: list[Action] = []
        for a in acts:
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and a.key not in have:
                row.append(Action(ActionKind.RECOMPUTE, a.stage, a.microbatch))
            row.append(a)
        out.append(row)
    return schedule.with_actions(out)


def add_offload(schedule: Schedule, *, ranks: "set[int] | None" = None) -> Schedule:
    """Offload every micro-batch's saved activations to host memory right after its ``F`` and reload them right
    before its first use (``R``, ``B`` or ``I``), on ``ranks`` (default: all), unless that use comes next.

    Works on a compute-only schedule (the markers are kept by :func:`derive_communication`)."""
    uses = (ActionKind.RECOMPUTE, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
    out = []
    for r, acts in enumerate(schedule.actions):
        if ranks is not None and r not in ranks:
            out.append(list(acts))
            continue
        row: list[Action] = []
        away: set[tuple[int, int]] = set()
        for i, a in enumerate(acts):
            if a.kind in uses and a.key in away:
                row.append(Action(ActionKind.RELOAD, a.stage, a.microbatch))
                away.discard(a.key)
            row.append(a)
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            if a.kind is ActionKind.FORWARD and not (nxt is not None and nxt.key == a.key and nxt.kind in uses):
                row.append(Action(ActionKind.OFFLOAD, a.stage, a.microbatch))
                away.add(a.key)
        out.append(row)
    return schedule.with_actions(out)
