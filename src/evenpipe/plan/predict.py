"""``evenpipe train --predict PROFILE`` (pure planning code, no torch): the profile's prediction of this run, printed against what it measured.

Predicted: the schedule simulated with the profile's costs for this run's layout and micro-batch size, plus each
rank's optimizer step and the fixed per-step cost (:func:`evenpipe.cost.profile_fit.predict_step`). Measured: the
median over steps after the first of the slowest rank's step time (the first step also learns shapes and BPipe
sizes), and each rank's peak activation bytes from the activation stash.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from evenpipe.cost.categories import MEMORY_CATEGORIES
from evenpipe.cost.category_memory import peak_bytes_by_category, with_conventions
from evenpipe.cost.parallel import ParallelConfig
from evenpipe.cost.profile import Profile, ProfileError, load_profile
from evenpipe.cost.profile_fit import ProfileModel, StepPrediction, predict_step
from evenpipe.cost.profiled_source import ProfiledSource
from evenpipe.cost.runtime_memory import RuntimeConventions, StateSharding, TrainPrecision
from evenpipe.schedule.ir import Schedule

__all__ = ["check_profile_for_training", "PredictedRun", "predicted_run", "prediction_table",
           "report_prediction", "predicted_compute_s", "profiled_source"]


def check_profile_for_training(path: str, *, model_name: str, model_config: Any, dtype: str = "float32",
                               device: str | None = None) -> Profile:
    """Load ``path`` and refuse it unless it profiles this model, at this sequence length, in this dtype (and on
    this kind of device, when given): ProfileError, one line."""
    where = f"profile {path!r}"
    profile = load_profile(path, model=model_name, num_layers=model_config.num_layers, hidden=model_config.hidden)
    ProfileModel(profile).check_seq_len(model_config.seq_len)
    if profile.machine.dtype != dtype:
        raise ProfileError(f"{where} was measured in {profile.machine.dtype}, training runs in {dtype}")
    if device is not None and profile.machine.device != device:
        raise ProfileError(f"{where} was measured on {profile.machine.device}, training runs on {device}")
    return profile


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictedRun:
    """A run's prediction next to its measurement."""

    prediction: StepPrediction
    """From the profile."""
    measured_step_s: float
    """Median over steps after the first of the slowest rank's step."""
    measured_steps_s: tuple[float, ...]
    """The slowest rank's step, each step after the first (what ``measured_step_s`` is the median of)."""
    measured_rank_step_s: tuple[float, ...]
    """Per pipeline rank, its median step after the first."""
    measured_peak_bytes: tuple[float, ...]
    """Per pipeline rank, peak activation bytes (stash)."""
    num_steps: int
    """Steps the medians are over."""

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {"predicted_step_s": p.step_time, "measured_step_s": self.measured_step_s,
                "predicted_rank_step_s": list(p.rank_step_times), "measured_rank_step_s": list(self.measured_rank_step_s),
                "predicted_schedule_s": p.trace.step_time, "predicted_optimizer_s": list(p.optimizer_s),
                "predicted_peak_bytes": list(p.peak_activation_bytes), "measured_peak_bytes": list(self.measured_peak_bytes),
                "num_steps": self.num_steps, "measured_steps_s": list(self.measured_steps_s)}


def predicted_run(profile: Profile, schedule: Schedule, *, microbatch_size: int, layout: Sequence[int],
                  step_times: Sequence[Sequence[float]], peak_bytes: Sequence[float],
                  rank_of_report: Sequence[int]) -> PredictedRun:
    """``step_times[i]``: every step's seconds of report ``i`` (pipeline rank ``rank_of_report[i]``)."""
    pred = predict_step(ProfileModel(profile), schedule, microbatch_size=microbatch_size, layout=layout)
    steps = min(len(t) for t in step_times)
    later = range(1, steps) if steps > 1 else range(steps)
    slowest = [max(t[i] for t in step_times) for i in later]
    per_rank = []
    for r in range(schedule.num_ranks):
        mine = [t for t, k in zip(step_times, rank_of_report) if k == r]
        per_rank.append(statistics.median(max(t[i] for t in mine) for i in later))
    return PredictedRun(prediction=pred, measured_step_s=statistics.median(slowest), measured_steps_s=tuple(slowest),
                        measured_rank_step_s=tuple(per_rank), measured_peak_bytes=tuple(float(b) for b in peak_bytes),
                        num_steps=len(later))


def _err(pred: float, meas: float) -> str:
    return f"{(pred - meas) / meas:+7.1%}" if meas else "      -"


