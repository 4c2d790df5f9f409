"""Write the standard files of one trace into a folder: timeline.png, memory.png, trace.json (Chrome/Perfetto),
trace.evenpipe.json (the trace itself, :meth:`Trace.to_json`, for ``evenpipe compare``), schedule.txt."""

from __future__ import annotations

import pathlib

from evenpipe.report.chrome_trace import write_chrome_trace
from evenpipe.sim.trace import Trace

__all__ = ["write_bundle", "BUNDLE_FILES"]

BUNDLE_FILES = ("timeline.png", "memory.png", "trace.json", "schedule.txt", "trace.evenpipe.json")


def write_bundle(trace: Trace, out_dir: str | pathlib.Path, *, time_label: str = "time (s)") -> list[pathlib.Path]:
    """Write :data:`BUNDLE_FILES` for ``trace`` under ``out_dir`` (created if needed); return their paths.

    The memory picture draws the BPipe budget when the schedule's ``meta`` carries one; ``time_label`` names the
    pictures' time axis (unit costs are not seconds).
    """
    from evenpipe.report.memory import save_memory  # matplotlib only when pictures are asked for
    from evenpipe.report.timeline import save_timeline

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = trace.schedule.meta.get("budget")
    paths = [save_timeline(trace, out / "timeline.png", time_label=time_label),
             save_memory(trace, out / "memory.png", budget=float(budget) if isinstance(budget, (int, float)) else None,
                         time_label=time_label),
             write_chrome_trace(trace, out / "trace.json")]
    schedule_txt = out / "schedule.txt"
    schedule_txt.write_text(trace.schedule.to_text())
    paths.append(schedule_txt)
    own = out / "trace.evenpipe.json"
    own.write_text(trace.to_json())
    paths.append(own)
    return paths
