"""Check a schedule against named rules; a failure raises ``ScheduleValidationError(rule, message, grid)``.

Rules (the first broken one is reported):

- ``range``: stages, micro-batches and peers exist.
- ``placement``: an action references a stage on its own rank (``ACCEPT``/``RETURN``: on its peer), and
  activation/gradient transfers name the rank of the neighbouring stage as peer.
- ``duplicate``: no action (kind, stage, micro-batch) appears twice.
- ``completeness``: every ``(stage, mb)`` has one ``F`` and either one ``B`` or one ``I`` and one ``W``.
- ``dependency``: in each rank's program order ``F(s,m)`` follows ``F(s-1,m)`` or its ``RECV_F``; ``B``/``I`` of
  ``(s,m)`` follows ``F(s,m)`` and ``B``/``I(s+1,m)`` or its ``RECV_B``; ``W`` follows ``I``; ``R`` follows ``F``
  and precedes the backward; sends follow what they send; ``LOAD`` follows ``EVICT`` and ``RETURN`` follows
  ``ACCEPT``; evicted activations are not used between ``EVICT`` and ``LOAD`` (nor offloaded ones between
  ``OFFLOAD`` and ``RELOAD``, which follows its ``OFFLOAD``).
- ``matching``: every send has exactly one matching receive on its peer and vice versa.
- ``deadlock``: a dry run with rendezvous semantics (a send and its receive complete together, only when both
  are at the heads of their ranks' lists) completes. Computes at a head always complete, because their data
  dependencies were already checked in program order.

Everything is O(actions): one scan with per-kind arrays indexed by ``stage * M + mb``, then a dry run in which a
blocked rank is only revisited when its peer reaches the matching action.
"""

from __future__ import annotations

from evenpipe.errors import ScheduleValidationError
from evenpipe.schedule.grid import format_grid
from evenpipe.schedule.ir import Action, ActionKind, Schedule
from evenpipe.schedule.semantics import SEMANTICS, TABLES, Requirement, kind_table
from evenpipe.schedule.validate_columns import columns_valid

__all__ = ["validate", "validate_rules", "message_key", "passed_validation"]

_KINDS = TABLES.kinds
_C = {k: k.code for k in _KINDS}
F, B, I, W, R = (_C[ActionKind.FORWARD], _C[ActionKind.BACKWARD], _C[ActionKind.BACKWARD_INPUT],
                 _C[ActionKind.BACKWARD_WEIGHT], _C[ActionKind.RECOMPUTE])
RF, EV, AC, OF = _C[ActionKind.RECV_F], _C[ActionKind.EVICT], _C[ActionKind.ACCEPT], _C[ActionKind.OFFLOAD]
RB = _C[ActionKind.RECV_B]
_TRANSFER = frozenset(c for c, is_msg in enumerate(TABLES.message) if is_msg)
"""Messages between two ranks (host moves are local)."""
_CHANNEL, _STAGE_SHIFT, _COUNTERPART = TABLES.channel, TABLES.sender_stage_shift, TABLES.peer_code
_ON_PEER = tuple(SEMANTICS[k].stage_on_peer for k in _KINDS)
_NEIGHBOUR = TABLES.neighbour_shift
_AWAY = TABLES.away
_USES_ACTIVATIONS = frozenset(k.code for k in _KINDS if Requirement.ACTIVATIONS_HERE in SEMANTICS[k].requires)
_REQUIRES = kind_table("validator", {k: tuple(q for q in SEMANTICS[k].requires
                                             if q is not Requirement.ACTIVATIONS_HERE) for k in _KINDS})
"""Per kind code, the program-order predicates :meth:`_Scan.missing` checks (activations-here separately)."""


