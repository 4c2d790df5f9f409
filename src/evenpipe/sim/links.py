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
path's rule, :func:`~evenpipe.sim.fast._served_first`; a tie made by a landing is left to the engine), checked as
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

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.kernel import (PARKED, CannotVouch, attempt, compute_memory, cross_rank_inputs, recomputed_slots,
                                 served_first, stage_tables, sums_exact, wait_or_park)
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
        all(PEER_ONLY.issuperset(ks) for ks in schedule.columns.kinds)


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
        self.has_moves = any(KEVICT in ks for ks in schedule.columns.kinds)
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
        """The one pass of the module's rules over every rank's list. One function with closures over its local
        lists, because the hot loop's speed is local-variable access; raises ``CannotVouch`` where it cannot vouch."""
        sched, costs, cols = self.schedule, self.costs, self.schedule.columns
        P, S, M = sched.num_ranks, sched.num_stages, sched.num_microbatches
        layout = sched.stage_to_rank
        table, act, ckpt, wgb = stage_tables(costs.stages)
        dur_f, dur_b, link_f, link_b, instant = self._cuts()
        recomputed = recomputed_slots(sched)
        cross_in, cross_grad = cross_rank_inputs(layout)
        NK = 2 * S * M  # message slots: 2u, the input of F(u); 2u + 1, the output gradient of B/I(u); then moves
        moves = self.has_moves
        bdur, blid, bbytes = self._moves(recomputed, act, ckpt, instant) if moves else ([], [], [])
        total = 2 * NK if moves else NK
        sreach, rreach = [-1.0] * total, [-1.0] * total  # when each end was reached (-1: not yet)
        spos, rpos = [0] * total, [0] * total  # where: rank << 32 | index
        ready, mstart, mend, exposed = [0.0] * total, [0.0] * total, [-1.0] * total, [0.0] * total
        # moves only, by slot - NK: conditions still missing (both ends, and each landing it waits for), the
        # latest of those landings, when its data was ready on the sending side, and who waits for it to land
        pending = [2] * NK if moves else []
        landed_by = [-1.0] * NK if moves else []
        rdata = [0.0] * NK if moves else []
        gated: dict[int, list[int]] = {}
        startable: list[int] = []  # moves whose conditions are all met
        mixed = [False] * P  # ranks whose memory changes include moves' (recorded out of time order)
        queue: list[list[int]] = [[] for _ in range(P * P)]  # per link, its messages in the sender's order
        head = [0] * (P * P)
        link_end = [0.0] * (P * P)
        waiters: dict[int, list[int]] = {}
        todo = list(range(P - 1, -1, -1))
        low = (1 << 32) - 1
        mem: list[list[tuple[float, float]]] = [[] for _ in range(P)]
        held: list[dict[int, float]] = [{} for _ in range(P)]  # (stage * M + mb) -> bytes

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

        def wait_landing(k: int, g: int) -> None:
            """Move ``k`` starts only after move ``g`` has landed."""
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

        def triggers(k: int) -> tuple[int, int]:
            """The positions whose time made ``k`` ready (the second -2 unless both ends did; -1 for a landing)."""
            t = ready[k]
            if k >= NK and landed_by[k - NK] == t:
                return (-1, -2)
            a = spos[k] if sreach[k] == t else -2
            b = rpos[k] if rreach[k] == t else -2
            return (a, b) if a >= 0 else (b, -2)

        def advance(lid: int) -> None:
            """Start the link's messages in order while the next one has all its conditions met."""
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

        starts = [[0.0] * len(ks) for ks in cols.kinds]
        ends = [[0.0] * len(ks) for ks in cols.kinds]
        evicting: list[list[int]] = [[] for _ in range(P)]  # evictions since the rank's last F/R
        returning: list[list[int]] = [[] for _ in range(P)]  # the last ACCEPT's move and the RETURNs since
        back: list[dict[int, int]] = [{} for _ in range(P)]  # u -> its LOAD's move, until a compute consumes it
        pcs, t_free = [0] * P, [0.0] * P
        FWD, BWD, BIN, RE, SF, SB, RF, EV, AC, RET = F, B, I, R, KSEND_F, KSEND_B, KRECV_F, KEVICT, KACCEPT, KRETURN
        MOVE, TRANSFER = FIRST_MOVE, FIRST_TRANSFER
        mend_at = mend.__getitem__
        while todo:
            r = todo.pop()
            ks, ss, ms = cols.kinds[r], cols.stages[r], cols.microbatches[r]
            st_r, en_r, mem_r, held_r = starts[r], ends[r], mem[r], held[r]
            ev_r, ret_r, back_r = evicting[r], returning[r], back[r]
            i, n, now = pcs[r], len(ks), t_free[r]
            base = r << 32
            while i < n:
                c = ks[i]
                s = ss[i]
                u = s * M + ms[i]
                if c >= MOVE:  # a BPipe move's end: reached now
                    st_r[i] = en_r[i] = now
                    if c == EV or c == RET:
                        k = NK + 2 * u + BRINGS_BACK[c]
                        sreach[k], spos[k] = now, base | i
                        if c == EV:
                            rdata[k - NK] = now
                            ev_r.append(k)
                        else:  # its data is ready when it is reached and its eviction has landed
                            e = mend[k - 1]
                            rdata[k - NK] = e if e > now else now
                            wait_landing(k, k - 1)
                            ret_r.append(k)
                        if not instant[blid[k - NK]]:
                            queue[blid[k - NK]].append(k)
                    else:
                        k = NK + 2 * u + BRINGS_BACK[c]
                        rreach[k], rpos[k] = now, base | i
                        for g in ret_r if c == AC else ev_r:
                            wait_landing(k, g)
                        if c == AC:
                            ret_r[:] = [k]
                        else:
                            back_r[u] = k
                    pending[k - NK] -= 1
                    if not pending[k - NK]:
                        startable.append(k)
                    if startable:
                        start_moves()
                    i += 1
                    continue
                if c >= TRANSFER:  # a send or a receive: reached now
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
                    i += 1
                    continue
                start = now
                k_in = k_back = -1
                if c == FWD or c == BWD or c == BIN:
                    k = 2 * u if c == FWD else 2 * u + 1
                    if cross_in[s] if c == FWD else cross_grad[s]:
                        e = mend[k]
                        if e < 0.0:
                            waiters.setdefault(k, []).append(r)
                            break
                        k_in = k
                        if e > start:
                            start = e
                if back_r and c != FWD and u in back_r:  # the first compute after a LOAD waits for the return
                    k_back = back_r[u]
                    e = mend[k_back]
                    if e < 0.0:
                        waiters.setdefault(k_back, []).append(r)
                        break
                    if e > start:
                        start = e
                gate = ev_r if (c == FWD or c == RE) and ev_r else None
                if gate is not None:  # this FWD/RE allocates only after the rank's evictions since the last landed
                    start = wait_or_park(mend_at, gate, start, waiters, r)
                    if start == PARKED:
                        break
                base_t = now  # the engine's exposure rules: each input's lateness beyond the rank being free
                if k_in >= 0:
                    e, d = mend[k_in], sreach[k_in]
                    late = e - (now if now > d else d)
                    if late > exposed[k_in]:
                        exposed[k_in] = late
                    if e > base_t:
                        base_t = e
                if k_back >= 0:
                    e, d = mend[k_back], rdata[k_back - NK]
                    late = e - (now if now > d else d)
                    if late > exposed[k_back]:
                        exposed[k_back] = late
                    if e > base_t:
                        base_t = e
                if gate is not None:  # the delay the gate added, split among the evictions by arrival
                    for g in sorted(gate, key=mend.__getitem__):
                        e = mend[g] if mend[g] < start else start
                        if e > base_t:
                            exposed[g] += e - base_t
                            base_t = e
                    gate.clear()
                if k_back >= 0:
                    del back_r[u]
                now = start + table[c * S + s]
                compute_memory(c, u, start, now, ckpt[s] if u in recomputed else act[s], act[s] - ckpt[s], wgb[s],
                               held_r, mem_r)
                st_r[i] = start
                en_r[i] = now
                i += 1
            pcs[r], t_free[r] = i, now
        if any(pc != len(ks) for pc, ks in zip(pcs, cols.kinds)):
            raise CannotVouch  # the evaluation stopped (a link order it cannot take): the dataflow path decides
        if moves:
            if any(mend[k] < 0.0 for k in range(NK, total) if sreach[k] >= 0.0):
                raise CannotVouch
            if not all(sums_exact(mem[r]) for r in range(P) if mixed[r]):
                raise CannotVouch  # the memory points could depend on the order of same-time changes
        return self._trace(starts, ends, mem, sreach, spos, rpos, mstart, mend, exposed, bbytes)

    def _trace(self, starts: list[list[float]], ends: list[list[float]], mem: list[list[tuple[float, float]]],
               sreach: list[float], spos: list[int], rpos: list[int], mstart: list[float], mend: list[float],
               exposed: list[float], move_bytes: list[float]) -> Trace:
        """What :func:`~evenpipe.sim.engine.make_trace` would return, with the transfer records built only when
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


def _numbers(slots: list[int], spos: list[int], rpos: list[int]) -> list[int]:
    """The engine's numbering key of each message slot: the position (``rank << 32 | index``) of its later end
    (the engine creates a message when it meets its second end, ranks in order)."""
    return list(map(max, map(spos.__getitem__, slots), map(rpos.__getitem__, slots)))
