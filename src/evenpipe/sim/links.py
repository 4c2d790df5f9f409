"""The simulator's rules for a validated schedule of computes, plain messages and BPipe moves on links that take time.

A schedule that passed the validator (:func:`~evenpipe.schedule.validate.passed_validation`) and holds only
computes, activation / gradient messages (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``) and BPipe moves
(``EVICT``/``ACCEPT``, ``RETURN``/``LOAD``) needs little of what the dataflow path (:mod:`evenpipe.sim.fast`)
prepares: the validator guarantees that every message has both ends, on the ranks its peers name, that a receive
comes before the compute that consumes it and a send after the compute that produces it, that a micro-batch is
moved at most once each way and its evicted activations are back before they are used. So one pass over each
rank's list evaluates the event engine's rules directly, with one slot per message: ``2u`` for the input of
``F(u)``, ``2u + 1`` for the output gradient of ``B``/``I(u)`` (``u = stage * M + mb``), and after those
``NK + 2u`` for the eviction of ``u`` and ``NK + 2u + 1`` for its return. A send or receive records when its rank
reaches it; a plain message is ready when both ends are reached (its data is ready when its send is, which
follows the producer); a move also waits for what the engine makes it wait for -- an ``ACCEPT`` for the moves its
rank's earlier ``RETURN``\\ s and ``ACCEPT`` started to land, a ``RETURN`` for its own eviction to land, a ``LOAD``
for its rank's evictions since the last ``F``/``R``. A link serves its messages one at a time in the sender's
program order, which is the engine's FIFO order when their ready times increase along it (ties: the dataflow
path's rule, :func:`~evenpipe.sim.kernel.served_first`; a tie made by a landing is left to the engine), checked as
each starts; a link whose messages all take no time never queues. A compute starts at the latest of its rank
being free, its input message's end, the return of its evicted activations (the first backward-side compute after
a ``LOAD``) and, for an ``F``/``R``, the landing of its rank's evictions since the last ``F``/``R``; exposed times
and memory changes follow the engine's rules. Anything else -- a tie the rule cannot order, a message served out
of order, an evaluation that stops, memory changes whose sums depend on their order -- answers ``None``, and the
dataflow path or the event engine decides. ``tests/unit/sim/test_fast_golden.py`` compares the traces with the
event engine's, float for float.
"""

from __future__ import annotations

from itertools import repeat
from typing import Callable

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.kernel import (PARKED, CannotVouch, RunState, attempt, compute_memory, cross_rank_inputs, kinds_used,
                                 park, recomputed_slots, served_first, stage_tables, sums_exact, wait_or_park)
from evenpipe.sim.result import by_end, timeline, unit_bytes
from evenpipe.sim.rules import (BRINGS_BACK, FIRST_MOVE, FIRST_TRANSFER, KACCEPT, KEVICT, KRECV_F, KRETURN, KSEND_B,
                                KSEND_F, PEER_ONLY, B, F, I, R)
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["NAME", "applies", "run", "simulate_links"]

NAME = "links"
"""The evaluator's name in traces and in the dispatcher."""
_K = ActionKind


def applies(schedule: Schedule, costs: SimCosts) -> bool:
    """A validated schedule without host moves, on links that charge no CPU time and no late-receive cost."""
    return not costs.event_engine_only and passed_validation(schedule) and \
        PEER_ONLY.issuperset(kinds_used(schedule))


def run(schedule: Schedule, costs: SimCosts) -> Trace:
    """The one pass; raises :class:`~evenpipe.sim.kernel.CannotVouch` where it cannot vouch for the engine's
    answer."""
    return _LinkRun(schedule, costs).run()


def simulate_links(schedule: Schedule, costs: SimCosts) -> Trace | None:
    """The trace the event engine would return, or ``None`` where these rules cannot vouch for it (a schedule
    that did not pass the validator, other kinds of actions, links that charge CPU time or cost late receives
    more, see the module)."""
    return attempt(lambda: run(schedule, costs)) if applies(schedule, costs) else None


