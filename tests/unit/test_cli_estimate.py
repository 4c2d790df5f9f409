"""``evenpipe estimate``: readable and JSON output, the memory picture, one-line errors with exit 2, no torch."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from evenpipe.cli import main

BASE = ["estimate", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--tp", "8", "--pp", "8",
        "--global-batch", "1536", "--recompute", "full", "--attention", "eager"]


def test_readable_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE) == 0
    out = capsys.readouterr().out
    for needle in ("step time", "MFU", "HFU", "bubble fraction", "tp_comm", "dp_comm", "recompute",
                   "peak memory per pipeline rank", "activations", "fits: yes"):
        assert needle in out
    assert "dp=16" in out  # derived from --gpus / (tp·pp)


def test_json_has_the_promised_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + ["--schedule", "interleaved", "--chunks", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "mfu", "hfu", "tflops_per_gpu", "bubble_fraction", "memory_per_stage_gib",
                "peak_memory_gib", "fits"):
        assert key in d
    assert len(d["memory_per_stage_gib"]) == 8 and d["fits"] is True
    assert d["config"]["schedule"] == "interleaved" and d["config"]["chunks"] == 2


def test_explicit_architecture(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
            "--vocab", "128256", "--seq-len", "8192", "--gpu", "h100-80gb", "--gpus", "8", "--tp", "2", "--pp", "4",
            "--global-batch", "16", "--schedule", "bpipe", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["schedule"] == "bpipe" and d["gpus"] == 8


def test_out_writes_the_memory_picture(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + ["--out", str(tmp_path)]) == 0
    png = tmp_path / "memory_per_stage.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert str(png) in capsys.readouterr().out


def test_not_fitting_is_reported_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "gpt3-175b", "--gpu", "a100-40gb", "--tp", "8", "--pp", "2", "--global-batch", "8",
            "--attention", "eager", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(args[:-1] + ["--require-fit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0]


@pytest.mark.parametrize("change,needle", [
    (["--model", "gpt-9"], "unknown model preset 'gpt-9'"),
    (["--tp", "5"], "--gpus 1024 is not a multiple"),
    (["--tp", "5", "--gpus", "640"], "tp 5 does not divide the 96 attention heads"),
    (["--layout", "12,12"], "layout [12, 12] needs one entry per stage: pp·chunks = 8·1 = 8"),
    (["--layout", "12,12,12,12,12,12,12,13"], "places 97 layers but the model has 96 (it duplicates 1)"),
    (["--dp", "8"], "--gpus 1024 != tp·pp·dp"),
    (["--global-batch", "1000"], "global batch 1000 is not divisible"),
    (["--gpu", "v100"], "unknown GPU preset 'v100'"),
    (["--schedule", "dualpipe"], "unknown schedule 'dualpipe'"),
    (["--recompute", "some"], "unknown recompute mode 'some'"),
])
def test_bad_input_is_one_line_and_exit_2(change: list[str], needle: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    args = list(BASE)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_estimate_runs_without_torch_or_matplotlib() -> None:
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'matplotlib', 'numpy'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "from evenpipe.cli import main\n"
        "sys.exit(main(['estimate', '--model', 'llama2-70b', '--gpu', 'h100-80gb', '--gpus', '64', '--tp', '8',\n"
        "               '--pp', '4', '--global-batch', '64', '--json']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gpus"] == 64


def test_gpu_profile_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "gpu.json"
    profile.write_text(json.dumps({"base": "a100-80gb", "name": "slow-a100", "peak_tflops": 156.0}))
    assert main(BASE + ["--json"]) == 0
    fast = json.loads(capsys.readouterr().out)
    args = list(BASE)
    args[args.index("--gpu") + 1] = str(profile)
    assert main(args + ["--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow["gpu"] == "slow-a100" and slow["step_time_s"] > fast["step_time_s"]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt-small", "llama3-8b"])
def test_every_preset_name_works_in_estimate(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One preset table: the names ``train`` knows (gpt-tiny is its default) estimate too."""
    assert main(["estimate", "--model", name, "--gpu", "a100-80gb", "--global-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == name


LLAMA405 = ["estimate", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "8192", "--tp", "8", "--pp", "16",
            "--global-batch", "2048", "--recompute", "full"]


def test_llama3_405b_on_pp16_gets_lighter_end_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3 405B's 126 layers on 16 stages: 7, 8 x 14, 7 (Dubey et al. 2024), embedding and head on the ends."""
    assert main(LLAMA405 + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["layout"] == [7] + [8] * 14 + [7]
    stages = d["stage_memory_gib"]
    assert stages[0]["weights"] < stages[1]["weights"] == stages[14]["weights"] > stages[15]["weights"]
    assert stages[0]["embedding"] > 0 and stages[15]["head"] > 0
    assert main(LLAMA405) == 0
    assert "layers per stage: 7,8x14,7" in capsys.readouterr().out


def test_explicit_layout_moves_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE + ["--layout", "11,12,12,13,13,12,12,11", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    weights = [s["weights"] for s in d["stage_memory_gib"]]
    assert weights[3] == pytest.approx(weights[1] * 13 / 12) and weights[0] == pytest.approx(weights[1] * 11 / 12)
