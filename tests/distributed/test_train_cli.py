"""``evenpipe train`` end to end: it launches its own processes, and the same ``--seed`` gives the same loss
trajectory pipelined and un-pipelined (``--stages 1``); ``--json-out`` and ``--trace`` are written."""

from __future__ import annotations

import json
import pathlib

import pytest

from harness import run_train

pytestmark = pytest.mark.distributed

COMMON = ["--model", "gpt-tiny", "--seq-len", "16", "--microbatches", "4", "--steps", "5", "--seed", "3",
          "--random-tokens", "--timeout", "60"]


def _train(tmp: pathlib.Path, name: str, *extra: str) -> dict:
    summary, stdout = run_train([*COMMON, *extra], tmp / f"{name}.json", timeout_s=180)
    assert "loss" in stdout and "tokens/s" in stdout and "peak RSS" in stdout, stdout
    return summary


def test_same_seed_same_trajectory_pipelined_and_unpipelined(tmp_path: pathlib.Path) -> None:
    trace, metrics = tmp_path / "trace.json", tmp_path / "metrics.jsonl"
    piped = _train(tmp_path, "zb", "--schedule", "zb-h1", "--stages", "2", "--trace", str(trace),
                   "--metrics", str(metrics))
    single = _train(tmp_path, "single", "--schedule", "1f1b", "--stages", "1")
    assert len(piped["losses"]) == len(single["losses"]) == 5
    for a, b in zip(piped["losses"], single["losses"]):
        assert abs(a - b) / abs(b) < 1e-5, (piped["losses"], single["losses"])
    for key in ("step_time_s", "tokens_per_s", "peak_activation_bytes", "peak_hosted_bytes",
                "evicted_bytes_per_step"):
        assert key in piped, key
    assert len(piped["peak_activation_bytes"]) == 2 and min(piped["peak_activation_bytes"]) > 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in lines] == piped["losses"]
    assert all(m["tokens_per_s"] > 0 and m["memory_bytes"] > 0 for m in lines), lines
    assert piped["config"]["schedule"]["family"] == "zb-h1" and piped["config"]["runtime"]["steps"] == 5
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name", "") for e in events}
    assert any("I" in n and n[0].isdigit() for n in names) and any("W" in n for n in names), sorted(names)[:20]