class _LinkRun:
    def __init__(self, schedule: Schedule, costs: SimCosts) -> None:
        self.has_moves = KEVICT in kinds_used(schedule)
        self.schedule, self.costs = schedule, costs

    def _cuts(self) -> tuple[list[float], list[float], list[int], list[int], list[bool]]:
        """Per stage ``s`` with its successor on another rank: the durations of ``SEND_F(s)`` and of the
        ``SEND_B(s + 1)`` that answers it, and their link ids (``src * P + dst``); per link id whether every
        message on it takes no time."""
        sched, costs = self.schedule, self.costs
        P, S, layout, stages = sched.num_ranks, sched.num_stages, sched.stage_to_rank, costs.stages
        dur_f, dur_b, link_f, link_b = [0.0] * S, [0.0] * S, [-1] * S, [-1] * S
        instant = [True] * (P * P)
        for s in range(S - 1):
            a, b = layout[s], layout[s + 1]
            if a == b:
                continue
            nb = stages[s].output_bytes
            dur_f[s], dur_b[s] = costs.link(a, b).transfer_time(nb), costs.link(b, a).transfer_time(nb)
            link_f[s], link_b[s] = a * P + b, b * P + a
            if dur_f[s]:
                instant[a * P + b] = False
            if dur_b[s]:
                instant[b * P + a] = False
        return dur_f, dur_b, link_f, link_b, instant

    def _moves(self, recomputed: set[int], act: list[float], ckpt: list[float], instant: list[bool]
               ) -> tuple[list[float], list[int], list[float]]:
        """Per move slot ``2u`` (eviction) / ``2u + 1`` (return): its duration, link id and bytes (the checkpoint
        of a recomputed micro-batch, else its activations); marks the links that moves make take time."""
        sched, costs, cols = self.schedule, self.costs, self.schedule.columns
        P, M = sched.num_ranks, sched.num_microbatches
        n = 2 * sched.num_stages * M
        dur, lid, nbytes = [0.0] * n, [0] * n, [0.0] * n
        time_of: dict[tuple[int, float], float] = {}
        for r, (ks, ss, ms, ps) in enumerate(zip(cols.kinds, cols.stages, cols.microbatches, cols.peers)):
            if KEVICT not in ks and KRETURN not in ks:
                continue
            for i, c in enumerate(ks):
                if c == KEVICT or c == KRETURN:
                    s, u, dst = ss[i], ss[i] * M + ms[i], ps[i]
                    nb = ckpt[s] if u in recomputed else act[s]
                    j = 2 * u + BRINGS_BACK[c]
                    lid[j] = link = r * P + dst
                    nbytes[j] = nb
                    t = time_of.get((link, nb))
                    if t is None:
                        t = time_of[(link, nb)] = costs.link(r, dst).transfer_time(nb)
                    dur[j] = t
                    if t:
                        instant[link] = False
        return dur, lid, nbytes

    def run(self) -> Trace:
        """The one pass of the module's rules over every rank's list: the hot loop and the link and move
        handlers are closures over the run's lists (:class:`_LinkState`), because the loop's speed is access to
        local and closed-over variables; raises ``CannotVouch`` where it cannot vouch."""
        st = self._state()
        step = _stepper(st)
        todo = st.todo
        while todo:
            step(todo.pop())
        if any(pc != len(ks) for pc, ks in zip(st.pcs, st.kinds)):
            raise CannotVouch  # the evaluation stopped (a link order it cannot take): the dataflow path decides
        if self.has_moves:
            NK, mend, sreach = st.NK, st.mend, st.sreach
            if any(mend[k] < 0.0 for k in range(NK, 2 * NK) if sreach[k] >= 0.0):
                raise CannotVouch
            if not all(sums_exact(st.mem[r]) for r in range(st.P) if st.mixed[r]):
                raise CannotVouch  # the memory points could depend on the order of same-time changes
        return self._trace(st.starts, st.ends, st.mem, st.sreach, st.spos, st.rpos, st.mstart, st.mend, st.exposed,
                           st.bbytes)

    def _state(self) -> "_LinkState":
        """The run's tables and its empty lists."""
        sched, costs, cols = self.schedule, self.costs, self.schedule.columns
        P, S, M = sched.num_ranks, sched.num_stages, sched.num_microbatches
        table, act, ckpt, wgb = stage_tables(costs.stages)
        dur_f, dur_b, link_f, link_b, instant = self._cuts()
        recomputed = recomputed_slots(sched)
        cross_in, cross_grad = cross_rank_inputs(sched.stage_to_rank)
        NK = 2 * S * M  # message slots: 2u, the input of F(u); 2u + 1, the output gradient of B/I(u); then moves
        moves = self.has_moves
        bdur, blid, bbytes = self._moves(recomputed, act, ckpt, instant) if moves else ([], [], [])
        total = 2 * NK if moves else NK
        return _LinkState(
            P=P, S=S, M=M, NK=NK, kinds=cols.kinds, stages=cols.stages, mbs=cols.microbatches, table=table, act=act,
            ckpt=ckpt, wgb=wgb, dur_f=dur_f, dur_b=dur_b, link_f=link_f, link_b=link_b, instant=instant,
            recomputed=recomputed, cross_in=cross_in, cross_grad=cross_grad, bdur=bdur, blid=blid, bbytes=bbytes,
            sreach=[-1.0] * total, rreach=[-1.0] * total, spos=[0] * total, rpos=[0] * total, ready=[0.0] * total,
            mstart=[0.0] * total, mend=[-1.0] * total, exposed=[0.0] * total, pending=[2] * NK if moves else [],
            landed_by=[-1.0] * NK if moves else [], rdata=[0.0] * NK if moves else [], gated={}, startable=[],
            mixed=[False] * P, queue=[[] for _ in range(P * P)], head=[0] * (P * P), link_end=[0.0] * (P * P),
            waiters={}, todo=list(range(P - 1, -1, -1)), mem=[[] for _ in range(P)], held=[{} for _ in range(P)],
            starts=[[0.0] * len(ks) for ks in cols.kinds], ends=[[0.0] * len(ks) for ks in cols.kinds],
            evicting=[[] for _ in range(P)], returning=[[] for _ in range(P)], back=[{} for _ in range(P)],
            pcs=[0] * P, t_free=[0.0] * P)

    def _trace(self, starts: list[list[float]], ends: list[list[float]], mem: list[list[tuple[float, float]]],
               sreach: list[float], spos: list[int], rpos: list[int], mstart: list[float], mend: list[float],
               exposed: list[float], move_bytes: list[float]) -> Trace:
        """What :func:`~evenpipe.sim.result.make_trace` would return, with the transfer records built only when
        first read: the step time, memory, per-action times (the trace derives the compute spans from them), number
        of transfers, the records of
        those some compute waited on (in order of arrival: by end, then the engine's numbering) and their exposed
        total (summed in that order; the others' zeros add nothing) are known now."""
        sched, costs = self.schedule, self.costs
        late = [k for k, x in enumerate(exposed) if x]  # by arrival, then the engine's numbering (unique)
        late = [k for _, _, k in sorted(zip(map(mend.__getitem__, late), _numbers(late, spos, rpos), late))]
        total = sum(map(exposed.__getitem__, late), 0.0)  # in the records' order, as Trace sums them
        unit = unit_bytes(sched, costs)

        def times_and_transfers() -> tuple[tuple[list[list[float]], list[list[float]]], tuple[TransferRecord, ...]]:
            records = self._records(sreach, spos, rpos, mstart, mend, exposed, move_bytes)
            records.sort(key=by_end)
            return (starts, ends), tuple(records)
        return Trace.deferred(schedule=sched, memory=tuple(timeline(r, m, unit[r]) for r, m in enumerate(mem)),
                              unit_bytes=unit, step_time=max(max((max(e, default=0.0) for e in ends), default=0.0),
                                                             0.0),
                              spans=None, num_transfers=sum(t >= 0.0 for t in sreach),
                              exposed_transfer_time=total, times_and_transfers=times_and_transfers,
                              times=(starts, ends),
                              waited=tuple(self._records_of(late, spos, rpos, mstart, mend, exposed, move_bytes)),
                              evaluator=NAME)

    def _records(self, sreach: list[float], spos: list[int], rpos: list[int], mstart: list[float],
                 mend: list[float], exposed: list[float], move_bytes: list[float]) -> list[TransferRecord]:
        """Every message, in the engine's numbering (by the position of its later end, ranks in order)."""
        slots = [k for k, t in enumerate(sreach) if t >= 0.0]
        later = _numbers(slots, spos, rpos)
        slots = [slots[j] for j in sorted(range(len(slots)), key=later.__getitem__)]
        return self._records_of(slots, spos, rpos, mstart, mend, exposed, move_bytes)

    def _records_of(self, slots: list[int], spos: list[int], rpos: list[int], mstart: list[float],
                    mend: list[float], exposed: list[float], move_bytes: list[float]) -> list[TransferRecord]:
        """The records of these message slots, in their order: the plain messages' built column by column."""
        sched, stages = self.schedule, self.costs.stages
        M, layout = sched.num_microbatches, sched.stage_to_rank
        NK = 2 * sched.num_stages * M
        plain = slots if not move_bytes else [k for k in slots if k < NK]
        consumer = [(k >> 1) // M for k in plain]
        sender = [s - 1 if not k & 1 else s + 1 for k, s in zip(plain, consumer)]
        kinds = [_K.SEND_B if k & 1 else _K.SEND_F for k in plain]
        out = list(map(tuple.__new__, repeat(TransferRecord), zip(
            map(layout.__getitem__, sender), map(layout.__getitem__, consumer), kinds, sender,
            [(k >> 1) % M for k in plain], [stages[min(a, b)].output_bytes for a, b in zip(sender, consumer)],
            map(mstart.__getitem__, plain), map(mend.__getitem__, plain), map(exposed.__getitem__, plain))))
        if len(plain) == len(slots):
            return out
        made = iter(out)  # put the moves' records in their places among the plain ones
        return [next(made) if k < NK else self._move_record(k, spos, rpos, mstart, mend, exposed, move_bytes)
                for k in slots]

    def _move_record(self, k: int, spos: list[int], rpos: list[int], mstart: list[float], mend: list[float],
                     exposed: list[float], move_bytes: list[float]) -> TransferRecord:
        """The record of move slot ``k`` (``NK + 2u``: the eviction of ``u``, ``NK + 2u + 1``: its return)."""
        M = self.schedule.num_microbatches
        j = k - 2 * self.schedule.num_stages * M
        u = j >> 1
        return tuple.__new__(TransferRecord, (spos[k] >> 32, rpos[k] >> 32, _K.RETURN if j & 1 else _K.EVICT, u // M,
                                              u % M, move_bytes[j], mstart[k], mend[k], exposed[k]))


_LOW = (1 << 32) - 1
"""Mask of the index in a position ``rank << 32 | index``."""


class _LinkState(RunState):
    """One run's tables and lists. Message slots ``k``: ``2u`` the input of ``F(u)``, ``2u + 1`` the output
    gradient of ``B``/``I(u)``, then ``NK + 2u`` the eviction of ``u`` and ``NK + 2u + 1`` its return."""

    P: int
    S: int
    M: int
    NK: int
    """Number of plain message slots (``2 * S * M``)."""
    kinds: tuple[list[int], ...]
    stages: tuple[list[int], ...]
    mbs: tuple[list[int], ...]
    table: list[float]
    act: list[float]
    ckpt: list[float]
    wgb: list[float]
    dur_f: list[float]
    dur_b: list[float]
    link_f: list[int]
    link_b: list[int]
    instant: list[bool]
    """Per link id (``src * P + dst``), whether every message on it takes no time."""
    recomputed: set[int]
    cross_in: list[bool]
    cross_grad: list[bool]
    bdur: list[float]
    blid: list[int]
    bbytes: list[float]
    sreach: list[float]
    """Per slot, when its send was reached (-1: not yet); ``rreach`` the same for its receive."""
    rreach: list[float]
    spos: list[int]
    """Per slot, where its send is: ``rank << 32 | index``; ``rpos`` the same for its receive."""
    rpos: list[int]
    ready: list[float]
    mstart: list[float]
    mend: list[float]
    exposed: list[float]
    pending: list[int]
    """Moves only, by slot - NK: conditions still missing (both ends, and each landing it waits for)."""
    landed_by: list[float]
    """Moves only: the latest of the landings it waits for."""
    rdata: list[float]
    """Moves only: when its data was ready on the sending side."""
    gated: dict[int, list[int]]
    """Move slot -> moves that wait for it to land."""
    startable: list[int]
    """Moves whose conditions are all met."""
    mixed: list[bool]
    """Ranks whose memory changes include moves' (recorded out of time order)."""
    queue: list[list[int]]
    """Per link, its messages in the sender's order."""
    head: list[int]
    link_end: list[float]
    waiters: dict[int, list[int]]
    todo: list[int]
    mem: list[list[tuple[float, float]]]
    held: list[dict[int, float]]
    """Per rank, (stage * M + mb) -> bytes."""
    starts: list[list[float]]
    ends: list[list[float]]
    evicting: list[list[int]]
    """Per rank, evictions since its last F/R."""
    returning: list[list[int]]
    """Per rank, the last ACCEPT's move and the RETURNs since."""
    back: list[dict[int, int]]
    """Per rank, u -> its LOAD's move, until a compute consumes it."""
    pcs: list[int]
    t_free: list[float]


def _finisher(st: _LinkState) -> Callable[[int, float, float], None]:
    """``finish(k, t, duration)``: message ``k`` moves from ``t``; a move's memory changes and the moves its
    landing releases."""
    mstart, mend, spos, rpos, ends, waiters, todo, NK = st.mstart, st.mend, st.spos, st.rpos, st.ends, st.waiters, \
        st.todo, st.NK
    bbytes, held, mem, mixed, gated, landed_by, rdata, pending, startable = st.bbytes, st.held, st.mem, st.mixed, \
        st.gated, st.landed_by, st.rdata, st.pending, st.startable
    low = _LOW

    def finish(k: int, t: float, duration: float) -> None:
        mstart[k] = t
        e = mend[k] = t + duration
        q, i = spos[k] >> 32, spos[k] & low
        ends[q][i] = e
        d, i = rpos[k] >> 32, rpos[k] & low
        ends[d][i] = e
        woken = waiters.pop(k, None)
        if woken:
            todo.extend(woken)
        if k >= NK:  # a move: the sender frees on arrival, the receiver allocates at the start
            j = k - NK
            nb = bbytes[j]
            if nb:
                u = j >> 1
                hq, hd = held[q], held[d]
                hq[u] = hq.get(u, 0.0) - nb
                mem[q].append((e, -nb))
                hd[u] = hd.get(u, 0.0) + nb
                mem[d].append((t, nb))
                mixed[q] = mixed[d] = True
            for g in gated.pop(k, ()):
                jg = g - NK
                if e > landed_by[jg]:
                    landed_by[jg] = e
                if g == k + 1 and not j & 1 and e > rdata[jg]:  # a return's data: its own eviction
                    rdata[jg] = e
                pending[jg] -= 1
                if not pending[jg]:
                    startable.append(g)
    return finish


def _landings(st: _LinkState) -> tuple[Callable[[int, int], None], Callable[[int], float]]:
    """``wait_landing(k, g)``: move ``k`` starts only after move ``g`` has landed; ``move_ready(k)``: when move
    ``k``'s conditions are met (both ends reached, the landings it waits for landed)."""
    mend, landed_by, pending, gated, sreach, rreach, ready, NK = st.mend, st.landed_by, st.pending, st.gated, \
        st.sreach, st.rreach, st.ready, st.NK

    def wait_landing(k: int, g: int) -> None:
        e = mend[g]
        if e >= 0.0:
            if e > landed_by[k - NK]:
                landed_by[k - NK] = e
        else:
            pending[k - NK] += 1
            gated.setdefault(g, []).append(k)

    def move_ready(k: int) -> float:
        t = sreach[k]
        if rreach[k] > t:
            t = rreach[k]
        if landed_by[k - NK] > t:
            t = landed_by[k - NK]
        ready[k] = t
        return t
    return wait_landing, move_ready


def _advancer(st: _LinkState, finish: Callable[[int, float, float], None], move_ready: Callable[[int], float]
              ) -> Callable[[int], None]:
    """``advance(lid)``: start the link's messages in order while the next one has all its conditions met."""
    queue, head, link_end, rreach, sreach, ready, dur_b, dur_f, M, NK = st.queue, st.head, st.link_end, st.rreach, \
        st.sreach, st.ready, st.dur_b, st.dur_f, st.M, st.NK
    pending, bdur, mstart, mend, spos, rpos, ends, waiters, todo, landed_by = st.pending, st.bdur, st.mstart, \
        st.mend, st.spos, st.rpos, st.ends, st.waiters, st.todo, st.landed_by
    low = _LOW

    def triggers(k: int) -> tuple[int, int]:
        """The positions whose time made ``k`` ready (the second -2 unless both ends did; -1 for a landing)."""
        t = ready[k]
        if k >= NK and landed_by[k - NK] == t:
            return (-1, -2)
        a = spos[k] if sreach[k] == t else -2
        b = rpos[k] if rreach[k] == t else -2
        return (a, b) if a >= 0 else (b, -2)

    def advance(lid: int) -> None:
        q, h = queue[lid], head[lid]
        busy = link_end[lid]
        while h < len(q):
            k = q[h]
            if k < NK:
                t = rreach[k]
                if t < 0.0:
                    break
                if sreach[k] > t:
                    t = sreach[k]
                ready[k] = t
                duration = dur_b[(k >> 1) // M] if k & 1 else dur_f[(k >> 1) // M - 1]
            else:
                if pending[k - NK]:
                    break
                t = move_ready(k)
                duration = bdur[k - NK]
            if h:
                before = ready[q[h - 1]]
                if not (t > before or t == before and served_first(*triggers(q[h - 1]), *triggers(k))):
                    raise CannotVouch  # maybe not served in FIFO order: the engine decides
                if busy > t:
                    t = busy
            if k < NK:  # finish(k, t, duration), inlined for the common case
                mstart[k] = t
                busy = mend[k] = t + duration
                p = spos[k]
                ends[p >> 32][p & low] = busy
                p = rpos[k]
                ends[p >> 32][p & low] = busy
                woken = waiters.pop(k, None)
                if woken:
                    todo.extend(woken)
            else:  # finishing a move only queues the moves it releases: this link is not re-entered
                finish(k, t, duration)
                busy = mend[k]
            h += 1
        head[lid] = h
        link_end[lid] = busy
    return advance


def _move_handlers(st: _LinkState, finish: Callable[[int, float, float], None]
                   ) -> tuple[Callable[[int, int, int, int, float], None], Callable[[], None], Callable[[int], None]]:
    """``reach_move(r, i, c, u, now)``: rank ``r`` reaches a BPipe move's end; ``start_moves()``: start the moves
    whose conditions are met; and the links' ``advance``."""
    wait_landing, move_ready = _landings(st)
    advance = _advancer(st, finish, move_ready)
    startable, mend, blid, instant, queue, head, NK = st.startable, st.mend, st.blid, st.instant, st.queue, \
        st.head, st.NK
    sreach, spos, rreach, rpos, rdata, pending = st.sreach, st.spos, st.rreach, st.rpos, st.rdata, st.pending
    evicting, returning, back, starts, ends = st.evicting, st.returning, st.back, st.starts, st.ends

    def start_moves() -> None:
        while startable:
            k = startable.pop()
            if mend[k] >= 0.0:
                continue  # started already by its link's queue
            lid = blid[k - NK]
            if instant[lid]:
                finish(k, move_ready(k), 0.0)
            elif queue[lid][head[lid]] == k:  # its send was reached, so it is queued, at or after the head
                advance(lid)

    def reach_move(r: int, i: int, c: int, u: int, now: float) -> None:
        starts[r][i] = ends[r][i] = now
        k = NK + 2 * u + BRINGS_BACK[c]
        if c == KEVICT or c == KRETURN:
            sreach[k], spos[k] = now, (r << 32) | i
            if c == KEVICT:
                rdata[k - NK] = now
                evicting[r].append(k)
            else:  # its data is ready when it is reached and its eviction has landed
                e = mend[k - 1]
                rdata[k - NK] = e if e > now else now
                wait_landing(k, k - 1)
                returning[r].append(k)
            if not instant[blid[k - NK]]:
                queue[blid[k - NK]].append(k)
        else:
            rreach[k], rpos[k] = now, (r << 32) | i
            for g in returning[r] if c == KACCEPT else evicting[r]:
                wait_landing(k, g)
            if c == KACCEPT:
                returning[r][:] = [k]
            else:
                back[r][u] = k
        pending[k - NK] -= 1
        if not pending[k - NK]:
            startable.append(k)
        if startable:
            start_moves()
    return reach_move, start_moves, advance


def _move_gate(st: _LinkState) -> Callable[[int, int, int, float, float], float]:
    """``wait_moves(r, c, u, now, start)``, for a compute of a rank with BPipe moves in flight: its start after the
    return of its evicted activations (the first backward-side compute after a ``LOAD``) and, for an ``F``/``R``,
    the landing of the rank's evictions since the last ``F``/``R``, with those waits charged to the moves by the
    engine's rules (``start`` is the start its other inputs allow); or :data:`PARKED`, having changed nothing."""
    mend, waiters, rdata, exposed, NK, back, evicting = st.mend, st.waiters, st.rdata, st.exposed, st.NK, st.back, \
        st.evicting
    mend_at = mend.__getitem__

    def wait_moves(r: int, c: int, u: int, now: float, start: float) -> float:
        back_r, gate = back[r], evicting[r]
        base_t = start
        k_back = back_r[u] if back_r and c != F and u in back_r else -1
        if k_back >= 0:  # the first compute after a LOAD waits for the return
            e = mend[k_back]
            if e < 0.0:
                park(waiters, k_back, r)
                return PARKED
            if e > start:
                start = e
        if (c == F or c == R) and gate:  # this F/R allocates only after the rank's evictions have landed
            start = wait_or_park(mend_at, gate, start, waiters, r)
            if start == PARKED:
                return PARKED
        if k_back >= 0:
            e, d = mend[k_back], rdata[k_back - NK]
            late = e - (now if now > d else d)
            if late > exposed[k_back]:
                exposed[k_back] = late
            if e > base_t:
                base_t = e
        if (c == F or c == R) and gate:  # the delay the gate added, split among the evictions by arrival
            for g in sorted(gate, key=mend.__getitem__):
                e = mend[g] if mend[g] < start else start
                if e > base_t:
                    exposed[g] += e - base_t
                    base_t = e
            gate.clear()
        if k_back >= 0:
            del back_r[u]
        return start
    return wait_moves


def _stepper(st: _LinkState) -> Callable[[int], None]:
    """``step(r)``: run rank ``r`` from its cursor until a compute must wait or the list ends."""
    finish = _finisher(st)
    reach_move, start_moves, advance = _move_handlers(st, finish)
    moves_gate = _move_gate(st)
    kinds, stages, mbs, starts, ends, mem, held, evicting, back, pcs, t_free = st.kinds, st.stages, st.mbs, \
        st.starts, st.ends, st.mem, st.held, st.evicting, st.back, st.pcs, st.t_free
    M, S, sreach, spos, rreach, rpos, link_f, link_b, instant, ready, queue, head, startable = st.M, st.S, \
        st.sreach, st.spos, st.rreach, st.rpos, st.link_f, st.link_b, st.instant, st.ready, st.queue, st.head, \
        st.startable
    cross_in, cross_grad, mend, waiters, exposed, table, ckpt, act, wgb, recomputed = st.cross_in, st.cross_grad, \
        st.mend, st.waiters, st.exposed, st.table, st.ckpt, st.act, st.wgb, st.recomputed
    FWD, BWD, BIN, RE, SF, SB, RF, MOVE, TRANSFER = F, B, I, R, KSEND_F, KSEND_B, KRECV_F, FIRST_MOVE, FIRST_TRANSFER

    def step(r: int) -> None:
        ks, ss, ms = kinds[r], stages[r], mbs[r]
        st_r, en_r, mem_r, held_r, ev_r, back_r = starts[r], ends[r], mem[r], held[r], evicting[r], back[r]
        i, n, now = pcs[r], len(ks), t_free[r]
        base = r << 32
        while i < n:
            c = ks[i]
            s = ss[i]
            u = s * M + ms[i]
            if c >= MOVE:  # a BPipe move's end: reached now
                reach_move(r, i, c, u, now)
            elif c >= TRANSFER:  # a send or a receive: reached now
                st_r[i] = en_r[i] = now
                if c == SF or c == SB:
                    k = 2 * (u + M) if c == SF else 2 * (u - M) + 1
                    sreach[k], spos[k] = now, base | i
                    lid = link_f[s] if c == SF else link_b[s - 1]
                else:
                    k = 2 * u if c == RF else 2 * u + 1
                    rreach[k], rpos[k] = now, base | i
                    lid = link_f[s - 1] if c == RF else link_b[s]
                if instant[lid]:
                    if sreach[k] >= 0.0 and rreach[k] >= 0.0:
                        ready[k] = t = sreach[k] if sreach[k] > rreach[k] else rreach[k]
                        finish(k, t, 0.0)
                else:  # advance the link only when this message is its next and both ends are reached
                    q = queue[lid]
                    if c == SF or c == SB:
                        q.append(k)
                        go = rreach[k] >= 0.0 and head[lid] == len(q) - 1
                    else:
                        go = head[lid] < len(q) and q[head[lid]] == k
                    if go:
                        advance(lid)
                        if startable:
                            start_moves()
            else:  # a compute
                start = now
                if c == FWD or c == BWD or c == BIN:
                    k = 2 * u if c == FWD else 2 * u + 1
                    if cross_in[s] if c == FWD else cross_grad[s]:
                        e = mend[k]
                        if e < 0.0:
                            park(waiters, k, r)
                            break
                        d = sreach[k]  # the engine's exposure: the input's lateness beyond the rank being free
                        late = e - (now if now > d else d)  # (the same if a later park makes it run again)
                        if late > exposed[k]:
                            exposed[k] = late
                        if e > start:
                            start = e
                gated = ev_r and (c == FWD or c == RE) or back_r and c != FWD and u in back_r
                if gated:
                    start = moves_gate(r, c, u, now, start)
                    if start == PARKED:
                        break
                now = start + table[c * S + s]
                compute_memory(c, u, start, now, ckpt[s] if u in recomputed else act[s], act[s] - ckpt[s], wgb[s],
                               held_r, mem_r)
                st_r[i] = start
                en_r[i] = now
            i += 1
        pcs[r], t_free[r] = i, now
    return step


def _numbers(slots: list[int], spos: list[int], rpos: list[int]) -> list[int]:
    """The engine's numbering key of each message slot: the position (``rank << 32 | index``) of its later end
    (the engine creates a message when it meets its second end, ranks in order)."""
    return list(map(max, map(spos.__getitem__, slots), map(rpos.__getitem__, slots)))
