"""BPipe (Kim et al., ICML 2023): balance activation memory by moving activations between paired ranks.

Rank ``x < p/2`` (the *evictor*) is paired with ``p-1-x`` (the *acceptor*); the middle rank of an odd ``p`` has
no partner. An **activation unit** is what one micro-batch leaves on one stage for its backward; a rank's
*held units* are its own (``F`` adds one, the ``B`` -- or ``W`` after a split backward -- frees it) plus the
units it hosts for its partner. The budget ``K`` (default ``ceil((p+1)/2)``) bounds held units at every point of
every rank's program order.

The evictor walks its 1F1B order. When a compute would push it over ``K`` it evicts the held micro-batch whose
backward is farthest away (in 1F1B the one forwarded last; none is evicted twice). The ``EVICT`` goes right
after that micro-batch's ``F`` and its ``SEND_F``, so the transfer overlaps the next compute; if that keeps the
acceptor's window too long for ``K``, the ``EVICT`` moves down to just before the compute that needs the room.
Each evicted micro-batch is loaded back one compute slot before its first use (``R``, ``B`` or ``I``), so the
transfer overlaps that compute; if the load would exceed ``K`` there it is paid for by another eviction (before
a forward) or moved after the compute (before a backward, which frees a unit). Markers are ordered so that
held units never exceed ``K`` even between actions. The acceptor's own plus hosted units are checked in the
program order :func:`derive_communication` gives it (which posts an ``ACCEPT`` due during one of the acceptor's
backwards ahead of that backward, so the evictor never waits for it and BPipe keeps 1F1B's step time), and
also its own peak plus its hosted peak must fit: in the simulator (:mod:`evenpipe.sim.engine`, whose rules a
runtime must follow too) an evictor never holds more than :func:`held_units` says, whatever the costs and links,
but an acceptor's forward may run while a ``RETURN`` is still in flight, so only that sum bounds it.
By default the middle pair of an even ``p`` (whose evictor needs no room) still moves one micro-batch, so every
rank peaks at ``K``: balanced memory, which is the point of BPipe. When no schedule meets ``K``, the error names
the smallest budget that works (tests check that the default is met, exactly, for every ``M >= p``).
"""

from __future__ import annotations

import heapq
import math
from itertools import accumulate
from typing import Callable

from evenpipe.errors import ConfigError
from evenpipe.schedule.comm import derive_communication
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.memo import ObjectMemo
from evenpipe.schedule.semantics import TABLES
from evenpipe.schedule.witness import WitnessTiming, reuse_witness, witness_timing

__all__ = ["bpipe_pairs", "bpipe_partner", "bpipe_transform", "default_bpipe_budget", "held_units",
           "held_units_trace", "lowest_bpipe_budget"]

_F, _B, _I, _W, _R = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                      ActionKind.BACKWARD_WEIGHT, ActionKind.RECOMPUTE)
_UNITS, _HOSTED, _BACKWARD = TABLES.units, TABLES.hosted, TABLES.backward
"""Held-unit change, hosted-or-own and backward-or-not of each kind code (:mod:`evenpipe.schedule.semantics`).
Backwards allocate nothing: derive_communication posts an ACCEPT due while one runs ahead of it."""


def bpipe_partner(rank: int, num_ranks: int) -> int | None:
    """BPipe's partner of ``rank``: ``p-1-rank``, or ``None`` for the middle rank of an odd ``p``."""
    if not 0 <= rank < num_ranks:
        raise ConfigError(f"rank {rank} out of range 0..{num_ranks - 1}")
    partner = num_ranks - 1 - rank
    return None if partner == rank else partner


def default_bpipe_budget(num_ranks: int) -> int:
    """``ceil((p+1)/2)`` activation units, the paper's balanced target."""
    return math.ceil((num_ranks + 1) / 2)


Weights = tuple[float, ...]
"""Unequal micro-batches: each micro-batch's activation units (its bytes over one unit's), by micro-batch index."""
_EPS = 1e-9
"""Slack for sums of weights against a budget (whole units compare exactly)."""