def message_key(rank: int, a: Action) -> tuple[int, int, int]:
    """``(channel, sending stage, mb)``: equal for a send and its matching receive (channels F, B, evict, load)."""
    code = a.kind.code
    if code not in _TRANSFER:
        raise ValueError(f"{a} is not a transfer")
    return (_CHANNEL[code], a.stage + _STAGE_SHIFT[code], a.microbatch)


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleValidationError`` naming the first broken rule, with a rank-by-step grid.

    The rules are decided over the integer columns first (:func:`evenpipe.schedule.validate_columns.columns_valid`);
    only when that fast path has any doubt does the action-by-action scan below (the reference, which words
    every error) run. Either way the dry run then checks deadlock-freedom."""
    messages = columns_valid(schedule)
    if messages is None:
        messages = validate_rules(schedule)
    _dry_run(schedule, messages)
    object.__setattr__(schedule, "_validated", True)  # the one mutable fact of a Schedule: it passed


def passed_validation(schedule: Schedule) -> bool:
    """Whether this very schedule object passed :func:`validate`, so a consumer may rely on every rule (the
    simulator's one-pass paths skip their own checks of them)."""
    return schedule._validated


def validate_rules(schedule: Schedule) -> list[list[int]]:
    """The reference scan of every rule but deadlock-freedom (raises on the first broken one); returns, per
    rank, ``[position, message key, ...]`` of its peer transfers for the dry run."""
    scan = _Scan(schedule)
    for r, acts in enumerate(schedule.actions):
        scan.rank(r, acts)
    scan.completeness()
    if scan.first_dependency_error is not None:
        raise scan.first_dependency_error
    scan.matching()
    return [[x for i, key in enumerate(keys) if key >= 0 for x in (i, key)] for keys in scan.keys]


class _Scan:
    """One pass over every rank's list: range, placement, duplicates and program-order dependencies."""

    __slots__ = ("schedule", "S", "M", "P", "layout", "done", "peer", "away", "recomputed", "keys", "where",
                 "first_dependency_error")

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.P, self.S, self.M = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
        self.layout = schedule.stage_to_rank
        n = self.S * self.M
        self.done = [[0] * n for _ in _KINDS]
        """``done[kind][s*M+m]``: 1 + the rank that ran it, 0 if not yet."""
        self.peer = {c: [-1] * n for c in _TRANSFER}
        self.where: dict[tuple[int, int], tuple[int, int]] = {}
        self.away = bytearray(n)
        self.recomputed = bytearray(n)
        for _, _, a in schedule.iter_actions():
            if a.kind is ActionKind.RECOMPUTE and a.stage < self.S and a.microbatch < self.M:
                self.recomputed[a.stage * self.M + a.microbatch] = 1
        self.first_dependency_error: ScheduleValidationError | None = None
        """Dependency errors are kept until completeness is checked, so a missing action is named as such."""
        self.keys: list[list[int]] = []
        """Per rank, per position: the message key as one int, or -1 for a compute."""

    def fail(self, rule: str, message: str, r: int, i: int) -> ScheduleValidationError:
        return ScheduleValidationError(rule, message, format_grid(self.schedule, {r: i}))

    def rank(self, r: int, acts: tuple[Action, ...]) -> None:
        S, M, P, layout, done, away = self.S, self.M, self.P, self.layout, self.done, self.away
        transfers, uses_activations, missing_of, on_peer = _TRANSFER, _USES_ACTIVATIONS, self.missing, _ON_PEER
        check = self.first_dependency_error is None
        keys: list[int] = []
        append = keys.append
        for i, a in enumerate(acts):
            code, s, m, peer = a.kind.code, a.stage, a.microbatch, a.peer
            if s >= S or m >= M or (peer is not None and not 0 <= peer < P):
                raise self.fail("range", f"rank {r} action {i} {a}: stages are 0..{S - 1}, micro-batches "
                                f"0..{M - 1}, ranks 0..{P - 1}", r, i)
            home = layout[s]
            if (home != peer) if on_peer[code] else (home != r):
                raise self.fail("placement", f"rank {r} action {i} {a} references stage {s}, which lives on rank "
                                f"{home}", r, i)
            u = s * M + m
            row = done[code]
            if row[u]:
                raise self.fail("duplicate", f"rank {r} action {i} {a} appears twice", r, i)
            if check:
                missing = missing_of(code, s, m, u, r)
                if missing:
                    self.first_dependency_error = self.fail(
                        "dependency", f"rank {r} action {i} {a} runs before {missing} on the same rank", r, i)
                elif code in uses_activations and away[u]:
                    self.first_dependency_error = self.fail(
                        "dependency", f"rank {r} action {i} {a} uses activations sent away ({s}EVICT{m} or "
                        f"{s}OFFLOAD{m}) before they are back ({s}LOAD{m} or {s}RELOAD{m})", r, i)
                check = self.first_dependency_error is None
            if code in transfers:
                self.transfer(code, a, r, i, u)
                append((_CHANNEL[code] * S + s + _STAGE_SHIFT[code]) * M + m)
            else:
                if _AWAY[code]:
                    away[u] = 1 if _AWAY[code] > 0 else 0
                append(-1)
            row[u] = r + 1
        self.keys.append(keys)

    def transfer(self, code: int, a: Action, r: int, i: int, u: int) -> None:
        """Peer checks; record the transfer for matching; track evicted activations."""
        s, peer, S = a.stage, a.peer, self.S
        offset = _NEIGHBOUR[code]
        expected = None if offset is None else s + offset
        if expected is not None and not (0 <= expected < S and peer == self.layout[expected]):
            want = f"rank {self.layout[expected]}" if 0 <= expected < S else "no transfer (no such stage)"
            raise self.fail("placement", f"rank {r} action {i} {a} has peer {peer}; expected {want}", r, i)
        if peer == r:
            raise self.fail("placement", f"rank {r} action {i} {a} sends to its own rank", r, i)
        self.peer[code][u] = peer if peer is not None else -1
        self.where[(code, u)] = (r, i)
        if _AWAY[code]:
            self.away[u] = 1 if _AWAY[code] > 0 else 0

    def missing(self, code: int, s: int, m: int, u: int, r: int) -> str:
        """The token of the first action that must precede this one on rank ``r`` but has not run, or ''."""
        for req in _REQUIRES[code] or ():
            miss = _CHECKS[req](self, s, m, u, r + 1)
            if miss:
                return miss
        return ""

    # -- one checker per named predicate (Requirement); ``me`` is 1 + the rank --------------------------------
    def _input(self, s: int, m: int, u: int, me: int) -> str:
        if s == 0:
            return ""
        if self.layout[s - 1] == me - 1:
            return "" if self.done[F][u - self.M] == me else f"{s - 1}F{m}"
        return "" if self.done[RF][u] == me else f"{s}RECV_F{m}"

    def _own_forward(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[F][u] == me else f"{s}F{m}"

    def _recomputed(self, s: int, m: int, u: int, me: int) -> str:
        return "" if not self.recomputed[u] or self.done[R][u] == me else f"{s}R{m}"

    def _output_gradient(self, s: int, m: int, u: int, me: int) -> str:
        done = self.done
        if s + 1 >= self.S:
            return ""
        if self.layout[s + 1] == me - 1:
            v = u + self.M
            return "" if done[B][v] == me or done[I][v] == me else f"{s + 1}B{m} (or {s + 1}I{m})"
        return "" if done[RB][u] == me else f"{s}RECV_B{m}"

    def _input_gradient(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[I][u] == me else f"{s}I{m}"

    def _gradient_produced(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[B][u] == me or self.done[I][u] == me else f"{s}B{m} (or {s}I{m})"

    def _evicted(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[EV][u] == me else f"{s}EVICT{m}"

    def _accepted(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[AC][u] == me else f"{s}ACCEPT{m}"

    def _offloaded(self, s: int, m: int, u: int, me: int) -> str:
        return "" if self.done[OF][u] == me else f"{s}OFFLOAD{m}"

    def completeness(self) -> None:
        """Every (stage, mb) has one F and either one B or one I and one W."""
        done, M = self.done, self.M
        f, b, i_, w = done[F], done[B], done[I], done[W]
        for u in range(self.S * M):
            if f[u] and ((b[u] and not i_[u] and not w[u]) or (not b[u] and i_[u] and w[u])):
                continue
            s, m = divmod(u, M)
            have = [f"{s}{k}{m}" for k, arr in (("F", f), ("B", b), ("I", i_), ("W", w)) if arr[u]]
            r = self.layout[s]
            acts = self.schedule.actions[r]
            idx = next((j for j, a in enumerate(acts) if a.key == (s, m) and a.kind.is_compute), len(acts))
            raise ScheduleValidationError(
                "completeness", f"stage {s} micro-batch {m} has {have or 'no compute'}; it needs one F and either "
                f"one B or one I and one W, on rank {r}", format_grid(self.schedule, {r: idx}))

    def matching(self) -> None:
        """Every recorded transfer has its counterpart on its peer, naming this rank as peer."""
        S, M = self.S, self.M
        for (code, u), (r, i) in self.where.items():
            other = _COUNTERPART[code]
            shift = _STAGE_SHIFT[code] - _STAGE_SHIFT[other]
            v = u + shift * M
            peer = self.peer[code][u]
            ok = 0 <= v < S * M and self.done[other][v] == peer + 1 and self.peer[other][v] == r
            if not ok:
                a = self.schedule.actions[r][i]
                want = _KINDS[other].value
                raise self.fail("matching", f"rank {r} action {i} {a} has no matching {want} on rank {peer}", r, i)


_CHECKS = {
    Requirement.INPUT: _Scan._input, Requirement.OWN_FORWARD: _Scan._own_forward,
    Requirement.RECOMPUTED: _Scan._recomputed, Requirement.OUTPUT_GRADIENT: _Scan._output_gradient,
    Requirement.INPUT_GRADIENT: _Scan._input_gradient, Requirement.GRADIENT_PRODUCED: _Scan._gradient_produced,
    Requirement.EVICTED: _Scan._evicted, Requirement.ACCEPTED: _Scan._accepted, Requirement.OFFLOADED: _Scan._offloaded,
}
"""The checker of each named predicate (:data:`Requirement.ACTIVATIONS_HERE` is tracked in the scan itself)."""
assert set(_CHECKS) | {Requirement.ACTIVATIONS_HERE} == set(Requirement), "a requirement has no checker"


def _dry_run(schedule: Schedule, messages: list[list[int]]) -> None:
    """Rendezvous dry run: a transfer completes when its counterpart is at the head of the peer's list.
    ``messages[r]`` is ``[position, key, ...]`` of rank r's peer transfers; computes always complete."""
    P = schedule.num_ranks
    peers = schedule.columns.peers
    head = [0] * P  # index into messages[r] (steps of 2)
    stack = list(range(P))
    while stack:
        r = stack.pop()
        row, i = messages[r], head[r]
        n = len(row)
        peer_of = peers[r]
        while i < n:
            key = row[i + 1]
            peer = peer_of[row[i]]
            j = head[peer]
            other = messages[peer]
            if j < len(other) and other[j + 1] == key:
                head[peer] = j + 2
                stack.append(peer)
                i += 2
                continue
            break
        head[r] = i
    lengths = [len(k) for k in schedule.columns.kinds]
    pos = [messages[r][head[r]] if head[r] < len(messages[r]) else lengths[r] for r in range(P)]
    stuck = {r: pos[r] for r in range(P) if pos[r] < lengths[r]}
    if stuck:
        lists = schedule.actions
        heads = ", ".join(f"rank {r} at {lists[r][i]}" for r, i in sorted(stuck.items()))
        raise ScheduleValidationError("deadlock", f"rendezvous dry run stops: {heads}",
                                      format_grid(schedule, stuck, reached=dict(enumerate(pos))))