def prediction_table(run: PredictedRun) -> str:
    """Predicted against measured: the step, each rank's step and peak activation memory."""
    p = run.prediction
    lines = [f"predicted vs measured (median of {run.num_steps} step(s) after the first)",
             f"{'':22s} {'predicted':>12s} {'measured':>12s} {'error':>8s}",
             f"{'step time':22s} {p.step_time * 1e3:9.1f} ms {run.measured_step_s * 1e3:9.1f} ms "
             f"{_err(p.step_time, run.measured_step_s)}"]
    for r, (ps, ms) in enumerate(zip(p.rank_step_times, run.measured_rank_step_s)):
        lines.append(f"{f'rank {r} step':22s} {ps * 1e3:9.1f} ms {ms * 1e3:9.1f} ms {_err(ps, ms)}")
    for r, (pb, mb) in enumerate(zip(p.peak_activation_bytes, run.measured_peak_bytes)):
        lines.append(f"{f'rank {r} peak act.':22s} {pb / 2**20:8.2f} MiB {mb / 2**20:8.2f} MiB {_err(pb, mb)}")
    return "\n".join(lines)


def report_prediction(profile_path: str, *, model_name: str, model_config: Any, schedule: Schedule,
                      microbatch_size: int, layout: Sequence[int], reports: Sequence[Any],
                      dtype: str = "float32") -> PredictedRun:
    """The prediction of a finished run (``reports``: every rank's ``RankReport``; replica 0 is compared) in
    training dtype ``dtype``; ``layout``: blocks per stage as the runtime built them."""
    profile = check_profile_for_training(profile_path, model_name=model_name, model_config=model_config,
                                         dtype=dtype)
    mine = [r for r in reports if r.dp_rank == 0]
    return predicted_run(profile, schedule, microbatch_size=microbatch_size,
                         layout=tuple(layout),
                         step_times=[r.step_times_s for r in mine],
                         peak_bytes=[max(r.peak_activation_bytes for r in mine if r.pp_rank == k)
                                     for k in range(schedule.num_ranks)],
                         rank_of_report=[r.pp_rank for r in mine])


def predicted_compute_s(profile_path: str, *, model_name: str, model_config: Any, schedule: Schedule,
                        microbatch_size: int, layout: Sequence[int], dtype: str = "float32") -> tuple[float, ...]:
    """Per rank, the seconds its compute actions take in the simulated step (the slow-rank detector's
    reference, :mod:`evenpipe.plan.slow_rank`)."""
    profile = check_profile_for_training(profile_path, model_name=model_name, model_config=model_config,
                                         dtype=dtype)
    pred = predict_step(ProfileModel(profile), schedule, microbatch_size=microbatch_size, layout=tuple(layout))
    return tuple(pred.trace.busy_time(r) for r in range(schedule.num_ranks))


def category_prediction(profile_path: str, cfg: ParallelConfig, *, dtype: str,
                        sharding: str) -> tuple[dict[str, int], ...] | None:
    """The profile's predicted peak of every memory category per pipeline rank for a run of ``cfg`` in ``dtype``
    under ``--sharding sharding`` (evenpipe's conventions); None with sequence parallelism (a profile measures
    layers without it)."""
    if cfg.sequence_parallel:
        return None
    return peak_bytes_by_category(profiled_source(profile_path, dtype=dtype, sharding=sharding), cfg)


def profiled_source(profile_path: str, *, dtype: str, sharding: str) -> ProfiledSource:
    """The profile's cost source with evenpipe's conventions for a run in ``dtype`` under ``--sharding``."""
    conventions = RuntimeConventions(dtype=TrainPrecision(dtype), sharding=StateSharding(sharding))
    source = with_conventions(ProfiledSource(ProfileModel(load_profile(profile_path))), conventions)
    assert isinstance(source, ProfiledSource)
    return source


def category_table(predicted: Sequence[Mapping[str, int]] | None, measured: Sequence[Mapping[str, int]]) -> str:
    """Predicted against measured peak bytes, per pipeline rank and memory category (KiB)."""
    if predicted is None:
        return ("memory by category: not predicted (a profile predicts no sequence parallelism and one "
                "recomputation mode for every stage only)")
    lines = ["peak memory by category (KiB): predicted vs measured",
             f"{'rank':>4} {'category':22s} {'predicted':>12s} {'measured':>12s} {'error':>8s}"]
    for r, (p, m) in enumerate(zip(predicted, measured)):
        for c in MEMORY_CATEGORIES:
            pv, mv = p.get(c, 0), m.get(c, 0)
            err = "   exact" if pv == mv else _err(pv, mv)
            lines.append(f"{r:4d} {c:22s} {pv / 1024:12.1f} {mv / 1024:12.1f} {err:>8s}")
    return "\n".join(lines)
