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
    assert "rank 1 peak memory" in out and "mean FORWARD" in out and "EVICT transfer" in out
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
