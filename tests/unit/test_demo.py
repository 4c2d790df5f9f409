"""``make demo``: the simulation part, the bookkeeping around the training runs, and (slow) the whole demo."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from evenpipe import demo
from evenpipe.schedule import build_schedule

P, M = demo.DEMO_RANKS, demo.DEMO_MICROBATCHES
# bytes of one activation unit per rank in the fake runs below (the last rank, with the head, is larger)
UNITS = (500_000, 510_000, 520_000, 700_000)


def _fake_run(tmp_path: pathlib.Path, schedule: str, *, peaks: list[int], hosted: list[int] | None = None,
              evicted: list[int] | None = None, losses: list[float] | None = None,
              trace_events: list[dict] | None = None, prediction: dict | None = None) -> demo.TrainRun:
    hosted = hosted or [0] * P
    raw = {"losses": losses or [5.0, 4.5], "step_time_s": 0.1, "tokens_per_s": 10240.0,
           "peak_activation_bytes": peaks, "peak_own_bytes": [p - h for p, h in zip(peaks, hosted)],
           "peak_hosted_bytes": hosted, "evicted_bytes_per_step": evicted or [0] * P,
           "config": {"schedule": {"family": schedule}}}
    if prediction is not None:
        raw["prediction"] = prediction
    path = tmp_path / f"{schedule}.json"
    path.write_text(json.dumps(raw))
    trace = tmp_path / f"{schedule}_trace.json"
    if trace_events is not None:
        trace.write_text(json.dumps({"traceEvents": trace_events}))
    return demo.TrainRun.from_json(path, trace_path=trace, wall_s=1.0)


def _fake_1f1b(tmp_path: pathlib.Path, **kw: object) -> demo.TrainRun:
    # 1F1B's rank r holds P - r units at its peak
    return _fake_run(tmp_path, "1f1b", peaks=[(P - r) * UNITS[r] for r in range(P)], **kw)  # type: ignore[arg-type]


def test_simulated_bpipe_lowers_the_first_rank_and_stays_within_budget() -> None:
    traces = demo.simulate_pair()
    one, bp = traces["1f1b"].peak_activations, traces["bpipe"].peak_activations
    assert one[0] == pytest.approx(P)
    budget = traces["bpipe"].schedule.meta["budget"]
    assert bp[0] < one[0] and max(bp) <= budget + 1e-9


def test_train_run_reads_the_json_summary(tmp_path: pathlib.Path) -> None:
    run = _fake_run(tmp_path, "bpipe", peaks=[3, 3, 3, 3], hosted=[0, 0, 1, 2], evicted=[200, 100, 0, 0])
    assert run.schedule == "bpipe" and run.losses == (5.0, 4.5)
    assert run.peak_own_bytes == (3, 3, 2, 1) and run.peak_hosted_bytes == (0, 0, 1, 2)
    assert run.moved_bytes_per_step == 300


def test_measured_costs_recover_bytes_per_unit_and_trace_durations(tmp_path: pathlib.Path) -> None:
    events = [{"ph": "X", "dur": us, "args": {"kind": kind, "stage": 1, "mb": mb}}
              for mb, us in enumerate((1000.0, 3000.0, 2000.0)) for kind in ("FORWARD",)]
    events += [{"ph": "X", "dur": 5000.0, "args": {"kind": "BACKWARD", "stage": 1, "mb": 0}}]
    run = _fake_1f1b(tmp_path, trace_events=events)
    costs = demo.measured_costs(build_schedule("1f1b", num_ranks=P, num_microbatches=M), run)
    assert [c.activation_bytes for c in costs.stages] == pytest.approx(UNITS)
    assert costs.stages[1].forward == pytest.approx(0.002)  # median of 1, 3 and 2 ms
    assert costs.stages[1].backward_input == pytest.approx(0.005)
    assert costs.stages[0].forward == 1.0  # no spans for stage 0: the default


def test_measured_timeline_keeps_compute_spans_per_rank(tmp_path: pathlib.Path) -> None:
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
              {"ph": "X", "pid": 2, "ts": 1000.0, "dur": 500.0, "args": {"kind": "FORWARD", "stage": 2, "mb": 0}},
              {"ph": "X", "pid": 2, "ts": 4000.0, "dur": 2000.0, "args": {"kind": "BACKWARD", "stage": 2, "mb": 0}},
              {"ph": "X", "pid": 2, "ts": 1600.0, "dur": 9000.0,
               "args": {"kind": "SEND_F", "stage": 2, "mb": 0, "src": 2, "dst": 3, "bytes": 8.0}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = demo.measured_timeline(build_schedule("1f1b", num_ranks=P, num_microbatches=M), path)
    assert [str(r.action) for r in trace.records(2)] == ["2F0", "2B0"] and trace.records(0) == ()
    assert trace.records(2)[1].start == pytest.approx(0.004) and trace.step_time == pytest.approx(0.006)
    assert trace.transfers == () and trace.source == "measured"


def test_prediction_prints_bpipe_against_measured_and_writes_pictures(tmp_path: pathlib.Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    runs = {"1f1b": _fake_1f1b(tmp_path), "bpipe": _fake_run(tmp_path, "bpipe", peaks=[3 * UNITS[0]] * P)}
    traces = demo.run_prediction(runs, tmp_path / "predicted")
    # BPipe keeps 3 of rank 0's own units at its peak: the prediction is exactly 3 x its measured unit
    assert traces["bpipe"].peak_activation_bytes[0] == pytest.approx(3 * UNITS[0])
    assert traces["1f1b"].peak_activation_bytes[0] == pytest.approx(P * UNITS[0])
    out = capsys.readouterr().out
    assert "predicted vs measured" in out and "+0.0%" in out
    for name in demo.DEMO_SCHEDULES:
        assert (tmp_path / "predicted" / name / "memory.png").stat().st_size > 0


def test_tables_show_ratio_and_loss_difference(tmp_path: pathlib.Path) -> None:
    a = _fake_1f1b(tmp_path, losses=[5.0, 4.0])
    b = _fake_run(tmp_path, "bpipe", peaks=[3 * UNITS[0]] * P, losses=[5.0, 4.004])
    mem = demo.memory_table(a, b).splitlines()
    assert mem[0].split()[-1] == "bpipe/1f1b" and mem[2].split()[-1] == "0.750"
    loss = demo.loss_table(a, b).splitlines()
    assert loss[-1].split() == ["2", "4.000000", "4.004000", "1.0e-03"]


def test_main_without_training_lists_the_simulated_files(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--out", str(tmp_path), "--no-train"]) == 0
    out = capsys.readouterr().out
    assert "sim-13b/bpipe/timeline.png" in out and "== 2." not in out
    assert (tmp_path / "sim-13b" / "1f1b" / "memory.png").exists()


def test_a_failing_training_run_raises_with_its_output(tmp_path: pathlib.Path) -> None:
    with pytest.raises(demo.DemoRunError, match=r"exited 2:\n(.|\n)*unknown model .no-such-model."):
        demo.train_run("1f1b", tmp_path, steps=1, model="no-such-model", timeout_s=120)


@pytest.mark.slow
@pytest.mark.distributed
def test_whole_demo_trains_both_schedules_with_equal_losses(tmp_path: pathlib.Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--out", str(tmp_path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "== 3. predicted vs measured" in out
    runs = {n: json.loads((tmp_path / "measured" / f"{n}.json").read_text()) for n in demo.DEMO_SCHEDULES}
    assert runs["bpipe"]["losses"] == pytest.approx(runs["1f1b"]["losses"], rel=1e-5)
    one, bp = runs["1f1b"]["peak_activation_bytes"], runs["bpipe"]["peak_activation_bytes"]
    assert bp[0] <= (3 / 4 + 0.10) * one[0]
    assert sum(runs["bpipe"]["evicted_bytes_per_step"]) > 0
    for n in demo.DEMO_SCHEDULES:
        assert (tmp_path / "measured" / f"{n}_trace.json").stat().st_size > 0


def _timed(predicted_ms: float, measured_ms: float, schedule: str = "1f1b", ranks: int = 2) -> demo.TimedStep:
    return demo.TimedStep(schedule=schedule, num_ranks=ranks, predicted_s=predicted_ms / 1e3,
                          measured_s=measured_ms / 1e3)


def test_final_line_says_agreement_only_within_the_stated_accuracy() -> None:
    ok = demo.step_verdict([_timed(31.0, 33.0), _timed(34.0, 33.0, "bpipe")], num_ranks=4, num_cores=4,
                           accuracy=0.10)
    assert ok.startswith("predicted and measured steps agree within 6.1%") and "stated accuracy 10%" in ok
    miss = demo.step_verdict([_timed(31.0, 33.0), _timed(40.0, 33.0, "bpipe")], num_ranks=4, num_cores=4,
                             accuracy=0.10)
    assert miss.startswith("predicted step off by +21.2%, more than the stated 10%") and "agree" not in miss
    assert "bpipe at P=2 40.0 ms vs 33.0 ms" in miss


def test_final_line_gives_the_reason_when_nothing_could_be_timed() -> None:
    line = demo.step_verdict([], num_ranks=4, num_cores=1)
    assert line.startswith("step times not compared: this host has 1 core(s)") and "\n" not in line


def test_timed_run_has_one_process_per_core() -> None:
    assert [demo.timed_ranks(4, c) for c in (1, 2, 3, 4, 16)] == [0, 2, 3, 4, 4]
    assert demo.host_cores() >= 1


def test_timing_times_a_run_per_core_when_the_pipeline_shares_cores(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """With fewer cores than ranks, the P=4 runs are not predicted; one 1F1B run at P=cores is, from a profile
    taken just before it."""
    calls: list[tuple[object, ...]] = []

    def fake_profile(out: pathlib.Path, *, num_processes: int, microbatch_size: int) -> pathlib.Path:
        calls.append(("profile", num_processes, microbatch_size))
        return out / "profile.json"

    def fake_train(schedule: str, out: pathlib.Path, *, steps: int, num_ranks: int,
                   predict: pathlib.Path | None, global_batch: int) -> demo.TrainRun:
        calls.append((schedule, num_ranks, predict, global_batch))
        run = _fake_run(tmp_path, schedule, peaks=[1, 1])
        return dataclasses.replace(run, num_ranks=num_ranks, predicted_step_s=0.0304, measured_step_s=0.032)

    monkeypatch.setattr(demo, "profile_run", fake_profile)
    monkeypatch.setattr(demo, "train_run", fake_train)
    runs = {"1f1b": _fake_1f1b(tmp_path), "bpipe": _fake_run(tmp_path, "bpipe", peaks=[3 * UNITS[0]] * P)}
    timed = demo.run_timing(runs, tmp_path / "timed", steps=2, num_cores=2)
    b = demo.TIMED_MICROBATCH_SIZE  # profiled and trained at one micro-batch size, a step of compute
    assert calls == [("profile", 2, b), ("1f1b", 2, tmp_path / "timed" / "profile.json", b * demo.DEMO_MICROBATCHES)]
    assert [(t.schedule, t.num_ranks) for t in timed] == [("1f1b", 2)]
    out = capsys.readouterr().out
    assert "P=4 step times are not predicted" in out and "-5.0%" in out
    assert demo.step_verdict(timed, num_ranks=P, num_cores=2).startswith("predicted and measured steps agree")
    calls.clear()
    assert demo.run_timing(runs, tmp_path / "timed", steps=2, num_cores=1) == [] and calls == []


def test_timing_uses_the_pipeline_runs_when_each_rank_had_a_core(tmp_path: pathlib.Path) -> None:
    pred = {"predicted_step_s": 0.05, "measured_step_s": 0.04}
    runs = {n: _fake_run(tmp_path, n, peaks=[1] * P, prediction=pred) for n in demo.DEMO_SCHEDULES}
    assert runs["bpipe"].predicted_step_s == 0.05 and runs["bpipe"].num_ranks == P
    timed = demo.run_timing(runs, tmp_path / "timed", steps=2, num_cores=8)
    assert [t.schedule for t in timed] == list(demo.DEMO_SCHEDULES) and timed[0].error == pytest.approx(0.25)
    line = demo.step_verdict(timed, num_ranks=P, num_cores=8)
    assert line.startswith("predicted step off by +25.0%") and "run it again on a quiet host" in line
