"""``evenpipe simulate`` run in-process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from evenpipe.cli import main


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_1f1b(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8")
    assert out["schedule"] == "1f1b" and out["stages"] == 4 and out["microbatches"] == 8 and out["chunks"] == 1
    assert out["peak_activations"] == [4, 3, 2, 1]
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["step_time"] == pytest.approx(33)
    assert out["actions"] > 2 * 4 * 8 and out["exposed_transfer_time"] == 0
    assert out["peak_activation_bytes"] == [4, 3, 2, 1]


def test_weight_time_adds_to_full_backward(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "--schedule", "gpipe", "--stages", "2", "--microbatches", "3", "--weight-time", "1")
    assert out["step_time"] == pytest.approx((1 + 2 + 1) * (3 + 2 - 1))


def test_interleaved_defaults_to_two_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "--schedule", "interleaved", "--stages", "2", "--microbatches", "4")
    assert out["chunks"] == 2 and out["num_stages"] == 4


def test_latency_aware_orders_for_the_link_latency(capsys: pytest.CaptureFixture[str]) -> None:
    times = ["--stages", "8", "--microbatches", "8", "--forward-time", "1", "--backward-time", "1",
             "--weight-time", "1", "--link-latency", "1"]
    ours = _json(capsys, "--schedule", "latency-aware", *times)
    zb = _json(capsys, "--schedule", "zb-h1", *times)
    assert ours["schedule"] == "latency-aware" and ours["meta"]["cap"] == 8
    assert max(ours["peak_activations"]) <= max(zb["peak_activations"])
    assert ours["step_time"] <= 0.85 * zb["step_time"]
    capped = _json(capsys, "--schedule", "latency-aware", *times, "--activation-cap", "3", "--chunks", "2")
    assert capped["chunks"] == 2 and max(capped["peak_activations"]) <= 3


def test_slow_link_bpipe_reports_exposed_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    fast = _json(capsys, "--schedule", "bpipe", "--stages", "4", "--microbatches", "8")
    slow = _json(capsys, "--schedule", "bpipe", "--stages", "4", "--microbatches", "8", "--link-bandwidth", "0.5",
                 "--activation-bytes", "1")
    assert slow["step_time"] > fast["step_time"]
    assert slow["exposed_transfer_time"] > 0 and slow["exposed_transfers"]
    assert "EVICT" in {t["kind"] for t in slow["exposed_transfers"]}  # forwards waited for the room
    assert fast["meta"]["budget"] == 3
    assert fast["peak_activations"] == [3, 3, 3, 3] and fast["exposed_transfer_time"] == 0


def test_table_output_and_files(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    assert main(["simulate", "--schedule", "bpipe", "--stages", "2", "--microbatches", "2",
                 "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "schedule bpipe" in text and "peak act. units" in text and "bubble" in text
    assert {p.name for p in tmp_path.iterdir()} == {"timeline.png", "memory.png", "trace.json", "schedule.txt",
                                                    "trace.evenpipe.json"}


def test_unit_costs_are_labelled_as_units_not_seconds_and_bytes(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: pathlib.Path) -> None:
    """Without a profile or a model the costs are unit costs: no seconds, no bytes; with a model they are real."""
    assert main(["simulate", "--schedule", "bpipe", "--stages", "4", "--microbatches", "8", "--output-bytes", "1",
                 "--link-bandwidth", "0.5", "--activation-bytes", "3000"]) == 0
    text = capsys.readouterr().out
    assert "time units   bubble" in text and "peak size units" in text and "3000" in text
    assert " B" not in text and "KiB" not in text and " s " not in text and "peak bytes" not in text
    assert "unit costs: times in the unit of --forward-time" in text
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["units"] == "unit costs"
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--model", "gpt-tiny",
                 "--gpu", "a100-80gb"]) == 0
    text = capsys.readouterr().out
    assert "peak bytes" in text and " s   bubble" in text and "time units" not in text and "unit costs" not in text


def test_unit_cost_pictures_label_time_in_units(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import evenpipe.report.bundle as bundle
    labels: list[str] = []
    monkeypatch.setattr(bundle, "write_bundle", lambda trace, out, *, time_label: labels.append(time_label) or [])
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--out",
                 str(tmp_path)]) == 0
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--model", "gpt-tiny",
                 "--gpu", "a100-80gb", "--out", str(tmp_path)]) == 0
    assert labels == ["time (time units)", "time (s)"]


@pytest.mark.parametrize("args,needle", [
    (["--schedule", "nope", "--stages", "2", "--microbatches", "2"], "unknown schedule 'nope'"),
    (["--schedule", "1f1b", "--stages", "0", "--microbatches", "2"], "num_ranks"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--forward-time", "-1"], "--forward-time"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--link-bandwidth", "0"], "--link-bandwidth"),
    (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--chunks", "2"], "num_chunks"),
    (["--schedule", "latency-aware", "--stages", "2", "--microbatches", "2", "--chunks", "3"], "allowed: 1, 2"),
    (["--schedule", "latency-aware", "--stages", "2", "--microbatches", "2", "--activation-cap", "0.5"],
     "allowed: cap >= 1"),
])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("evenpipe simulate: error:")


def test_model_costs_put_embedding_and_head_on_their_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate --model``: stage durations from the cost model; uneven layouts by default when the layers do not
    divide (Llama 3 405B on 16 stages), or given with --layout."""
    out = _json(capsys, "--schedule", "1f1b", "--stages", "16", "--microbatches", "32", "--model", "llama3-405b",
                "--gpu", "h100-80gb", "--tp", "8")
    assert out["stages"] == 16 and out["step_time"] > 0
    even = _json(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--model", "gpt-tiny",
                 "--gpu", "a100-80gb")
    moved = _json(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--model", "gpt-tiny",
                  "--gpu", "a100-80gb", "--layout", "1,1,1,1")
    assert even["step_time"] == pytest.approx(moved["step_time"])
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--model", "gpt-tiny",
                 "--gpu", "a100-80gb", "--layout", "1,1,1"]) == 2
    assert "layout [1, 1, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("args,code", [(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "64",
                                         "--json"], 0),
                                        (["simulate", "--schedule", "1f1b", "--stages", "0", "--microbatches", "8",
                                          "--json"], 2)])
def test_process_entry_ends_quickly_with_all_output(args: list[str], code: int) -> None:
    """``python -m evenpipe`` ends a pure command without the interpreter's teardown: the exit code is main's and
    everything printed reaches a pipe (where it stays buffered until flushed)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe buffers stdout, as usual
    proc = subprocess.run([sys.executable, "-m", "evenpipe", *args], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == code, proc.stderr
    if code == 0:
        out = json.loads(proc.stdout)
        assert (out["schedule"], out["stages"], out["microbatches"]) == ("1f1b", 4, 64)
    else:
        assert proc.stderr.startswith("evenpipe simulate: error:") and proc.stderr.count("\n") == 1
