"""Bad input to every subcommand ends with exit code 2 and exactly one line on stderr (no traceback), before any
work: within 10 s (an interval timer in-process, ``timeout=10`` for the subprocess cases) and with nothing left in
the output folder. Most cases run in-process through :func:`evenpipe.cli.main` (the same code path as the process
entry); a few run as ``python -m evenpipe`` to cover the process entry itself.

Paths in a case: ``{out}`` is an empty output folder, ``{file}`` an existing regular file (so ``{file}/x`` is a
path under a file), ``{tmp}`` the test's folder holding prepared inputs."""

from __future__ import annotations

import array
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Iterator

import pytest

from evenpipe.cli import main

TIMEOUT_S = 10

SIM = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"]
TRAIN = ["train", "--model", "gpt-tiny", "--stages", "2", "--microbatches", "2", "--seq-len", "16", "--steps", "2"]
EST = ["estimate", "--model", "gpt-tiny", "--gpu", "a100-80gb", "--global-batch", "8"]
PLAN = ["plan", "--model", "gpt-tiny", "--gpu", "a100-80gb", "--gpus", "2", "--global-batch", "8"]
CMP = ["compare", "{tmp}/trace.json", "{tmp}/trace.json"]

CASES: dict[str, list[str]] = {
    # simulate
    "simulate backward time inf": [*SIM, "--backward-time", "inf"],
    "simulate forward time nan": [*SIM, "--forward-time", "nan"],
    "simulate negative latency": [*SIM, "--link-latency", "-1"],
    "simulate latency inf": [*SIM, "--link-latency", "inf"],
    "simulate zero bandwidth": [*SIM, "--link-bandwidth", "0"],
    "simulate lengths missing": [*SIM, "--lengths", "{tmp}/missing.txt"],
    "simulate lengths count": [*SIM, "--lengths", "{tmp}/three_mbs.txt"],
    "simulate lengths not numbers": [*SIM, "--lengths", "{tmp}/bad_mbs.txt"],
    "simulate lengths too long": [*SIM, "--model", "gpt-tiny", "--gpu", "a100-80gb", "--lengths",
                                  "{tmp}/long_doc.txt"],
    "simulate too large to fit": ["simulate", "--schedule", "1f1b", "--stages", "100000", "--microbatches", "100000"],
    "simulate unknown schedule": ["simulate", "--schedule", "nosuch", "--stages", "2", "--microbatches", "4"],
    "simulate zero stages": ["simulate", "--schedule", "1f1b", "--stages", "0", "--microbatches", "4"],
    "simulate zero microbatches": ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "0"],
    "simulate stages not a number": ["simulate", "--schedule", "1f1b", "--stages", "two", "--microbatches", "4"],
    "simulate out is a file": [*SIM, "--out", "{file}"],
    "simulate out under a file": [*SIM, "--out", "{file}/pictures"],
    "simulate out unwritable": [*SIM, "--out", "/proc/evenpipe-out"],
    "simulate missing profile": [*SIM, "--profile", "{tmp}/missing.json"],
    "simulate model without gpu": [*SIM, "--model", "gpt-tiny"],
    # train
    "train json-out under a file": [*TRAIN, "--json-out", "{file}/run.json"],
    "train metrics unwritable": [*TRAIN, "--metrics", "/proc/evenpipe-metrics.jsonl"],
    "train trace in a missing folder": [*TRAIN, "--trace", "{out}/missing/trace.json"],
    "train trace-json is a folder": [*TRAIN, "--trace-json", "{out}"],
    "train checkpoint-dir under a file": [*TRAIN, "--checkpoint-dir", "{file}/ckpt"],
    "train checkpoint-dir is a file": [*TRAIN, "--checkpoint-dir", "{file}"],
    "train seq-len beyond the positions": ["train", "--model", "gpt-tiny", "--seq-len", "100000"],
    "train token id outside the vocabulary": [*TRAIN, "--tokens", "{tmp}/big_ids.bin"],
    "train missing token file": [*TRAIN, "--tokens", "{tmp}/missing.bin"],
    "train unsupported hf model type": [*TRAIN[:1], "--hf-config", "{tmp}/neox.json", *TRAIN[3:]],
    "train unknown hf model type": [*TRAIN[:1], "--hf-config", "{tmp}/bert.json", *TRAIN[3:]],
    "train bytes for a vocabulary of 128": [*TRAIN[:1], "--hf-config", "{tmp}/llama128.json", *TRAIN[3:]],
    "train resume with another global batch": [*TRAIN, "--random-tokens", "--checkpoint-dir", "{tmp}/ckpt",
                                               "--resume", "--global-batch", "8"],
    "train resume with another seed": [*TRAIN, "--random-tokens", "--checkpoint-dir", "{tmp}/ckpt", "--resume",
                                       "--seed", "5"],
    "train resume with another lr": [*TRAIN, "--random-tokens", "--checkpoint-dir", "{tmp}/ckpt", "--resume",
                                     "--lr", "0.01"],
    "train resume without checkpoint-dir": [*TRAIN, "--resume"],
    "train unknown schedule": [*TRAIN, "--schedule", "nosuch"],
    "train global batch not divisible": [*TRAIN, "--global-batch", "7"],
    "train negative lr": [*TRAIN, "--lr", "-1"],
    "train unknown sharding": [*TRAIN, "--sharding", "bogus"],
    "train bad layout": [*TRAIN, "--layout", "1,x"],
    "train unknown model": ["train", "--model", "nosuch"],
    "train document longer than a row": [*TRAIN, "--documents", "{tmp}/long_docs.jsonl"],
    "train documents all too short": [*TRAIN, "--documents", "{tmp}/short_docs.jsonl"],
    "train document offsets mismatch": [*TRAIN, "--documents", "{tmp}/docs.bin"],
    "train documents missing tokenizer": [*TRAIN, "--documents", "{tmp}/text_docs.jsonl", "--tokenizer",
                                          "{tmp}/missing/tokenizer.json"],
    "train documents unknown policy": [*TRAIN, "--documents", "{tmp}/long_docs.jsonl", "--microbatching", "fifo"],
    "train microbatch memory not a size": [*TRAIN, "--documents", "{tmp}/long_docs.jsonl", "--microbatch-memory",
                                           "lots"],
    "train microbatch memory without documents": [*TRAIN, "--microbatch-memory", "1MiB"],
    "train microbatch memory without a profile": [*TRAIN, "--documents", "{tmp}/long_docs.jsonl",
                                                  "--split-long-documents", "--microbatch-memory", "1MiB"],
    # estimate
    "estimate out under a file": [*EST, "--out", "{file}/pictures"],
    "estimate unknown hf model type": ["estimate", "--hf-config", "{tmp}/bert.json", "--gpu", "a100-80gb",
                                       "--global-batch", "8"],
    "estimate unknown gpu": ["estimate", "--model", "gpt-tiny", "--gpu", "nosuch", "--global-batch", "8"],
    "estimate too large to simulate": [*EST[:5], "--global-batch", "100000000", "--pp", "4"],
    "estimate unknown model": ["estimate", "--model", "nosuch", "--gpu", "a100-80gb", "--global-batch", "8"],
    # plan
    "plan unknown gpu": ["plan", "--model", "gpt-tiny", "--gpu", "nosuch", "--gpus", "2", "--global-batch", "8"],
    "plan zero gpus": ["plan", "--model", "gpt-tiny", "--gpu", "a100-80gb", "--gpus", "0", "--global-batch", "8"],
    "plan unknown schedule": [*PLAN, "--schedules", "nosuch"],
    "plan unknown model": ["plan", "--model", "nosuch", "--gpu", "a100-80gb", "--gpus", "2", "--global-batch", "8"],
    # profile
    "profile plot in an unknown format": ["profile", "--model", "gpt-tiny", "--plot", "{out}/eff.xyz"],
    "profile plot under a file": ["profile", "--model", "gpt-tiny", "--plot", "{file}/eff.png"],
    "profile zero microbatch size": ["profile", "--model", "gpt-tiny", "--microbatch-sizes", "0",
                                     "--out", "{out}/p.json"],
    "profile missing profile to analyze": ["profile", "--analyze", "{tmp}/missing.json"],
    # compare
    "compare missing traces": ["compare", "{tmp}/missing.json", "{tmp}/missing.json", "--out", "{out}/c.png"],
    "compare out under a file": [*CMP, "--out", "{file}/c.png"],
    "compare out in an unknown format": [*CMP, "--out", "{out}/c.xyz"],
    # clusters: estimate --cluster, plan --cluster --what-if
    "estimate cluster with a gpu": [*EST, "--cluster", "{examples}/mixed_a100_h100.json"],
    "estimate cluster unknown placement": ["estimate", "--model", "gpt-tiny", "--cluster",
                                           "{examples}/mixed_a100_h100.json", "--global-batch", "8", "--pp", "2",
                                           "--placement", "random"],
    "plan what-if not a change": ["plan", "--model", "gpt-tiny", "--cluster", "{examples}/mixed_a100_h100.json",
                                  "--global-batch", "8", "--what-if", "rank five x2"],
    "plan what-if rank outside the cluster": ["plan", "--model", "gpt-tiny", "--cluster",
                                              "{examples}/mixed_a100_h100.json", "--global-batch", "8",
                                              "--what-if", "rank 16 x1.5"],
    "plan what-if negative delay": ["plan", "--model", "gpt-tiny", "--cluster", "{examples}/mixed_a100_h100.json",
                                    "--global-batch", "8", "--what-if", "link 3-4 +-5ms"],
    "plan what-if zero factor": ["plan", "--model", "gpt-tiny", "--cluster", "{examples}/mixed_a100_h100.json",
                                 "--global-batch", "8", "--what-if", "rank 3 x0"],
    "plan what-if on a profile": ["plan", "--profile", "{tmp}/missing.json", "--gpus", "2", "--global-batch", "8",
                                  "--what-if", "rank 1 x2"],
    "plan cluster negative speed": ["plan", "--model", "gpt-tiny", "--cluster", "{tmp}/slow_cluster.json",
                                    "--global-batch", "8"],
    "estimate cluster ranks missing": ["estimate", "--model", "gpt-tiny", "--cluster", "{tmp}/gap_cluster.json",
                                       "--global-batch", "8"],
    "plan cluster with other gpus": ["plan", "--model", "gpt-tiny", "--cluster", "{examples}/mixed_a100_h100.json",
                                     "--gpus", "8", "--global-batch", "8"],
    # the command itself
    "unknown command": ["nosuch"],
}

