"""Discrete-event simulation of one schedule step under a cost model.

Execution model (the runtime's as well):

- each rank runs its action list in order, one compute at a time;
- a send never blocks its rank, and a receive is only *posted* when the rank reaches it;
- a message moves once the send is reached, the receive is posted and its directed link is free (one transfer
  at a time per direction of a rank pair); it takes ``costs.link(src, dst).transfer_time(bytes)``;
- a compute waits for the messages it consumes (its input activation or output gradient, and its evicted or
  offloaded activations coming back); transfers overlap compute;
- BPipe: ``EVICT`` frees the evictor's copy and ``RETURN`` the acceptor's only when the transfer lands, so
  the rank's next allocations wait for them: a ``F`` or ``R`` waits until every ``EVICT`` its rank issued
  before it has landed, so does the transfer of a later ``LOAD``, and an ``ACCEPT``'s transfer waits for every
  ``RETURN`` (and ``ACCEPT``) its rank posted before it. The wait beyond a compute's other inputs counts as
  those transfers' exposed time. An acceptor's own ``F`` does not wait for its ``RETURN``s (that would stall
  it for a slow link; the BPipe transform bounds the overlap instead, see below);
- host offload/reload use the rank's host link, ``costs.link(rank, rank)``, one transfer per direction at a time;
- a message whose receive is posted after its send takes ``late_receive_s`` of its link longer (a rendezvous
  backend on a busy CPU host, see :mod:`evenpipe.sim.costs`);
- a link with ``cpu_s_per_byte`` (a CPU host, where the backend's threads copy on the cores that compute) gives
  each endpoint rank ``cpu_s_per_byte * bytes`` of work when the transfer starts; it runs once the rank's
  current compute ends (or at once on an idle rank), and the rank's next compute starts after it. Transfers
  themselves keep their link time; the work is no action, so the trace counts it as the rank's idle time.

Memory per rank counts activation bytes saved for backward, own plus hosted (BPipe). ``F`` allocates
``activation_bytes`` (``checkpoint_bytes`` if that micro-batch is recomputed), ``R`` adds the difference, ``B``
frees the micro-batch, ``I`` keeps ``weight_grad_bytes`` until ``W``. ``EVICT``/``RETURN``/``OFFLOAD`` free on the
sender when the transfer lands; ``ACCEPT``/``LOAD``/``RELOAD`` allocate on the receiver when the transfer starts
(the first bytes arrive), not when the receive is posted, which is how the runtime takes the buffer.

Consequences (pinned by the tests), whatever the costs and links: an evictor (or any rank without ``RETURN`` or
``OFFLOAD``) never holds more activation units than the largest prefix sum of its program order
(``schedule.bpipe.held_units``), since its allocations take effect no earlier than their place in the list and
its frees no later than its next allocation; an acceptor's own units never exceed its own program-order peak
and its hosted units never exceed its hosted program-order peak, so it never holds more than their sum, which
the BPipe transform keeps within the budget.

The engine uses a heap of timed events (plus a queue of events due now) and per-rank cursors:
O(actions x log events), no scans. It is the reference: :func:`evenpipe.sim.simulate` first tries the same rules
evaluated by quicker evaluators (:mod:`evenpipe.sim.dispatch`, exact where they answer, checked against this engine
by golden tests) and runs this engine where none can vouch for an identical trace.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Hashable

from evenpipe.errors import ConfigError, ScheduleValidationError
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.sim.costs import SimCosts, StageCosts
from evenpipe.sim.kernel import PARKED, gc_paused, wait_or_park
from evenpipe.sim.result import by_end, make_trace
from evenpipe.sim.rules import (ALLOCS, EVENT, FREES, HOST, HOST_SIDE, KACCEPT, KB, KEVICT, KF, KI, KINDS, KLOAD,
                                KOFFLOAD, KR, KRECV_B, KRECV_F, KRELOAD, KRETURN, KSEND_F, PEER, RECV, RECV_SHIFT,
                                SEND, B, F, I, R, W)
from evenpipe.sim.trace import TransferRecord, Trace

__all__ = ["NAME", "simulate_events", "check_costs", "run"]

NAME = "events"
"""The evaluator's name in traces and in the dispatcher."""

_Dep = tuple[Hashable, float, int]
"""(signal, delay after it, transfer id or -1): a compute waits until ``signal`` time + delay."""


