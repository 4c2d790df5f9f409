"""Schedule generators, one module per family, built from three independent choices (DESIGN principle 3):

- a **layout** (``stage_to_rank``): one stage per rank, or V chunks per rank placed round-robin (``s % P``);
- an **ordering policy**: the order in which a rank runs its forwards and its backwards;
- an **in-flight limit**: how many forwards a rank runs before its first backward (the warm-up count).

GPipe and 1F1B share layout and ordering and differ only by the warm-up count; looped BFS is GPipe with a
chunk-major order; interleaved 1F1B is 1F1B with Megatron's virtual-pipeline order. Each generator returns the
compute-only schedule; :func:`evenpipe.schedule.build_schedule` adds communication and validates.
"""

from evenpipe.schedule.generate.gpipe import gpipe
from evenpipe.schedule.generate.interleaved import interleaved
from evenpipe.schedule.generate.looped_bfs import looped_bfs
from evenpipe.schedule.generate.one_f_one_b import one_f_one_b
from evenpipe.schedule.generate.ordering import (
    Work,
    compute_schedule,
    linear_layout,
    looped_layout,
    warmup_then_alternate,
)
from evenpipe.schedule.generate.zb_h1 import zb_h1

__all__ = [
    "Work",
    "compute_schedule",
    "gpipe",
    "interleaved",
    "linear_layout",
    "looped_bfs",
    "looped_layout",
    "one_f_one_b",
    "warmup_then_alternate",
    "zb_h1",
]
