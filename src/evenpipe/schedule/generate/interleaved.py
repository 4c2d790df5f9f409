"""Interleaved 1F1B, Megatron-LM's virtual pipeline (Narayanan et al., 2021, section 2.2).

Rank ``r`` holds V chunks, stages ``r, r+P, ..., r+(V-1)P``. Micro-batches are taken in rounds of G: a rank runs
a round's forwards on chunk 0, then the same round on chunk 1, ..., then the next round; backwards go the same
way with the chunks reversed. The warm-up is ``2(P - r - 1) + (V - 1)G`` chunk-forwards (capped at V*M).

With ``M % P == 0`` the rounds have ``G = P`` micro-batches and this is exactly Megatron's schedule: the first
rank holds at most ``min(2(P-1) + (V-1)P + 1, V*M)`` chunk-activations and the bubble shrinks about V-fold.
Otherwise, like torch.distributed.pipelining's ``ScheduleInterleaved1F1B``, there are ``max(1, M // P)`` rounds
of ``G = M / rounds >= P`` micro-batches (one round of M when ``M < P``), which needs
``M % max(1, M // P) == 0``; every such schedule is validated (it is deadlock-free). With ``V == 1`` it is 1F1B.
"""

from __future__ import annotations

from evenpipe.schedule.generate.one_f_one_b import one_f_one_b_warmup
from evenpipe.schedule.generate.ordering import compute_schedule, looped_layout, warmup_then_alternate
from evenpipe.schedule.ir import Schedule

__all__ = ["interleaved", "interleaved_round_size", "interleaved_warmup"]


def interleaved_round_size(num_ranks: int, num_microbatches: int) -> int | None:
    """Micro-batches per round (G), or ``None`` when M cannot be split into equal rounds of at least P."""
    rounds = max(1, num_microbatches // num_ranks)
    return num_microbatches // rounds if num_microbatches % rounds == 0 else None


def interleaved_warmup(rank: int, num_ranks: int, num_microbatches: int, num_chunks: int, round_size: int) -> int:
    """Warm-up chunk-forwards of rank ``rank``: ``2(P - r - 1) + (V - 1)G``, capped at ``V*M``."""
    if num_chunks == 1:
        return one_f_one_b_warmup(rank, num_ranks, num_microbatches)
    return min(2 * (num_ranks - rank - 1) + (num_chunks - 1) * round_size, num_chunks * num_microbatches)


def _chunk_order(rank: int, num_ranks: int, num_microbatches: int, round_size: int,
                 chunks: list[int]) -> list[tuple[int, int]]:
    """``(stage, microbatch)`` for one rank: each round of micro-batches through ``chunks`` in order."""
    out: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, round_size):
        group = range(first, min(first + round_size, num_microbatches))
        out.extend((c * num_ranks + rank, m) for c in chunks for m in group)
    return out


def interleaved(*, num_ranks: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Compute-only interleaved 1F1B with ``num_chunks`` chunks per rank (the caller checks the round size)."""
    P, M, V = num_ranks, num_microbatches, num_chunks
    G = interleaved_round_size(P, M)
    assert G is not None, f"M={M} does not split into equal rounds for P={P}"
    work = []
    for r in range(P):
        forwards = _chunk_order(r, P, M, G, list(range(V)))
        backwards = _chunk_order(r, P, M, G, list(reversed(range(V))))
        work.append(warmup_then_alternate(forwards, backwards, interleaved_warmup(r, P, M, V, G)))
    return compute_schedule("interleaved", num_ranks=P, num_microbatches=M, stage_to_rank=looped_layout(P, V),
                            work=work, meta={"chunks": V, "round_size": G})
