"""Non-interleaved 1F1B as in Megatron-LM (Narayanan et al., 2021), one stage per rank."""

from __future__ import annotations

from evenpipe.schedule.generate.ordering import compute_schedule, linear_layout, warmup_then_alternate
from evenpipe.schedule.ir import Schedule

__all__ = ["one_f_one_b", "one_f_one_b_warmup"]


def one_f_one_b_warmup(rank: int, num_ranks: int, num_microbatches: int) -> int:
    """Megatron's warm-up count ``min(P - r - 1, M)``: rank r then holds at most ``min(P - r, M)`` micro-batches."""
    return min(num_ranks - rank - 1, num_microbatches)


def one_f_one_b(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Compute-only 1F1B: GPipe's layout and order with a warm-up of ``P - r - 1`` forwards."""
    work = []
    for r in range(num_ranks):
        items = [(r, m) for m in range(num_microbatches)]
        work.append(warmup_then_alternate(items, items, one_f_one_b_warmup(r, num_ranks, num_microbatches)))
    return compute_schedule("1f1b", num_ranks=num_ranks, num_microbatches=num_microbatches,
                            stage_to_rank=linear_layout(num_ranks), work=work)
