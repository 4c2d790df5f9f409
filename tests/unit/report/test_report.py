"""Pictures, Chrome traces and tables from simulated traces."""

from __future__ import annotations

import json
import pathlib

import pytest

from evenpipe.report.bundle import BUNDLE_FILES, write_bundle
from evenpipe.report.chrome_trace import TraceEvent, chrome_trace_json, trace_events, write_chrome_trace, write_events
from evenpipe.report.tables import comparison_table, exposed_table, format_bytes, summary_table
from evenpipe.schedule.ir import Schedule
from evenpipe.sim import Link, SimCosts, StageCosts, Trace, simulate

BPIPE_TEXT = ("# bpipe ranks=2 microbatches=2 layout=0,1\n"
              "0: 0F0 0SEND_F0@1 0F1 0SEND_F1@1 0EVICT1@1 0RECV_B0@1 0B0 0LOAD1@1 0RECV_B1@1 0B1\n"
              "1: 0ACCEPT1@0 1RECV_F0@0 1F0 1B0 1SEND_B0@0 1RECV_F1@0 0RETURN1@0 1F1 1B1 1SEND_B1@0")


@pytest.fixture(scope="module")
def trace() -> Trace:
    stage = StageCosts(forward=1, backward_input=2, activation_bytes=4, output_bytes=1)
    return simulate(Schedule.from_text(BPIPE_TEXT), SimCosts.from_stages([stage, stage],
                                                                         default_link=Link(bandwidth_bytes_per_s=2)))


def test_chrome_trace_layout(trace: Trace, tmp_path: pathlib.Path) -> None:
    path = write_chrome_trace(trace, tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    computes = [e for e in spans if e["tid"] == 0]
    sends = [e for e in spans if e["tid"] == 1]
    assert len(computes) == sum(1 for _ in trace.compute_records()) == 8
    assert len(sends) == len(trace.transfers)
    first = next(e for e in computes if e["name"] == "1F0")
    rec = next(r for r in trace.records(1) if str(r.action) == "1F0")
    assert first["pid"] == 1 and first["ts"] == pytest.approx(rec.start * 1e6)
    assert first["dur"] == pytest.approx(rec.duration * 1e6)
    assert first["args"] == {"kind": "FORWARD", "stage": 1, "mb": 0}
    evict = next(e for e in sends if e["args"]["kind"] == "EVICT")
    assert evict["pid"] == 0 and evict["args"]["bytes"] == 4 and evict["args"]["dst"] == 1
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and names[(1, 1)] == "transfers"
    assert {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"} == {"sim rank 0",
                                                                                               "sim rank 1"}


def test_plain_records_get_their_own_lanes(tmp_path: pathlib.Path) -> None:
    events = [TraceEvent(0, "compute", "0F0", 0.0, 0.5, {"kind": "FORWARD"}), TraceEvent(0, "stash", "pack", 0.1, 0.2)]
    doc = json.loads(write_events(events, tmp_path / "t.json", label="measured").read_text())
    spans = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert spans["pack"]["tid"] == 2 and spans["pack"]["ts"] == pytest.approx(1e5)
    assert spans["0F0"]["dur"] == pytest.approx(5e5)
    assert chrome_trace_json([])["traceEvents"] == []


def test_trace_events_cover_computes_and_transfers(trace: Trace) -> None:
    events = trace_events(trace)
    assert sum(e.lane == "compute" for e in events) == 8
    assert sum(e.lane == "transfers" for e in events) == len(trace.transfers)


def test_bundle_writes_pngs(trace: Trace, tmp_path: pathlib.Path) -> None:
    paths = write_bundle(trace, tmp_path / "out")
    assert [p.name for p in paths] == list(BUNDLE_FILES)
    for p in paths[:2]:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert Schedule.from_text(paths[3].read_text()).actions == trace.schedule.actions


def test_plot_functions_draw_on_given_axes(trace: Trace) -> None:
    from matplotlib.figure import Figure

    from evenpipe.report.memory import plot_memory
    from evenpipe.report.timeline import plot_timeline

    fig = Figure()
    ax1, ax2 = fig.subplots(2)
    assert plot_timeline(trace, ax1) is ax1
    rects = sum(len(c.get_paths()) for c in ax1.collections)
    assert rects == 8 + len(trace.transfers)  # one box per compute, one bar per transfer
    assert {t.get_text() for t in ax1.texts} <= {"0", "1"}
    plot_memory(trace, ax2, budget=1.0)
    assert len(ax2.get_lines()) == 2 * 2 + 1  # a step line and a peak marker per rank, plus the budget
    with pytest.raises(ValueError, match="units"):
        plot_memory(trace, ax2, units="gib")


def test_tables(trace: Trace) -> None:
    text = summary_table(trace)
    assert "schedule bpipe" in text and "P=2" in text and f"{trace.step_time:.6g}" in text
    assert "exposed" in exposed_table(trace)
    table = comparison_table({"a": trace, "b": trace})
    assert "a peak" in table and "b bytes" in table and "bubble" in table
    assert format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2**30) == "3 GiB" and format_bytes(12) == "12 B"
