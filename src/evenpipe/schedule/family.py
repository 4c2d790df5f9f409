"""The closed set of schedule families, parsed once at the edge, and one record of traits per family.

Everything that used to switch on a family's name (the cost model, the planner's bounds and search, the CLI)
reads the family's :class:`FamilyTraits` (``family.traits``) or the schedule's ``stage_to_rank`` instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from evenpipe.errors import parse_choice
from evenpipe.schedule.memo import KeyEnum

__all__ = ["ChunkRule", "FamilyTraits", "Ordering", "Placement", "ScheduleFamily", "Transform", "TRAITS"]


class ScheduleFamily(KeyEnum):
    """A named schedule preset. The value is its name on the command line."""

    GPIPE = "gpipe"
    """All forwards, then all backwards (Huang et al., 2019)."""
    ONE_F_ONE_B = "1f1b"
    """Megatron's non-interleaved one-forward-one-backward (Narayanan et al., 2021)."""
    INTERLEAVED = "interleaved"
    """Megatron's interleaved 1F1B with V virtual chunks per rank, stage ``s`` on rank ``s % P``."""
    LOOPED_BFS = "looped-bfs"
    """Breadth-first looping (Lamy-Poirier, 2023): each local chunk forwards every micro-batch before the next."""
    ZB_H1 = "zb-h1"
    """Zero-bubble H1 (Qi et al., 2024): backward split into I and W, W deferred into bubbles, 1F1B's memory."""
    ZB_H2 = "zb-h2"
    """Zero-bubble H2 (Qi et al., 2024): like ZB-H1, but a rank may hold up to 2P-1 micro-batches to fill more."""
    ZB_V = "zb-v"
    """Zero-bubble V (Qi et al., 2024): two chunks per rank in a V; every rank peaks at 1F1B's first-rank peak."""
    V_HALF = "v-half"
    """V-Half (Qi et al., 2024, "Pipeline Parallelism with Controllable Memory"): about half of 1F1B's memory."""
    V_MIN = "v-min"
    """V-Min (same paper): about a third of 1F1B's activation memory for large P (the paper's (P+4)//3
    micro-batches), with no more bubble than 1F1B."""
    DUALPIPE_V = "dualpipev"
    """DualPipeV (DeepSeek-V3's DualPipe cut in half): V placement, paired forward/backward steady state."""
    BPIPE = "bpipe"
    """1F1B plus BPipe's evict/load transfers between ranks x and p-1-x (Kim et al., 2023)."""
    LATENCY_AWARE = "latency-aware"
    """List scheduling that knows each link's message time, under a per-rank activation cap (after CrossPipe,
    Chen et al., 2025); one stage per rank, or two in a V with ``--chunks 2``."""

    @classmethod
    def parse(cls, name: "str | ScheduleFamily") -> "ScheduleFamily":
        """The family called ``name`` (case-insensitive; ``_`` accepted for ``-``)."""
        return parse_choice(cls, name, "schedule", normalize=True)

    @property
    def traits(self) -> "FamilyTraits":
        """This family's record."""
        return TRAITS[self]

    @property
    def has_chunks(self) -> bool:
        """Whether the family lets the user choose several stages (chunks) per rank."""
        return self.traits.chunks is ChunkRule.CHOSEN


class Placement(KeyEnum):
    """Where a family puts its stages."""

    LINEAR = "one stage per rank: stage s on rank s"
    LOOPED = "V chunks per rank, round-robin: stage s on rank s % P"
    V_SHAPE = "two chunks per rank in a V: stage s on rank s for s < P, else on rank 2P-1-s"
    LINEAR_OR_V = "one stage per rank (V=1), or two chunks per rank in a V (V=2)"

    def stage_to_rank(self, num_ranks: int, num_chunks: int) -> tuple[int, ...]:
        """Rank of every stage."""
        P = num_ranks
        if self is Placement.LINEAR or (self is Placement.LINEAR_OR_V and num_chunks == 1):
            return tuple(range(P))
        if self is Placement.LOOPED:
            return tuple(s % P for s in range(P * num_chunks))
        return tuple(s if s < P else 2 * P - 1 - s for s in range(2 * P))


