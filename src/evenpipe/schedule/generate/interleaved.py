"""Interleaved 1F1B, Megatron-LM's virtual pipeline (Narayanan et al., 2021, section 2.2).

Rank ``r`` holds V chunks, stages ``r, r+P, ..., r+(V-1)P``. Micro-batches are taken in groups of P: a rank runs
a group's forwards on chunk 0, then the same group on chunk 1, ..., then the next group; backwards go the same
way with the chunks reversed. The warm-up is ``2(P - r - 1) + (V - 1)P`` forwards (capped at V*M), so the first
rank holds at most ``min(2(P-1) + (V-1)P + 1, V*M)`` chunk-activations, and the bubble shrinks about V-fold.

Megatron requires ``M % P == 0``; we require the same (a partial last group is not part of Megatron's schedule
and we do not claim it). With ``V == 1`` the schedule is plain 1F1B.
"""

from __future__ import annotations

from evenpipe.schedule.generate.one_f_one_b import one_f_one_b_warmup
from evenpipe.schedule.generate.ordering import compute_schedule, looped_layout, warmup_then_alternate
from evenpipe.schedule.ir import Schedule

__all__ = ["interleaved", "interleaved_warmup"]


def interleaved_warmup(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int) -> int:
    """Megatron's warm-up forwards for rank ``rank`` (chunk-forwards, capped at ``V*M``)."""
    if num_chunks == 1:
        return one_f_one_b_warmup(rank, num_ranks, num_microbatches)
    return min(2 * (num_ranks - rank - 1) + (num_chunks - 1) * num_ranks, num_chunks * num_microbatches)


def _chunk_order(rank: int, num_ranks: int, num_microbatches: int, chunks: list[int]) -> list[tuple[int, int]]:
    """``(stage, microbatch)`` for one rank: groups of P micro-batches, each group through ``chunks`` in order."""
    out: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, num_ranks):
        group = range(first, min(first + num_ranks, num_microbatches))
        out.extend((c * num_ranks + rank, m) for c in chunks for m in group)
    return out


def interleaved(*, num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Compute-only interleaved 1F1B with ``num_chunks`` chunks per rank (caller checks ``M % P == 0``)."""
    P, M, V = num_ranks, num_microbatches, num_chunks
    work = []
    for r in range(P):
        forwards = _chunk_order(r, P, M, list(range(V)))
        backwards = _chunk_order(r, P, M, list(reversed(range(V))))
        work.append(warmup_then_alternate(forwards, backwards, interleaved_warmup(r, P, M, V)))
    return compute_schedule("interleaved", num_ranks=P, num_microbatches=M, stage_to_rank=looped_layout(P, V),
                            work=work, meta={"chunks": V})
