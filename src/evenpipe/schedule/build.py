"""``build_schedule``: a named family plus options -> a complete, validated schedule."""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from typing import TYPE_CHECKING, Callable, Collection, Iterator

from evenpipe.errors import ConfigError
from evenpipe.schedule.comm import derive_communication
from evenpipe.schedule.family import ChunkRule, Ordering, ScheduleFamily, Transform
from evenpipe.schedule.generate import gpipe, interleaved, looped_bfs, one_f_one_b, zb_h1
from evenpipe.schedule.columns import Columns
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.validate import validate

if TYPE_CHECKING:
    from evenpipe.schedule.generate.latency_plan import LinkPlan

__all__ = ["build_schedule", "add_offload", "offload_beside_bpipe", "add_recompute", "compute_order",
           "plan_durations_for"]


def build_schedule(family: ScheduleFamily | str, *, num_ranks: int, num_microbatches: int, num_chunks: int | None = None,
                   bpipe_budget: int | None = None, recompute: bool | Collection[int] = False,
                   plan_durations: tuple[int, int, int] | None = None, bpipe: bool = False,
                   link_plan: LinkPlan | None = None, offload_ranks: frozenset[int] = frozenset(),
                   bpipe_weights: tuple[float, ...] | None = None) -> Schedule:
    """A complete schedule (compute, SEND/RECV, and for bpipe EVICT/ACCEPT/RETURN/LOAD), already validated.

    ``num_chunks`` is V, the stages per rank, for ``interleaved`` and ``looped-bfs`` (default 2); the other
    families fix it (1, or 2 for the V-shaped ones), and ``None`` takes the family's default.
    Interleaved takes micro-batches in equal rounds (``M % max(1, M // P) == 0``; any multiple of P gives
    Megatron's schedule exactly). ``bpipe_budget`` is the
    activation units a rank may hold under BPipe (default ``ceil((P+1)/2)``). ``recompute`` inserts ``R`` right
    before every backward (``B`` or ``I``) of every stage (True) or of the stages it lists. ``plan_durations``
    are the relative integer durations of ``F``, ``I`` and ``W`` that zb-h2, v-half and v-min plan their order
    with (default 1, 1, 1; :func:`plan_durations_for` turns measured or modelled times into them). ``bpipe``
    applies the BPipe transform to any family that allows it (``bpipe`` itself is 1F1B with it);
    ``bpipe_budget`` is then in activation units of one stage (a chunk when interleaved), default the lowest
    balanced peak the pairing allows. ``link_plan`` is what ``latency-aware`` orders for (times, each link's
    message time, the per-rank activation cap; default: ``plan_durations`` over free links, cap P).
    ``offload_ranks``: ranks that copy their saved activations to host memory (:func:`add_offload`).
    ``bpipe_weights``: unequal micro-batches, each one's activation units for BPipe's eviction plan
    (:func:`~evenpipe.schedule.bpipe.bpipe_transform`). Bad values raise ``ConfigError``.
    """
    fam = ScheduleFamily.parse(family)
    num_chunks = fam.traits.chunks.chunks(num_chunks) if num_chunks is None else num_chunks
    if link_plan is not None and fam.traits.ordering is not Ordering.LATENCY_AWARE:
        warnings.warn(f"a link plan has no effect on schedule {fam.value!r}", stacklevel=2)
        link_plan = None
    with _gc_paused():
        return _build(fam, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                      bpipe_budget=bpipe_budget, recompute=recompute, plan_durations=plan_durations,
                      bpipe=bpipe or fam is ScheduleFamily.BPIPE, link_plan=link_plan, offload_ranks=offload_ranks,
                      bpipe_weights=bpipe_weights)


def plan_durations_for(forward: float, backward_input: float, backward_weight: float) -> tuple[int, int, int]:
    """Integer durations of F, I and W in the ratio of the given times (F counts 2, none less than 1)."""
    if not forward > 0:
        return (1, 1, 1)
    return tuple(max(1, round(min(_MAX_PLAN_UNITS, 2 * t / forward)))  # type: ignore[return-value]
                 for t in (forward, backward_input, backward_weight))