class ChunkRule(enum.Enum):
    """How many stages a family puts on each rank."""

    ONE = "exactly 1"
    TWO = "exactly 2 (fixed by the placement)"
    CHOSEN = "the user's V >= 1 (default 2)"
    ONE_OR_TWO = "the user's V, 1 or 2 (default 1)"

    def chunks(self, requested: int | None) -> int:
        """The chunk count to use for a request (``None``: the default)."""
        if self is ChunkRule.ONE:
            return 1
        if self is ChunkRule.TWO:
            return 2
        if requested is None:
            return 1 if self is ChunkRule.ONE_OR_TWO else 2
        return requested

    def allows(self, chunks: int) -> bool:
        if self is ChunkRule.ONE_OR_TWO:
            return chunks in (1, 2)
        return chunks == self.chunks(chunks) and chunks >= 1


class Ordering(enum.Enum):
    """The ordering policy of a family's generator (see :mod:`evenpipe.schedule.generate`)."""

    FILL_DRAIN = "all forwards, then all backwards"
    ONE_F_ONE_B = "warm-up of P-r-1 forwards, then one forward one backward"
    INTERLEAVED_ROUNDS = "Megatron's rounds of micro-batches through the chunks"
    BREADTH_FIRST = "each chunk forwards every micro-batch before the next"
    ZERO_BUBBLE_H1 = "1F1B's order with W deferred into the bubbles"
    MEMORY_CAPPED = "unit-time greedy: I, then F within a per-rank activation cap, then W"
    V_PATTERN = "ZB-V's fixed warm-up and F-I-W steady state on the V, then input gradients first"
    BUILDING_BLOCK = "one micro-batch's shortest-lived V block, repeated (Qi et al. 2024b)"
    DUALPIPE = "DualPipeV's eight phases around a paired forward/backward steady state"
    LATENCY_AWARE = "list scheduling with each link's message time, I then F within a per-rank cap then W"


