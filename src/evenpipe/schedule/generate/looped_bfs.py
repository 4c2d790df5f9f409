"""Breadth-first looped schedule (Lamy-Poirier, 2023): V chunks per rank placed ``s % P``; each local chunk runs
every micro-batch forward before the next chunk starts, then the backwards run chunk by chunk in reverse."""

from __future__ import annotations

from evenpipe.schedule.generate.ordering import compute_schedule, looped_layout, warmup_then_alternate
from evenpipe.schedule.ir import Schedule

__all__ = ["looped_bfs"]


def looped_bfs(*, num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Compute-only looped BFS: chunk-major order, all forwards first (GPipe's in-flight limit)."""
    P, M, V = num_ranks, num_microbatches, num_chunks
    work = []
    for r in range(P):
        forwards = [(c * P + r, m) for c in range(V) for m in range(M)]
        backwards = [(c * P + r, m) for c in reversed(range(V)) for m in range(M)]
        work.append(warmup_then_alternate(forwards, backwards, num_warmup=len(forwards)))
    return compute_schedule("looped-bfs", num_ranks=P, num_microbatches=M, stage_to_rank=looped_layout(P, V),
                            work=work, meta={"chunks": V})
