"""Messages of a latency-aware schedule, placed by its planned times.

:func:`evenpipe.schedule.comm.derive_communication` places a receive by a witness run with free links, so on a
slow link it is often posted only when the consumer's rank reaches it, and the whole link time is then exposed.
Here the compute order is timed with the plan's durations and message times (:func:`planned_times`), every
message ``k`` gets the planned finish ``t_k`` of its producer, and each rank's events are sorted by one key: a
compute by its planned *finish* ``(end, 0)``, both ends of message ``k`` by ``(t_k, 1, k)``. So a send follows
its producer (equal time, 0 before 1) and a receive is posted right after the last compute planned to finish by
the time its message is sent.

Why it cannot deadlock (the argument of :mod:`evenpipe.schedule.comm` with finishes for starts): a consumer
starts no earlier than ``t_j`` and every planned duration is positive, so its finish is after ``t_j`` and the
receive of ``j`` precedes it. Take, in a rendezvous run, the message ``k`` of smallest index not yet exchanged.
On either of its ranks the events before it are messages of smaller index (exchanged) and computes finishing by
``t_k``, whose inputs are messages of index below ``k`` received earlier on that rank; so both ends reach ``k``
and it completes. The validator re-checks this by its dry run.

Host moves (``OFFLOAD``/``RELOAD`` of :func:`evenpipe.schedule.build.add_offload`) touch no link: each is kept
right before the compute it preceded, as :func:`~evenpipe.schedule.comm.derive_communication` keeps them, so an
``OFFLOAD`` follows the send of its forward's output.
"""

from __future__ import annotations

from evenpipe.schedule.generate.latency_plan import PRODUCES, LinkPlan, planned_times
from evenpipe.schedule.ir import Action, Schedule
from evenpipe.schedule.semantics import SEMANTICS

__all__ = ["place_messages"]


def place_messages(compute: Schedule, plan: LinkPlan) -> Schedule:
    """``compute`` (computes and host moves only) with every SEND/RECV, placed by the planned times (module
    docstring)."""
    if any(not a.kind.is_compute and not SEMANTICS[a.kind].host_side for acts in compute.actions for a in acts):
        raise ValueError("place_messages takes a compute-only schedule (host moves allowed)")
    moves = [_host_moves(acts) for acts in compute.actions]
    if any(moves):
        bare = compute.with_actions([[a for a in acts if a.kind.is_compute] for acts in compute.actions])
        placed = place_messages(bare, plan)
        return placed.with_actions([_with_moves(acts, m) for acts, m in zip(placed.actions, moves)])
    _, ends = planned_times(compute, plan)
    layout, S = compute.stage_to_rank, compute.num_stages
    messages: list[tuple[float, int, int, Action, int, Action]] = []
    for r, acts in enumerate(compute.actions):
        for i, a in enumerate(acts):
            if a.kind not in PRODUCES:
                continue
            shift, send_kind, recv_kind = PRODUCES[a.kind]
            peer_stage = a.stage + shift
            if 0 <= peer_stage < S and layout[peer_stage] != r:
                dst = layout[peer_stage]
                messages.append((ends[r][i], r, i, Action(send_kind, a.stage, a.microbatch, dst),
                                 dst, Action(recv_kind, peer_stage, a.microbatch, r)))
    messages.sort(key=lambda msg: msg[:3])
    events: list[list[tuple[tuple[float, int, int], Action]]] = [
        [((ends[r][i], 0, i), a) for i, a in enumerate(acts)] for r, acts in enumerate(compute.actions)]
    for k, (t, src, _, send, dst, recv) in enumerate(messages):
        events[src].append(((t, 1, k), send))
        events[dst].append(((t, 1, k), recv))
    return compute.with_actions([[a for _, a in sorted(evs, key=lambda e: e[0])] for evs in events])



def _host_moves(acts: tuple[Action, ...]) -> dict[int, list[Action]]:
    """A rank's host moves by the index (among its computes) of the compute each precedes (the number of computes
    for those after the last one)."""
    out: dict[int, list[Action]] = {}
    n = 0
    for a in acts:
        if a.kind.is_compute:
            n += 1
        else:
            out.setdefault(n, []).append(a)
    return out


def _with_moves(acts: tuple[Action, ...], moves: dict[int, list[Action]]) -> list[Action]:
    """``acts`` with each host move put back right before the compute it preceded."""
    out: list[Action] = []
    n = 0
    for a in acts:
        if a.kind.is_compute:
            out.extend(moves.get(n, ()))
            n += 1
        out.append(a)
    return out + moves.get(n, [])