class _Xfer:
    """Mutable state of one message during the run (a plain slotted class, as the run's other state: a dataclass
    costs every import of the simulator its generated methods)."""

    __slots__ = ("src", "dst", "kind", "stage", "microbatch", "num_bytes", "duration", "link", "send_pos", "recv_pos",
                 "signal", "pending", "ready_data", "start", "end", "exposed", "frees", "allocs", "cpu", "late")

    def __init__(self, src: int, dst: int, kind: ActionKind, stage: int, microbatch: int, num_bytes: float,
                 duration: float, link: tuple[int, int], send_pos: tuple[int, int] | None,
                 recv_pos: tuple[int, int] | None, signal: Hashable, pending: int = 0, ready_data: float = 0.0,
                 start: float = -1.0, end: float = -1.0, exposed: float = 0.0, frees: bool = False,
                 allocs: bool = False, cpu: float = 0.0, late: float = 0.0) -> None:
        self.src, self.dst, self.kind, self.stage, self.microbatch = src, dst, kind, stage, microbatch
        self.num_bytes, self.duration, self.link, self.send_pos, self.recv_pos = num_bytes, duration, link, send_pos, recv_pos
        self.signal = signal
        """Signal set when the message arrives."""
        self.pending = pending
        """Conditions still missing before the transfer may start (send reached, receive posted, data ready)."""
        self.ready_data = ready_data
        """When the data was ready on the sending side (send reached and, for RETURN/RELOAD, the data arrived)."""
        self.start, self.end, self.exposed = start, end, exposed
        self.frees = frees
        """Whether arrival frees the sender's copy (EVICT, RETURN, OFFLOAD)."""
        self.allocs = allocs
        """Whether the start allocates on the receiver (ACCEPT, LOAD, RELOAD)."""
        self.cpu = cpu
        """Seconds of compute each endpoint rank gives to this transfer (``Link.cpu_s_per_byte``)."""
        self.late = late
        """Seconds added when the receive was posted after the send (``Link.late_receive_s``)."""


def simulate_events(schedule: Schedule, costs: SimCosts, *,
                    durations: dict[tuple[int, int], float] | None = None) -> Trace:
    """The reference: simulate with the event engine described above (same contract as
    :func:`evenpipe.sim.simulate`). ``durations`` gives every compute its own duration, keyed by (rank, index in
    the rank's action list), instead of its stage's (see :func:`evenpipe.sim.replay.replay`)."""
    with gc_paused():  # first, before anything allocates
        check_costs(schedule, costs)
        return _Engine(schedule, costs, per_action=durations).run()


def run(schedule: Schedule, costs: SimCosts) -> Trace:
    """The dispatcher's entry (costs already checked, collections paused): always answers."""
    return _Engine(schedule, costs).run()


def check_costs(schedule: Schedule, costs: SimCosts) -> None:
    """Raise :class:`ConfigError` unless ``costs`` describes every stage of ``schedule``."""
    if len(costs.stages) != schedule.num_stages:
        raise ConfigError(f"costs describe {len(costs.stages)} stages but schedule {schedule.name!r} has "
                          f"{schedule.num_stages}; pass one StageCosts per stage")
    per = costs.microbatch_stages
    if per is not None and (len(per) != schedule.num_microbatches or len(per[0]) != schedule.num_stages):
        raise ConfigError(f"per-micro-batch costs describe {len(per)} micro-batches of {len(per[0])} stages but "
                          f"schedule {schedule.name!r} has {schedule.num_microbatches} of {schedule.num_stages}; "
                          "pass one row per micro-batch")


def _stuck_grid(schedule: Schedule, pcs: list[int], width: int = 4) -> str:
    """Rank-by-step excerpt with each rank's first unfinished action in brackets."""
    lines = []
    for r, acts in enumerate(schedule.actions):
        pc = pcs[r]
        lo, hi = max(0, pc - width), min(len(acts), pc + width + 1)
        tokens = [f"[{a}]" if lo + j == pc else str(a) for j, a in enumerate(acts[lo:hi])]
        if pc >= len(acts):
            tokens.append("(done)")
        lines.append(f"  rank {r}: {'... ' if lo else ''}{' '.join(tokens)}{' ...' if hi < len(acts) else ''}")
    return "\n".join(lines)


def _microbatch_durations(schedule: Schedule, codes: list[list[int]],
                          per_mb: tuple[tuple[StageCosts, ...], ...]) -> dict[tuple[int, int], float]:
    """Per (rank, action index), a compute's duration from its own micro-batch's costs."""
    out: dict[tuple[int, int], float] = {}
    for r, acts in enumerate(schedule.actions):
        for i, (a, c) in enumerate(zip(acts, codes[r])):
            if c < SEND:
                st = per_mb[a.microbatch][a.stage]
                out[(r, i)] = (st.forward, st.backward, st.backward_input, st.backward_weight,
                               st.recompute_time)[c]
    return out


