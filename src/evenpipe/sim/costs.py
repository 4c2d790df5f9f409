"""What the simulator needs to know about a run: per-stage durations and bytes, and the links between ranks.

Units: seconds (or any consistent time unit) and bytes. A *stage* here is one entry of
``Schedule.stage_to_rank``: with interleaving, a chunk holding 1/V of a rank's layers.

Conventions (shared by the simulator, the cost model and the runtime's profiler):
- full backward ``B`` takes ``backward_input + backward_weight``; the zero-bubble split runs them as ``I`` and ``W``;
- a forward saves ``activation_bytes`` for backward (``checkpoint_bytes`` instead under recomputation, and the
  ``RECOMPUTE`` action rebuilds the full ``activation_bytes``);
- after ``I``, ``weight_grad_bytes`` of them stay alive until ``W``;
- ``output_bytes`` is the size of the activation sent to the next stage (the gradient sent back has the same size);
- BPipe evicts and loads ``activation_bytes`` (or ``checkpoint_bytes`` when recomputing);
- a link's ``cpu_s_per_byte`` is CPU time that each end of a transfer spends per byte moved, taken from that
  rank's computes (a CPU host, where the backend's threads copy the bytes on the cores that compute); 0 for
  devices whose copies do not compete with compute (and by default).
- a link's ``late_receive_s`` is added to a message whose receive is posted after its send: a rendezvous
  backend (gloo) moves the data only once the receiver asks for it, and on a CPU host whose cores compute, the
  sender's communication thread then waits to be scheduled (about 2 ms on a 2-core host, against 0.3 ms for a
  message whose receive was already waiting); 0 by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from evenpipe.errors import ConfigError

__all__ = ["Link", "StageCosts", "SimCosts"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A point-to-point link: fixed latency plus bytes over bandwidth."""

    latency_s: float = 0.0
    """Seconds before the first byte arrives."""
    bandwidth_bytes_per_s: float = math.inf
    """Sustained bytes per second; ``inf`` makes transfers free of size cost."""
    cpu_s_per_byte: float = 0.0
    """Seconds of each endpoint rank's compute that one byte moved takes (see the module docstring)."""
    late_receive_s: float = 0.0
    """Extra seconds a message takes when its receive is posted after its send (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ConfigError(f"link latency must be >= 0 s, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_per_s}")
        if not self.cpu_s_per_byte >= 0 or math.isinf(self.cpu_s_per_byte):
            raise ConfigError(f"link cpu_s_per_byte must be a finite number >= 0, got {self.cpu_s_per_byte}")
        if not self.late_receive_s >= 0 or math.isinf(self.late_receive_s):
            raise ConfigError(f"link late_receive_s must be a finite number >= 0, got {self.late_receive_s}")

    def cpu_time(self, num_bytes: float) -> float:
        """Seconds of compute each endpoint loses to moving ``num_bytes``."""
        return self.cpu_s_per_byte * num_bytes if num_bytes > 0 else 0.0

    def transfer_time(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return self.latency_s
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


FREE_LINK = Link()


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCosts:
    """Durations and bytes of one stage for one micro-batch."""

    forward: float = 1.0
    """Forward time."""
    backward_input: float = 2.0
    """Input-gradient part of the backward (the whole backward when ``backward_weight`` is 0)."""
    backward_weight: float = 0.0
    """Weight-gradient part of the backward."""
    recompute: float | None = None
    """Time to rebuild activations before backward; defaults to ``forward``."""
    activation_bytes: float = 1.0
    """Bytes saved for backward by one forward."""
    checkpoint_bytes: float = 0.0
    """Bytes kept per micro-batch when the stage recomputes (its input)."""
    weight_grad_bytes: float = 0.0
    """Bytes still alive between ``I`` and ``W``."""
    output_bytes: float = 0.0
    """Bytes of the activation message to the next stage (and of the gradient coming back)."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "activation_bytes", "checkpoint_bytes",
                     "weight_grad_bytes", "output_bytes"):
            value = getattr(self, name)
            if value < 0 or math.isnan(value):
                raise ConfigError(f"stage cost {name} must be >= 0, got {value}")

    @property
    def backward(self) -> float:
        """Full backward time (``B``)."""
        return self.backward_input + self.backward_weight

    @property
    def recompute_time(self) -> float:
        return self.forward if self.recompute is None else self.recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class SimCosts:
    """Per-stage costs plus links. ``links[(src, dst)]`` overrides ``default_link`` for one directed rank pair."""

    stages: tuple[StageCosts, ...]
    """One entry per stage of the schedule."""
    default_link: Link = FREE_LINK
    """Link used for every rank pair not in ``links``."""
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    """Directed rank-pair overrides (e.g. inter-node pairs)."""
    microbatch_stages: tuple[tuple[StageCosts, ...], ...] | None = None
    """Unequal micro-batches (variable lengths): ``microbatch_stages[m][s]`` is stage ``s``'s cost for micro-batch
    ``m``; ``stages`` then holds each stage's largest (what one activation unit means). None: every micro-batch
    costs ``stages`` (the fast path)."""

    def cost_of(self, stage: int, microbatch: int) -> StageCosts:
        """Stage ``stage``'s costs for micro-batch ``microbatch``."""
        per = self.microbatch_stages
        return self.stages[stage] if per is None else per[microbatch][stage]

    def link(self, src: int, dst: int) -> Link:
        return self.links.get((src, dst), self.default_link)

    @property
    def charges_cpu(self) -> bool:
        """Whether any link takes compute time from its endpoints (``Link.cpu_s_per_byte`` > 0)."""
        return self.default_link.cpu_s_per_byte > 0 or any(k.cpu_s_per_byte > 0 for k in self.links.values())

    @property
    def link_terms_event_only(self) -> bool:
        """Whether a link takes CPU time from its endpoints (``Link.cpu_s_per_byte``) or charges receives posted
        late (``Link.late_receive_s``): terms only the event engine models."""
        return self.charges_cpu or self.default_link.late_receive_s > 0 or \
            any(k.late_receive_s > 0 for k in self.links.values())

    @property
    def event_engine_only(self) -> bool:
        """Whether the costs have a term only the event engine models: unequal micro-batches
        (``microbatch_stages``), or a link's CPU time taken from its endpoints (``Link.cpu_s_per_byte``) or cost
        for receives posted late (``Link.late_receive_s``)."""
        return self.microbatch_stages is not None or self.link_terms_event_only

    @classmethod
    def uniform(cls, *, num_stages: int, num_chunks: int = 1, forward: float = 1.0, backward: float = 2.0,
                weight: float = 0.0, activation_bytes: float = 1.0, output_bytes: float = 0.0,
                checkpoint_bytes: float | None = None, weight_grad_bytes: float | None = None,
                link: Link = FREE_LINK) -> "SimCosts":
        """Identical stages. Times and bytes are given for a *whole* rank's share of layers and divided by
        ``num_chunks`` (so interleaving splits each rank's work into V smaller stages). ``backward`` is the
        input-gradient time ``B``; a full backward takes ``backward + weight``."""
        if num_stages < 1 or num_chunks < 1:
            raise ConfigError(f"num_stages and num_chunks must be >= 1, got {num_stages}, {num_chunks}")
        v = float(num_chunks)
        stage = StageCosts(
            forward=forward / v, backward_input=backward / v, backward_weight=weight / v,
            activation_bytes=activation_bytes / v, output_bytes=output_bytes,
            checkpoint_bytes=(0.0 if checkpoint_bytes is None else checkpoint_bytes / v),
            weight_grad_bytes=(activation_bytes / v * 0.5 if weight_grad_bytes is None else weight_grad_bytes / v),
        )
        return cls(stages=tuple(stage for _ in range(num_stages)), default_link=link)

    @classmethod
    def from_stages(cls, stages: Sequence[StageCosts], *, default_link: Link = FREE_LINK,
                    links: Mapping[tuple[int, int], Link] | None = None) -> "SimCosts":
        return cls(stages=tuple(stages), default_link=default_link, links=dict(links or {}))

    @classmethod
    def per_microbatch(cls, rows: Sequence[Sequence[StageCosts]], *, default_link: Link = FREE_LINK,
                       links: Mapping[tuple[int, int], Link] | None = None) -> "SimCosts":
        """Costs of unequal micro-batches: ``rows[m][s]`` is stage ``s``'s cost for micro-batch ``m``. When every
        row is the same, the plain per-stage costs (the fast path); else ``stages`` takes each stage's largest
        bytes and times, field by field. ConfigError for no rows or rows of different lengths."""
        if not rows or any(len(row) != len(rows[0]) for row in rows):
            raise ConfigError(f"per-micro-batch costs need one row per micro-batch, every row one StageCosts per "
                              f"stage; got rows of lengths {sorted({len(row) for row in rows})}")
        first = tuple(rows[0])
        if all(tuple(row) == first for row in rows):
            return cls.from_stages(first, default_link=default_link, links=links)
        widest = tuple(_largest(column) for column in zip(*rows))
        return cls(stages=widest, default_link=default_link, links=dict(links or {}),
                   microbatch_stages=tuple(tuple(row) for row in rows))


def _largest(costs: Sequence[StageCosts]) -> StageCosts:
    """Field by field, the largest of ``costs`` (one stage over every micro-batch)."""
    names = ("forward", "backward_input", "backward_weight", "activation_bytes", "checkpoint_bytes",
             "weight_grad_bytes", "output_bytes")
    largest = {name: max(getattr(c, name) for c in costs) for name in names}
    recomputes = [c.recompute for c in costs]
    return StageCosts(**largest, recompute=None if all(r is None for r in recomputes)
                      else max(c.recompute_time for c in costs))