_MAX_PLAN_UNITS = 10**6
"""Longest integer duration :func:`plan_durations_for` gives (a backward 10^300 times a forward plans as 10^6)."""


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
           bpipe_budget: int | None, recompute: bool | Collection[int], plan_durations: tuple[int, int, int] | None,
           bpipe: bool, link_plan: LinkPlan | None = None, offload_ranks: frozenset[int] = frozenset(),
           bpipe_weights: tuple[float, ...] | None = None) -> Schedule:
    if bpipe and Transform.BPIPE not in fam.traits.transforms:
        allowed = ", ".join(f.value for f in ScheduleFamily if Transform.BPIPE in f.traits.transforms)
        raise ConfigError(f"--bpipe does not apply to schedule {fam.value!r}; allowed: {allowed}")
    compute = compute_order(fam, num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                            plan_durations=plan_durations, link_plan=link_plan)
    if bpipe_budget is not None and not bpipe:
        warnings.warn(f"bpipe_budget={bpipe_budget} has no effect on schedule {fam.value!r}", stacklevel=3)
    recompute = _recomputed_stages(recompute, compute.num_stages)
    if recompute:
        compute = add_recompute(compute, stages=None if len(recompute) == compute.num_stages else recompute)
    if offload_ranks and not bpipe:
        compute = add_offload(compute, ranks=set(offload_ranks), prefetch=True)
    meta: dict[str, object] = {**compute.meta, "family": fam.value, "chunks": num_chunks,
                               "recompute": _recompute_meta(recompute, compute.num_stages)}
    if bpipe:
        from evenpipe.schedule.bpipe import bpipe_transform  # BPipe's schedules only: the rest never load it
        full = bpipe_transform(compute, budget=bpipe_budget, weights=bpipe_weights)
        meta.update(full.meta)
        meta["family"] = fam.value
        if offload_ranks:
            full = offload_beside_bpipe(full, ranks=offload_ranks)
    elif fam.traits.ordering is Ordering.LATENCY_AWARE:  # receives posted by the planned times, not a witness's
        from evenpipe.schedule.generate.latency_comm import place_messages  # this family only: imported when used
        full = place_messages(compute, _link_plan(link_plan, plan_durations))
    else:
        full = derive_communication(compute)
    full = full.renamed(fam.value, meta)
    validate(full)
    return full


def compute_order(family: ScheduleFamily, *, num_ranks: int, num_microbatches: int,
                  num_chunks: int | None = None, plan_durations: tuple[int, int, int] | None = None,
                  link_plan: LinkPlan | None = None) -> Schedule:
    """The compute-only schedule of ``family`` after checking the sizes (``ConfigError`` when out of range);
    the same object for the same arguments while it is among the last few asked for (however they are passed:
    an omitted argument and its default ask for one schedule)."""
    V = family.traits.chunks.chunks(num_chunks) if num_chunks is None else num_chunks
    return _compute_order(family, num_ranks, num_microbatches, V, plan_durations, link_plan)


@functools.lru_cache(maxsize=16)  # schedules are immutable: the planner's memory count and its estimate, a
# configuration and its BPipe twin, build on one compute order (and so share its BPipe transform)
def _compute_order(family: ScheduleFamily, P: int, M: int, V: int, plan_durations: tuple[int, int, int] | None,
                   link_plan: LinkPlan | None) -> Schedule:
    """:func:`compute_order`, remembered by positional arguments (the chunks resolved)."""
    if P < 1:
        raise ConfigError(f"num_ranks must be >= 1, got {P}")
    if M < 1:
        raise ConfigError(f"num_microbatches must be >= 1, got {M}")
    if plan_durations is not None and (len(plan_durations) != 3 or min(plan_durations) < 1):
        raise ConfigError(f"plan_durations must be three integers >= 1 (F, I, W), got {plan_durations}")
    if V < 1:
        raise ConfigError(f"num_chunks must be >= 1, got {V}")
    traits = family.traits
    if not traits.chunks.allows(V) and traits.chunks is ChunkRule.ONE_OR_TWO:
        raise ConfigError(f"schedule {family.value!r} takes 1 or 2 stages per rank (one, or two in a V); got "
                          f"num_chunks={V}, allowed: 1, 2")
    if not traits.chunks.allows(V):
        fixed = traits.chunks.chunks(None)
        what = "one stage" if fixed == 1 else f"{fixed} stages"
        raise ConfigError(f"schedule {family.value!r} has {what} per rank; got num_chunks={V}, allowed: "
                          f"{fixed} (use interleaved or looped-bfs to choose the chunks)")
    why = traits.microbatch_error(P, M, V)
    if why is not None:
        raise ConfigError(f"{family.value} {why}")
    if family.traits.ordering is Ordering.MEMORY_CAPPED:
        return _capped(family, P, M, V, plan_durations or (1, 1, 1))
    if family.traits.ordering is Ordering.LATENCY_AWARE:
        from evenpipe.schedule.generate.latency_aware import latency_aware  # this family only: imported when used
        return latency_aware(num_ranks=P, num_microbatches=M, plan=_link_plan(link_plan, plan_durations),
                             stage_to_rank=traits.stage_to_rank(P, V))
    if family.traits.ordering is Ordering.BUILDING_BLOCK:
        from evenpipe.schedule.generate.building_block import building_block_v  # the V families only
        durations = plan_durations or (1, 1, 1)
        return building_block_v(family.value, num_ranks=P, num_microbatches=M,
                                stage_to_rank=traits.stage_to_rank(P, V),
                                durations=durations, meta={"chunks": 2, "plan_durations": list(durations)})
    return _GENERATORS[family](P, M, V)


