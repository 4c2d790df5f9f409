"""The schedule layer: the IR, generators, communication derivation, the BPipe transform and the validator.

Pure Python (no torch, numpy or matplotlib). The usual entry point is :func:`build_schedule`::

    >>> from evenpipe.schedule import build_schedule, held_units
    >>> s = build_schedule("bpipe", num_ranks=4, num_microbatches=8)
    >>> held_units(s)  # peak activation units per rank, own plus hosted
    [3, 3, 2, 3]

Pipeline: a generator (``generate/``) gives each rank's compute order; :func:`add_recompute` optionally inserts
``R`` before every backward; :func:`bpipe_transform` adds evict/load markers; :func:`derive_communication` adds
every transfer in a deadlock-free order; :func:`validate` checks the result (``build_schedule`` does all of it).
What the simulator does not need (generators, the BPipe transform, message placement) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenpipe import lazy_exports
from evenpipe.schedule.ir import (
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    Action,
    ActionKind,
    Schedule,
    parse_action,
)
from evenpipe.schedule.validate import message_key, validate  # bound now: ``validate`` is also a submodule's name
from evenpipe.schedule.grid import format_grid

__all__ = [
    "COMPUTE_KINDS",
    "LinkPlan",
    "RECV_KINDS",
    "SEND_KINDS",
    "WITNESS_DURATIONS",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleFamily",
    "WitnessTiming",
    "add_offload",
    "offload_beside_bpipe",
    "add_recompute",
    "bpipe_pairs",
    "bpipe_partner",
    "bpipe_transform",
    "build_schedule",
    "compute_order",
    "default_bpipe_budget",
    "derive_communication",
    "format_grid",
    "held_units",
    "held_units_trace",
    "lowest_bpipe_budget",
    "message_key",
    "parse_action",
    "validate",
    "witness_timing",
]


_LAZY: dict[str, str] = {
    **dict.fromkeys(("bpipe_pairs", "bpipe_partner", "bpipe_transform", "default_bpipe_budget", "held_units",
                     "held_units_trace", "lowest_bpipe_budget"), "evenpipe.schedule.bpipe"),
    **dict.fromkeys(("add_offload", "add_recompute", "build_schedule", "compute_order", "offload_beside_bpipe"),
                    "evenpipe.schedule.build"),
    "derive_communication": "evenpipe.schedule.comm",
    "ScheduleFamily": "evenpipe.schedule.family",
    "LinkPlan": "evenpipe.schedule.generate.latency_plan",
    **dict.fromkeys(("WITNESS_DURATIONS", "WitnessTiming", "witness_timing"), "evenpipe.schedule.witness"),
}
"""Exported name -> the module that defines it, imported on first access (PEP 562): the simulator reads
schedules (the IR and its validation) without the generators, the BPipe transform or the message placement."""


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from evenpipe.schedule.bpipe import (bpipe_pairs, bpipe_partner, bpipe_transform, default_bpipe_budget, held_units,
                                         held_units_trace, lowest_bpipe_budget)
    from evenpipe.schedule.build import (add_offload, add_recompute, build_schedule, compute_order,
                                         offload_beside_bpipe)
    from evenpipe.schedule.comm import derive_communication
    from evenpipe.schedule.family import ScheduleFamily
    from evenpipe.schedule.generate.latency_plan import LinkPlan
    from evenpipe.schedule.witness import WITNESS_DURATIONS, WitnessTiming, witness_timing
