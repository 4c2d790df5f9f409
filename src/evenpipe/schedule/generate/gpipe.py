"""GPipe (Huang et al., 2019): every forward, then every backward, one stage per rank."""

from __future__ import annotations

from evenpipe.schedule.generate.ordering import compute_schedule, linear_layout, warmup_then_alternate
from evenpipe.schedule.ir import Schedule

__all__ = ["gpipe"]


def gpipe(*, num_ranks: int, num_microbatches: int) -> Schedule:
    """Compute-only GPipe: warm-up count = all micro-batches (in-flight limit M on every rank)."""
    work = []
    for r in range(num_ranks):
        items = [(r, m) for m in range(num_microbatches)]
        work.append(warmup_then_alternate(items, items, num_warmup=num_microbatches))
    return compute_schedule("gpipe", num_ranks=num_ranks, num_microbatches=num_microbatches,
                            stage_to_rank=linear_layout(num_ranks), work=work)
