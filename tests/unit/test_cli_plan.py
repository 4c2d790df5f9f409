"""``evenpipe plan``: table, JSON, explain, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from evenpipe.cli import main

SMALL = ["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "32",
         "--max-microbatch-size", "4"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_top_k_with_limits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(SMALL + ["--top", "3"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if "limited by" in ln)
    rows = lines[header + 1:header + 4]
    assert [r.split()[0] for r in rows] == ["1", "2", "3"]
    for r in rows:
        assert r.split()[-1] in ("memory", "bubble", "communication", "compute")
    assert "searched" in out and "simulated" in out


def test_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(SMALL + ["--top", "4", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    cands = data["candidates"]
    assert len(cands) == 4
    for c in cands:
        for key in ("tp", "pp", "dp", "chunks", "microbatch_size", "recompute", "schedule", "step_time_s", "mfu",
                    "peak_memory_gib"):
            assert key in c
        assert c["tp"] * c["pp"] * c["dp"] == 8
        assert c["peak_memory_gib"] <= 80
    assert [c["step_time_s"] for c in cands] == sorted(c["step_time_s"] for c in cands)
    assert data["search"]["enumerated"] >= data["search"]["estimated"] > 0


def test_restricting_schedules_and_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(SMALL + ["--json", "--schedules", "1f1b", "--recompute", "full"], capsys)
    assert code == 0, err
    cands = json.loads(out)["candidates"]
    assert {c["schedule"] for c in cands} == {"1f1b"} and {c["recompute"] for c in cands} == {"full"}


def test_arch_flags_build_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--arch", "llama", "--layers", "8", "--hidden", "1024", "--heads", "8", "--vocab", "32000",
            "--seq-len", "1024", "--gpu", "a100-40gb", "--gpus", "4", "--global-batch", "16", "--json", "--top", "1"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert json.loads(out)["model"].startswith("llama")


def test_hf_config(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
           "intermediate_size": 2816, "num_hidden_layers": 8, "vocab_size": 32000, "max_position_embeddings": 2048,
           "hidden_act": "silu"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    argv = ["plan", "--hf-config", str(path), "--seq-len", "1024", "--gpu", "a100-40gb", "--gpus", "4",
            "--global-batch", "16", "--json", "--top", "1"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    assert json.loads(out)["candidates"]


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model", "gpt-9000b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8"], "gpt-9000b"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "tpu", "--gpus", "8", "--global-batch", "8"], "tpu"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "29", "--global-batch", "64"], "--gpus 29"),
    (["plan", "--model", "gpt-1t", "--gpu", "a100-40gb", "--gpus", "8", "--global-batch", "64"], "fits"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8",
      "--explain", "zero"], "zero"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8",
      "--schedules", "1f1b,warp"], "warp"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8",
      "--attention", "sparse"], "sparse"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8",
      "--schedules", "zb-v+bpipe"], "bpipe does not apply to schedule zb-v"),
    (["plan", "--arch", "gpt", "--layers", "4", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8"],
     "--hidden"),
    (["plan", "--gpu", "a100-80gb", "--gpus", "8", "--global-batch", "8"], "--model"),
    (["plan", "--model", "gpt-1.7b", "--gpu", "a100-80gb", "--gpus", "0", "--global-batch", "8"], "--gpus"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert out == ""


def test_plan_runs_without_torch() -> None:
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'numpy', 'matplotlib'):\n"
        "        raise ImportError('blocked ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "from evenpipe.cli import main\n"
        "sys.exit(main(['plan', '--model', 'gpt-1.7b', '--gpu', 'a100-80gb', '--gpus', '8', '--global-batch', '16',"
        " '--top', '1', '--schedules', '1f1b', '--max-microbatch-size', '2']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "limited by" in proc.stdout


def test_explain_bpipe_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gpt-1.7b", "--gpu", "a100-40gb", "--gpus", "8", "--global-batch", "16",
            "--max-microbatch-size", "2", "--top", "2", "--explain", "bpipe", "--schedules", "1f1b"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    verdict_line = next(ln for ln in out.splitlines() if ln.startswith("Does BPipe pay"))
    assert any(word in verdict_line for word in ("YES", "NO", "MARGINAL"))
    for label in ("best without BPipe:", "best with BPipe:", "lever:", "gain:", "eaten:", "why:"):
        assert label in out
    code, out, err = _run(argv + ["--json"], capsys)
    assert code == 0, err
    data = json.loads(out)["explain_bpipe"]
    assert data["verdict"] in ("pays", "marginal", "does not pay")
    assert data["bpipe"]["schedule"] == "bpipe" and data["baseline"]["schedule"] == "1f1b"


def test_llama3_405b_on_8192_h100_finds_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    """126 layers leave only pp in {1, 2} evenly on 8192 GPUs; uneven stages open pp 16 and the rest."""
    code, out, err = _run(["plan", "--model", "llama3-405b", "--gpu", "h100-80gb", "--gpus", "8192",
                           "--global-batch", "2048", "--seq-len", "8192", "--top", "3", "--json"], capsys)
    assert code == 0, err
    cands = json.loads(out)["candidates"]
    assert len(cands) == 3 and all(c["tp"] * c["pp"] * c["dp"] == 8192 for c in cands)
    assert all(c["pp"] > 2 and len(set(c["layout"])) > 1 and sum(c["layout"]) == 126 for c in cands)


def test_distributed_optimizer_is_searched_unless_fixed() -> None:
    from evenpipe.cost import hardware_preset, model_preset
    from evenpipe.plan.search import SearchSpace, enumerate_configs
    model, hw = model_preset("gpt-1.7b"), hardware_preset("a100-80gb")
    seen = {c.distributed_optimizer for c in enumerate_configs(model, hw, num_gpus=8, global_batch=32,
                                                               space=SearchSpace()) if c.dp > 1}
    assert seen == {False, True}
    fixed = {c.distributed_optimizer for c in enumerate_configs(model, hw, num_gpus=8, global_batch=32,
                                                                space=SearchSpace(distributed_optimizer=False))}
    assert fixed == {False}
    assert not any(c.distributed_optimizer for c in enumerate_configs(model, hw, num_gpus=8, global_batch=32,
                                                                      space=SearchSpace()) if c.dp == 1)


def test_plan_layout_fixes_the_stage_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(SMALL + ["--layout", "5,7,7,5", "--json"], capsys)
    assert code == 0, err
    assert all(c["layout"] == [5, 7, 7, 5] and c["pp"] * c["chunks"] == 4 for c in json.loads(out)["candidates"])


def test_schedules_take_family_plus_bpipe(capsys: pytest.CaptureFixture[str]) -> None:
    """``--schedules interleaved+bpipe``: interleaved with BPipe's transform, searched and explained like the rest."""
    argv = ["plan", "--model", "gpt-1.7b", "--gpu", "a100-40gb", "--gpus", "8", "--global-batch", "16",
            "--max-microbatch-size", "2", "--top", "2", "--json"]
    code, out, err = _run(argv + ["--schedules", "interleaved+bpipe"], capsys)
    assert code == 0, err
    cands = json.loads(out)["candidates"]
    assert cands and all(c["schedule"] == "interleaved" and c["bpipe"] and c["pp"] >= 3 for c in cands)
    code, out, err = _run(argv + ["--schedules", "interleaved,interleaved+bpipe", "--explain", "bpipe"], capsys)
    assert code == 0, err
    data = json.loads(out)["explain_bpipe"]
    assert data["bpipe"]["schedule"] == "interleaved" and data["bpipe"]["bpipe"]
    assert data["baseline"]["schedule"] == "interleaved" and not data["baseline"]["bpipe"]
    code, out, err = _run(argv[:-1] + ["--schedules", "interleaved+bpipe"], capsys)
    assert code == 0 and "interleaved+bpipe" in out, err
