"""Checkpoint and resume end to end through ``evenpipe train``: 8 straight steps equal, to the last bit, 4 steps
plus a resume for 4 more; the same checkpoint resumed with another schedule (1F1B -> BPipe), another pipeline
degree (4 -> 2), another layout and another data-parallel degree stays within 1e-5 of the straight run."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from harness import run_train

pytestmark = pytest.mark.distributed

COMMON = ["--model", "gpt-tiny", "--seq-len", "16", "--microbatches", "4", "--global-batch", "8", "--seed", "1",
          "--random-tokens", "--lr-schedule", "cosine", "--warmup-steps", "2", "--decay-steps", "8",
          "--clip-grad-norm", "1.0", "--timeout", "60"]


def _train(tmp: pathlib.Path, name: str, *extra: str) -> dict:
    return run_train([*COMMON, *extra], tmp / f"{name}.json")[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("resume")
    base = tmp / "ckpt"
    out = {"straight": _train(tmp, "straight", "--stages", "4", "--steps", "8"),
           "first": _train(tmp, "first", "--stages", "4", "--steps", "4", "--checkpoint-dir", str(base),
                           "--checkpoint-every", "2")}
    assert (base / "latest").read_text().strip() == "step_00000004"
    for name, layout in {"same": ["--stages", "4"], "bpipe": ["--stages", "4", "--schedule", "bpipe"],
                         "p2-dp2-layout": ["--stages", "2", "--dp", "2", "--schedule", "zb-h1", "--layout", "1,3"]
                         }.items():
        ckpt = tmp / f"ckpt-{name}"
        shutil.copytree(base, ckpt)  # each resume saves again at its end; keep the step-4 checkpoint for the rest
        out[name] = _train(tmp, name, *layout, "--steps", "8", "--checkpoint-dir", str(ckpt), "--resume")
    return out


def test_resume_is_bitwise_identical(runs: dict[str, dict]) -> None:
    assert runs["same"]["first_step"] == 4
    assert runs["first"]["losses"] + runs["same"]["losses"] == runs["straight"]["losses"]
    assert runs["first"]["grad_norms"] + runs["same"]["grad_norms"] == runs["straight"]["grad_norms"]


@pytest.mark.parametrize("name", ["bpipe", "p2-dp2-layout"])
def test_resume_across_schedule_pipeline_layout_and_dp(runs: dict[str, dict], name: str) -> None:
    want, got = runs["straight"]["losses"][4:], runs[name]["losses"]
    assert runs[name]["first_step"] == 4 and len(got) == 4
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5, (want, got)
