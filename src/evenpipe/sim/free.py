"""The simulator's rules on instant links, evaluated over computes only (the first evaluator the dispatcher tries).

When every message takes no time (free links, or sizes and latency zero) and the schedule holds only computes and
explicit activation / gradient messages, the event engine's times reduce to a longest path over the computes: a
message arrives when both of its ends are reached (a rank reaches a send or a receive when the compute before it
ends), a link never queues, and a compute starts at the latest of its rank becoming free and its input's send
being reached (its receive comes earlier on its own rank, so it is never later). So this module times the
computes alone, from integer columns, and derives every send's and receive's times, every transfer record and
the memory changes afterwards in bulk. Anything else -- a link that takes time, BPipe or host moves, a message
whose ends are missing, out of order or on the wrong ranks, a deadlock -- answers ``None`` and the dataflow path
(:mod:`evenpipe.sim.fast`) or the event engine decides. A schedule that passed the validator skips the checks
the validator already made and is timed, memory included, in one pass over its lists (:meth:`_FreeRun.run_validated`);
``tests/unit/sim/test_fast_golden.py`` compares both paths' traces with the event engine's, float for float.
"""

from __future__ import annotations

from itertools import accumulate, compress, repeat
from operator import sub

from evenpipe.schedule.ir import Schedule
from evenpipe.schedule.validate import passed_validation
from evenpipe.sim.costs import SimCosts
from evenpipe.sim.kernel import (PARKED, CannotVouch, attempt, compute_memory, cross_rank_inputs, kinds_used, park,
                                 microbatch_tables, recomputed_slots, wait_or_park)
from evenpipe.sim.result import by_end, timeline, unit_bytes
from evenpipe.sim.rules import (CHANNEL, IS_COMPUTE, KINDS, KRECV_B, KRECV_F, KSEND_B, KSEND_F, PLAIN, RECV_SHIFT,
                                SENDER_SHIFT, B, F, I, R)
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["NAME", "applies", "run", "simulate_free"]

NAME = "free"
"""The evaluator's name in traces and in the dispatcher."""


def applies(schedule: Schedule, costs: SimCosts) -> bool:
    """Computes and stage-to-stage messages only, on links that charge no CPU time and no late-receive cost;
    micro-batches may differ (each compute takes its own micro-batch's duration and bytes)."""
    return not costs.link_terms_event_only and PLAIN.issuperset(kinds_used(schedule))


def run(schedule: Schedule, costs: SimCosts, *, trust_validation: bool = True) -> Trace:
    """Time the schedule on instant links; raises :class:`~evenpipe.sim.kernel.CannotVouch` where a link takes
    time or the schedule leaves the instant-link rules. A schedule that passed the validator
    (:func:`~evenpipe.schedule.validate.passed_validation`) is timed in one pass over its lists that relies on the
    validator's rules; ``trust_validation=False`` (the golden tests) takes the path that checks them itself, which
    every other schedule takes."""
    free = _FreeRun(schedule, costs)
    return free.run_validated() if trust_validation and passed_validation(schedule) else free.run()


def simulate_free(schedule: Schedule, costs: SimCosts, *, trust_validation: bool = True) -> Trace | None:
    """The trace the event engine would return, or ``None`` where the instant-link rules do not apply (see
    :func:`run`)."""
    if not applies(schedule, costs):
        return None
    return attempt(lambda: run(schedule, costs, trust_validation=trust_validation))


