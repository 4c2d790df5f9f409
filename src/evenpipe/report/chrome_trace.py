"""Chrome / Perfetto trace-event JSON, for simulated and measured runs alike.

Layout: one process per rank (``pid = rank``), named ``rank R``; a thread per lane (``compute`` is tid 0,
``transfers`` tid 1, further lanes get the next ids). Every record is a complete ("X") event with microsecond
``ts``/``dur``. Open the file at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Mapping, NamedTuple

from evenpipe.sim.trace import Trace

__all__ = ["TraceEvent", "COMPUTE_LANE", "TRANSFER_LANE", "trace_events", "chrome_trace_json", "write_events",
           "write_chrome_trace"]

COMPUTE_LANE = "compute"
TRANSFER_LANE = "transfers"
_US = 1e6


class TraceEvent(NamedTuple):
    """One timed span on one lane of one rank (plain data, so the runtime can build them from measurements)."""

    rank: int
    """Rank (becomes the trace's process)."""
    lane: str
    """Lane within the rank (becomes a thread): ``compute``, ``transfers`` or any other name."""
    name: str
    """Label shown on the span, e.g. ``0F3``."""
    start_s: float
    """Start in seconds."""
    end_s: float
    """End in seconds."""
    args: Mapping[str, Any] = {}
    """Extra facts shown on click (kind, stage, mb, bytes, ...)."""


def trace_events(trace: Trace) -> list[TraceEvent]:
    """The compute actions (compute lane) and transfers (sender's transfer lane) of ``trace``."""
    events = [TraceEvent(rec.rank, COMPUTE_LANE, str(rec.action), rec.start, rec.end,
                         {"kind": rec.action.kind.name, "stage": rec.action.stage, "mb": rec.action.microbatch})
              for rec in trace.compute_records()]
    for t in trace.transfers:
        events.append(TraceEvent(t.src, TRANSFER_LANE, f"{t.stage}{t.kind.token}{t.microbatch}->{t.dst}", t.start,
                                 t.end, {"kind": t.kind.name, "stage": t.stage, "mb": t.microbatch, "src": t.src,
                                         "dst": t.dst, "bytes": t.num_bytes, "exposed_s": t.exposed_s}))
    return events


def chrome_trace_json(events: Iterable[TraceEvent], *, label: str = "") -> dict[str, Any]:
    """The trace-event document for ``events``; ``label`` prefixes the process names (e.g. ``sim``)."""
    lanes: dict[str, int] = {COMPUTE_LANE: 0, TRANSFER_LANE: 1}
    out: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for e in events:
        tid = lanes.setdefault(e.lane, len(lanes))
        ranks.add(e.rank)
        out.append({"name": e.name, "cat": str(e.args.get("kind", e.lane)), "ph": "X", "pid": e.rank, "tid": tid,
                    "ts": e.start_s * _US, "dur": max(e.end_s - e.start_s, 0.0) * _US, "args": dict(e.args)})
    prefix = f"{label} " if label else ""
    meta: list[dict[str, Any]] = []
    for r in sorted(ranks):
        meta.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"{prefix}rank {r}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for lane, tid in lanes.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": lane}})
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_events(events: Iterable[TraceEvent], path: str | pathlib.Path, *, label: str = "") -> pathlib.Path:
    """Write ``events`` as a Chrome trace JSON file and return its path."""
    path = pathlib.Path(path)
    path.write_text(json.dumps(chrome_trace_json(events, label=label)))
    return path


def write_chrome_trace(trace: Trace, path: str | pathlib.Path) -> pathlib.Path:
    """Write a simulated or measured :class:`Trace` (labelled by its ``source``)."""
    return write_events(trace_events(trace), path, label=trace.source)
