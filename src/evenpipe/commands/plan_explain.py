"""The answer of ``evenpipe plan --explain bpipe`` on analytic costs, as text lines.

Apart from :mod:`evenpipe.commands.plan` so that a plan without ``--explain`` imports neither this presentation
nor :mod:`evenpipe.plan.explain`.
"""

from __future__ import annotations

import argparse

from evenpipe.cost import Hardware, ModelSpec
from evenpipe.cost.parallel import split_bpipe
from evenpipe.plan.explain import BPipeExplanation, ComponentDelta, Eater, Lever, Verdict
from evenpipe.plan.search import Candidate, SearchSpace
from evenpipe.schedule import ScheduleFamily

__all__ = ["explanation_lines"]


def explanation_lines(model: ModelSpec, hw: Hardware, args: argparse.Namespace, space: SearchSpace,
                      e: BPipeExplanation) -> list[str]:
    """``Does BPipe pay for ...?``: the answer, both best configurations, the lever, the costs and why."""
    where = f"{model.name} on {args.gpus} x {hw.name} ({space.attention.value} attention)"
    if e.bpipe is None:
        return [f"Does BPipe pay for {where}? Not applicable: no BPipe configuration fits "
                "(BPipe needs at least 3 pipeline ranks).",
                f"  best without BPipe: {_describe(e.baseline)}"]
    base, bp = e.baseline, e.bpipe
    steps = f"step {base.step_time_s:.3f} s -> {bp.step_time_s:.3f} s"
    answer = {Verdict.PAYS: f"YES: {100 * e.gain:+.1f}% throughput ({steps})",
              Verdict.MARGINAL: f"MARGINAL: {100 * e.gain:+.1f}% throughput ({steps}), within the "
                                f"{100 * e.margin:.0f}% margin",
              Verdict.DOES_NOT_PAY: f"NO: {100 * e.gain:+.1f}% throughput ({steps})"}[e.verdict]
    lines = [f"Does BPipe pay for {where}? {answer}."]
    for label, c in (("best without BPipe:", base), ("best with BPipe:   ", bp)):
        lines.append(f"  {label} {_describe(c)}")
        lines.append(f"  {' ' * len(label)} step {c.step_time_s:.3f} s, MFU {100 * c.mfu:.1f}%, peak "
                     f"{c.peak_memory_gib:.1f} of {e.usable_memory_gib:g} GiB usable, bubble "
                     f"{100 * c.estimate.bubble_fraction:.1f}%")
    lines += _lever_lines(e)
    lines += _cost_lines(e)
    lines.append(f"  why:   {_why(e)}")
    return lines


_LEVER_DETAIL = {
    Lever.LARGER_MICROBATCH: lambda b, p: f"micro-batch {b.microbatch_size} -> {p.microbatch_size}",
    Lever.LESS_RECOMPUTE: lambda b, p: f"recompute {b.recompute.value} -> {p.recompute.value}",
    Lever.SMALLER_TP: lambda b, p: f"tp {b.tp} -> {p.tp}",
    Lever.SMALLER_PP: lambda b, p: f"pp {b.pp} -> {p.pp}",
}


def _lever_lines(e: BPipeExplanation) -> list[str]:
    assert e.bpipe is not None
    base, bp = e.baseline.config, e.bpipe.config
    if e.levers:
        lever = "; ".join(f"{lv.value} ({_LEVER_DETAIL[lv](base, bp)})" for lv in e.levers)
    elif e.twin_fits:
        lever = "none"
    else:
        lever = "none: its micro-batch, recomputation, tp and pp are no better than the best without BPipe"
    lines = [f"  lever: {lever}"]
    plain = _plain_name(e)
    if e.twin_fits is False:
        lines.append(f"         with plain {plain} this configuration needs {e.twin_peak_memory_gib:.1f} GiB on its "
                     f"fullest rank (> {e.usable_memory_gib:g} usable): BPipe is what makes it fit")
    elif e.twin is not None:
        lines.append(f"         it also fits with plain {plain} ({e.twin_peak_memory_gib:.1f} GiB, step "
                     f"{e.twin.step_time_s:.3f} s): BPipe unlocks nothing here")
    return lines


def _plain_name(e: BPipeExplanation) -> str:
    """The BPipe configuration's schedule without eviction (1F1B for schedule ``bpipe``)."""
    assert e.bpipe is not None
    family, _ = split_bpipe(e.bpipe.config.schedule)
    return family.value.upper() if family is ScheduleFamily.ONE_F_ONE_B else family.value


def _fmt(deltas: tuple[ComponentDelta, ...]) -> str:
    return ", ".join(f"{c.name.replace('_', ' ')} {c.delta_s:+.3f} s" for c in deltas) or "nothing"


def _cost_lines(e: BPipeExplanation) -> list[str]:
    assert e.bpipe is not None
    base, bp = e.baseline, e.bpipe
    lines = [f"  gain:  {_fmt(e.savings)}", f"  eaten: {_fmt(e.costs)}"]
    notes = []
    if Eater.BUBBLE in e.eaters:
        why = []
        if bp.config.num_microbatches < base.config.num_microbatches:
            why.append(f"fewer micro-batches, {base.config.num_microbatches} -> {bp.config.num_microbatches}")
        if bp.config.pp > base.config.pp:
            why.append(f"more stages, pp {base.config.pp} -> {bp.config.pp}")
        if base.config.chunks > bp.config.chunks:
            why.append(f"less interleaving (v={base.config.chunks} -> v={bp.config.chunks})")
        notes.append(f"bubble {100 * base.estimate.bubble_fraction:.1f}% -> {100 * bp.estimate.bubble_fraction:.1f}%"
                     + (f" from {'; '.join(why)}" if why else ""))
    if Eater.TRANSFER in e.eaters:
        notes.append(f"ranks wait {e.component('bpipe_transfer').bpipe_s:.3f} s on evict/load transfers")
    if Eater.ACCEPTOR_MEMORY in e.eaters:
        notes.append(f"acceptors host up to {e.hosted_gib:.1f} GiB of their partners' activations")
    lines += [f"         {n}" for n in notes]
    return lines


def _why(e: BPipeExplanation) -> str:
    assert e.bpipe is not None
    saved = -sum(c.delta_s for c in e.savings)
    spent = sum(c.delta_s for c in e.costs)
    levers = ", ".join(lv.value for lv in e.levers)
    if e.verdict is Verdict.PAYS:
        return (f"BPipe pays: balancing activations unlocks {levers or 'a faster configuration'}, saving "
                f"{saved:.3f} s, and its costs take back only {spent:.3f} s.")
    head = "BPipe is marginal" if e.verdict is Verdict.MARGINAL else "BPipe does not pay"
    if e.twin_fits:
        timed = [x.value for x in e.eaters if x is not Eater.ACCEPTOR_MEMORY]
        return (f"{head}: activations already fit without it (its best configuration runs as plain {_plain_name(e)}), so "
                f"balancing buys nothing, while {' and '.join(timed) or 'its costs'} add {spent:.3f} s against "
                f"the best configuration without BPipe.")
    if not e.levers:
        return f"{head}: it unlocks nothing the best configuration without it needs; it adds {spent:.3f} s."
    return (f"{head}: what it unlocks ({levers}) saves {saved:.3f} s, but {spent:.3f} s of costs eat it.")


def _describe(c: Candidate) -> str:
    cfg = c.config
    chunks = f" v={cfg.chunks}" if cfg.chunks > 1 else ""
    return (f"{cfg.schedule_name}{chunks} tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} mbs={cfg.microbatch_size} "
            f"(m={cfg.num_microbatches}) recompute={cfg.recompute.value}")
