"""``evenpipe profile --analyze``, ``simulate --profile``, ``compare`` and the one-line refusals of bad profiles,
run in-process on a synthetic profile (no measuring)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from evenpipe.cli import main
from evenpipe.sim import Trace

sys.path.insert(0, str(pathlib.Path(__file__).parent / "cost"))
from test_profile_fit import make_profile  # noqa: E402


@pytest.fixture()
def profile_path(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "profile.json"
    path.write_text(make_profile(layers=8).to_json())
    return path


def test_analyze_prints_fits_and_draws(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--analyze", str(profile_path), "--predict-sizes", "3,8"]) == 0
    out = capsys.readouterr().out
    assert "b=3 pred" in out and "max resid" in out and "GFLOP/s" in out
    assert (profile_path.parent / "efficiency_vs_microbatch.png").stat().st_size > 1000


def test_simulate_with_profile(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                               tmp_path: pathlib.Path) -> None:
    args = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "8", "--profile", str(profile_path),
            "--microbatch-size", "3", "--json", "--out", str(tmp_path / "sim")]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step_time"] > doc["schedule_time"] > 0
    assert len(doc["peak_activation_bytes"]) == 2 and doc["peak_activation_bytes"][0] > doc["peak_activation_bytes"][1]
    trace = Trace.from_json((tmp_path / "sim" / "trace.evenpipe.json").read_text())
    assert trace.step_time == pytest.approx(doc["schedule_time"])


def test_compare_two_traces(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                            tmp_path: pathlib.Path) -> None:
    for b in ("1", "2"):
        assert main(["simulate", "--schedule", "bpipe", "--stages", "2", "--microbatches", "4", "--profile",
                     str(profile_path), "--microbatch-size", b, "--out", str(tmp_path / b)]) == 0
    capsys.readouterr()
    png = tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "1" / "trace.evenpipe.json"), str(tmp_path / "2" / "trace.evenpipe.json"),
                 "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 1 peak memory" in out and "mean FORWARD" in out and "EVICT transfer" in out and "EVICT wait" in out
    assert "-50.0%" in out  # b=1 against b=2: half the bytes
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("edit, message", [
    (None, "does not exist"),
    (lambda d: d.update(version=99), "schema version 99"),
    (lambda d: d.update(format="x"), "not an evenpipe profile"),
])
def test_bad_profile_one_line_exit_2(edit, message: str, tmp_path: pathlib.Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.json"
    if edit is not None:
        doc = make_profile(layers=8).to_dict()
        edit(doc)
        path.write_text(json.dumps(doc))
    code = main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--profile", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_compare_refuses_other_schedules(profile_path: pathlib.Path, tmp_path: pathlib.Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("1f1b", "gpipe"):
        main(["simulate", "--schedule", name, "--stages", "2", "--microbatches", "4" if name == "1f1b" else "3",
              "--profile", str(profile_path), "--out", str(tmp_path / name)])
    capsys.readouterr()
    code = main(["compare", str(tmp_path / "1f1b" / "trace.evenpipe.json"),
                 str(tmp_path / "gpipe" / "trace.evenpipe.json")])
    assert code == 2 and "different schedules" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "nothing.json"), str(tmp_path / "nothing.json")]) == 2


def test_estimate_and_plan_with_profile(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--profile", str(profile_path), "--pp", "2", "--schedule", "1f1b",
                 "--microbatch-size", "2", "--global-batch", "16", "--memory-gib", "1", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["num_microbatches"] == 8 and est["fits"] and len(est["peak_bytes"]) == 2
    # 4 copies (weights, grads, two AdamW moments) of float32 parameters: embedding + 4 blocks on rank 0
    assert est["state_bytes"][0] == pytest.approx((10 + 4 * 100) * 16)
    assert main(["plan", "--profile", str(profile_path), "--gpus", "2", "--global-batch", "8", "--memory-gib", "1"]) == 0
    assert "tokens/s" in capsys.readouterr().out


def test_plan_explain_bpipe_from_profile(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a budget between 1F1B's rank-0 peak at b=4 and BPipe's: only BPipe fits the large micro-batch
    args = ["plan", "--profile", str(profile_path), "--gpus", "4", "--global-batch", "16", "--explain", "bpipe",
            "--max-microbatch-size", "4", "--json"]
    assert main(args + ["--memory-gib", "1"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    assert roomy["without"]["microbatch_size"] == 4 and not roomy["pays"]  # memory no object: BPipe only adds work
    assert "verdict: BPipe does not pay" in roomy["text"]
    assert main(args[:-1] + ["--memory-gib", "1"]) == 0
    assert "fastest with BPipe" in capsys.readouterr().out
    assert main(args[:-1]) == 2
    assert "needs --memory-gib" in capsys.readouterr().err


def test_train_refuses_a_profile_of_another_model(profile_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--model", "gpt-mini", "--stages", "2", "--predict", str(profile_path)])
    err = capsys.readouterr().err
    assert code == 2 and "not 'gpt-mini'" in err and len(err.strip().splitlines()) == 1


def test_train_refuses_a_profile_of_another_dtype(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    path.write_text(make_profile().to_json())  # gpt-tiny, measured in float32
    code = main(["train", "--model", "gpt-tiny", "--stages", "2", "--seq-len", "16", "--dtype", "bfloat16",
                 "--predict", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "measured in float32, training runs in bfloat16" in err and len(err.strip().splitlines()) == 1


def test_profile_and_train_name_a_relative_hf_config_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile of ``--hf-config rel/path.json`` must be accepted by ``train --hf-config rel/path.json --predict``:
    both name the model by the config's absolute path."""
    pytest.importorskip("transformers")
    import argparse

    from evenpipe.commands import profile as profile_cmd
    from evenpipe.commands import train as train_cmd
    root = pathlib.Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    rel = "benchmarks/data/tiny_llama_config.json"
    name, _ = profile_cmd._model_config(argparse.Namespace(hf_config=rel, model=None), ())
    parser = argparse.ArgumentParser()
    train_cmd.add_arguments(parser)
    config = train_cmd.build_config(parser.parse_args(["--hf-config", rel, "--stages", "2"]))
    assert name == config.model.name == str(root / rel)


