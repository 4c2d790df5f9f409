"""Per-step training metrics: a named record, a progress log line, a JSON-lines file and (optionally) TensorBoard.

Only global rank 0 writes. TensorBoard needs the ``tensorboard`` package; asking for it without the package is a
one-line ConfigError raised by :func:`require_tensorboard` before any process starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any, TextIO

from evenpipe.errors import ConfigError

__all__ = ["StepMetrics", "MetricsSink", "require_tensorboard", "format_progress"]

log = logging.getLogger("evenpipe.train")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """What one optimizer step measured (on global rank 0, loss shared by all ranks)."""

    step: int
    """Steps done, counting this one (1-based)."""
    loss: float
    """Mean training loss over the global batch."""
    lr: float
    """Learning rate this step used."""
    grad_norm: float
    """The whole model's gradient L2 norm before clipping."""
    step_time_s: float
    """Wall-clock seconds of the step on rank 0 (pipeline, gradient sync and optimizer)."""
    tokens_per_s: float
    """Global tokens of the step divided by its time."""
    peak_activation_bytes: int
    """Rank 0's peak activation bytes this step (0 when not measured)."""
    memory_bytes: int
    """Rank 0's peak process memory so far: CUDA allocator peak on GPU, else resident set size."""


def format_progress(m: StepMetrics, total_steps: int) -> str:
    """One progress line: step, loss, learning rate, throughput, step time and memory."""
    return (f"step {m.step:4d}/{total_steps}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad norm {m.grad_norm:8.3f}  "
            f"{m.tokens_per_s:10.0f} tokens/s  "
            f"step {m.step_time_s * 1e3:8.1f} ms  mem {m.memory_bytes / 2**20:8.1f} MiB")


def require_tensorboard() -> None:
    """ConfigError unless ``torch.utils.tensorboard`` can be imported."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package, which is not installed; "
                          "pip install tensorboard (with your torch pinned) or drop --tensorboard") from None


class MetricsSink:
    """Writes each step's :class:`StepMetrics` to a JSON-lines file and/or TensorBoard (either may be None)."""

    def __init__(self, *, jsonl_path: str | None, tensorboard_dir: str | None, append: bool = False) -> None:
        self._file: TextIO | None = open(jsonl_path, "a" if append else "w") if jsonl_path else None
        self._writer: Any = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, m: StepMetrics, **extra: float) -> None:
        """Record one step; ``extra`` adds named scalars (e.g. ``eval_loss``)."""
        record = {**dataclasses.asdict(m), **extra}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            for name, value in record.items():
                if name != "step":
                    self._writer.add_scalar(f"train/{name}", value, m.step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