SUBPROCESS_CASES = ("simulate too large to fit", "simulate backward time inf", "train json-out under a file",
                    "estimate unknown hf model type", "compare out under a file")
"""Cases run as processes: commands whose refusals come before torch is imported (a loaded machine can take
seconds to import it; the in-process cases have it imported already)."""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Prepared inputs: a file, token ids beyond gpt-tiny's 256, Hugging Face configs, a checkpoint directory of
    another run's options, a trace."""
    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "a_file").write_text("not a folder\n")
    (tmp / "three_mbs.txt").write_text("1 2\n3\n4\n")
    (tmp / "bad_mbs.txt").write_text("1 2\n3 x\n4\n5\n")
    (tmp / "long_doc.txt").write_text("1\n2\n100000\n4\n")
    (tmp / "long_docs.jsonl").write_text(json.dumps({"tokens": [1, 2]}) + "\n" + json.dumps({"tokens": [3] * 40}))
    (tmp / "short_docs.jsonl").write_text('{"tokens": [5]}\n{"tokens": []}\n')  # skipped, counted: none left
    (tmp / "text_docs.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp / "docs.bin").write_bytes(array.array("H", range(10)).tobytes())
    (tmp / "docs.idx").write_bytes(array.array("q", [0, 4, 12]).tobytes())  # 12 > the 10 tokens
    (tmp / "big_ids.bin").write_bytes(array.array("H", [1, 2, 3] * 200 + [300] + [4] * 50).tobytes())
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
              "max_position_embeddings": 64, "intermediate_size": 128}
    (tmp / "neox.json").write_text(json.dumps({"model_type": "gpt_neox", **common}))
    (tmp / "bert.json").write_text(json.dumps({"model_type": "bert", **common}))
    links = {"intra_node": {"latency_s": 5e-6}}
    (tmp / "slow_cluster.json").write_text(json.dumps({"links": links, "nodes": [
        {"device": "a100-80gb", "ranks": [0, {"rank": 1, "speed": -0.5}]}]}))
    (tmp / "gap_cluster.json").write_text(json.dumps({"links": links, "nodes": [
        {"device": "a100-80gb", "ranks": [0, 2]}]}))
    (tmp / "llama128.json").write_text(json.dumps({"model_type": "llama", **common, "vocab_size": 128}))
    ckpt = tmp / "ckpt"  # as a run of TRAIN --random-tokens --global-batch 4 leaves it (the manifest only)
    from evenpipe.training.checkpoint_manifest import Manifest, write_manifest
    from evenpipe.training.config import CheckpointOptions, DataOptions, ScheduleOptions, TrainConfig
    from evenpipe.training.run_record import RUN_KEY, run_fingerprint
    (ckpt / "step_00000002").mkdir(parents=True)
    run = run_fingerprint(TrainConfig(schedule=ScheduleOptions(num_ranks=2, num_microbatches=2), model=_tiny16(),
                                      data=DataOptions(source="random", global_batch=4),
                                      checkpoint=CheckpointOptions(directory=str(ckpt))))
    write_manifest(str(ckpt / "step_00000002"), Manifest(step=2, world={RUN_KEY: run}, files=()))  # type: ignore
    from evenpipe.sim import SimCosts, simulate
    from evenpipe.schedule import build_schedule
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    trace = simulate(sched, SimCosts.uniform(num_stages=2, num_chunks=1, forward=1.0, backward=2.0))
    (tmp / "trace.json").write_text(trace.to_json())
    return tmp


