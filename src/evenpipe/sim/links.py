"""The simulator's rules for a validated schedule of computes and plain messages on links that take time.

A schedule that passed the validator (:func:`~evenpipe.schedule.validate.passed_validation`) and holds only
computes and activation / gradient messages (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``) needs little of what the
dataflow path (:mod:`evenpipe.sim.fast`) prepares: the validator guarantees that every message has both ends, on
the ranks of its two neighbouring stages, that a receive comes before the compute that consumes it and a send after
the compute that produces it. So one pass over each rank's list evaluates the event engine's rules directly,
with one slot per message (the consumer's input: ``2u`` for ``F(u)``, ``2u + 1`` for ``B``/``I(u)``, ``u = stage *
M + mb``): a send or receive records when its rank reaches it; a message is ready when both ends are reached (its
data is ready when its send is, which follows the producer); a link serves its messages one at a time in the
sender's program order, which is the engine's FIFO order when their ready times increase along it (ties: the
dataflow path's rule, :func:`~evenpipe.sim.fast._served_first`), and is checked as each starts; a link whose
messages all take no time never queues. A compute starts at the latest of its rank being free and its input
message's end. Anything else -- a tie the rule cannot order, a message served out of order, an evaluation that
stops -- answers ``None``, and the dataflow path or the event engine decides.
``tests/unit/sim/test_fast_golden.py`` compares the traces with the event engine's, float for float.
"""

from __future__ import annotations

import gc
from itertools import repeat

from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim import engine as _ref
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.fast import _served_first, compute_memory
from evenpipe.sim.free import _cross_rank_inputs, _recomputed_slots, _stage_tables
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["simulate_links"]

_K = ActionKind
_F, _B, _I, _W, _R = (k.code for k in (_K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT,
                                       _K.RECOMPUTE))
_SF, _RF, _SB, _RB = (k.code for k in (_K.SEND_F, _K.RECV_F, _K.SEND_B, _K.RECV_B))
_ALLOWED = frozenset({_F, _B, _I, _W, _R, _SF, _RF, _SB, _RB})


class _Fallback(Exception):
    """The schedule or an evaluation leaves these rules: another path decides."""


def simulate_links(schedule: Schedule, costs: SimCosts) -> Trace | None:
    """The trace the event engine would return, or ``None`` where these rules cannot vouch for it (a schedule
    that did not pass the validator, other kinds of actions, links that charge CPU time, see the module)."""
    if costs.charges_cpu or not passed_validation(schedule):
        return None
    collecting = gc.isenabled()
    gc.disable()  # ~10^5 acyclic objects: cyclic collections would only cost time
    try:
        return _LinkRun(schedule, costs).run()
    except _Fallback:
        return None
    finally:
        if collecting:
            gc.enable()


