"""The prediction of a run of documents (``train --documents --predict PROFILE``), step by step: every step's
micro-batches, each replica's in the order it ran them, at the shapes the runtime computed
(:meth:`evenpipe.runtime.document_batches.DocumentBatches.step_shapes`), priced by the profile.

Per step: its predicted time (each replica's estimate, :func:`evenpipe.cost.estimate.estimate_with`, the slowest)
and every memory category per pipeline rank (the cost model's memory walk of each replica,
:func:`evenpipe.cost.category_memory.peak_bytes_by_category`). Over a run: per rank and category the largest over
its steps, which is what the run measures (its peaks over the steps)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from evenpipe.cost.parallel import ParallelConfig

__all__ = ["StepForecast", "DocumentForecast"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepForecast:
    """The prediction of one step."""

    step_s: float
    """The slowest replica's predicted step (seconds of the profiled machine)."""
    replicas: tuple[tuple[dict[str, int], ...], ...]
    """Per replica, per pipeline rank, the predicted peak bytes of every memory category."""


class DocumentForecast:
    """Predictions of the steps of ``data`` (a :class:`~evenpipe.runtime.document_batches.DocumentBatches`) under
    ``cfg`` by the profile at ``profile_path`` (each step's computed once)."""

    def __init__(self, data: Any, profile_path: str, cfg: ParallelConfig, *, dtype: str, sharding: str) -> None:
        from evenpipe.plan.predict import profiled_source
        self.data, self.cfg = data, cfg
        self.source = profiled_source(profile_path, dtype=dtype, sharding=sharding)
        self._steps: dict[int, StepForecast] = {}

    def step(self, step: int) -> StepForecast:
        """Step ``step``'s prediction."""
        if step not in self._steps:
            from evenpipe.cost.category_memory import peak_bytes_by_category
            from evenpipe.cost.estimate import estimate_with
            times, replicas = [], []
            for rep in self.data.step_shapes(step):
                rep_cfg = dataclasses.replace(self.cfg, global_batch=len(rep) * self.cfg.microbatch_size * self.cfg.dp,
                                              microbatch_shapes=tuple(rep))
                times.append(estimate_with(self.source, rep_cfg).step_time_s)
                replicas.append(peak_bytes_by_category(self.source, rep_cfg))
            self._steps[step] = StepForecast(step_s=max(times), replicas=tuple(replicas))
        return self._steps[step]

    def metrics(self, step: int) -> dict[str, float]:
        """For the metrics line of ``step`` (0-based), beside the measured ``step_time_s`` and rank 0's
        ``peak_activation_bytes``: the predicted step and rank 0's predicted own plus hosted activations."""
        f = self.step(step)
        rank0 = f.replicas[0][0]
        return {"predicted_step_s": f.step_s,
                "predicted_activation_bytes": float(rank0["own_activations"] + rank0["hosted_activations"])}

    def peaks(self, steps: Iterable[int]) -> tuple[dict[str, int], ...]:
        """Per pipeline rank and category the largest prediction over ``steps`` and replicas."""
        from evenpipe.plan.varlen_predict import larger_peaks
        out: tuple[dict[str, int], ...] = ()
        for step in steps:
            for rep in self.step(step).replicas:
                out = larger_peaks(out, rep)
        return out