def _link_plan(link_plan: LinkPlan | None, plan_durations: tuple[int, int, int] | None) -> LinkPlan:
    """The latency-aware family's plan: the one given, else ``plan_durations`` (default 1, 1, 1) over free links."""
    if link_plan is not None:
        return link_plan
    from evenpipe.schedule.generate.latency_plan import LinkPlan  # the latency-aware family only
    f, i, w = plan_durations or (1, 1, 1)
    return LinkPlan(forward=f, backward_input=i, backward_weight=w)


def _capped(family: ScheduleFamily, P: int, M: int, V: int, durations: tuple[int, int, int]) -> Schedule:
    """A memory-capped family: its placement and its cap (see the family's traits)."""
    from evenpipe.schedule.generate.capped import capped_zero_bubble  # the memory-capped families only
    traits = family.traits
    cap = traits.activation_cap
    assert cap is not None
    return capped_zero_bubble(family.value, num_ranks=P, num_microbatches=M, stage_to_rank=traits.stage_to_rank(P, V),
                              cap=cap(P), durations=durations,
                              meta={"chunks": traits.chunks.chunks(V), "plan_durations": list(durations)})


def _zb_v(P: int, M: int, V: int) -> Schedule:
    from evenpipe.schedule.generate.zb_v import zb_v  # the V families' generators load when one is built
    return zb_v(num_ranks=P, num_microbatches=M, stage_to_rank=ScheduleFamily.ZB_V.traits.stage_to_rank(P, 2))


def _dualpipe_v(P: int, M: int, V: int) -> Schedule:
    from evenpipe.schedule.generate.dualpipe_v import dualpipe_v
    return dualpipe_v(num_ranks=P, num_microbatches=M)


_GENERATORS: dict[ScheduleFamily, Callable[[int, int, int], Schedule]] = {
    ScheduleFamily.GPIPE: lambda P, M, V: gpipe(num_ranks=P, num_microbatches=M),
    ScheduleFamily.ONE_F_ONE_B: lambda P, M, V: one_f_one_b(num_ranks=P, num_microbatches=M),
    ScheduleFamily.INTERLEAVED: lambda P, M, V: interleaved(num_ranks=P, num_microbatches=M, num_chunks=V),
    ScheduleFamily.LOOPED_BFS: lambda P, M, V: looped_bfs(num_ranks=P, num_microbatches=M, num_chunks=V),
    ScheduleFamily.ZB_H1: lambda P, M, V: zb_h1(num_ranks=P, num_microbatches=M),
    ScheduleFamily.ZB_V: _zb_v,
    ScheduleFamily.DUALPIPE_V: _dualpipe_v,
    ScheduleFamily.BPIPE: lambda P, M, V: one_f_one_b(num_ranks=P, num_microbatches=M),  # transformed later
}
"""Compute order of each family from (ranks, micro-batches, chunks): the named presets."""
assert set(_GENERATORS) | {f for f in ScheduleFamily if f.traits.plans_with_durations} == \
    set(ScheduleFamily), "every family needs a generator"


def _recomputed_stages(recompute: bool | Collection[int], num_stages: int) -> frozenset[int]:
    """The stages ``build_schedule``'s ``recompute`` names (True: all, False: none); ConfigError for a stage
    outside ``0..num_stages-1``."""
    if isinstance(recompute, bool):
        return frozenset(range(num_stages)) if recompute else frozenset()
    stages = frozenset(int(s) for s in recompute)
    bad = sorted(s for s in stages if not 0 <= s < num_stages)
    if bad:
        raise ConfigError(f"recompute stage {bad[0]} is not a stage of this schedule (0..{num_stages - 1})")
    return stages


def _recompute_meta(stages: frozenset[int], num_stages: int) -> bool | list[int]:
    """The schedule's ``recompute`` meta: True (every stage), False (none) or the stages."""
    return len(stages) == num_stages if len(stages) in (0, num_stages) else sorted(stages)


