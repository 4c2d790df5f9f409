"""The predicted memory of a run of documents (``train --documents --predict PROFILE``): every step's micro-batches,
each replica's in the order it ran them, walked by the cost model's memory walk
(:func:`evenpipe.plan.varlen_predict.step_peak_bytes`, each micro-batch priced at the shape the runtime computes:
:meth:`evenpipe.runtime.document_batches.DocumentBatches.step_shapes`); per pipeline rank and category the largest
over the steps, which is what the run measures (its peaks over the steps)."""

from __future__ import annotations

from typing import Any, Iterable

from evenpipe.cost.parallel import ParallelConfig

__all__ = ["documents_prediction"]


def documents_prediction(data: Any, steps: Iterable[int], profile_path: str, cfg: ParallelConfig, *, dtype: str,
                         sharding: str) -> tuple[dict[str, int], ...]:
    """Per pipeline rank, the predicted peak bytes of every memory category over ``steps`` of ``data`` (a
    :class:`~evenpipe.runtime.document_batches.DocumentBatches`) under ``cfg``, by the profile at ``profile_path``."""
    from evenpipe.plan.predict import profiled_source
    from evenpipe.plan.varlen_predict import larger_peaks, step_peak_bytes
    source = profiled_source(profile_path, dtype=dtype, sharding=sharding)
    out: tuple[dict[str, int], ...] = ()
    for step in steps:
        out = larger_peaks(out, step_peak_bytes(source, cfg, data.step_shapes(step)))
    return out
