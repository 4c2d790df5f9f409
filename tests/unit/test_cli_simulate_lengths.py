"""``evenpipe simulate --lengths FILE``: each micro-batch its own durations and bytes (issue 34)."""

from __future__ import annotations

import json
import pathlib

import pytest

from evenpipe.cli import main


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_unit_costs_scale_with_tokens_by_hand(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    # tokens 3 and 6, mean 4.5: micro-batch 0 takes 2/3 of F=1, B=2 and of one byte, micro-batch 1 takes 4/3.
    # GPipe on two ranks: rank 1's backwards run 10/3..14/3 and 14/3..22/3, rank 0's second one 22/3..10.
    lengths = tmp_path / "mbs.txt"
    lengths.write_text("# two micro-batches\n3\n1, 2 3\n")
    out = _json(capsys, "--schedule", "gpipe", "--stages", "2", "--microbatches", "2", "--lengths", str(lengths))
    assert out["step_time"] == pytest.approx(10.0)
    assert out["peak_activation_bytes"] == pytest.approx([2.0, 2.0])


def test_full_rows_are_the_padded_micro_batches(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "3", "--model", "gpt-tiny", "--gpu",
             "a100-80gb", "--microbatch-size", "2"]
    full, mixed = tmp_path / "full.txt", tmp_path / "mixed.txt"
    full.write_text("64 64\n64,64\n64 64\n")  # one document filling each row: the padded shape
    mixed.write_text("64 64\n5 7\n64 60\n")
    plain = _json(capsys, *model)
    assert _json(capsys, *model, "--lengths", str(full)) == plain
    varied = _json(capsys, *model, "--lengths", str(mixed))
    assert varied["step_time"] < plain["step_time"]
    assert max(varied["peak_activation_bytes"]) <= max(plain["peak_activation_bytes"])


def test_timeline_draws_each_width(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "mbs.txt"
    lengths.write_text("1\n4\n1\n")
    out = tmp_path / "out"
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "3", "--lengths",
                 str(lengths), "--out", str(out)]) == 0
    assert (out / "timeline.png").stat().st_size > 0
    trace = json.loads((out / "trace.json").read_text())
    widths = {e["args"]["mb"]: e["dur"] for e in trace["traceEvents"]
              if e.get("ph") == "X" and e["args"].get("kind") == "FORWARD" and e.get("pid") == 0}
    assert widths[1] == pytest.approx(4 * widths[0])


def test_bpipe_evicts_by_each_micro_batch_bytes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "mbs.txt"
    lengths.write_text("4\n1\n1\n4\n1\n1\n4\n1\n")  # mean 2.125 tokens: the largest saves 4 / 2.125 bytes
    out = _json(capsys, "--schedule", "bpipe", "--stages", "4", "--microbatches", "8", "--lengths", str(lengths))
    assert out["meta"]["weighted"] is True
    largest = 4 / 2.125
    assert max(out["peak_activation_bytes"]) <= out["meta"]["budget"] * largest * (1 + 1e-9)