class _RankMoves:
    """One rank's moves met so far while preparing it (keys are (stage, micro-batch))."""

    __slots__ = ("away", "back", "accepted", "offloaded", "evicting", "returning")

    def __init__(self) -> None:
        self.away: dict[tuple[int, int], ActionKind] = {}
        """EVICT/OFFLOAD not yet brought back."""
        self.back: dict[tuple[int, int], int] = {}
        """LOAD/RELOAD index not yet consumed."""
        self.accepted: dict[tuple[int, int], int] = {}
        self.offloaded: set[tuple[int, int]] = set()
        self.evicting: list[int] = []
        """EVICTs posted since the last F/R: the next F/R and LOADs wait for them to land."""
        self.returning: list[int] = []
        """RETURNs posted since the last ACCEPT, and that ACCEPT: the next ACCEPT waits for them."""


class _Engine:
    """State of one run. Signals are transfer ids (message arrived), ``("F"|"G", stage, mb)`` (a forward or an
    input gradient finished, only when a consumer has no message to wait on) or ``("off", rank, stage, mb)``."""

    __slots__ = ("schedule", "costs", "xfers", "time_of", "duration", "codes", "xfer_at", "deps", "gates", "gated",
                 "needed", "recomputed", "avail", "waiters", "links_free", "link_queue", "heap", "soon", "now", "seq",
                 "pc", "t_free", "cpu_free", "starts", "ends", "held", "mem", "late", "per_action")

    def __init__(self, schedule: Schedule, costs: SimCosts,
                 per_action: dict[tuple[int, int], float] | None = None) -> None:
        self.schedule = schedule
        self.costs = costs
        self.per_action = per_action
        """Per (rank, action index), a compute's own duration instead of its stage's (a replay of measured
        times)."""
        self.xfers: list[_Xfer] = []
        self.time_of: dict[tuple[tuple[int, int], float], tuple[float, float, float]] = {}
        """Transfer time, endpoint CPU time and late-receive cost per (directed pair, bytes), computed once."""
        self.duration: list[list[float]] = []
        """Per compute code (F, B, I, W, R) and stage, the action's duration."""
        self.codes: list[list[int]] = []
        """Per rank and action index, the kind code."""
        self.xfer_at: list[list[int]] = []
        """Per rank and action index, the transfer id of a send/receive (-1 for computes)."""
        self.deps: list[list[tuple[_Dep, ...]]] = []
        """Per rank and action index, what a compute waits for."""
        self.gates: list[list[tuple[int, ...]]] = []
        """Per rank and action index, the EVICT transfers a ``F``/``R`` waits to land (issued since the previous
        one)."""
        self.gated: dict[int, list[int]] = {}
        """Transfer id -> ACCEPT/LOAD transfers of the same rank that may not start before it lands."""
        self.needed: set[Hashable] = set()
        """Compute-completion signals somebody waits on."""
        self.recomputed: set[tuple[int, int]] = set()
        self.avail: dict[Hashable, float] = {}
        self.waiters: dict[Hashable, list[int]] = {}
        """Signal -> ranks (>= 0) or transfers (``-(id + 1)``) waiting for it."""
        self.links_free: dict[tuple[int, int], float] = {}
        self.link_queue: dict[tuple[int, int], deque[int]] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.soon: deque[int] = deque()
        """Events due at ``now``, in the order they were scheduled."""
        self.now = 0.0
        self.seq = 0
        self.pc: list[int] = []
        self.t_free: list[float] = []
        self.cpu_free: list[float] = []
        """Per rank, when the transfer work charged to it (``Link.cpu_s_per_byte``) is done."""
        self.starts: list[list[float]] = []
        self.ends: list[list[float]] = []
        self.held: list[dict[tuple[int, int], float]] = []
        self.mem: list[list[tuple[float, float]]] = []
        """Per rank, (time, bytes delta) in the order they were decided."""
        self.late: list[Hashable] = []
        """Compute-completion signals to announce at their end time (event ids after the transfers')."""

    # -- preparation --------------------------------------------------------------------------------------
    def _bytes_moved(self, stage: int, mb: int) -> float:
        st = self.costs.cost_of(stage, mb)
        return st.checkpoint_bytes if (stage, mb) in self.recomputed else st.activation_bytes

    def _new_xfer(self, src: int, dst: int, kind: ActionKind, stage: int, mb: int, num_bytes: float,
                  send_pos: tuple[int, int] | None, recv_pos: tuple[int, int] | None,
                  link: tuple[int, int], signal: Hashable | None = None) -> int:
        tid = len(self.xfers)
        times = self.time_of.get((link, num_bytes))
        if times is None:
            host_side = max(src, dst)  # a host transfer uses the rank's own pair (rank, rank)
            timing = self.costs.link(src, dst) if src != HOST and dst != HOST else \
                self.costs.link(host_side, host_side)
            times = self.time_of[(link, num_bytes)] = (timing.transfer_time(num_bytes), timing.cpu_time(num_bytes),
                                                       timing.late_receive_s)
        self.xfers.append(_Xfer(src, dst, kind, stage, mb, num_bytes, times[0], link,
                                send_pos, recv_pos, tid if signal is None else signal,
                                (send_pos is not None) + (recv_pos is not None), 0.0, -1.0, -1.0, 0.0,
                                FREES[kind.code], ALLOCS[kind.code], times[1],
                                times[2] if send_pos is not None and recv_pos is not None else 0.0))
        if send_pos is not None:
            self.xfer_at[send_pos[0]][send_pos[1]] = tid
        if recv_pos is not None:
            self.xfer_at[recv_pos[0]][recv_pos[1]] = tid
        return tid

    def _add_data_dep(self, tid: int, signal: Hashable) -> None:
        self.xfers[tid].pending += 1
        self.waiters.setdefault(signal, []).append(-(tid + 1))

    def _fail(self, rule: str, message: str, r: int, i: int) -> ScheduleValidationError:
        pcs = [len(a) for a in self.schedule.actions]
        pcs[r] = i
        return ScheduleValidationError(rule, message, _stuck_grid(self.schedule, pcs))

    def _prepare(self) -> None:
        """Match every send with its receive (creating the transfers), then derive each compute's inputs."""
        sched = self.schedule
        stages = self.costs.stages
        self.duration = [[st.forward for st in stages], [st.backward for st in stages],
                         [st.backward_input for st in stages], [st.backward_weight for st in stages],
                         [st.recompute_time for st in stages]]
        code = EVENT
        self.codes = [[code[a.kind.code] for a in acts] for acts in sched.actions]  # type: ignore[misc]
        per_mb = self.costs.microbatch_stages
        if per_mb is not None and self.per_action is None:  # unequal micro-batches: each compute its own time
            self.per_action = _microbatch_durations(sched, self.codes, per_mb)
        self.recomputed = {a.key for acts, codes in zip(sched.actions, self.codes) if R in codes
                           for a, c in zip(acts, codes) if c == R}
        self.xfer_at = [[-1] * len(acts) for acts in sched.actions]
        unmatched: dict[tuple[int, int, int, int, int], tuple[int, int]] = {}  # one side seen, other not yet
        recv_index: list[dict[tuple[int, int, int], int]] = []
        pop, match, shift, host_side = unmatched.pop, PEER, RECV_SHIFT, HOST_SIDE
        for r, acts in enumerate(sched.actions):
            idx: dict[tuple[int, int, int], int] = {}
            codes = self.codes[r]
            for i, c in enumerate(codes):
                if c < SEND:
                    continue
                a = acts[i]
                kc = a.kind.code
                peer = a.peer
                if peer is None or host_side[kc]:  # host transfers: no peer rank
                    continue
                if c < RECV:
                    key = (r, peer, match[kc], a.stage + shift[kc], a.microbatch)
                    side = (r, i)
                else:
                    key = (peer, r, kc, a.stage, a.microbatch)
                    idx[key[2:]] = i
                    side = (-1 - r, i)  # receives are marked with negative ranks
                other = pop(key, None)
                if other is None:
                    unmatched[key] = side
                elif (other[0] < 0) == (side[0] < 0):
                    raise self._fail("match", f"rank {r} has {a} twice", r, i)
                else:
                    send_pos, recv_pos = (side, other) if side[0] >= 0 else (other, side)
                    recv_pos = (-1 - recv_pos[0], recv_pos[1])
                    send = sched.actions[send_pos[0]][send_pos[1]]
                    if self.codes[send_pos[0]][send_pos[1]] == SEND:  # activation/gradient: boundary output
                        num_bytes = (stages if per_mb is None else per_mb[key[4]])[min(send.stage, key[3])].output_bytes
                    else:
                        num_bytes = self._bytes_moved(key[3], key[4])
                    self._new_xfer(key[0], key[1], send.kind, send.stage, key[4], num_bytes, send_pos, recv_pos,
                                   key[:2])
            recv_index.append(idx)
        for key, (r, i) in unmatched.items():
            if r >= 0:
                raise self._fail("match", f"{sched.actions[r][i]} on rank {r} has no matching "
                                 f"{KINDS[key[2]].value} on rank "
                                 f"{key[1]}", r, i)
            r = -1 - r
            raise self._fail("match", f"{sched.actions[r][i]} on rank {r} has no matching send on rank {key[0]}",
                             r, i)
        self.gates = [[()] * len(acts) for acts in sched.actions]
        self.deps = [self._prepare_rank(r, recv_index[r]) for r in range(sched.num_ranks)]

    def _prepare_rank(self, r: int, recv_index: dict[tuple[int, int, int], int]) -> list[tuple[_Dep, ...]]:
        """Derive what each compute of rank ``r`` waits for, and the data each of its sends waits for."""
        sched = self.schedule
        last = sched.num_stages - 1
        done: set[tuple[str, int, int]] = set()  # ("F" | "G", stage, mb) produced so far on this rank
        mv = _RankMoves()
        away, back, evicting = mv.away, mv.back, mv.evicting
        xfer_at, gates = self.xfer_at[r], self.gates[r]
        out: list[tuple[_Dep, ...]] = []
        no_deps: tuple[_Dep, ...] = ()
        codes = self.codes[r]
        for i, a in enumerate(sched.actions[r]):
            c = codes[i]
            if c == RECV:  # activation / gradient receive: nothing to derive
                out.append(no_deps)
                continue
            s, m = a.stage, a.microbatch
            if c == SEND:  # SEND_F / SEND_B: normally after the compute that produced the data
                signal = ("F", s, m) if a.kind.code == KSEND_F else ("G", s, m)
                if signal not in done:
                    self._add_data_dep(xfer_at[i], signal)
                    self.needed.add(signal)
                out.append(no_deps)
                continue
            kc = a.kind.code
            deps: list[_Dep] = []
            if c < SEND:
                if kc == KF and s > 0:
                    deps.extend(self._input_dep(r, s, m, s - 1, KRECV_F, "F", recv_index, done))
                elif (kc == KB or kc == KI) and s < last:
                    deps.extend(self._input_dep(r, s, m, s + 1, KRECV_B, "G", recv_index, done))
                if kc != KF:
                    if (s, m) in back:
                        tid = xfer_at[back.pop((s, m))]
                        deps.append((tid, 0.0, tid))
                    elif (s, m) in away:
                        raise self._fail("evict", f"{a} on rank {r} needs activations that {away[(s, m)].value} "
                                         f"sent away and no load brings back before it", r, i)
                if kc == KF:
                    done.add(("F", s, m))
                elif kc == KB or kc == KI:
                    done.add(("G", s, m))
                if evicting and (kc == KF or kc == KR):
                    gates[i] = tuple(evicting)
                    evicting.clear()
            else:
                self._prepare_move(r, i, a, mv)
                if (kc == KEVICT or kc == KOFFLOAD) and ("F", s, m) not in done:
                    self._add_data_dep(xfer_at[i], ("F", s, m))
                    self.needed.add(("F", s, m))
            out.append(tuple(deps) if deps else no_deps)
        return out

    def _prepare_move(self, r: int, i: int, a: Action, mv: "_RankMoves") -> None:
        """A BPipe or host move of rank ``r``: what its transfer waits for, and the rank's record of moves."""
        kc, s, m = a.kind.code, a.stage, a.microbatch
        xfer_at = self.xfer_at[r]
        if kc == KEVICT or kc == KOFFLOAD:
            mv.away[(s, m)] = a.kind
            if kc == KEVICT:
                mv.evicting.append(xfer_at[i])
            if kc == KOFFLOAD:
                mv.offloaded.add((s, m))
                self._new_xfer(r, HOST, a.kind, s, m, self._bytes_moved(s, m), (r, i), None, (r, HOST),
                               signal=("off", r, s, m))
        elif kc == KLOAD or kc == KRELOAD:
            mv.away.pop((s, m), None)
            mv.back[(s, m)] = i
            if kc == KRELOAD:
                if (s, m) not in mv.offloaded:
                    raise self._fail("offload", f"{a} on rank {r} reloads activations never offloaded", r, i)
                tid = self._new_xfer(HOST, r, a.kind, s, m, self._bytes_moved(s, m), None, (r, i), (HOST, r))
                self._add_data_dep(tid, ("off", r, s, m))
            else:
                self._gate_transfer(xfer_at[i], mv.evicting)
        elif kc == KACCEPT:
            mv.accepted[(s, m)] = i
            self._gate_transfer(xfer_at[i], mv.returning)
            mv.returning[:] = [xfer_at[i]]  # later ACCEPTs start after this one (and so after these RETURNs)
        elif kc == KRETURN:
            if (s, m) not in mv.accepted:
                raise self._fail("evict", f"{a} on rank {r} returns activations it never accepted", r, i)
            self._add_data_dep(xfer_at[i], xfer_at[mv.accepted.pop((s, m))])
            mv.returning.append(xfer_at[i])

    def _gate_transfer(self, tid: int, landings: list[int]) -> None:
        """Transfer ``tid`` (an ACCEPT/LOAD) starts only once the transfers in ``landings`` have landed."""
        for landing in landings:
            self.xfers[tid].pending += 1
            self.gated.setdefault(landing, []).append(tid)

    def _input_dep(self, r: int, s: int, m: int, src_stage: int, recv_code: int, signal: str,
                   recv_index: dict[tuple[int, int, int], int], done: set[tuple[str, int, int]]) -> list[_Dep]:
        """What compute (s, m) on rank r waits for from stage ``src_stage`` (its input or its output gradient)."""
        q = self.schedule.stage_to_rank[src_stage]
        if q != r:
            j = recv_index.get((recv_code, s, m))
            if j is not None:
                tid = self.xfer_at[r][j]
                return [(tid, 0.0, tid)]
            # No receive in the schedule (e.g. compute-only CSV): an implicit, unserialised transfer.
            num_bytes = self.costs.cost_of(min(s, src_stage), m).output_bytes
            self.needed.add((signal, src_stage, m))
            return [((signal, src_stage, m), self.costs.link(q, r).transfer_time(num_bytes), -1)]
        if (signal, src_stage, m) in done:
            return []
        self.needed.add((signal, src_stage, m))
        return [((signal, src_stage, m), 0.0, -1)]

    # -- event loop -----------------------------------------------------------------------------------------
    def _push(self, t: float, payload: int) -> None:
        """Schedule an event: a rank id (>= 0), a finished transfer ``-(id + 1)``, or a late signal."""
        if t <= self.now:  # due now (free links, zero durations): skip the heap
            self.soon.append(payload)
        else:
            self.seq += 1
            heapq.heappush(self.heap, (t, self.seq, payload))

    def _mem(self, r: int, t: float, delta: float) -> None:
        self.mem[r].append((t, delta))

    def _signal(self, key: Hashable, t: float) -> None:
        self.avail[key] = t
        for w in self.waiters.pop(key, ()):
            if w >= 0:
                self._advance(w, t)
            else:
                self._condition_met(-w - 1, t)

    def _condition_met(self, tid: int, now: float) -> None:
        """The data a transfer sends became available (its producer finished or it arrived here first)."""
        x = self.xfers[tid]
        if x.ready_data < now:
            x.ready_data = now
        x.pending -= 1
        if not x.pending:
            self._ready(tid, x, now)

    def _ready(self, tid: int, x: _Xfer, now: float) -> None:
        """All conditions met: start now if the link is free, else queue behind it (FIFO)."""
        queue = self.link_queue.get(x.link)
        if self.links_free.get(x.link, 0.0) <= now and not queue:
            self._start_xfer(tid, now)
        elif queue is None:
            self.link_queue[x.link] = deque([tid])
        else:
            queue.append(tid)

    def _charge_cpu(self, x: _Xfer, now: float) -> None:
        """Queue a starting transfer's CPU work on both endpoint ranks (after their current compute)."""
        cpu_free, t_free = self.cpu_free, self.t_free
        for r in (x.src, x.dst):
            if r != HOST:
                base = cpu_free[r]
                if now > base:
                    base = now
                if t_free[r] > base:
                    base = t_free[r]
                cpu_free[r] = base + x.cpu

    def _start_xfer(self, tid: int, now: float) -> None:
        x = self.xfers[tid]
        x.start = now
        if x.cpu:
            self._charge_cpu(x, now)
        if x.allocs:
            self._alloc(x.dst, (x.stage, x.microbatch), now, x.num_bytes)
        end = now + x.duration
        if x.late:  # the receive was posted after the send: the sender's side moves the data only now
            sent, recv = x.send_pos, x.recv_pos
            if self.starts[recv[0]][recv[1]] > self.starts[sent[0]][sent[1]]:  # type: ignore[index]
                end += x.late
        x.end = end
        self.links_free[x.link] = end
        if end <= self.now:
            self.soon.append(-(tid + 1))
        else:
            self.seq += 1
            heapq.heappush(self.heap, (end, self.seq, -(tid + 1)))

    def _finish_xfer(self, tid: int, now: float) -> None:
        x = self.xfers[tid]
        if x.frees:
            self._free(x.src, (x.stage, x.microbatch), now, x.num_bytes)
        queue = self.link_queue.get(x.link)
        if queue:
            self._start_xfer(queue.popleft(), now)
        for g in self.gated.pop(tid, ()):  # receives that waited for this move to land
            y = self.xfers[g]
            y.pending -= 1
            if not y.pending:
                self._ready(g, y, now)
        if x.recv_pos is not None:
            self.ends[x.recv_pos[0]][x.recv_pos[1]] = now
        if x.send_pos is not None:
            self.ends[x.send_pos[0]][x.send_pos[1]] = now
        key = x.signal
        self.avail[key] = now
        waiting = self.waiters.pop(key, None)
        if waiting is not None:
            for w in waiting:
                if w >= 0:
                    self._advance(w, now)
                else:
                    self._condition_met(-w - 1, now)

    def _free(self, r: int, key: tuple[int, int], t: float, num_bytes: float | None) -> None:
        """Free ``num_bytes`` of micro-batch ``key`` on rank ``r`` (all it holds when None)."""
        held = self.held[r].get(key, 0.0)
        amount = held if num_bytes is None else num_bytes
        if amount:
            self.held[r][key] = held - amount
            self._mem(r, t, -amount)

    def _alloc(self, r: int, key: tuple[int, int], t: float, num_bytes: float) -> None:
        if num_bytes:
            self.held[r][key] = self.held[r].get(key, 0.0) + num_bytes
            self._mem(r, t, num_bytes)

    def _advance(self, r: int, now: float) -> None:
        """Run rank ``r`` from its cursor at time ``now`` until it starts a compute, blocks or finishes."""
        acts, codes = self.schedule.actions[r], self.codes[r]
        i, n = self.pc[r], len(acts)
        xfer_at, starts, ends, avail, xfers = self.xfer_at[r], self.starts[r], self.ends[r], self.avail, self.xfers
        while i < n:
            c = codes[i]
            if c < SEND:
                start = now
                for key, delay, _ in self.deps[r][i]:  # inputs, each after its delay (implicit messages)
                    t = avail.get(key)
                    if t is None:  # park (kernel.park, inlined: the reference's hottest loop)
                        self.pc[r] = i
                        waiting = self.waiters.get(key)
                        if waiting is None:
                            self.waiters[key] = [r]
                        else:
                            waiting.append(r)
                        return
                    if t + delay > start:
                        start = t + delay
                gate = self.gates[r][i]
                if gate:  # BPipe: this F/R allocates only after the rank's earlier evictions have landed
                    start = wait_or_park(avail.get, gate, start, self.waiters, r)
                    if start == PARKED:
                        self.pc[r] = i
                        return
                if self.cpu_free[r] > start:  # transfer work charged to this rank comes first
                    start = self.cpu_free[r]
                self._run_compute(r, i, c, acts[i], start)
                return
            tid = xfer_at[i]
            starts[i] = ends[i] = now
            x = xfers[tid]
            if c < RECV and x.ready_data < now:
                x.ready_data = now
            x.pending -= 1
            if not x.pending:
                if x.duration == 0.0 and not x.late and self.links_free.get(x.link, 0.0) <= now \
                        and not self.link_queue.get(x.link):
                    x.start = x.end = now  # instant on a free link: arrives now, link stays free
                    if x.cpu:
                        self._charge_cpu(x, now)
                    if x.allocs:
                        self._alloc(x.dst, (x.stage, x.microbatch), now, x.num_bytes)
                    self.soon.append(-(tid + 1))
                else:
                    self._ready(tid, x, now)
            i += 1
        self.pc[r] = i

    def _run_compute(self, r: int, i: int, c: int, a: Action, start: float) -> None:
        deps = self.deps[r][i]
        if deps:
            ready = self.t_free[r]
            for _, _, tid in deps:
                if tid >= 0:
                    x = self.xfers[tid]
                    exposed = x.end - (ready if ready > x.ready_data else x.ready_data)
                    if exposed > x.exposed:
                        x.exposed = exposed
        if self.gates[r][i]:
            self._expose_gate(r, i, start)
        stage = a.stage
        end = start + (self.duration[c][stage] if self.per_action is None else self.per_action[(r, i)])
        key = (stage, a.microbatch)
        held = self.held[r]
        if c == F:
            st = self.costs.stages[stage] if self.costs.microbatch_stages is None else \
                self.costs.microbatch_stages[a.microbatch][stage]
            num_bytes = st.checkpoint_bytes if key in self.recomputed else st.activation_bytes
            if num_bytes:
                held[key] = held.get(key, 0.0) + num_bytes
                self.mem[r].append((start, num_bytes))
        elif c == B or c == W:  # frees everything the micro-batch still holds here
            num_bytes = held.pop(key, 0.0)
            if num_bytes:
                self.mem[r].append((end, -num_bytes))
        elif c == I:
            self._free(r, key, end, max(0.0, held.get(key, 0.0)
                                        - self.costs.cost_of(stage, a.microbatch).weight_grad_bytes))
        else:  # recompute
            st = self.costs.cost_of(stage, a.microbatch)
            self._alloc(r, key, start, max(0.0, st.activation_bytes - st.checkpoint_bytes))
        self.starts[r][i] = start
        self.ends[r][i] = end
        self.t_free[r] = end
        self.pc[r] = i + 1
        if self.needed and c != W and c != R:
            signal = ("F" if c == F else "G", stage, a.microbatch)
            if signal in self.needed:  # announced when the clock reaches ``end``, not before
                self._push(end, -(len(self.xfers) + len(self.late) + 1))
                self.late.append(signal)
        if end <= self.now:
            self.soon.append(r)
        else:
            self.seq += 1
            heapq.heappush(self.heap, (end, self.seq, r))

    def _expose_gate(self, r: int, i: int, start: float) -> None:
        """Charge the delay the eviction gate added to compute ``i`` of rank ``r`` to the evictions causing it.

        Without the gate the compute would start at ``base`` (rank free and inputs arrived); the interval
        ``base..start`` is split among the gating evictions by arrival, so the charges sum to the delay.
        """
        base = self.t_free[r]
        for key, delay, _ in self.deps[r][i]:
            t = self.avail[key] + delay
            if t > base:
                base = t
        for x in sorted((self.xfers[tid] for tid in self.gates[r][i]), key=by_end):
            end = x.end if x.end < start else start
            if end > base:
                x.exposed += end - base
                base = end

    def run(self) -> Trace:
        sched = self.schedule
        n = sched.num_ranks
        self.pc, self.t_free, self.cpu_free = [0] * n, [0.0] * n, [0.0] * n
        self.starts = [[0.0] * len(a) for a in sched.actions]
        self.ends = [[0.0] * len(a) for a in sched.actions]
        self.held = [{} for _ in range(n)]
        self.mem = [[] for _ in range(n)]
        self._prepare()
        for r in range(n):
            self._push(0.0, r)
        num_xfers = len(self.xfers)
        heap, soon = self.heap, self.soon
        now = 0.0
        while True:
            if soon:
                p = soon.popleft()
            elif heap:
                now, _, p = heapq.heappop(heap)
                self.now = now
            else:
                break
            if p >= 0:
                self._advance(p, now)
            elif -p - 1 < num_xfers:
                self._finish_xfer(-p - 1, now)
            else:
                self._signal(self.late[-p - 1 - num_xfers], now)
        self._check_finished()
        return self._result()

    def _check_finished(self) -> None:
        sched = self.schedule
        if all(self.pc[r] == len(acts) for r, acts in enumerate(sched.actions)):
            stuck = [x for x in self.xfers if x.end < 0]
            if not stuck:
                return
            x = stuck[0]
            pos = x.send_pos or x.recv_pos
            assert pos is not None
            raise self._fail("deadlock", f"transfer {x.kind.value} of stage {x.stage} micro-batch {x.microbatch} "
                             f"never completed", pos[0], pos[1])
        stuck_at = ", ".join(f"rank {r} at {acts[self.pc[r]]}" for r, acts in enumerate(sched.actions)
                             if self.pc[r] < len(acts))
        raise ScheduleValidationError("deadlock", f"schedule {sched.name!r} cannot make progress: {stuck_at}",
                                      _stuck_grid(sched, self.pc))

    # -- result -------------------------------------------------------------------------------------------
    def _result(self) -> Trace:
        new = tuple.__new__
        transfers = [
            new(TransferRecord, (x.src if x.src != HOST else x.dst, x.dst if x.dst != HOST else x.src, x.kind,
                                 x.stage, x.microbatch, x.num_bytes, x.start, x.end, x.exposed))
            for x in self.xfers]
        return make_trace(self.schedule, self.costs, self.starts, self.ends, transfers, self.mem, evaluator=NAME)
