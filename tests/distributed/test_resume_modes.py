"""Checkpoints in every mode (issue 33.1), four processes each: a run stopped after 3 of 6 steps and resumed
reproduces the uninterrupted losses bit for bit with the same layout -- bfloat16 with tensor parallelism and
optimizer-state sharding; FSDP (``--sharding full``) with BPipe -- and within 1e-5 (float32) when the schedule,
pipeline degree, data-parallel degree, tensor-parallel degree, sharding mode or sequence parallelism changes at
the resume.

Each uninterrupted run saves at steps 3 and 6; a resume copies its directory without step 6 and continues from
step 3, so one straight run serves as both the checkpoint source and the reference."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from harness import run_train

pytestmark = pytest.mark.distributed

COMMON = ["--model", "gpt-tiny", "--seq-len", "16", "--microbatches", "4", "--global-batch", "8", "--seed", "3",
          "--random-tokens", "--lr-schedule", "cosine", "--warmup-steps", "2", "--decay-steps", "6",
          "--clip-grad-norm", "1.0", "--timeout", "120", "--steps", "6"]


def _straight(tmp: pathlib.Path, name: str, layout: list[str]) -> tuple[dict, pathlib.Path]:
    ckpt = tmp / f"ckpt-{name}"
    summary = run_train([*COMMON, *layout, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"],
                        tmp / f"{name}.json")[0]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000003", "step_00000006"]
    return summary, ckpt


def _resume(tmp: pathlib.Path, source: pathlib.Path, name: str, layout: list[str]) -> dict:
    ckpt = tmp / f"ckpt-{name}"
    shutil.copytree(source, ckpt, ignore=shutil.ignore_patterns("step_00000006"))
    summary, out = run_train([*COMMON, *layout, "--checkpoint-dir", str(ckpt), "--resume"], tmp / f"{name}.json")
    assert f"resuming from {ckpt / 'step_00000003'} (step 3)" in out, out[-2000:]
    assert summary["first_step"] == 3 and len(summary["losses"]) == 3
    return summary


SAME = {
    "bf16-tp2-dp2-optimizer": ["--dtype", "bfloat16", "--stages", "1", "--tp", "2", "--dp", "2",
                               "--sharding", "optimizer"],
    "fsdp-bpipe": ["--stages", "2", "--dp", "2", "--sharding", "full", "--schedule", "bpipe"],
}
SYNC = {"fsdp-bpipe"}
"""Cases whose uninterrupted run saves synchronously (the resumed one, like every other, in the background)."""


@pytest.mark.parametrize("name", list(SAME))
def test_resume_in_the_same_layout_is_bitwise(tmp_path: pathlib.Path, name: str) -> None:
    straight, ckpt = _straight(tmp_path, "straight", SAME[name] + (["--checkpoint-sync"] if name in SYNC else []))
    resumed = _resume(tmp_path, ckpt, "resumed", SAME[name])
    assert straight["checkpoints"]["asynchronous"] is (name not in SYNC) and resumed["checkpoints"]["asynchronous"]
    assert [s["step"] for s in straight["checkpoints"]["saves"]] == [3, 6]
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["grad_norms"] == straight["grad_norms"][3:]


BASE = ["--stages", "2", "--tp", "2"]
"""The float32 run whose step-3 checkpoint the other layouts resume: pipeline 2 x tensor parallel 2, 1F1B."""
CHANGED = {
    "tp1-dp2-fsdp-zb-v": ["--stages", "2", "--dp", "2", "--sharding", "full", "--schedule", "zb-v"],
    "pp4-bpipe": ["--stages", "4", "--schedule", "bpipe"],
    "pp1-tp2-dp2-optimizer": ["--stages", "1", "--tp", "2", "--dp", "2", "--sharding", "optimizer"],
    "pp1-tp2-dp2-fsdp": ["--stages", "1", "--tp", "2", "--dp", "2", "--sharding", "full"],
    "pp2-tp2-sequence-parallel-bpipe": ["--stages", "2", "--tp", "2", "--sequence-parallel", "--schedule", "bpipe"],
}


def test_resume_across_modes_stays_within_1e_5(tmp_path: pathlib.Path) -> None:
    straight, ckpt = _straight(tmp_path, "straight", BASE)
    want = straight["losses"][3:]
    gaps = {}
    for name, layout in CHANGED.items():
        got = _resume(tmp_path, ckpt, name, layout)["losses"]
        gaps[name] = max(abs(a - b) for a, b in zip(want, got))
    assert all(gap < 1e-5 for gap in gaps.values()), gaps