class _FreeRun:
    def __init__(self, schedule: Schedule, costs: SimCosts) -> None:
        self.schedule, self.costs = schedule, costs
        self.cols = schedule.columns

    def _messages(self) -> tuple[dict[int, int], dict[int, int]]:
        """Send and receive positions (``rank << 32 | index``) by message key ``(channel, sending stage, mb)``."""
        S, M = self.schedule.num_stages, self.schedule.num_microbatches
        cols = self.cols
        sends: dict[int, int] = {}
        recvs: dict[int, int] = {}
        num_sends = num_recvs = 0
        offset = [(CHANNEL[c] * S + SENDER_SHIFT[c]) * M if CHANNEL[c] >= 0 else 0 for c in range(len(KINDS))]
        for r, (ks, ss, ms) in enumerate(zip(cols.kinds, cols.stages, cols.microbatches)):
            base = r << 32
            send_at = [i for i, c in enumerate(ks) if c == KSEND_F or c == KSEND_B]
            recv_at = [i for i, c in enumerate(ks) if c == KRECV_F or c == KRECV_B]
            sends.update(zip([offset[ks[i]] + ss[i] * M + ms[i] for i in send_at], [base | i for i in send_at]))
            recvs.update(zip([offset[ks[i]] + ss[i] * M + ms[i] for i in recv_at], [base | i for i in recv_at]))
            num_sends += len(send_at)
            num_recvs += len(recv_at)
        if len(sends) != num_sends or len(recvs) != num_recvs or sends.keys() != recvs.keys():
            raise CannotVouch  # unmatched or repeated messages: the engine names them
        peers = cols.peers
        low = (1 << 32) - 1
        for key, sp in sends.items():
            rp = recvs[key]
            src, dst = sp >> 32, rp >> 32
            if peers[src][sp & low] != dst or peers[dst][rp & low] != src:
                raise CannotVouch
        return sends, recvs

    def run(self) -> Trace:
        """Time the computes (checking the instant-link rules), then derive memory; the per-action times and
        transfer records are derived when first read."""
        sched, costs, cols = self.schedule, self.costs, self.cols
        P = sched.num_ranks
        sends, recvs = self._messages()
        low = (1 << 32) - 1
        self._check_instant(sends, recvs)
        # computes per rank: positions, and the compute index before each position (-1: none)
        cpos = [[i for i, c in enumerate(ks) if IS_COMPUTE[c]] for ks in cols.kinds]
        before = [list(accumulate(map(int, map(IS_COMPUTE.__getitem__, ks)))) for ks in cols.kinds]  # computes up to i
        offset = list(accumulate([0] + [len(c) for c in cpos]))  # global compute id = offset[r] + j
        deps = self._compute_deps(cpos, before, offset, recvs, sends)
        cstart, ends_of = self._time_computes(cpos, offset, deps)
        mem = self._memory(cpos, offset, cstart, ends_of)

        def times_and_transfers() -> tuple[tuple[list[list[float]], list[list[float]]], tuple[TransferRecord, ...]]:
            starts, ends, reach = self._action_times(cpos, offset, cstart, ends_of)
            records = self._records(sends, recvs, reach, ends, low)
            records.sort(key=by_end)
            return (starts, ends), tuple(records)
        # what make_trace derives from the full times, from the computes alone (a message arrives when the later
        # of its ends is reached, i.e. at some compute's end, so no message ends after the last compute)
        unit = unit_bytes(sched, costs)
        spans = [(sum(map(sub, ends_of[a:b], cstart[a:b])), min(cstart[a:b], default=float("inf")),
                  max(ends_of[a:b], default=float("-inf"))) for a, b in zip(offset, offset[1:])]
        return Trace.deferred(schedule=sched, memory=tuple(timeline(r, mem[r], unit[r]) for r in range(P)),
                              unit_bytes=unit, step_time=max(max(ends_of, default=0.0), 0.0), spans=spans,
                              num_transfers=len(sends), exposed_transfer_time=0.0,
                              times_and_transfers=times_and_transfers, evaluator=NAME)

    def _check_instant(self, sends: dict[int, int], recvs: dict[int, int]) -> None:
        """Raise :class:`CannotVouch` unless every link is instant for the bytes it carries."""
        sched, costs = self.schedule, self.costs
        S, M = sched.num_stages, sched.num_microbatches
        checked: set[tuple[int, int, int]] = set()
        for key, sp in sends.items():
            channel, rest = divmod(key, S * M)
            sending = rest // M
            link = (sp >> 32, recvs[key] >> 32, sending if channel == 0 else sending - 1)
            if link not in checked:
                checked.add(link)
                if costs.link(link[0], link[1]).transfer_time(costs.stages[link[2]].output_bytes):
                    raise CannotVouch

    def _time_computes(self, cpos: list[list[int]], offset: list[int], deps: list[list[tuple[int, ...]]]
                       ) -> tuple[list[float], list[float]]:
        """Start and end of every compute (global ids ``offset[r] + j``), each at the latest of its rank being free
        and the computes it waits for ending."""
        cols, P, M = self.cols, self.schedule.num_ranks, self.schedule.num_microbatches
        SM = self.schedule.num_stages * M
        table = microbatch_tables(self.costs, M)[0]
        cstart: list[float] = [0.0] * offset[-1]
        cend: list[float | None] = [None] * offset[-1]
        end_of = cend.__getitem__
        waiters: dict[int, list[int]] = {}
        pcs, t_free = [0] * P, [0.0] * P
        todo = list(range(P - 1, -1, -1))
        while todo:
            r = todo.pop()
            ks, ss, ms = cols.kinds[r], cols.stages[r], cols.microbatches[r]
            positions, deps_r, base = cpos[r], deps[r], offset[r]
            j, count, now = pcs[r], len(positions), t_free[r]
            while j < count:
                start = wait_or_park(end_of, deps_r[j], now, waiters, r)
                if start == PARKED:
                    break
                i = positions[j]
                end = start + table[ks[i] * SM + ss[i] * M + ms[i]]
                g = base + j
                cstart[g] = start
                cend[g] = end
                woken = waiters.pop(g, None)
                if woken:
                    todo.extend(woken)
                now = end
                j += 1
            pcs[r] = j
            t_free[r] = now
        if any(pc != len(c) for pc, c in zip(pcs, cpos)):
            raise CannotVouch  # a deadlock: the engine reports it
        return cstart, cend  # type: ignore[return-value]  # every compute is timed by now

    def _memory(self, cpos: list[list[int]], offset: list[int], cstart: list[float], cend: list[float]
                ) -> list[list[tuple[float, float]]]:
        """Each rank's memory changes, in program order, as the engine records them."""
        cols = self.cols
        recomputed = {(s, m) for ks, ss, ms in zip(cols.kinds, cols.stages, cols.microbatches) if R in ks
                      for c, s, m in zip(ks, ss, ms) if c == R}
        M = self.schedule.num_microbatches
        _, act, ckpt, wgb = microbatch_tables(self.costs, M)
        mem: list[list[tuple[float, float]]] = []
        for r, positions in enumerate(cpos):
            ks, ss, ms, base = cols.kinds[r], cols.stages[r], cols.microbatches[r], offset[r]
            held: dict[tuple[int, int], float] = {}
            mem_r: list[tuple[float, float]] = []
            for j, i in enumerate(positions):
                u, mk = ss[i] * M + ms[i], (ss[i], ms[i])
                compute_memory(ks[i], mk, cstart[base + j], cend[base + j],
                               ckpt[u] if mk in recomputed else act[u], act[u] - ckpt[u], wgb[u], held, mem_r)
            mem.append(mem_r)
        return mem

    def run_validated(self) -> Trace:
        """:meth:`run` for a schedule that passed the validator, in one pass over each rank's list.

        The validator guarantees what :meth:`run` checks: every message has both ends on the ranks of its
        neighbouring stages (so the links to check follow from the layout), each compute lives on its stage's rank,
        its input's receive comes earlier on its rank and a producer on its own rank earlier still, and sends
        follow what they send. So a send, reached when the compute before it ends, writes that time into its
        consumer's slot, and a compute whose input comes from another rank (the layout tells) waits, in evaluation
        order, until that slot is written and starts at the later of its rank being free and that time --
        :meth:`run`'s rule; receives add nothing and are skipped. Memory changes are recorded as each compute is
        timed, in program order, by :func:`~evenpipe.sim.kernel.compute_memory`."""
        sched, costs = self.schedule, self.costs
        layout, stages = sched.stage_to_rank, costs.stages
        for s in range(sched.num_stages - 1):  # every cut between ranks carries both directions' messages
            a, b = layout[s], layout[s + 1]
            nb = stages[s].output_bytes
            if a != b and (costs.link(a, b).transfer_time(nb) or costs.link(b, a).transfer_time(nb)):
                raise CannotVouch
        return self._validated_trace(*self._one_pass())

    def _one_pass(self) -> tuple[list[list[float]], list[list[float]], list[list[tuple[float, float]]]]:
        """:meth:`run_validated`'s pass: per rank the start and end of each compute (receives dropped, sends
        kept) and the memory changes."""
        sched, cols = self.schedule, self.cols
        P, S, M = sched.num_ranks, sched.num_stages, sched.num_microbatches
        recomputed = recomputed_slots(sched)
        table, act, ckpt, wgb = microbatch_tables(self.costs, M)
        SM = S * M
        slot = [0.0] * (2 * S * M)  # 2u: when F(u)'s input was sent; 2u + 1: B/I(u)'s output gradient
        posted = bytearray(2 * S * M)
        cross_in, cross_grad = cross_rank_inputs(sched.stage_to_rank)
        # receives add nothing on instant links (the consumer waits for the send itself): drop them
        lists = []
        for ks, ss, ms in zip(cols.kinds, cols.stages, cols.microbatches):
            keep = [c != KRECV_F and c != KRECV_B for c in ks]
            lists.append((list(compress(ks, keep)), list(compress(ss, keep)), list(compress(ms, keep))))
        waiters: dict[int, list[int]] = {}
        pcs, t_free = [0] * P, [0.0] * P
        starts: list[list[float]] = [[] for _ in range(P)]
        ends: list[list[float]] = [[] for _ in range(P)]
        mem: list[list[tuple[float, float]]] = [[] for _ in range(P)]
        held: list[dict[int, float]] = [{} for _ in range(P)]
        FWD, BWD, BIN, SF, SB = F, B, I, KSEND_F, KSEND_B
        todo = list(range(P - 1, -1, -1))
        while todo:
            r = todo.pop()
            ks, ss, ms = lists[r]
            st_r, en_r, mem_r, held_r = starts[r], ends[r], mem[r], held[r]
            i, n, now = pcs[r], len(ks), t_free[r]
            while i < n:
                c = ks[i]
                s = ss[i]
                u = s * M + ms[i]
                if c == SF or c == SB:
                    k = 2 * (u + M) if c == SF else 2 * (u - M) + 1
                    slot[k] = now
                    posted[k] = 1
                    woken = waiters.pop(k, None)
                    if woken:
                        todo.extend(woken)
                    i += 1
                    continue
                start = now
                if c == FWD or c == BWD or c == BIN:
                    k = 2 * u if c == FWD else 2 * u + 1
                    if cross_in[s] if c == FWD else cross_grad[s]:
                        if not posted[k]:
                            park(waiters, k, r)
                            break
                        if slot[k] > now:
                            start = slot[k]
                now = start + table[c * SM + u]
                compute_memory(c, u, start, now, ckpt[u] if u in recomputed else act[u], act[u] - ckpt[u], wgb[u],
                               held_r, mem_r)
                st_r.append(start)
                en_r.append(now)
                i += 1
            pcs[r], t_free[r] = i, now
        if any(pc != len(ks) for pc, (ks, _, _) in zip(pcs, lists)):
            raise CannotVouch  # cannot happen after the dry run; the engine would report it
        return starts, ends, mem

    def _validated_trace(self, starts: list[list[float]], ends: list[list[float]],
                         mem: list[list[tuple[float, float]]]) -> Trace:
        """The deferred trace of :meth:`_one_pass`'s computes: the sends, receives and records come when read."""
        sched, costs, cols = self.schedule, self.costs, self.cols
        P = sched.num_ranks
        num_transfers = sum(ks.count(KSEND_F) + ks.count(KSEND_B) for ks in cols.kinds)

        def times_and_transfers() -> tuple[tuple[list[list[float]], list[list[float]]], tuple[TransferRecord, ...]]:
            sends, recvs = self._messages()
            cpos = [[i for i, c in enumerate(ks) if IS_COMPUTE[c]] for ks in cols.kinds]
            offset = list(accumulate([0] + [len(c) for c in cpos]))
            cstart = [t for row in starts for t in row]
            cend = [t for row in ends for t in row]
            times, finish, reach = self._action_times(cpos, offset, cstart, cend)
            records = self._records(sends, recvs, reach, finish, (1 << 32) - 1)
            records.sort(key=by_end)
            return (times, finish), tuple(records)
        unit = unit_bytes(sched, costs)
        spans = [(sum(map(sub, en, st)), min(st, default=float("inf")), max(en, default=float("-inf")))
                 for st, en in zip(starts, ends)]
        return Trace.deferred(schedule=sched, memory=tuple(timeline(r, mem[r], unit[r]) for r in range(P)),
                              unit_bytes=unit, step_time=max(max((max(en, default=0.0) for en in ends),
                                                                 default=0.0), 0.0),
                              spans=spans, num_transfers=num_transfers, exposed_transfer_time=0.0,
                              times_and_transfers=times_and_transfers, evaluator=NAME)

    def _compute_deps(self, cpos: list[list[int]], before: list[list[int]], offset: list[int],
                      recvs: dict[int, int], sends: dict[int, int]) -> list[list[tuple[int, ...]]]:
        """Per rank and compute, the global ids of the computes whose ends it waits for: the compute before the
        send of its input (or output gradient) on the sender's rank; a producer on its own rank must come
        earlier (it then adds no wait)."""
        sched, cols = self.schedule, self.cols
        S, M, layout = sched.num_stages, sched.num_microbatches, sched.stage_to_rank
        last = S - 1
        low = (1 << 32) - 1
        out: list[list[tuple[int, ...]]] = []
        for r, positions in enumerate(cpos):
            ks, ss, ms = cols.kinds[r], cols.stages[r], cols.microbatches[r]
            produced: dict[tuple[int, int, int], int] = {}  # (slot, stage, mb) -> position; slot 0: F, 1: B/I
            row: list[tuple[int, ...]] = []
            for i in positions:
                c, s, m = ks[i], ss[i], ms[i]
                if layout[s] != r:
                    raise CannotVouch
                if c == F:
                    src_stage, slot, channel = s - 1, 0, 0
                elif (c == B or c == I) and s < last:
                    src_stage, slot, channel = s + 1, 1, 1
                else:
                    src_stage = -1
                dep: tuple[int, ...] = ()
                if 0 <= src_stage < S:
                    if layout[src_stage] == r:
                        if (slot, src_stage, m) not in produced:
                            raise CannotVouch  # consumer before its producer: the engine decides
                    else:
                        key = (channel * S + src_stage) * M + m
                        rp = recvs.get(key)
                        if rp is None or rp >> 32 != r or rp & low > i:
                            raise CannotVouch  # no receive here (an implicit message), or it comes too late
                        sp = sends[key]
                        q, k = sp >> 32, before[sp >> 32][sp & low] - 1
                        if k >= 0:
                            dep = (offset[q] + k,)
                if c == F or c == B or c == I:
                    mark = (0 if c == F else 1, s, m)
                    if mark in produced:
                        raise CannotVouch  # produced twice
                    produced[mark] = i
                row.append(dep)
            for i, c in enumerate(ks):  # a send follows what it sends (else its data is late)
                if (c == KSEND_F or c == KSEND_B) and produced.get((0 if c == KSEND_F else 1, ss[i], ms[i]), i) >= i:
                    raise CannotVouch
            out.append(row)
        return out

    def _action_times(self, cpos: list[list[int]], offset: list[int], cstart: list[float], cend: list[float]
                      ) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
        """Per rank and position: start and end (a send or receive: when it is reached, and for now the same as
        its end; the message ends are filled in by :meth:`_records`), and when the rank reaches it."""
        starts, ends, reach = [], [], []
        for r, ks in enumerate(self.cols.kinds):
            n = len(ks)
            positions = cpos[r]
            base = offset[r]
            vals = [0.0] * n
            for j, i in enumerate(positions):
                vals[i] = cend[base + j]
            reached = list(accumulate(vals, max))  # at a transfer: the end of the last compute before it
            st = list(reached)
            en = list(reached)
            for j, i in enumerate(positions):
                st[i] = cstart[base + j]
            starts.append(st)
            ends.append(en)
            reach.append(reached)
        return starts, ends, reach

    def _records(self, sends: dict[int, int], recvs: dict[int, int], reach: list[list[float]],
                 ends: list[list[float]], low: int) -> list[TransferRecord]:
        """Every message, in the engine's numbering (by the position of its later end, ranks in order), with
        both ends' action end set to its arrival."""
        cols, stages = self.cols, self.costs.stages
        send_at = list(sends.values())
        recv_at = list(map(recvs.__getitem__, sends))
        later = list(map(max, send_at, recv_at))
        order = sorted(range(len(later)), key=later.__getitem__)
        send_at = [send_at[k] for k in order]
        recv_at = [recv_at[k] for k in order]
        src = [p >> 32 for p in send_at]
        dst = [p >> 32 for p in recv_at]
        si = [p & low for p in send_at]
        ri = [p & low for p in recv_at]
        arrive = list(map(max, [reach[q][i] for q, i in zip(src, si)], [reach[q][i] for q, i in zip(dst, ri)]))
        for q, i, e in zip(src, si, arrive):
            ends[q][i] = e
        for q, i, e in zip(dst, ri, arrive):
            ends[q][i] = e
        kinds = [KINDS[cols.kinds[q][i]] for q, i in zip(src, si)]
        stage = [cols.stages[q][i] for q, i in zip(src, si)]
        mb = [cols.microbatches[q][i] for q, i in zip(src, si)]
        if self.costs.microbatch_stages is None:
            nbytes = [stages[min(s, s + RECV_SHIFT[k.code])].output_bytes for k, s in zip(kinds, stage)]
        else:
            cost_of = self.costs.cost_of
            nbytes = [cost_of(min(s, s + RECV_SHIFT[k.code]), m).output_bytes for k, s, m in zip(kinds, stage, mb)]
        return list(map(tuple.__new__, repeat(TransferRecord),
                        zip(src, dst, kinds, stage, mb, nbytes, arrive, arrive, repeat(0.0))))