class Transform(enum.Enum):
    """A transform that may be applied to a family's compute order."""

    RECOMPUTE = "recompute"
    BPIPE = "bpipe"


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyTraits:
    """What a family is made of (DESIGN principle 3: partition + placement + ordering policy)."""

    placement: Placement
    """Where stages live."""
    chunks: ChunkRule
    """Stages per rank."""
    ordering: Ordering
    """The generator's ordering policy."""
    split_backward: bool
    """Whether backwards run as separate I and W actions (W may trail the last I)."""
    transforms: frozenset[Transform]
    """Transforms that apply to the family's compute order."""
    min_microbatches_per_stage: int = 0
    """M must be at least this times the number of stages (DualPipeV: 1)."""
    equal_rounds: bool = False
    """M must split into equal rounds of at least P micro-batches (``M % max(1, M // P) == 0``)."""
    memory_saturates: bool = True
    """Each rank's activation peak stops growing with M beyond 2P (so peaks may be counted on 2P micro-batches)."""
    activation_cap: Callable[[int], int] | None = None
    """For memory-capped families: the per-rank cap in chunk-activations as a function of P."""

    @property
    def plans_with_durations(self) -> bool:
        """Whether the generator orders actions for given F, I, W durations (``plan_durations``)."""
        return self.ordering in (Ordering.MEMORY_CAPPED, Ordering.BUILDING_BLOCK, Ordering.LATENCY_AWARE)

    def microbatch_error(self, num_ranks: int, num_microbatches: int, num_chunks: int) -> str | None:
        """Why ``num_microbatches`` is not allowed (``None`` when it is)."""
        P, M = num_ranks, num_microbatches
        need = self.min_microbatches_per_stage * P * num_chunks
        if M < need:
            return f"needs at least {need} micro-batches (one per stage); got M={M} for P={P}"
        if self.equal_rounds and M % max(1, M // P):
            near = [m for m in range(max(1, M - P), M + P + 1) if m % max(1, m // P) == 0]
            return (f"needs num_microbatches M with M % max(1, M // P) == 0 (equal rounds); got M={M} for P={P} "
                    f"ranks (nearby allowed: {', '.join(map(str, near))}; any multiple of {P} works)")
        return None

    def stage_to_rank(self, num_ranks: int, num_chunks: int | None = None) -> tuple[int, ...]:
        """Rank of every stage for ``num_ranks`` ranks."""
        return self.placement.stage_to_rank(num_ranks, self.chunks.chunks(num_chunks))


_BOTH = frozenset({Transform.RECOMPUTE, Transform.BPIPE})
_RECOMPUTE_ONLY = frozenset({Transform.RECOMPUTE})

TRAITS: dict[ScheduleFamily, FamilyTraits] = {
    ScheduleFamily.GPIPE: FamilyTraits(placement=Placement.LINEAR, chunks=ChunkRule.ONE,
                                       ordering=Ordering.FILL_DRAIN, split_backward=False, transforms=_BOTH,
                                       memory_saturates=False),
    ScheduleFamily.ONE_F_ONE_B: FamilyTraits(placement=Placement.LINEAR, chunks=ChunkRule.ONE,
                                             ordering=Ordering.ONE_F_ONE_B, split_backward=False, transforms=_BOTH),
    ScheduleFamily.INTERLEAVED: FamilyTraits(placement=Placement.LOOPED, chunks=ChunkRule.CHOSEN,
                                             ordering=Ordering.INTERLEAVED_ROUNDS, split_backward=False,
                                             transforms=_BOTH, equal_rounds=True),
    ScheduleFamily.LOOPED_BFS: FamilyTraits(placement=Placement.LOOPED, chunks=ChunkRule.CHOSEN,
                                            ordering=Ordering.BREADTH_FIRST, split_backward=False,
                                            transforms=_BOTH, memory_saturates=False),
    ScheduleFamily.ZB_H1: FamilyTraits(placement=Placement.LINEAR, chunks=ChunkRule.ONE,
                                       ordering=Ordering.ZERO_BUBBLE_H1, split_backward=True, transforms=_BOTH),
    ScheduleFamily.ZB_H2: FamilyTraits(placement=Placement.LINEAR, chunks=ChunkRule.ONE,
                                       ordering=Ordering.MEMORY_CAPPED, split_backward=True,
                                       transforms=_RECOMPUTE_ONLY, activation_cap=lambda P: 2 * P - 1),
    ScheduleFamily.ZB_V: FamilyTraits(placement=Placement.V_SHAPE, chunks=ChunkRule.TWO,
                                      ordering=Ordering.V_PATTERN, split_backward=True,
                                      transforms=_RECOMPUTE_ONLY),
    ScheduleFamily.V_HALF: FamilyTraits(placement=Placement.V_SHAPE, chunks=ChunkRule.TWO,
                                        ordering=Ordering.MEMORY_CAPPED, split_backward=True,
                                        transforms=_RECOMPUTE_ONLY, activation_cap=lambda P: P + 1),
    ScheduleFamily.V_MIN: FamilyTraits(placement=Placement.V_SHAPE, chunks=ChunkRule.TWO,
                                       ordering=Ordering.BUILDING_BLOCK, split_backward=True,
                                       transforms=_RECOMPUTE_ONLY),
    ScheduleFamily.DUALPIPE_V: FamilyTraits(placement=Placement.V_SHAPE, chunks=ChunkRule.TWO,
                                            ordering=Ordering.DUALPIPE, split_backward=True,
                                            transforms=_RECOMPUTE_ONLY, min_microbatches_per_stage=1),
    ScheduleFamily.BPIPE: FamilyTraits(placement=Placement.LINEAR, chunks=ChunkRule.ONE,
                                       ordering=Ordering.ONE_F_ONE_B, split_backward=False,
                                       transforms=_BOTH),  # already transformed: --bpipe changes nothing
    ScheduleFamily.LATENCY_AWARE: FamilyTraits(placement=Placement.LINEAR_OR_V, chunks=ChunkRule.ONE_OR_TWO,
                                               ordering=Ordering.LATENCY_AWARE, split_backward=True,
                                               transforms=_RECOMPUTE_ONLY),
}
"""One record per family."""
assert set(TRAITS) == set(ScheduleFamily), "every family needs its traits"