def test_unwritable_out_is_refused_before_measuring(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import evenpipe.runtime.profile as rp

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured although --out cannot be written")
    monkeypatch.setattr(rp, "profile_model", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["profile", "--model", "gpt-tiny", "--out", str(blocker / "sub" / "profile.json")])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and len(err.strip().splitlines()) == 1
    created = tmp_path / "new" / "deeper" / "profile.json"  # a missing folder is made, as `--out DIR/x` expects
    from evenpipe.commands.profile import _check_writable
    _check_writable(created)
    assert created.parent.is_dir()


def test_a_fit_through_as_many_sizes_as_terms_is_called_exact() -> None:
    """Two sizes and the two terms 1 + b: the fit passes through both points by construction, so the report says
    so instead of a 0.0% residual; with three sizes the residual is a real check and is shown."""
    from evenpipe.commands.profile import fit_report
    two = fit_report(make_profile(sizes=(1, 2), fixed=1.0))
    block = next(line for line in two.splitlines() if line.startswith("block     forward_s"))
    assert "exact" in block and "%" not in block
    assert "(exact: as many profiled sizes as fit terms (2)" in two
    three = fit_report(make_profile(sizes=(1, 2, 4), curve=0.3))
    block = next(line for line in three.splitlines() if line.startswith("block     forward_s"))
    assert "exact" not in block and block.rstrip().endswith("%") and "(exact:" not in three


def test_the_report_gives_every_latency_in_milliseconds() -> None:
    from evenpipe.commands.profile import fit_report
    text = fit_report(make_profile())
    assert " us" not in text
    assert "latency 0.100 ms" in text and "fixed per step (loss broadcast): 0.050 ms" in text


def test_progress_is_one_flushed_line_per_step_when_stderr_is_not_a_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from evenpipe.runtime.profile import _Progress
    progress = _Progress(3, enabled=True)
    for what in ("layers, round 1/1", "optimizer step", "point-to-point messages"):
        progress.step(what)
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 3
    assert err.splitlines()[1].startswith("profiling 2/3: optimizer step done (")
    _Progress(3, enabled=False).step("x")
    assert capsys.readouterr().err == ""
