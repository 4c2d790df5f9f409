"""Plain-text tables of simulated or measured traces (no matplotlib)."""

from __future__ import annotations

from typing import Mapping

from evenpipe.sim.trace import Trace

__all__ = ["summary_table", "comparison_table", "exposed_table", "format_bytes"]


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``1.5 KiB``; plain numbers below 1 KiB keep up to 4 significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.4g} B"


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _size(num: float, unit_costs: bool) -> str:
    return f"{num:.4g}" if unit_costs else format_bytes(num)


def summary_table(trace: Trace, *, unit_costs: bool = False) -> str:
    """Header facts (schedule, P, M, V, step time, bubble, exposed transfers) and a per-rank table.

    ``unit_costs``: the trace's costs are unit costs (``evenpipe simulate`` without a profile or a model), so times
    are labelled ``time units`` and sizes ``size units``, not seconds and bytes."""
    s = trace.schedule
    exposed = trace.exposed_transfers
    t_unit = " time units" if unit_costs else " s"
    head = [f"schedule {s.name}   P={s.num_ranks}  M={s.num_microbatches}  V={s.num_chunks}   "
            f"actions {trace.num_actions}",
            f"step time {trace.step_time:.6g}{t_unit}   bubble {trace.bubble_fraction:.2%}   "
            f"exposed transfer time {trace.exposed_transfer_time:.4g}{t_unit} ({len(exposed)} transfers)"]
    rows = [["rank", "busy", "peak act. units", "peak size units" if unit_costs else "peak bytes"]]
    for r in range(trace.num_ranks):
        rows.append([str(r), f"{trace.busy_time(r):.6g}", f"{trace.peak_activations[r]:.3g}",
                     _size(trace.peak_activation_bytes[r], unit_costs)])
    return "\n".join(head) + "\n\n" + _grid(rows)


def exposed_table(trace: Trace, limit: int = 10, *, unit_costs: bool = False) -> str:
    """The most exposed transfers (what a compute waited on), or a line saying there were none; ``unit_costs`` as
    in :func:`summary_table`."""
    exposed = trace.exposed_transfers
    if not exposed:
        return "no exposed transfers"
    rows = [["transfer", "src->dst", "size units" if unit_costs else "bytes", "start", "end", "exposed"]]
    for t in exposed[:limit]:
        rows.append([f"{t.stage}{t.kind.token}{t.microbatch}", f"{t.src}->{t.dst}", _size(t.num_bytes, unit_costs),
                     f"{t.start:.4g}", f"{t.end:.4g}", f"{t.exposed_s:.4g}"])
    more = f"\n... and {len(exposed) - limit} more" if len(exposed) > limit else ""
    return _grid(rows) + more


def comparison_table(traces: Mapping[str, Trace]) -> str:
    """Side by side: per-rank peak activations (units and bytes) of each trace, then step time and bubble."""
    names = list(traces)
    num_ranks = max(t.num_ranks for t in traces.values())
    rows = [["rank"] + [f"{n} peak" for n in names] + [f"{n} bytes" for n in names]]
    for r in range(num_ranks):
        units = [f"{traces[n].peak_activations[r]:.3g}" if r < traces[n].num_ranks else "" for n in names]
        sizes = [format_bytes(traces[n].peak_activation_bytes[r]) if r < traces[n].num_ranks else "" for n in names]
        rows.append([str(r)] + units + sizes)
    rows.append(["max"] + [f"{max(traces[n].peak_activations):.3g}" for n in names]
                + [format_bytes(max(traces[n].peak_activation_bytes)) for n in names])
    rows.append(["step s"] + [f"{traces[n].step_time:.4g}" for n in names] + [""] * len(names))
    rows.append(["bubble"] + [f"{traces[n].bubble_fraction:.1%}" for n in names] + [""] * len(names))
    rows.append(["exposed s"] + [f"{traces[n].exposed_transfer_time:.3g}" for n in names] + [""] * len(names))
    return _grid(rows)
