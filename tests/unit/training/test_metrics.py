"""Per-step metrics: one JSON line per step, the same scalars to TensorBoard, a one-line error without it."""

from __future__ import annotations

import json
import pathlib
import sys
import types

import pytest

from evenpipe.errors import ConfigError
from evenpipe.training.metrics import MetricsSink, StepMetrics, format_progress, require_tensorboard


def _m(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=5.0 - step, lr=1e-3, grad_norm=1.5, step_time_s=0.25, tokens_per_s=4096.0,
                       peak_activation_bytes=1024, memory_bytes=2**20)


def test_jsonl_has_one_record_per_step(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = MetricsSink(jsonl_path=str(path), tensorboard_dir=None)
    sink.write(_m(1))
    sink.write(_m(2), eval_loss=3.5)
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval_loss"] == 3.5 and rows[0]["loss"] == 4.0


def test_tensorboard_gets_every_scalar(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, float, int]] = []

    class Writer:
        def __init__(self, log_dir: str) -> None:
            assert log_dir == str(tmp_path)

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            calls.append((tag, value, step))

        def close(self) -> None:
            calls.append(("closed", 0.0, 0))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    sink = MetricsSink(jsonl_path=None, tensorboard_dir=str(tmp_path))
    sink.write(_m(3))
    sink.close()
    assert ("train/loss", 2.0, 3) in calls and ("train/tokens_per_s", 4096.0, 3) in calls
    assert calls[-1][0] == "closed" and not any(tag == "train/step" for tag, _, _ in calls)


def test_missing_tensorboard_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with pytest.raises(ConfigError, match="--tensorboard needs the tensorboard package"):
        require_tensorboard()


def test_progress_line_names_step_loss_throughput_time_and_memory() -> None:
    line = format_progress(_m(2), 10)
    for word in ("step    2/10", "loss 3.0000", "tokens/s", "250.0 ms", "1.0 MiB"):
        assert word in line, line
