"""The Megatron 2021 fitter: row assumptions, the calibrated surrogate, and that a search reduces the error."""

from __future__ import annotations

import dataclasses

import pytest

from evenpipe.cost import Recompute, ScheduleFamily
from evenpipe.cost.fit import (PRIOR, _calibrate, _surrogate_tflops, fit_efficiency, load_megatron_rows,
                               predict_tflops, row_setup)

from cost_reference import reference_path

ROWS = load_megatron_rows(reference_path("megatron2021_weak_scaling.csv"))


def test_rows_and_assumptions() -> None:
    assert len(ROWS) == 10
    by_size = {r.params_b: row_setup(r)[2] for r in ROWS}
    assert by_size[529.6].chunks == 3 and by_size[529.6].dp == 9 and by_size[529.6].num_microbatches == 280
    assert by_size[1.7].schedule is ScheduleFamily.ONE_F_ONE_B and by_size[1.7].dp == 32
    assert all(c.recompute is Recompute.FULL and c.microbatch_size == 1 for c in by_size.values())
    assert all(c.num_gpus == r.gpus for r, c in zip(ROWS, by_size.values()))


@pytest.mark.parametrize("index", [0, 4])
def test_surrogate_is_exact_at_its_calibration_point(index: int) -> None:
    row = ROWS[index]
    cal = _calibrate(row, PRIOR)
    assert _surrogate_tflops(row, cal, PRIOR) == pytest.approx(predict_tflops(row, PRIOR), rel=1e-9)


def test_search_reduces_the_error_from_a_bad_start() -> None:
    small = [r for r in ROWS if r.pp == 1]  # cheap rows (no pipeline)
    start = dataclasses.replace(PRIOR, gemm_peak_fraction=0.5)
    before = sum(abs(predict_tflops(r, start) / r.tflops_per_gpu - 1) for r in small) / len(small)
    result = fit_efficiency(small, start=start, fields=("gemm_peak_fraction",), rounds=2)
    assert result.mean_abs_error is not None and result.mean_abs_error < before / 2
    assert 0.5 < result.efficiency.gemm_peak_fraction <= 0.95