def held_units_trace(actions: tuple[Action, ...], weights: Weights | None = None) -> list[float]:
    """Held units (own plus hosted) after each action of one rank, in program order; a micro-batch counts its
    weight when ``weights`` are given."""
    held: float = 0
    out: list[float] = []
    units = _UNITS
    for a in actions:
        held += units[a.kind.code] if weights is None else units[a.kind.code] * weights[a.microbatch]
        out.append(held)
    return out


def held_units(schedule: Schedule, weights: Weights | None = None) -> list[float]:
    """Peak held activation units (own plus hosted) of each rank, counted in program order (weighted by
    micro-batch with ``weights``)."""
    units = _UNITS
    if weights is None:
        return [max(accumulate(map(units.__getitem__, kinds)), default=0) for kinds in schedule.columns.kinds]
    return [max(held_units_trace(acts, weights), default=0) for acts in schedule.actions]


def bpipe_pairs(compute: Schedule) -> tuple[tuple[int, int], ...]:
    """``(evictor, acceptor)`` pairs from the schedule's own memory profile: ranks ordered by their program-order
    peak (fullest first, lower rank first among equals), the fullest paired with the emptiest, the second
    fullest with the second emptiest, ...; the middle rank of an odd count has no partner. For 1F1B (peaks
    ``P - r``) this is BPipe's ``x <-> P-1-x``."""
    peaks = held_units(compute)
    P = compute.num_ranks
    order = sorted(range(P), key=lambda r: (-peaks[r], r))
    return tuple((order[i], order[P - 1 - i]) for i in range(P // 2))


def lowest_bpipe_budget(schedule: Schedule, weights: Weights | None = None) -> int:
    """The lowest balanced peak the pairing of :func:`bpipe_pairs` allows: the smallest budget, from the mean
    of each pair's peaks up, for which the transform finds a schedule (``ceil((P+1)/2)`` for 1F1B, M >= P);
    whole units, each micro-batch counting its weight when ``weights`` are given."""
    compute = schedule.compute_only()
    timing = witness_timing(compute)
    pairs = bpipe_pairs(compute)
    peaks = held_units(compute, weights)
    paired = {r for pair in pairs for r in pair}
    start = max([math.ceil((peaks[e] + peaks[a]) / 2 - _EPS) for e, a in pairs]
                + [math.ceil(peaks[r] - _EPS) for r in range(compute.num_ranks) if r not in paired] + [1])
    top = max(math.ceil(max(peaks, default=1) - _EPS), 1)
    return next((k for k in range(start, top + 1) if _plan(compute, timing, k, pairs, weights=weights) is not None),
                top)


def bpipe_transform(schedule: Schedule, *, budget: int | None = None, balance: bool = True,
                    weights: Weights | None = None) -> Schedule:
    """Add BPipe's EVICT/LOAD (and derived ACCEPT/RETURN plus all SEND/RECV) so every rank holds <= ``budget``.

    Works on any schedule whose stages do not hand activations to a stage on the same rank (1F1B, GPipe,
    interleaved and looped with P >= 2, ZB-H1): pairs come from its own memory profile (:func:`bpipe_pairs`) and
    the budget, in activation units of one stage (a chunk when interleaved), defaults to
    :func:`lowest_bpipe_budget`. With ``balance`` (default) and a budget no larger than the default, a pair whose
    acceptor would peak below the budget (the middle pair of an even ``p``, whose evictor needs no room) moves
    one micro-batch anyway, so that every rank peaks at the budget: balanced memory for one extra overlapped
    evict/load per step. A larger budget is slack the caller asked for, and nothing moves that need not.

    ``weights``: unequal micro-batches, each micro-batch's activation units (its bytes over a unit's, e.g. over
    the largest micro-batch's); held units then add up weights, so the evictor evicts by bytes (a small
    micro-batch frees less room, a large one more) and the acceptor's check counts what it hosts.

    The schedule's transfers are ignored and derived again. Raises ``ConfigError`` naming the smallest budget
    that works when ``budget`` cannot be met.
    """
    if weights is not None and (len(weights) != schedule.num_microbatches or not all(w > 0 for w in weights)):
        raise ConfigError(f"bpipe weights: need {schedule.num_microbatches} micro-batch weights > 0, got "
                          f"{len(weights)} (smallest {min(weights, default=0)})")
    return _TRANSFORMED.get(schedule, (budget, balance, weights),
                            lambda: _transform(schedule, budget=budget, balance=balance, weights=weights))


_TRANSFORMED: ObjectMemo[Schedule] = ObjectMemo(4)
"""The last few results of :func:`bpipe_transform` by input object, budget and balance: schedules are immutable,
so the same input object gets the same answer (the planner counts memory on the schedule it then estimates)."""


def _transform(schedule: Schedule, *, budget: int | None, balance: bool, weights: Weights | None) -> Schedule:
    """:func:`bpipe_transform` itself."""
    P = schedule.num_ranks
    local = [s for s in range(schedule.num_stages - 1) if schedule.rank_of(s) == schedule.rank_of(s + 1)]
    if local and P > 1:
        raise ConfigError(f"bpipe needs every stage boundary to cross ranks; stages {local[0]} and {local[0] + 1} "
                          f"of {schedule.name!r} share rank {schedule.rank_of(local[0])} (V-shaped placements "
                          "hand activations over locally)")
    if budget is not None and budget < 1:
        raise ConfigError(f"bpipe budget must be >= 1 activation unit, got {budget}")
    compute = schedule.compute_only()
    default = lowest_bpipe_budget(compute, weights)
    K = default if budget is None else budget
    timing = witness_timing(compute)
    pairs = bpipe_pairs(compute)
    meta = {**schedule.meta, "bpipe": True, "budget": K, "pairs": [list(p) for p in pairs]}
    if weights is not None:
        meta["weighted"] = True
    lists = _plan(compute, timing, K, pairs, balance=balance and K <= default, weights=weights)
    if lists is None:
        no_eviction = math.ceil(max(held_units(compute, weights), default=0) - _EPS)
        smallest = next((k for k in range(K + 1, no_eviction + 1)
                         if _plan(compute, timing, k, pairs, weights=weights) is not None), no_eviction)
        raise ConfigError(f"bpipe budget {K} cannot be met for {P} ranks and {schedule.num_microbatches} "
                          f"micro-batches; the smallest budget that works is {smallest}")
    marked = compute.with_actions(lists)
    reuse_witness(marked, compute)  # the markers change no compute's witness time
    result = derive_communication(marked)
    assert max(held_units(result, weights), default=0) <= K + _EPS, "acceptor check disagrees with the derived schedule"
    if weights is None:
        assert all(sum(_own_and_hosted_peaks_of_codes(kinds)) <= K for kinds in result.columns.kinds), \
            "acceptor overlap exceeds budget"
    else:
        assert all(sum(_own_and_hosted_peaks(acts, weights)) <= K + _EPS for acts in result.actions), \
            "acceptor overlap exceeds budget"
    return result.renamed(result.name, meta)


def _plan(compute: Schedule, timing: WitnessTiming, budget: int, pairs: tuple[tuple[int, int], ...], *,
          balance: bool = False, weights: Weights | None = None) -> list[list[Action]] | None:
    """Every rank's compute list with EVICT/LOAD markers on evictors, or ``None`` if some rank would exceed
    ``budget``. Acceptors are checked in the program order :func:`derive_communication` will give them.
    With ``balance``, pairs whose acceptor would stay below the budget move one extra micro-batch."""
    lists = [list(acts) for acts in compute.actions]
    paired = {r for pair in pairs for r in pair}
    if any(max(held_units_trace(compute.actions[r], weights), default=0) > budget + _EPS
           for r in range(compute.num_ranks) if r not in paired):
        return None
    for r, partner in pairs:
        planned = _pair_plan(compute, timing, budget, r, partner, weights)
        if planned is None:
            return None
        marked, peak = planned
        if balance and peak < budget - _EPS:
            marked = _balanced(compute, timing, budget, r, partner, peak, weights) or marked
        lists[r] = marked
    return lists


_PAIR_PLANS: ObjectMemo[dict[tuple[int, int, int, Weights | None], "tuple[list[Action], float] | None"]] = \
    ObjectMemo(1)
"""For the last compute order asked about: (budget, evictor, acceptor) -> :func:`_pair_plan`'s answer (the budget
search and the final transform ask the same questions of one order)."""


def _pair_plan(compute: Schedule, timing: WitnessTiming, budget: int, rank: int, partner: int,
               weights: Weights | None = None) -> tuple[list[Action], float] | None:
    """The evictor's marked list and the acceptor's peak, or ``None`` when no placement meets ``budget``:
    evictions right after their forwards if the acceptor then fits, else right before the computes that need
    the room. Remembered for the last compute order asked about (callers never mutate the list)."""
    plans = _PAIR_PLANS.get(compute, None, dict)
    key = (budget, rank, partner, weights)
    if key not in plans:
        answer = None
        for early in (True, False):  # prefer overlapping the eviction with compute; fall back for the acceptor
            marked = _evict_and_load(compute.actions[rank], budget, partner=partner, early=early, weights=weights)
            if marked is None:
                break
            peak = _acceptor_peak(compute.actions[partner], timing, partner, marked, timing.start[rank], weights)
            if peak <= budget + _EPS:
                answer = (marked, peak)
                break
        plans[key] = answer
    return plans[key]


_BALANCE_TRIES = 4
"""Forwards tried (from the end of the warm-up on) for the one extra eviction of :func:`_balanced`."""


def _balanced(compute: Schedule, timing: WitnessTiming, budget: int, rank: int, partner: int,
              peak: float, weights: Weights | None = None) -> list[Action] | None:
    """The evictor's list with one extra micro-batch moved so that the acceptor also peaks at ``budget``.

    Used where the acceptor would stay below the budget (the middle pair of an even ``p``): evicting one
    micro-batch while the acceptor is at its own peak balances the pair without raising either above ``budget``.
    Returns ``None`` when none of the first few steady-state forwards does it.
    """
    acts = compute.actions[rank]
    first_backward = next((i for i, a in enumerate(acts) if a.kind is not _F), len(acts))
    forwards = [a.key for a in acts[max(0, first_backward - 1):] if a.kind is _F]
    for key in forwards[:_BALANCE_TRIES]:
        marked = _evict_and_load(acts, budget, partner=partner, early=True, forced=frozenset({key}), weights=weights)
        if marked is None:
            continue
        moved = _acceptor_peak(compute.actions[partner], timing, partner, marked, timing.start[rank], weights)
        if peak < moved <= budget + _EPS:
            return marked
    return None


def _own_and_hosted_peaks_of_codes(codes: list[int]) -> tuple[int, int]:
    """Program-order peaks of a rank's own units (F, LOAD minus B, W, EVICT) and of its hosted ones (ACCEPT
    minus RETURN), each on its own, from its kind codes (0 when never positive)."""
    own = max(accumulate(map(_OWN_UNITS.__getitem__, codes)), default=0)
    hosted = max(accumulate(map(_HOSTED_UNITS.__getitem__, codes)), default=0)
    return max(own, 0), max(hosted, 0)


def _own_and_hosted_peaks(actions: tuple[Action, ...], weights: Weights) -> tuple[float, float]:
    """:func:`_own_and_hosted_peaks_of_codes` with each micro-batch counting its weight."""
    own = hosted = own_peak = hosted_peak = 0.0
    for a in actions:
        code = a.kind.code
        w = weights[a.microbatch]
        own += _OWN_UNITS[code] * w
        hosted += _HOSTED_UNITS[code] * w
        own_peak, hosted_peak = max(own_peak, own), max(hosted_peak, hosted)
    return own_peak, hosted_peak


_OWN_UNITS = tuple(0 if hosted else units for units, hosted in zip(_UNITS, _HOSTED))
_HOSTED_UNITS = tuple(units if hosted else 0 for units, hosted in zip(_UNITS, _HOSTED))
"""Per kind code, its held-unit change counted as own or as hosted (the other count: 0)."""


def _marker_times(marked: list[Action], compute_starts: tuple[int, ...]) -> list[tuple[int, Action]]:
    """``(anchor time, marker)`` for the EVICT/LOAD markers of an evictor: the start of the next compute."""
    starts = iter(compute_starts)
    out: list[tuple[int, Action]] = []
    pending: list[Action] = []
    for a in marked:
        if a.kind.is_compute:
            t = next(starts)
            out.extend((t, m) for m in pending)
            pending = []
        else:
            pending.append(a)
    end = max(compute_starts, default=0) + 2  # after the last compute (never reached for BPipe markers)
    return out + [(end, m) for m in pending]


def _acceptor_peak(own: tuple[Action, ...], timing: WitnessTiming, acceptor: int, marked: list[Action],
                   evictor_starts: tuple[int, ...], weights: Weights | None = None) -> float:
    """Peak held units of an acceptor: its own computes merged with ACCEPT/RETURN at the evictor's marker
    times, messages first at equal times, and an ACCEPT due while a backward runs (with the messages before
    it) ahead of that backward: the order :func:`derive_communication` produces. At least its own peak plus its
    hosted peak, since the acceptor's forwards do not wait for its returns to land (:mod:`evenpipe.sim.engine`).
    Each micro-batch counts its weight when ``weights`` are given."""
    events = _marker_times(marked, evictor_starts)
    own_starts, own_finishes = timing.start[acceptor], timing.finish[acceptor]
    j = 0
    held: float = 0
    peak: float = 0
    hosted: float = 0
    hosted_peak: float = 0
    for i, a in enumerate(own):
        last = j
        while last < len(events) and events[last][0] <= own_starts[i]:
            last += 1
        if _BACKWARD[a.kind.code]:
            for k in range(last, len(events)):
                if events[k][0] >= own_finishes[i]:
                    break
                if events[k][1].kind is ActionKind.EVICT:
                    last = k + 1
        for _, m in events[j:last]:
            step = _marker_step(m, weights)
            held, hosted = held + step, hosted + step
            peak, hosted_peak = max(peak, held), max(hosted_peak, hosted)
        j = last
        held += _UNITS[a.kind.code] if weights is None else _UNITS[a.kind.code] * weights[a.microbatch]
        peak = max(peak, held)
    for _, m in events[j:]:
        step = _marker_step(m, weights)
        held, hosted = held + step, hosted + step
        peak, hosted_peak = max(peak, held), max(hosted_peak, hosted)
    own_peak = max(held_units_trace(own, weights), default=0)
    return max(peak, own_peak + hosted_peak)


def _marker_step(m: Action, weights: Weights | None) -> float:
    """What an acceptor's ACCEPT (+) or RETURN (-) of an evictor's marker ``m`` adds to its held units."""
    step = 1 if m.kind is ActionKind.EVICT else -1
    return step if weights is None else step * weights[m.microbatch]


def _evict_and_load(acts: tuple[Action, ...], budget: int, *, partner: int, early: bool,
                    forced: frozenset[tuple[int, int]] = frozenset(),
                    weights: Weights | None = None) -> list[Action] | None:
    """The evictor's compute list with EVICT/LOAD markers inserted, or ``None`` if ``budget`` is unreachable.

    Walks the list keeping ``held`` (units in program order). Before a compute that would push ``held`` over
    the budget, it picks victims (farthest first use; a micro-batch is evicted at most once). With ``early``
    each ``EVICT`` goes right after the victim's own ``F`` (and its send), so the transfer overlaps the computes
    in between, which only lowers ``held`` there; otherwise it goes right before the compute that needs the
    room, which keeps the acceptor's hosting window one slot shorter. Micro-batches in ``forced`` are evicted
    right after their ``F`` whether or not room is needed. ``weights``: each micro-batch counts its weight (held
    units, the room a victim frees and a load takes).
    """
    kinds = [a.kind for a in acts]
    keys = [(a.stage, a.microbatch) for a in acts]
    using = [k is _R or k is _B or k is _I for k in kinds]
    first_use: dict[tuple[int, int], int] = {}
    for i, key in enumerate(keys):
        if using[i]:
            first_use.setdefault(key, i)
    count = len(acts)
    units = _UNITS

    size: Callable[[list[tuple[int, int]]], float] = len if weights is None else _weigher(weights)
    held: float = 0
    away: set[tuple[int, int]] = set()
    evictable: set[tuple[int, int]] = set()  # own units forwarded, not yet used, never evicted
    farthest: list[tuple[int, tuple[int, int]]] = []  # max-heap on first use, lazily pruned
    evict_after_forward: dict[tuple[int, int], Action] = {}
    markers_before: dict[int, list[Action]] = {}  # placed right before compute i
    deferred: list[tuple[int, int]] = []
    for i, kind in enumerate(kinds):
        key = keys[i]
        uses = using[i]
        forward = kind is _F
        if away:
            must = [k for k in deferred if k in away] if deferred else []
            if uses and key in away and key not in must:
                must.append(key)
            j = i + 1
            ahead = [keys[j]] if (j < count and using[j] and keys[j] in away and keys[j] not in must) else []
            if not forward and held + size(must) + size(ahead) > budget + _EPS:
                deferred, ahead = ahead, []
            else:
                deferred = []
            loads = must + ahead
        else:  # nothing away: nothing to load
            deferred = loads = []
        own = 1 if weights is None else weights[key[1]]
        loading = size(loads)
        need = held + loading + (own if forward else 0) - budget
        victims = _pick_victims(farthest, evictable, set(loads) | {key}, need, weights) if need > _EPS else []
        if victims is None:
            return None
        if victims or loads:
            evicts = [Action(ActionKind.EVICT, k[0], k[1], partner) for k in victims]
            if early:
                evict_after_forward.update(zip(victims, evicts))
                evicts = []
            first = _leaving_first(victims, held + loading - budget, weights) if evicts else 0
            markers = evicts[:first] + [Action(ActionKind.LOAD, k[0], k[1], partner) for k in loads] + evicts[first:]
            if markers:
                markers_before[i] = markers
            evictable.difference_update(victims)
            away.update(victims)
            away.difference_update(loads)
        held += loading - size(victims) + units[kind.code] * own
        if forward and key in forced:
            evict_after_forward[key] = Action(ActionKind.EVICT, key[0], key[1], partner)
            away.add(key)
            held -= own
        elif forward:
            evictable.add(key)
            heapq.heappush(farthest, (-first_use.get(key, count), key))
        elif uses:
            evictable.discard(key)
        if held > budget + _EPS:
            return None
    out: list[Action] = []
    for i, a in enumerate(acts):
        if i in markers_before:
            out.extend(markers_before[i])
        out.append(a)
        if keys[i] in evict_after_forward and kinds[i] is _F:
            out.append(evict_after_forward[keys[i]])
    return out


def _weigher(weights: Weights) -> Callable[[list[tuple[int, int]]], float]:
    """The units of a list of ``(stage, micro-batch)`` keys, each micro-batch counting its weight."""
    return lambda ks: sum(weights[k[1]] for k in ks)


def _leaving_first(victims: list[tuple[int, int]], over: float, weights: Weights | None) -> int:
    """How many of ``victims`` (in order) must leave before the loads land: the fewest that free ``over`` units."""
    if over <= _EPS:
        return 0
    if weights is None:
        return int(over)
    freed = 0.0
    for n, k in enumerate(victims, 1):
        freed += weights[k[1]]
        if freed >= over - _EPS:
            return n
    return len(victims)


def _pick_victims(farthest: list[tuple[int, tuple[int, int]]], evictable: set[tuple[int, int]],
                  protected: set[tuple[int, int]], need: float,
                  weights: Weights | None = None) -> list[tuple[int, int]] | None:
    """Pop evictable, unprotected micro-batches whose first backward use is farthest away until they free
    ``need`` units (each one unit, or its weight)."""
    victims: list[tuple[int, int]] = []
    skipped: list[tuple[int, tuple[int, int]]] = []
    freed: float = 0
    while freed < need - _EPS and farthest:
        entry = heapq.heappop(farthest)
        if entry[1] not in evictable:
            continue  # stale: used, freed or already evicted
        if entry[1] in protected:
            skipped.append(entry)
            continue
        victims.append(entry[1])
        freed += 1 if weights is None else weights[entry[1][1]]
    for entry in skipped:
        heapq.heappush(farthest, entry)
    return victims if freed >= need - _EPS else None
