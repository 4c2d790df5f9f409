"""The compute orders torch.distributed.pipelining's own schedule classes generate, as evenpipe schedules.

torch's schedule visualizer (``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops``) builds a
schedule class on mocked stages, so no process group or GPU is needed, and returns every rank's pipeline order.
We keep its compute actions (``F``, ``I``, ``W`` and full backwards ``B``; an ``OVERLAP_F_B`` pair becomes its
forward followed by its backward, which is the order a single stream runs them in), write them in torch's CSV
form and read that back with :meth:`evenpipe.schedule.Schedule.from_torch_csv` under the class's stage
placement. The result is a compute-only schedule: add communication with
:func:`evenpipe.schedule.derive_communication`, then validate and simulate it like any other.

This lives in the runtime layer because it imports torch; the schedule layer stays torch-free.
"""

from __future__ import annotations

import enum
from typing import Any

from evenpipe.errors import ConfigError, parse_choice
from evenpipe.schedule.family import Placement
from evenpipe.schedule.ir import Schedule

__all__ = ["TorchSchedule", "torch_compute_order"]


class TorchSchedule(enum.Enum):
    """torch 2.13 schedule classes whose orders we import; the value is torch's name for the class, lower-cased
    (torch looks names up case-insensitively)."""

    ZBV_ZERO_BUBBLE = "zbvzerobubble"
    DUALPIPE_V = "dualpipev"
    INTERLEAVED_ZERO_BUBBLE = "interleavedzerobubble"
    INTERLEAVED_1F1B = "interleaved1f1b"

    @classmethod
    def parse(cls, name: "str | TorchSchedule") -> "TorchSchedule":
        return parse_choice(cls, name, "torch schedule", normalize=True)

    @property
    def placement(self) -> Placement:
        """Where the class puts its stages."""
        v_shaped = self in (TorchSchedule.ZBV_ZERO_BUBBLE, TorchSchedule.DUALPIPE_V)
        return Placement.V_SHAPE if v_shaped else Placement.LOOPED


_TOKENS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
"""torch computation type name -> our compute token (the same letters torch prints)."""


def _tokens(action: Any) -> list[str]:
    kind = action.computation_type.name
    if kind == "OVERLAP_F_B":
        return [t for sub in action.sub_actions for t in _tokens(sub)]
    if kind not in _TOKENS:
        raise ConfigError(f"torch action {action} ({kind}) is not a compute evenpipe imports; allowed: "
                          f"{', '.join(_TOKENS)}, OVERLAP_F_B")
    return [f"{action.stage_index}{_TOKENS[kind]}{action.microbatch_index}"]


def torch_compute_order(schedule: "TorchSchedule | str", *, num_ranks: int, num_microbatches: int,
                        num_chunks: int = 2) -> Schedule:
    """The compute order torch's ``schedule`` class generates for ``num_ranks`` ranks, ``num_microbatches``
    micro-batches and ``num_chunks`` stages per rank (the V-shaped classes take exactly 2)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    which = TorchSchedule.parse(schedule)
    try:
        ops = get_schedule_ops(which.value, num_ranks, num_microbatches, num_stages_per_rank=num_chunks)
    except (ValueError, AssertionError) as e:
        raise ConfigError(f"torch's {which.value} refuses P={num_ranks} M={num_microbatches} "
                          f"V={num_chunks}: {e}") from None
    rows = [",".join(t for a in rank if a is not None for t in _tokens(a)) for rank in ops]
    layout = which.placement.stage_to_rank(num_ranks, num_chunks)
    return Schedule.from_torch_csv("\n".join(rows) + "\n", name=f"torch-{which.value}",
                                   num_microbatches=num_microbatches, stage_to_rank=layout)
