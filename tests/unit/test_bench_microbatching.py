"""``benchmarks/bench_microbatching.py``: its figures are the simulator's predictions (varlen_predict), and bad
setups are refused in one line."""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_microbatching  # noqa: E402

from evenpipe.errors import ConfigError  # noqa: E402


def _args(**kw: object) -> argparse.Namespace:
    base = dict(model="llama2-7b", gpu="h100-80gb", schedule="1f1b", row_len=2048, rows=2, replica_tokens=8192)
    return argparse.Namespace(**{**base, **kw})


def test_figures_are_the_simulated_predictions() -> None:
    import dataclasses

    from evenpipe.cost import ParallelConfig, ScheduleFamily, hardware_preset, model_preset
    from evenpipe.cost.analytic_source import AnalyticSource
    from evenpipe.plan.varlen_predict import predict_throughput

    lengths = [1500, 300, 40, 900, 1200, 700, 100, 2048, 60, 512, 3000, 77] * 2
    out = bench_microbatching.run_setup(lengths, (1, 2, 2), _args())
    model = dataclasses.replace(model_preset("llama2-7b"), seq_len=2048)
    cfg = ParallelConfig(pp=2, dp=2, microbatch_size=2, global_batch=4, schedule=ScheduleFamily.ONE_F_ONE_B,
                         distributed_optimizer=True)
    batches = bench_microbatching.global_batches([min(n, 2048) for n in lengths], 8192 * 2)
    want = predict_throughput(batches, source=AnalyticSource(model, hardware_preset("h100-80gb")), cfg=cfg)
    got = {name: row["tokens_per_s"] for name, row in out["policies"].items()}
    assert got == {p.value: t.tokens_per_s for p, t in want.items()}
    assert out["balance/pad"] == got["balance"] / got["pad"] and out["batches"] == len(batches)


@pytest.mark.parametrize("text", ["1,4", "1,x,2", "0,4,1", "1,4,1,1"])
def test_bad_setup_is_one_line(text: str) -> None:
    with pytest.raises(ConfigError, match="TP,PP,DP") as err:
        bench_microbatching.parse_setup(text)
    assert "\n" not in str(err.value)