def _tiny16():  # type: ignore[no-untyped-def]
    from evenpipe.training.config import ModelOptions
    return ModelOptions(preset="gpt-tiny", seq_len=16)


@pytest.fixture()
def paths(inputs: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)  # default outputs (compare.png, profile.json) would land here too
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    return {"out": str(out), "file": str(inputs / "a_file"), "tmp": str(inputs), "examples": str(examples)}


@pytest.fixture()
def ten_seconds() -> Iterator[None]:
    """In-process cases end within TIMEOUT_S, or the interval timer interrupts them (a failure)."""
    def expire(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"the case ran past {TIMEOUT_S} s")
    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _argv(case: str, paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) for a in CASES[case]]


def _check(code: int, err: str, out_dir: str) -> None:
    lines = err.splitlines()
    assert "--data " not in err, err  # names only options that exist
    assert code == 2, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("evenpipe"), lines[0]
    assert os.listdir(out_dir) == [], os.listdir(out_dir)


def test_the_table_covers_every_command_with_forty_cases() -> None:
    from evenpipe.cli import SUBCOMMANDS
    assert len(CASES) >= 40
    assert set(SUBCOMMANDS) <= {argv[0] for argv in CASES.values()}


@pytest.mark.parametrize("case", [c for c in CASES if c not in SUBPROCESS_CASES])
def test_bad_input_in_process(case: str, paths: dict[str, str], ten_seconds: None,
                              capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(_argv(case, paths))
    except SystemExit as e:  # argparse's own errors
        code = int(e.code or 0)
    _check(code, capsys.readouterr().err, paths["out"])


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_as_a_process(case: str, paths: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "evenpipe", *_argv(case, paths)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=paths["out"])
    _check(proc.returncode, proc.stderr, paths["out"])
