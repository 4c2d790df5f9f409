"""Small hand-built schedules (with explicit transfers) so the simulator is testable on its own."""

from __future__ import annotations

from evenpipe.schedule.ir import Action, ActionKind, Schedule

K = ActionKind


def one_f_one_b(num_ranks: int, num_microbatches: int, *, gpipe: bool = False) -> Schedule:
    """1F1B (or GPipe) over ``num_ranks`` stages, one stage per rank, with send/recv around each compute."""
    p, m = num_ranks, num_microbatches
    ranks: list[list[Action]] = []
    for r in range(p):
        order: list[tuple[ActionKind, int]] = []
        warm = m if gpipe else min(p - 1 - r, m)
        order += [(K.FORWARD, i) for i in range(warm)]
        for i in range(m - warm):
            order += [(K.FORWARD, warm + i), (K.BACKWARD, i)]
        order += [(K.BACKWARD, i) for i in range(m - warm, m)]
        acts: list[Action] = []
        for kind, mb in order:
            if kind is K.FORWARD:
                if r > 0:
                    acts.append(Action(K.RECV_F, r, mb, r - 1))
                acts.append(Action(K.FORWARD, r, mb))
                if r < p - 1:
                    acts.append(Action(K.SEND_F, r, mb, r + 1))
            else:
                if r < p - 1:
                    acts.append(Action(K.RECV_B, r, mb, r + 1))
                acts.append(Action(K.BACKWARD, r, mb))
                if r > 0:
                    acts.append(Action(K.SEND_B, r, mb, r - 1))
        ranks.append(acts)
    return Schedule(name="gpipe" if gpipe else "1f1b", num_ranks=p, num_microbatches=m,
                    stage_to_rank=tuple(range(p)), actions=tuple(tuple(a) for a in ranks))