def add_recompute(schedule: Schedule, *, stages: Collection[int] | None = None) -> Schedule:
    """Insert ``R(s, m)`` right before every ``B``/``I`` of ``(s, m)`` that has none yet, for every stage or
    for ``stages``."""
    cols = schedule.columns
    rec, backs = ActionKind.RECOMPUTE.code, (ActionKind.BACKWARD.code, ActionKind.BACKWARD_INPUT.code)
    out: list[tuple[list[int], list[int], list[int], list[int]]] = []
    for ks, ss, ms, ps in zip(cols.kinds, cols.stages, cols.microbatches, cols.peers):
        have = {(s, m) for k, s, m in zip(ks, ss, ms) if k == rec}
        row: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        for k, s, m, p in zip(ks, ss, ms, ps):
            if k in backs and (s, m) not in have and (stages is None or s in stages):
                row[0].append(rec)
                row[1].append(s)
                row[2].append(m)
                row[3].append(-1)
            row[0].append(k)
            row[1].append(s)
            row[2].append(m)
            row[3].append(p)
        out.append(row)
    return schedule.with_columns(Columns(*(tuple(col) for col in zip(*out))))


def offload_beside_bpipe(schedule: Schedule, *, ranks: Collection[int]) -> Schedule:
    """A BPipe-transformed ``schedule`` with host offload (prefetched) on ``ranks`` of every unit BPipe does not
    evict (an evicted unit goes to the partner instead; a hosted one is the partner's), messages derived again.
    Offload comes after BPipe's plan, so BPipe's pairs and budget are those of the schedule without it (offload
    only lowers what a rank holds between a forward and its backward)."""
    evicted = {(r, a.stage, a.microbatch) for r, acts in enumerate(schedule.actions) for a in acts
               if a.kind is ActionKind.EVICT}
    return derive_communication(add_offload(schedule, ranks=set(ranks), prefetch=True, skip=evicted))


def add_offload(schedule: Schedule, *, ranks: "set[int] | None" = None, prefetch: bool = False,
                skip: Collection[tuple[int, int, int]] = ()) -> Schedule:
    """Offload every micro-batch's saved activations to host memory right after its ``F`` and reload them right
    before its first use (``R``, ``B`` or ``I``), on ``ranks`` (default: all), unless that use comes next.
    ``prefetch`` issues each reload one forward earlier when a forward of another micro-batch precedes the use
    (1F1B's steady state: the copy back overlaps that forward, at the price of one more unit held during it).
    ``skip``: ``(rank, stage, micro-batch)`` units left in place (BPipe evicts them).

    Works on a compute-only schedule (the markers are kept by :func:`derive_communication`); other actions are
    kept where they stand."""
    uses = (ActionKind.RECOMPUTE, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
    out = []
    for r, acts in enumerate(schedule.actions):
        if ranks is not None and r not in ranks:
            out.append(list(acts))
            continue
        row: list[Action] = []
        away: set[tuple[int, int]] = set()
        last_forward = -1  # where in ``row`` the latest forward stands
        for i, a in enumerate(acts):
            if a.kind in uses and a.key in away:
                at = last_forward if prefetch and last_forward >= 0 and row[last_forward].key != a.key else len(row)
                row.insert(at, Action(ActionKind.RELOAD, a.stage, a.microbatch))
                away.discard(a.key)
                last_forward = -1
            row.append(a)
            nxt = acts[i + 1] if i + 1 < len(acts) else None
            if a.kind is ActionKind.FORWARD:
                last_forward = len(row) - 1
            elif a.kind in uses or a.kind is ActionKind.BACKWARD_WEIGHT:
                last_forward = -1
            if a.kind is ActionKind.FORWARD and not (nxt is not None and nxt.key == a.key and nxt.kind in uses) \
                    and (r, a.stage, a.microbatch) not in skip:
                row.append(Action(ActionKind.OFFLOAD, a.stage, a.microbatch))
                away.add(a.key)
        out.append(_without_idle_moves(row))
    return schedule.with_actions(out)


def _without_idle_moves(row: list[Action]) -> list[Action]:
    """``row`` without each ``OFFLOAD`` whose ``RELOAD`` comes before any compute (a round trip that frees
    nothing while a compute runs: it would only cost two copies)."""
    idle: set[tuple[int, int]] = set()
    away: dict[tuple[int, int], bool] = {}  # offloaded key -> a compute ran since
    for a in row:
        if a.kind.is_compute:
            away = dict.fromkeys(away, True)
        elif a.kind is ActionKind.OFFLOAD:
            away[a.key] = False
        elif a.kind is ActionKind.RELOAD and not away.pop(a.key, True):
            idle.add(a.key)
    if not idle:
        return row
    return [a for a in row if not (a.kind in (ActionKind.OFFLOAD, ActionKind.RELOAD) and a.key in idle)]
