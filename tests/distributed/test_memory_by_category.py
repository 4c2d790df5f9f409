"""Memory to the byte (issue 31 point 3): what ``estimate --json`` predicts under ``peak_bytes_by_category`` for
the command ``evenpipe train`` runs is what the run measures, per category and pipeline rank.

Model states (parameters, gradients, master weights, optimizer state and FSDP's gathered weights and gradients)
are exact counts and must agree within 2%; own, hosted and offloaded activations and communication buffers within
5%. The estimate's source is a profile of the model measured here in the run's dtype (``estimate --profile``; at
tp 2 it divides the profiled block's split activations). A representative subset of the matrix (bfloat16 under
FSDP with BPipe's hosting, float32 at tp 2 x dp 2 interleaved under the distributed optimizer, float32 zb-h1 under
selective recomputation, bfloat16 llama-tiny at tp 2 x dp 2 under FSDP with zb-h1, float32 interleaved with host
offload on every rank (``--offload all``, issue 31.4: the offloaded bytes leave own_activations for
offloaded_activations)); the whole matrix (both models and dtypes, tp 1 and 2, every sharding mode, four
schedules) is ``benchmarks/bench_memory_matrix.py``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from harness import run_train, train_env

from evenpipe.cost.categories import MEMORY_CATEGORIES, STATE_CATEGORIES

pytestmark = pytest.mark.distributed

STATE_TOLERANCE, TOLERANCE = 0.02, 0.05
CASES = (  # (model, dtype, tp, dp, sharding, schedule, chunks, recompute, offload)
    ("gpt-tiny", "bfloat16", 1, 2, "full", "bpipe", 1, "none", ()),
    ("gpt-tiny", "float32", 2, 2, "optimizer", "interleaved", 2, "none", ()),
    ("gpt-tiny", "float32", 1, 1, "none", "zb-h1", 1, "selective", ()),  # issue 33: the profile's selective figure
    ("llama-tiny", "bfloat16", 2, 2, "full", "zb-h1", 1, "none", ()),
    ("gpt-tiny", "float32", 1, 1, "none", "interleaved", 2, "none", ("--offload", "all")),  # issue 31.4
)
GLOBAL_BATCH, MICROBATCHES = 8, 4


def _evenpipe(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "evenpipe", *args], env=train_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _profile(tmp: pathlib.Path, model: str, dtype: str) -> pathlib.Path:
    out = tmp / f"profile-{model}-{dtype}.json"
    if not out.exists():
        _evenpipe("profile", "--model", model, "--microbatch-sizes", "1,2", "--dtype", dtype, "--repeats", "1",
                  "--warmup", "1", "--processes", "1", "--no-progress", "--out", str(out), "--plot",
                  str(tmp / "profile.png"))
    return out


def _compare(label: str, measured: list[dict[str, int]], predicted: list[dict[str, int]]) -> list[str]:
    bad = []
    for r, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        for c in MEMORY_CATEGORIES:
            bound = STATE_TOLERANCE if c in STATE_CATEGORIES else TOLERANCE
            if abs(p[c] - m[c]) > bound * m[c] or (m[c] == 0) != (p[c] == 0):
                bad.append(f"{label} rank {r} {c}: measured {m[c]}, predicted {p[c]} (bound {100 * bound:g}%)")
    return bad


def test_predicted_categories_match_the_measured_run(tmp_path: pathlib.Path) -> None:
    problems = []
    for model, dtype, tp, dp, sharding, schedule, chunks, recompute, offload in CASES:
        label = (f"{model} {dtype} tp{tp} dp{dp} --sharding {sharding} {schedule} --recompute {recompute} "
                 f"{' '.join(offload)}")
        shape = ["--dp", str(dp), "--tp", str(tp), "--sharding", sharding, "--dtype", dtype, "--schedule", schedule,
                 "--chunks", str(chunks), "--recompute", recompute, *offload]
        run, _ = run_train(["--model", model, "--stages", "2", "--microbatches", str(MICROBATCHES),
                            "--global-batch", str(GLOBAL_BATCH),
                            "--steps", "2", "--random-tokens", "--timeout", "60", *shape],
                           tmp_path / f"{len(problems)}-{schedule}.json", timeout_s=300)
        measured = run["peak_bytes_by_category"]
        assert len(measured) == 2 and all(m["parameters"] > 0 and m["own_activations"] > 0 for m in measured)
        assert all((m["offloaded_activations"] > 0) == bool(offload) for m in measured), (label, measured)
        assert all((m["gathered_states"] > 0) == (sharding == "full") for m in measured), (label, measured)
        b = GLOBAL_BATCH // (MICROBATCHES * dp)
        est = json.loads(_evenpipe("estimate", "--profile", str(_profile(tmp_path, model, dtype)), "--pp", "2",
                                   *shape, "--microbatch-size", str(b), "--global-batch", str(GLOBAL_BATCH),
                                   "--json"))
        assert est["runtime"] == {"runtime": "evenpipe", "dtype": dtype, "sharding": sharding}
        problems += _compare(label, measured, est["peak_bytes_by_category"])
    assert not problems, "\n".join(problems)
