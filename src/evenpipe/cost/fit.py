"""Fit :class:`Efficiency` to Narayanan et al. 2021, Table 1 (Megatron-LM weak scaling on A100-80GB).

Each row gives the model (L, h, a), tp, pp, the GPU count and the global batch; the rest is our assumption:

- data parallelism fills the GPUs: dp = gpus / (tp·pp); vocabulary 51,200, s = 2,048, GPT blocks;
- full activation recomputation, eager attention (no FlashAttention in 2021), no sequence parallelism, the
  plain (non-distributed) optimizer with fp32 gradient all-reduce;
- micro-batch size 1 (not in the table; the paper's appendix runs its largest models with b = 1);
- the interleaved schedule whenever pp > 1, with the smallest v >= 2 that divides the layers per rank, except
  where Korthikanti et al. 2022 list the chunks for the same model: v = 3 for 530B and v = 1 (plain 1F1B) for
  1T; pp = 1 runs plain gradient accumulation.

The target is ``tflops_per_gpu`` (executed FLOPs, recomputation included), i.e. :attr:`Estimate.tflops_per_gpu`.

Search: coordinate descent over a few :class:`Efficiency` fields on shrinking geometric grids, minimising the
mean squared log error of the predicted throughput. Simulating the largest
rows takes seconds, so the search runs on a *calibrated surrogate*: per row, the step time simulated at a
calibration point, scaled by the ratio of the busiest rank's compute work at the trial point to that at the
calibration point (the part outside the pipeline, gradient reduction and optimizer, is recomputed exactly).
After a search the rows are recalibrated at the optimum and the search repeats, so at the end the surrogate
equals the real :func:`estimate` at the returned point. Reported errors always come from :func:`estimate`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from evenpipe.cost.estimate import estimate
from evenpipe.cost.hardware import Hardware, hardware_preset
from evenpipe.cost.parallel import Attention, ParallelConfig, Recompute, ScheduleFamily
from evenpipe.cost.specs import Arch, ModelSpec
from evenpipe.cost.timing import Efficiency, stage_sim_costs
from evenpipe.errors import ConfigError

__all__ = ["PRIOR", "MegatronRow", "load_megatron_rows", "row_setup", "FIT_FIELDS", "FitResult", "fit_efficiency",
           "leave_one_out", "predict_tflops"]

FIT_FIELDS: dict[str, tuple[float, float]] = {
    "gemm_peak_fraction": (0.50, 0.95),
    "gemm_size_scale": (8.0, 1024.0),
    "hbm_fraction": (0.30, 1.00),
    "network_fraction": (0.30, 1.00),
    "nvlink_fraction": (0.30, 1.00),
}
"""The fitted Efficiency fields and their search ranges."""

PRIOR = Efficiency(gemm_peak_fraction=0.80, gemm_size_scale=128.0, hbm_fraction=0.70, network_fraction=0.80,
                   nvlink_fraction=0.75)
"""Fixed starting point of every search (datasheet-style guesses), so fits do not depend on the current defaults."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronRow:
    """One row of the weak-scaling table."""

    params_b: float
    """Billions of parameters (the paper's label)."""
    layers: int
    """Transformer layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention heads."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    gpus: int
    """GPUs."""
    global_batch: int
    """Global batch (sequences)."""
    tflops_per_gpu: float
    """Measured executed TFLOP/s per GPU."""


def load_megatron_rows(path: str | pathlib.Path) -> tuple[MegatronRow, ...]:
    """Read ``megatron2021_weak_scaling.csv``."""
    try:
        with pathlib.Path(path).open() as f:
            rows = list(csv.DictReader(f))
        return tuple(MegatronRow(params_b=float(r["params_b"]), layers=int(r["layers"]), hidden=int(r["hidden"]),
                                 heads=int(r["heads"]), tp=int(r["tp"]), pp=int(r["pp"]), gpus=int(r["gpus"]),
                                 global_batch=int(r["global_batch"]), tflops_per_gpu=float(r["tflops_per_gpu"]))
                     for r in rows)
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"cannot read Megatron table {str(path)!r}: {e}") from None


_KORTHIKANTI_CHUNKS = {(105, 20480): 3, (128, 25600): 1}
"""Chunks per rank that Korthikanti et al. 2022 (same group, same machines) list for the 530B and 1T models."""


def row_setup(row: MegatronRow) -> tuple[ModelSpec, Hardware, ParallelConfig]:
    """The model, hardware and configuration we assume for a row (see the module docstring)."""
    h = row.hidden
    model = ModelSpec(name=f"gpt-{row.params_b:g}b", arch=Arch.GPT, num_layers=row.layers, hidden=h,
                      num_heads=row.heads, num_kv_heads=row.heads, ffn_hidden=4 * h, vocab=51200, seq_len=2048,
                      tied_embeddings=True)
    per_rank = row.layers // row.pp
    v = 1 if row.pp == 1 else next(c for c in range(2, per_rank + 1) if per_rank % c == 0)
    v = _KORTHIKANTI_CHUNKS.get((row.layers, row.hidden), v)
    cfg = ParallelConfig(tp=row.tp, pp=row.pp, dp=row.gpus // (row.tp * row.pp), chunks=v, microbatch_size=1,
                         global_batch=row.global_batch, recompute=Recompute.FULL, attention=Attention.EAGER,
                         schedule=ScheduleFamily.INTERLEAVED if v > 1 else ScheduleFamily.ONE_F_ONE_B)
    return model, hardware_preset("a100-80gb"), cfg


def predict_tflops(row: MegatronRow, eff: Efficiency) -> float:
    """Predicted executed TFLOP/s per GPU for a row, from the full :func:`estimate`."""
    model, hw, cfg = row_setup(row)
    return estimate(model, hw, cfg, efficiency=eff).tflops_per_gpu


def _busiest_work(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, eff: Efficiency) -> float:
    """Compute seconds of the busiest pipeline rank for the whole step (no waits)."""
    costs = stage_sim_costs(model, hw, cfg, eff)
    per_rank = [0.0] * cfg.pp
    for s, st in enumerate(costs.stages):
        rec = st.recompute_time if cfg.recompute is Recompute.FULL else 0.0
        per_rank[s % cfg.pp] += st.forward + st.backward + rec
    return max(per_rank) * cfg.num_microbatches


@dataclass(frozen=True, slots=True)
class _Calibration:
    pipeline_s: float
    work_s: float
    outside_s: float
    optimizer_s: float
    flops_rate: float  # executed TFLOPs per GPU times step seconds
    hbm_fraction: float
    network_fraction: float


def _calibrate(row: MegatronRow, eff: Efficiency) -> _Calibration:
    model, hw, cfg = row_setup(row)
    est = estimate(model, hw, cfg, efficiency=eff)
    opt = est.breakdown.optimizer
    outside = est.breakdown.dp_comm
    return _Calibration(pipeline_s=est.step_time_s - opt - outside, work_s=_busiest_work(model, hw, cfg, eff),
                        outside_s=outside, optimizer_s=opt, flops_rate=est.tflops_per_gpu * est.step_time_s,
                        hbm_fraction=eff.hbm_fraction, network_fraction=eff.network_fraction)


def _surrogate_tflops(row: MegatronRow, cal: _Calibration, eff: Efficiency) -> float:
    model, hw, cfg = row_setup(row)
    work = _busiest_work(model, hw, cfg, eff)
    step = (cal.pipeline_s * work / cal.work_s + cal.outside_s * cal.network_fraction / eff.network_fraction
            + cal.optimizer_s * cal.hbm_fraction / eff.hbm_fraction)
    return cal.flops_rate / step


def _mean_abs_rel_error(rows: Sequence[MegatronRow], predict: Callable[[MegatronRow], float]) -> float:
    return sum(abs(predict(r) / r.tflops_per_gpu - 1.0) for r in rows) / len(rows)


def _grid(lo: float, hi: float, centre: float, width: float, n: int = 13) -> list[float]:
    """n geometric points around ``centre`` spanning a factor ``width`` each side, clipped to [lo, hi]."""
    pts = {min(hi, max(lo, centre * width ** ((2 * i / (n - 1)) - 1))) for i in range(n)}
    return sorted(pts)


def _descend(rows: Sequence[MegatronRow], cals: dict[MegatronRow, _Calibration], start: Efficiency,
             fields: Iterable[str], sweeps: int = 10) -> Efficiency:
    """Coordinate descent on the mean squared log error (smooth, so coordinates do not stall like an L1 loss)."""
    eff = start
    names = list(fields)

    def loss(e: Efficiency) -> float:
        return sum(math.log(_surrogate_tflops(r, cals[r], e) / r.tflops_per_gpu) ** 2 for r in rows) / len(rows)

    best = loss(eff)
    width = 4.0
    for _ in range(sweeps):
        for name in names:
            lo, hi = FIT_FIELDS[name]
            for value in _grid(lo, hi, getattr(eff, name), width):
                changes: dict[str, object] = {name: value}
                trial = dataclasses.replace(eff, **changes)  # type: ignore[arg-type]
                trial_loss = loss(trial)
                if trial_loss < best - 1e-15:
                    eff, best = trial, trial_loss
        width = 1.0 + (width - 1.0) / 2.0
    return eff


@dataclass(frozen=True, slots=True, kw_only=True)
class FitResult:
    """A fitted Efficiency and its in-sample error."""

    efficiency: Efficiency
    """The fitted parameters (the others at their defaults)."""
    mean_abs_error: float | None
    """Mean absolute relative error of tflops_per_gpu over the fitted rows, from :func:`estimate` (None when
    not evaluated)."""


def fit_efficiency(rows: Sequence[MegatronRow], *, start: Efficiency | None = None,
                   fields: Iterable[str] = tuple(FIT_FIELDS), rounds: int = 2,
                   start_calibration: dict[MegatronRow, _Calibration] | None = None,
                   evaluate: bool = True) -> FitResult:
    """Fit ``fields`` to ``rows`` (calibrated-surrogate coordinate descent, ``rounds`` recalibrations)."""
    eff = start or PRIOR
    names = tuple(fields)
    cals = dict(start_calibration) if start_calibration else {r: _calibrate(r, eff) for r in rows}
    for i in range(rounds):
        eff = _descend(rows, cals, eff, names)
        if i < rounds - 1:
            cals = {r: _calibrate(r, eff) for r in rows}
    error = _mean_abs_rel_error(rows, lambda r: predict_tflops(r, eff)) if evaluate else None
    return FitResult(efficiency=eff, mean_abs_error=error)


def leave_one_out(rows: Sequence[MegatronRow], *, start: Efficiency | None = None,
                  fields: Iterable[str] = tuple(FIT_FIELDS), rounds: int = 2) -> list[tuple[MegatronRow, float]]:
    """For each row, fit on the others (from the same fixed start) and predict it with :func:`estimate`."""
    eff0 = start or PRIOR
    base = {r: _calibrate(r, eff0) for r in rows}  # at a fixed start point: independent of any held-out choice
    out = []
    for held in rows:
        rest = [r for r in rows if r is not held]
        fitted = fit_efficiency(rest, start=eff0, fields=fields, rounds=rounds,
                                start_calibration={r: base[r] for r in rest}, evaluate=False)
        out.append((held, predict_tflops(held, fitted.efficiency)))
    return out