class _LinkRun:
    def __init__(self, schedule: Schedule, costs: SimCosts) -> None:
        if any(c not in _ALLOWED for ks in schedule.columns.kinds for c in set(ks)):
            raise _Fallback
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

    def run(self) -> Trace:
        sched, costs, cols = self.schedule, self.costs, self.schedule.columns
        P, S, M = sched.num_ranks, sched.num_stages, sched.num_microbatches
        layout = sched.stage_to_rank
        table, act, ckpt, wgb = _stage_tables(costs.stages)
        dur_f, dur_b, link_f, link_b, instant = self._cuts()
        recomputed = _recomputed_slots(sched)
        cross_in, cross_grad = _cross_rank_inputs(layout)
        NK = 2 * S * M  # message slots: 2u, the input of F(u); 2u + 1, the output gradient of B/I(u)
        sreach, rreach = [-1.0] * NK, [-1.0] * NK  # when each end was reached (-1: not yet)
        spos, rpos = [0] * NK, [0] * NK  # where: rank << 32 | index
        ready, mstart, mend, exposed = [0.0] * NK, [0.0] * NK, [-1.0] * NK, [0.0] * NK
        queue: list[list[int]] = [[] for _ in range(P * P)]  # per link, its messages in the sender's order
        head = [0] * (P * P)
        link_end = [0.0] * (P * P)
        waiters: dict[int, list[int]] = {}
        todo = list(range(P - 1, -1, -1))
        low = (1 << 32) - 1

        def finish(k: int, t: float, duration: float) -> None:
            mstart[k] = t
            e = mend[k] = t + duration
            q, i = spos[k] >> 32, spos[k] & low
            ends[q][i] = e
            q, i = rpos[k] >> 32, rpos[k] & low
            ends[q][i] = e
            woken = waiters.pop(k, None)
            if woken:
                todo.extend(woken)

        def triggers(k: int) -> tuple[int, int]:
            """The positions whose time made ``k`` ready (the second -2 unless both ends did)."""
            t = ready[k]
            a = spos[k] if sreach[k] == t else -2
            b = rpos[k] if rreach[k] == t else -2
            return (a, b) if a >= 0 else (b, -2)

        def advance(lid: int, durations: list[float], stage_shift: int) -> None:
            """Start the link's messages in order while the next one has both ends reached."""
            q, h = queue[lid], head[lid]
            while h < len(q):
                k = q[h]
                if rreach[k] < 0.0:
                    break
                t = ready[k] = sreach[k] if sreach[k] > rreach[k] else rreach[k]
                if h:
                    prev = q[h - 1]
                    before = ready[prev]
                    if not (t > before or t == before and _served_first(*triggers(prev), *triggers(k))):
                        raise _Fallback  # maybe not served in FIFO order: the engine decides
                    if link_end[lid] > t:
                        t = link_end[lid]
                finish(k, t, durations[(k >> 1) // M + stage_shift])
                link_end[lid] = mend[k]
                h += 1
            head[lid] = h

        starts = [[0.0] * len(ks) for ks in cols.kinds]
        ends = [[0.0] * len(ks) for ks in cols.kinds]
        mem: list[list[tuple[float, float]]] = [[] for _ in range(P)]
        held: list[dict[int, float]] = [{} for _ in range(P)]  # (stage * M + mb) -> bytes
        pcs, t_free = [0] * P, [0.0] * P
        F, B, I, SF, SB, RF = _F, _B, _I, _SF, _SB, _RF
        while todo:
            r = todo.pop()
            ks, ss, ms = cols.kinds[r], cols.stages[r], cols.microbatches[r]
            st_r, en_r, mem_r, held_r = starts[r], ends[r], mem[r], held[r]
            i, n, now = pcs[r], len(ks), t_free[r]
            base = r << 32
            while i < n:
                c = ks[i]
                s = ss[i]
                u = s * M + ms[i]
                if c >= SF:  # a send or a receive: reached now
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
                            if k & 1:
                                advance(lid, dur_b, 0)
                            else:
                                advance(lid, dur_f, -1)
                    i += 1
                    continue
                start = now
                if c == F or c == B or c == I:
                    k = 2 * u if c == F else 2 * u + 1
                    if cross_in[s] if c == F else cross_grad[s]:
                        e = mend[k]
                        if e < 0.0:
                            waiters.setdefault(k, []).append(r)
                            break
                        d = sreach[k]
                        late = e - (now if now > d else d)
                        if late > exposed[k]:
                            exposed[k] = late
                        if e > start:
                            start = e
                now = start + table[c * S + s]
                compute_memory(c, u, start, now, ckpt[s] if u in recomputed else act[s], act[s] - ckpt[s], wgb[s],
                               held_r, mem_r)
                st_r[i] = start
                en_r[i] = now
                i += 1
            pcs[r], t_free[r] = i, now
        if any(pc != len(ks) for pc, ks in zip(pcs, cols.kinds)):
            raise _Fallback  # the evaluation stopped (a link order it cannot take): the dataflow path decides
        return _ref.make_trace(sched, costs, starts, ends, self._records(sreach, spos, rpos, mstart, mend, exposed),
                               mem)

    def _records(self, sreach: list[float], spos: list[int], rpos: list[int], mstart: list[float],
                 mend: list[float], exposed: list[float]) -> list[TransferRecord]:
        """Every message, in the engine's numbering (by the position of its later end, ranks in order)."""
        sched, stages = self.schedule, self.costs.stages
        M, layout = sched.num_microbatches, sched.stage_to_rank
        slots = [k for k, t in enumerate(sreach) if t >= 0.0]
        later = list(map(max, map(spos.__getitem__, slots), map(rpos.__getitem__, slots)))
        slots = [slots[j] for j in sorted(range(len(slots)), key=later.__getitem__)]
        consumer = [(k >> 1) // M for k in slots]
        sender = [s - 1 if not k & 1 else s + 1 for k, s in zip(slots, consumer)]
        kinds = [_K.SEND_B if k & 1 else _K.SEND_F for k in slots]
        return list(map(tuple.__new__, repeat(TransferRecord), zip(
            map(layout.__getitem__, sender), map(layout.__getitem__, consumer), kinds, sender,
            [(k >> 1) % M for k in slots], [stages[min(a, b)].output_bytes for a, b in zip(sender, consumer)],
            map(mstart.__getitem__, slots), map(mend.__getitem__, slots), map(exposed.__getitem__, slots))))
