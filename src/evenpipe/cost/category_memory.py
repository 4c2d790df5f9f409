"""The predicted peak of every memory category per pipeline rank (``estimate --json``'s
``peak_bytes_by_category``), the same categories ``train --json-out`` measures.

Model states: the rank's parameters (:class:`~evenpipe.cost.source.Holding`) times the source's bytes per
parameter of each category (FSDP's gathered states too: a tied table it leaves out gathers nothing).
Activations: the program-order walk of :func:`~evenpipe.cost.memory.stage_memory`
(own, with the stage output held until sent, and hosted). Offloaded activations: the largest sum of the units
a rank has offloaded to host memory and not yet reloaded, in program order (:func:`offloaded_peak`; a unit is
what the stash holds for one stage and micro-batch: its saved layers, its kept input, and the embedding or head
extras of the first or last stage). Communication buffers: a walk of the rank's whole
schedule as the executor posts it -- each pipeline message allocates its buffer when its run of transfers is
posted; a receive's buffer is taken by the compute that consumes it (``F`` its ``RECV_F``, ``B`` or ``I`` its
``RECV_B``), and a send is waited after the second compute or host move following its posting.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from evenpipe.errors import ConfigError
from evenpipe.schedule import ActionKind, Schedule
from evenpipe.schedule.semantics import SEMANTICS, MemoryEffect

from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.categories import MEMORY_CATEGORIES
from evenpipe.cost.microbatch_costs import bpipe_weights
from evenpipe.cost.memory import build_cost_schedule, rank_activation_peaks, tied_table
from evenpipe.cost.parallel import ParallelConfig, stage_layers
from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions
from evenpipe.cost.source import CostSource, shape_of

__all__ = ["peak_bytes_by_category", "message_buffer_peak", "offloaded_peak", "with_conventions"]

_K = ActionKind
_PIPELINE = frozenset((_K.SEND_F, _K.SEND_B, _K.RECV_F, _K.RECV_B))
_POSTED = frozenset(k for k in ActionKind if SEMANTICS[k].peer_kind is not None and not SEMANTICS[k].host_side)
"""Kinds the executor posts as messages (the rest run in place: computes and host moves)."""
_TAKES = {_K.FORWARD: _K.RECV_F, _K.BACKWARD: _K.RECV_B, _K.BACKWARD_INPUT: _K.RECV_B}
_TO_HOST = {k: (1 if SEMANTICS[k].memory is MemoryEffect.SEND_AWAY else -1) for k in ActionKind
            if SEMANTICS[k].host_side}
"""Host moves: +1 unit on the host (``OFFLOAD``), -1 (``RELOAD``)."""


def offloaded_peak(schedule: Schedule, rank: int, unit_bytes: Sequence[float]) -> float:
    """Peak bytes ``rank`` holds in host memory, walking its actions in program order (``unit_bytes[s]``: one
    micro-batch's activations of stage ``s``)."""
    now = peak = 0.0
    for a in schedule.actions[rank]:
        step = _TO_HOST.get(a.kind)
        if step is not None:
            now += step * unit_bytes[a.stage]
            peak = max(peak, now)
    return peak


def message_buffer_peak(schedule: Schedule, rank: int, message_bytes: "float | Sequence[float]") -> float:
    """Peak bytes of pipeline messages in flight on ``rank`` (every message ``message_bytes``, or, a sequence,
    each micro-batch's messages ``message_bytes[microbatch]``)."""
    size = (lambda mb: float(message_bytes)) if isinstance(message_bytes, (int, float)) else \
        (lambda mb: message_bytes[mb])  # type: ignore[index]
    pending: set[tuple[ActionKind, int, int]] = set()
    now = peak = 0.0
    sends = earlier = 0.0
    for a in schedule.actions[rank]:
        if a.kind in _POSTED:
            if a.kind in _PIPELINE:
                now += size(a.microbatch)
                if SEMANTICS[a.kind].sends:
                    sends += size(a.microbatch)
                else:
                    pending.add((a.kind, a.stage, a.microbatch))
                peak = max(peak, now)
            continue
        taken = _TAKES.get(a.kind)
        if taken is not None and (taken, a.stage, a.microbatch) in pending:
            pending.discard((taken, a.stage, a.microbatch))
            now -= size(a.microbatch)
        now -= earlier
        earlier, sends = sends, 0.0
    return peak


def peak_bytes_by_category(source: CostSource, cfg: ParallelConfig) -> tuple[dict[str, int], ...]:
    """Per pipeline rank, the predicted peak bytes of every category (see the module docstring)."""
    schedule = build_cost_schedule(cfg, source.plan_durations(cfg), bpipe_weights(source, cfg))
    layers = stage_layers(source.model, cfg)
    counts = source.param_counts(cfg)
    # offloaded units: of the largest micro-batch when they differ (an upper bound); messages: each micro-batch's
    shapes = cfg.microbatch_shapes
    shape = shape_of(source.model, cfg) if shapes is None else max(shapes, key=lambda sh: sh.num_tokens)
    last = schedule.num_stages - 1
    out = []
    for r, (peak, held) in enumerate(rank_activation_peaks(source, cfg)):
        n = counts.per_layer * sum(layers[s] for s in schedule.stages_of(r))
        n += counts.embedding if r == schedule.rank_of(0) else 0.0
        n += counts.head if r == schedule.rank_of(last) else 0.0
        b = source.state_bytes(cfg, r)
        tied = tied_table(source, cfg, schedule, r)
        n -= 2 * tied.params  # counted once below, in its own bytes
        t = tied.params
        act = source.layer_bytes(cfg, r, shape)
        units = [n_layers * act.layer_saved + (act.boundary if s else act.embedding) + (act.head if s == last else 0.0)
                 for s, n_layers in enumerate(layers)]
        sent = act.sent if shapes is None else [source.layer_bytes(cfg, r, sh).sent for sh in shapes]
        values = (n * b.parameters + t * tied.per_param.parameters, n * b.gradients + t * tied.per_param.gradients,
                  n * b.master + t * tied.per_param.master, n * b.optimizer + t * tied.per_param.optimizer,
                  n * b.gathered + t * tied.per_param.gathered,
                  peak.own_layers + peak.own_extra_embedding + peak.own_extra_head + held, peak.hosted,
                  offloaded_peak(schedule, r, units), message_buffer_peak(schedule, r, sent))
        out.append({name: round(v) for name, v in zip(MEMORY_CATEGORIES, values)})
    return tuple(out)


def with_conventions(source: CostSource, conventions: RuntimeConventions) -> CostSource:
    """``source`` answering model-state bytes (and an analytic source's activation bytes, counted in 2-byte
    elements, in the training dtype) by ``conventions``. A profile measured in another dtype than
    ``conventions.dtype`` is refused in one line (its activations are that dtype's)."""
    if isinstance(source, AnalyticSource):
        return dataclasses.replace(source, conventions=conventions)
    from evenpipe.cost.profiled_source import ProfiledSource  # a measured source only: off an analytic plan's path
    if isinstance(source, ProfiledSource):
        measured = source.fits.profile.machine.dtype
        if conventions.runtime is Runtime.EVENPIPE and measured != conventions.dtype.value:
            raise ConfigError(f"--dtype {conventions.dtype.value}: the profile was measured in {measured}; "
                              f"profile in {conventions.dtype.value} or pass --dtype {measured}")
        return source.with_conventions(conventions)
    raise ConfigError(f"runtime conventions apply to an analytic or a profiled source, not {source.name}")
