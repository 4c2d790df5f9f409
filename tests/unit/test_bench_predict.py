"""``benchmarks/bench_predict.py --bracket``: each run is predicted by the profiles taken just before and just
after it (mechanics only: profiling, training and simulation are replaced by fakes)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_predict  # noqa: E402

SPEED = {"profile.json": 1.00, "profile_1.json": 1.10, "profile_2.json": 1.30, "profile_3.json": 0.90,
         "profile_4.json": 1.40}
"""Fake host speed at each profile: a profile's prediction is ``SPEED`` times 100 ms."""


@pytest.fixture()
def fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> dict:
    seen: dict = {"profiles": [], "trained_with": [], "where": None}

    def profile(args, out, name="profile.json", *, quiet=False):
        seen["profiles"].append(name)
        return out / name

    def train(args, out, prof, schedule, chunks, b, round_=0):
        seen["trained_with"].append((schedule, round_, prof.name))
        steps = ([0.10, 0.12, 0.14] if round_ == 0 else [0.13, 0.14, 0.15]) if schedule == "1f1b" else [0.10] * 3
        return {"predicted_step_s": 0.1 * SPEED[prof.name], "measured_steps_s": steps,
                "measured_step_s": steps[1], "predicted_peak_bytes": [1.0], "measured_peak_bytes": [1.0],
                "num_steps": 3}

    def predict_from(args, prof, schedule, chunks, b):
        return 0.1 * SPEED[prof.name]

    def where_it_went(args, out, profile_of, rows):
        seen["where"] = {(case[0], r): profile_of(case, r).name for case in {(s, v, b) for s, v, b, _ in rows}
                         for r in range(args.rounds)}

    for name, fn in (("profile", profile), ("train", train), ("predict_from", predict_from),
                     ("where_it_went", where_it_went)):
        monkeypatch.setattr(bench_predict, name, fn)
    return seen


def test_bracket_predicts_each_run_from_the_profiles_around_it(fakes: dict, tmp_path: pathlib.Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bench_predict.main(["--out", str(tmp_path), "--schedules", "gpipe,1f1b", "--unprofiled", "", "--rounds", "2",
                        "--bracket", "--no-host-probe", "--stages", "1"])
    # runs in order gpipe r1, 1f1b r1, gpipe r2, 1f1b r2: a profile before each, one after the last
    assert fakes["profiles"] == ["profile.json", "profile_1.json", "profile_2.json", "profile_3.json",
                                 "profile_4.json"]
    assert fakes["trained_with"] == [("gpipe", 0, "profile.json"), ("1f1b", 0, "profile_1.json"),
                                     ("gpipe", 1, "profile_2.json"), ("1f1b", 1, "profile_3.json")]
    assert fakes["where"] == {("gpipe", 0): "profile.json", ("1f1b", 0): "profile_1.json",
                              ("gpipe", 1): "profile_2.json", ("1f1b", 1): "profile_3.json"}
    out = capsys.readouterr().out
    table = out.split("pred step", 1)[1].split("worst |error|", 1)[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith(("gpipe ", "1f1b "))}
    # gpipe: runs predicted (1.00+1.10)/2 and (1.30+0.90)/2 of 100 ms = 105 and 110 ms; the case: their mean
    assert rows["gpipe"][3] == "107.5ms" and rows["gpipe"][4] == "100.0ms" and rows["gpipe"][5] == "+7.5%"
    # 1f1b: (1.10+1.30)/2 and (0.90+1.40)/2 = 120 and 115 ms, against the mean of the runs' medians, 130 ms
    assert rows["1f1b"][3] == "117.5ms" and rows["1f1b"][4] == "130.0ms" and rows["1f1b"][5] == "-9.6%"


@pytest.mark.parametrize("extra", [["--profile", "p.json"], ["--reprofile"]])
def test_bracket_refuses_other_profiles(fakes: dict, tmp_path: pathlib.Path, extra: list[str]) -> None:
    with pytest.raises(SystemExit, match="--bracket"):
        bench_predict.main(["--out", str(tmp_path), *extra, "--bracket", "--no-host-probe"])
    assert fakes["profiles"] == [] and fakes["trained_with"] == []
