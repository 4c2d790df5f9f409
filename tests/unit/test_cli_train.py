"""``evenpipe train`` refuses bad options with one line and exit code 2, before starting any process."""

from __future__ import annotations

import pathlib

import pytest
import torch

from evenpipe.cli import main

pytest.importorskip("torch")

_HF_GPT2 = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "tiny-gpt2" / "config.json"
_HF_LLAMA = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "tiny-llama" / "config.json"


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Fail loudly if a bad option ever reaches the launcher."""
    launched: list[object] = []
    import evenpipe.training.launch as launch

    def fake(options: object, *, nproc: int) -> int:
        launched.append((options, nproc))
        return 0
    monkeypatch.setattr(launch, "launch_local", fake)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return launched


BAD = {
    "unknown model": (["--model", "gpt-huge-nope"], "unknown model 'gpt-huge-nope'"),
    "unknown schedule": (["--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    "micro-batches the schedule cannot use": (
        ["--schedule", "interleaved", "--stages", "2", "--chunks", "2", "--microbatches", "7"], "num_microbatches"),
    "global batch not divisible": (["--global-batch", "7", "--microbatches", "4"], "not divisible"),
    "layout drops a layer": (["--stages", "2", "--layout", "1,2"], "layout [1, 2]"),
    "bpipe budget too small": (["--schedule", "bpipe", "--bpipe-budget", "1"], "budget 1"),
    "zero steps": (["--steps", "0"], "--steps must be >= 1"),
    "a preset too big for this machine": (["--model", "llama3-405b"], "model llama3-405b has 405.85B parameters"),
    "resume without a directory": (["--resume"], "need --checkpoint-dir"),
    "token file missing": (["--tokens", "/nonexistent/t.bin"], "cannot read token file"),
    "cosine below zero": (["--min-lr", "-1"], "--min-lr must be between 0"),
    "tp not dividing the heads": (["--tp", "3"], "--tp 3 does not divide the model's 4 query heads"),
    "tp not dividing the key/value heads": (["--model", "llama-tiny", "--tp", "4"], "2 key/value heads"),
    "unknown sharding": (["--sharding", "zero3"], "unknown sharding mode 'zero3'"),
    "tp on a Hugging Face GPT-2": (["--hf-config", str(_HF_GPT2), "--tp", "2"],
                                   "cannot split Hugging Face model_type 'gpt2'"),
    "emulated slow rank outside the pipeline": (["--stages", "2", "--emulate-slow-rank", "3:2"],
                                                "rank 3; the pipeline has ranks 0..1"),
    "emulated slowdown below 1": (["--emulate-slow-rank", "1:0.5"], "RANK:FACTOR[@STEP] with FACTOR >= 1"),
    "emulated link to itself": (["--emulate-link-delay", "1-1:5"], "A-B:MS for two different"),
    "slow-rank threshold not above 1": (["--slow-rank-threshold", "0.9"], "--slow-rank-threshold must be > 1"),
    "sequence parallelism without tp": (["--sequence-parallel"], "--sequence-parallel needs --tp 2 or more"),
    "sequence parallelism not dividing the sequence": (["--sequence-parallel", "--tp", "2", "--seq-len", "15"],
                                                      "cannot split --seq-len 15"),
    "sequence parallelism on a Hugging Face model": (
        ["--hf-config", str(_HF_LLAMA), "--tp", "2", "--sequence-parallel"], "cannot run the Hugging Face model"),
    "offload on a rank outside the pipeline": (["--stages", "2", "--offload", "0,2"],
                                               "--offload '0,2': rank 2 is not a pipeline rank of 2"),
    "offload range backwards": (["--offload", "3-1"], "--offload '3-1': range 3-1 runs backwards"),
    "offload word other than all": (["--offload", "first"], "--offload 'first': 'first' is not a rank or a range"),
    "offload empty": (["--offload", ""], "--offload '': '' is not a rank or a range"),
    "offload negative rank": (["--offload", "-1"], "--offload '-1'"),
}


@pytest.mark.parametrize("argv,needle", list(BAD.values()), ids=list(BAD))
def test_bad_option_exits_2_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                          no_launch: list[object]) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("evenpipe train: error:") and needle.lower() in err.lower(), err
    assert not no_launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_nccl_without_gpu_is_refused(capsys: pytest.CaptureFixture[str], no_launch: list[object]) -> None:
    assert main(["train", "--backend", "nccl"]) == 2
    assert "nccl" in capsys.readouterr().err.lower() and not no_launch


def test_world_size_must_be_pp_times_dp(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                        no_launch: list[object]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--stages", "2", "--dp", "2"]) == 2
    assert "world size 3" in capsys.readouterr().err


def test_good_options_reach_the_launcher_with_the_world_size(no_launch: list[object]) -> None:
    assert main(["train", "--stages", "2", "--dp", "2", "--microbatches", "4", "--steps", "1"]) == 0
    (config, nproc), = no_launch
    from evenpipe.training.config import Backend, TrainConfig
    assert nproc == 4
    assert isinstance(config, TrainConfig) and config.data.global_batch == 2 * 4 * 2
    assert config.runtime.backend is Backend.GLOO and config.world_size == 4


def test_tensorboard_without_the_package_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str],
                                                     no_launch: list[object]) -> None:
    import sys
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert main(["train", "--tensorboard", "tb"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tensorboard package" in err and not no_launch, err


def test_tp_and_sharding_reach_the_launcher_in_the_world_size(no_launch: list[object]) -> None:
    argv = ["train", "--stages", "2", "--dp", "2", "--tp", "2", "--sharding", "optimizer", "--microbatches", "2"]
    assert main(argv) == 0
    (config, nproc), = no_launch
    from evenpipe.training.config import Sharding
    assert nproc == 8 and config.world_size == 8
    assert config.runtime.tp == 2 and config.runtime.sharding is Sharding.OPTIMIZER


def test_train_starts_with_a_header_of_model_world_and_batches(no_launch: list[object],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "gpt-tiny", "--stages", "2", "--dp", "2", "--microbatches", "4",
                 "--global-batch", "24", "--steps", "3", "--schedule", "bpipe", "--backend", "gloo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("train gpt-tiny: 220,544 parameters (float32), world 4 = pp 2 x dp 2 x tp 1 (gloo)")
    assert lines[1].strip() == "global batch 24 sequences of 64 tokens = 4 micro-batches of 3 sequence(s) x dp 2; " \
        "3 steps"
    assert len(no_launch) == 1


def test_train_help_gives_the_microbatch_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "sequences per micro-batch b (default 2;" in text and "micro-batches per step M (default 8)" in text


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipev"])
def test_fsdp_runs_every_split_backward_schedule(schedule: str, no_launch: list[object]) -> None:
    """--sharding full with a zero-bubble split reaches the launcher (issue 33.4; its numbers are tested in
    tests/distributed/test_tensor_parallel.py)."""
    assert main(["train", "--sharding", "full", "--schedule", schedule, "--dp", "2", "--stages", "2",
                 "--microbatches", "4"]) == 0
    (config, _), = no_launch
    assert config.schedule.family.traits.split_backward and config.runtime.sharding.value == "full"


@pytest.mark.parametrize("text,ranks", [("all", (0, 1, 2, 3)), ("ALL", (0, 1, 2, 3)), ("0,1", (0, 1)), ("0-1", (0, 1)),
                                        ("2, 0", (0, 2)), ("0,2-3", (0, 2, 3)), ("1-1", (1,))])
def test_offload_ranks_reach_the_schedule(text: str, ranks: tuple[int, ...], no_launch: list[object],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--stages", "4", "--offload", text, "--microbatches", "8"]) == 0
    (config, _), = no_launch
    assert config.schedule.offload == ranks
    from evenpipe.schedule import ActionKind
    built = config.schedule.build()
    offloading = {r for r, acts in enumerate(built.actions) if any(a.kind is ActionKind.OFFLOAD for a in acts)}
    assert offloading == set(ranks) - {3}  # 1F1B's last rank runs each backward right after its forward
    assert "+ offload (" in capsys.readouterr().out.splitlines()[0]
    from evenpipe.training.config import TrainConfig
    assert TrainConfig.from_json(config.to_json()).schedule.offload == ranks  # crosses to the workers intact


@pytest.mark.parametrize("schedule,chunks,bpipe,stages", [
    ("interleaved", 2, False, 2), ("zb-h1", 1, False, 2), ("1f1b", 1, True, 4), ("bpipe", 1, False, 4),
    ("interleaved", 1, True, 4), ("zb-v", 2, False, 2), ("latency-aware", 1, False, 2)])
def test_offload_composes_with_every_kind_of_schedule(schedule: str, chunks: int, bpipe: bool, stages: int,
                                                      no_launch: list[object]) -> None:
    argv = ["train", "--stages", str(stages), "--schedule", schedule, "--chunks", str(chunks), "--microbatches",
            str(2 * stages), "--offload", "0", "--model", "llama-tiny"]
    assert main(argv + (["--bpipe"] if bpipe else [])) == 0
    (config, _), = no_launch
    from evenpipe.schedule import ActionKind
    built = config.schedule.build()
    assert {ActionKind.OFFLOAD, ActionKind.RELOAD} <= {a.kind for a in built.actions[0]}
    if bpipe or schedule == "bpipe":  # BPipe's evictions and offload share rank 0, never one unit
        evicted = {a.key for a in built.actions[0] if a.kind is ActionKind.EVICT}
        offloaded = {a.key for a in built.actions[0] if a.kind is ActionKind.OFFLOAD}
        assert evicted and not evicted & offloaded


def test_offload_on_a_rank_that_offloads_nothing_warns(no_launch: list[object]) -> None:
    with pytest.warns(UserWarning, match=r"--offload: pipeline rank\(s\) 1 offload nothing in 1f1b"):
        assert main(["train", "--stages", "2", "--microbatches", "4", "--offload", "1"]) == 0
