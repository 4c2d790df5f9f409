"""``estimate --cluster`` and ``plan --cluster [--what-if ...]``: the one estimate and the one search on a cluster
of uneven devices (docs/cluster.md). Parsing and printing only; the planning is :mod:`evenpipe.plan.hetero` and
:mod:`evenpipe.plan.what_if`."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Callable

from evenpipe.errors import ConfigError

if TYPE_CHECKING:
    from evenpipe.cost import ModelSpec, ParallelConfig
    from evenpipe.cost.cluster import Cluster
    from evenpipe.cost.rank_sources import RankSources
    from evenpipe.cost.runtime_memory import RuntimeConventions
    from evenpipe.plan.hetero import ClusterPlan, PlacedCandidate
    from evenpipe.plan.replicas import ReplicaSplit
    from evenpipe.plan.search import SearchSpace
    from evenpipe.plan.what_if import WhatIfAnswer

__all__ = ["load_cluster_args", "estimate_source", "run_plan", "format_placed", "describe_groups", "split_lines",
           "what_if_lines"]


def load_cluster_args(args: argparse.Namespace, command: str) -> "tuple[ModelSpec, Cluster]":
    """The model and the ``--cluster`` file, checked against the other options (one-line errors); without
    ``--cluster``, ``--gpus`` devices of ``--gpu`` (``plan --gpu --what-if``)."""
    from evenpipe.commands.model_args import hardware_from_arg, model_from_args, with_gpus_per_node
    from evenpipe.cost.cluster import load_cluster
    if args.cluster is None:
        from evenpipe.cost.cluster_source import uniform_cluster
        if args.gpu is None or getattr(args, "profile", None) or args.gpus is None:
            raise ConfigError(f"--what-if needs --cluster FILE, or --gpu PRESET and --gpus N (the devices and links "
                              f"it changes){'; a profile measures no cluster' if getattr(args, 'profile', None) else ''}")
        hw = with_gpus_per_node(hardware_from_arg(args.gpu), args)
        return model_from_args(args), uniform_cluster(hw, args.gpus)
    if args.gpu is not None or getattr(args, "profile", None):
        raise ConfigError(f"{command} --cluster takes each rank's device from the cluster file; drop "
                          f"{'--gpu' if args.gpu is not None else '--profile'}")
    cluster = load_cluster(args.cluster)
    if args.gpus is not None and args.gpus != cluster.num_ranks:
        raise ConfigError(f"--gpus {args.gpus} != the {cluster.num_ranks} ranks of cluster file {args.cluster!r}; "
                          "allowed: leave --gpus out or give the cluster's rank count")
    return model_from_args(args), cluster


def estimate_source(args: argparse.Namespace, make_config: "Callable[..., ParallelConfig]",
                    conventions: "RuntimeConventions") -> "tuple[ParallelConfig, RankSources, str]":
    """``estimate --cluster``: the configuration (``make_config(args)`` with ``--gpus`` defaulting to the cluster's
    ranks), its source on the cluster under ``--placement``, and a header line naming the placement."""
    from evenpipe.plan.hetero import DeviceOrder, place, placed_source
    model, cluster = load_cluster_args(args, "estimate")
    cfg = make_config(argparse.Namespace(**{**vars(args), "gpus": cluster.num_ranks}),
                      shards_optimizer=conventions.shards_optimizer)
    order = DeviceOrder.parse(args.placement)
    groups = place(cluster, cfg.tp, cfg.pp, cfg.dp, order)
    if groups is None:
        raise ConfigError(f"--placement {order.value} splits a tensor-parallel group of {cfg.tp} over two nodes; "
                          "allowed: another --placement or a tp that divides the nodes")
    source = placed_source(model, cluster, groups, tp=cfg.tp, conventions=conventions)
    return cfg, source, f"{model.name} on cluster {args.cluster} ({source.name})\n  {order.value}: " \
        f"{describe_groups(groups)}"


def describe_groups(groups: tuple[tuple[int, ...], ...]) -> str:
    """``pipeline rank 0: ranks 8,9,...`` compactly: ``0<-8-11 1<-12-15``."""
    def ranks(g: tuple[int, ...]) -> str:
        return f"{g[0]}-{g[-1]}" if len(g) > 1 and list(g) == list(range(g[0], g[0] + len(g))) else \
            ",".join(map(str, g))
    return "pipeline rank <- cluster ranks: " + " ".join(f"{r}<-{ranks(g)}" for r, g in enumerate(groups))


def format_placed(p: "PlacedCandidate") -> str:
    """One plan on a cluster in one line."""
    from evenpipe.cost.parallel import describe_layout
    c = p.config
    chunks = f" v={c.chunks}" if c.chunks > 1 else ""
    return (f"{p.step_time_s:.3f} s  {c.schedule_name}{chunks} tp={c.tp} pp={c.pp} dp={c.dp} "
            f"mbs={c.microbatch_size} recompute={c.recompute.value} layers {describe_layout(p.candidate.estimate.layout)}"
            f"  placement {p.order.value} ({describe_groups(p.groups)})")


def run_plan(args: argparse.Namespace, space: "SearchSpace") -> int:
    """``plan --cluster`` (or ``--gpu --what-if``): the heterogeneity-aware plan, the best plan that treats the
    devices alike, and the answers to ``--what-if``."""
    from evenpipe.commands.model_args import conventions_from_args
    from evenpipe.plan.hetero import placed_source, search_cluster
    from evenpipe.plan.replicas import best_split
    from evenpipe.plan.what_if import answer_what_if, parse_what_if
    if args.explain is not None:
        raise ConfigError("--explain does not combine with --cluster yet; allowed: --explain with --gpu")
    model, cluster = load_cluster_args(args, "plan")
    what_ifs = [parse_what_if(w, cluster.num_ranks) for w in args.what_if or ()]
    kw = {"global_batch": args.global_batch, "space": space, "conventions": conventions_from_args(args)}
    t0 = time.perf_counter()
    aware = search_cluster(model, cluster, top_k=args.top, aware=True, **kw)  # type: ignore[arg-type]
    uniform = len({(cluster.speed(g), r.memory_gib) for g, r in enumerate(cluster.ranks)}) == 1
    alike = aware if uniform else search_cluster(model, cluster, top_k=1, aware=False, **kw)  # type: ignore[arg-type]
    answers = [answer_what_if(model, cluster, aware.best, w, **kw) for w in what_ifs]  # type: ignore[arg-type]
    split = best_split(aware, cluster, lambda on, groups, tp, peers: placed_source(
        model, on, groups, tp=tp, peers=peers, conventions=kw["conventions"]))  # type: ignore[arg-type]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"model": model.name, "cluster": args.cluster or f"{cluster.num_ranks} x {args.gpu}",
                          "ranks": cluster.num_ranks,
                          "global_batch": args.global_batch, "candidates": [p.to_dict() for p in aware.candidates],
                          "alike": alike.best.to_dict(), "speedup": alike.best.step_time_s / aware.best.step_time_s,
                          "search": {"searches": aware.num_searches + alike.num_searches,
                                     "estimated": aware.num_estimated + alike.num_estimated, "seconds": elapsed},
                          "replica_split": split.to_dict() if split is not None else None,
                          "split_speedup": alike.best.step_time_s / split.step_time_s if split is not None else None,
                          "what_if": [a.to_dict() for a in answers]}, indent=2))
        return 0
    print("\n".join(_plan_lines(model, args, aware, alike, elapsed)))
    if alike is not aware:
        print("\n".join(split_lines(split, aware.best.step_time_s, alike.best.step_time_s)))
    for a in answers:
        print()
        print("\n".join(what_if_lines(a)))
    return 0


def _plan_lines(model: "ModelSpec", args: argparse.Namespace, aware: "ClusterPlan", alike: "ClusterPlan",
                elapsed: float) -> list[str]:
    where = f"cluster {args.cluster}" if args.cluster else f"{args.gpus} x {args.gpu} (alike)"
    lines = [f"{model.name} on {where}, global batch {args.global_batch}: the fastest plans "
             "(step time; schedule, sizes, layers per stage, which devices run each pipeline rank)"]
    lines += [f"  {i}. {format_placed(p)}" for i, p in enumerate(aware.candidates, 1)]
    base, best = alike.best, aware.best
    if alike is aware:
        return lines + [f"{aware.num_searches} searches, {aware.num_estimated} configurations simulated in "
                        f"{elapsed:.2f} s"]
    lines += ["treating all devices alike (rank order, even layers; evaluated on this cluster):",
              f"     {format_placed(base)}",
              f"heterogeneity-aware: {base.step_time_s / best.step_time_s:.2f}x faster ({base.step_time_s:.3f} s "
              f"-> {best.step_time_s:.3f} s)",
              f"{aware.num_searches + alike.num_searches} searches, {aware.num_estimated + alike.num_estimated} "
              f"configurations simulated in {elapsed:.2f} s"]
    return lines


def split_lines(split: "ReplicaSplit | None", best_s: float, alike_s: float) -> list[str]:
    """The work split over unequal data-parallel replicas, beside the best plan (and, when it is faster, its gain
    over the plan that treats the devices alike, ``alike_s``)."""
    if split is None:
        return ["work split over unequal replicas: none applies (no data parallelism near the best, or replicas "
                "alike)"]
    c = split.config
    verdict = "faster" if split.step_time_s < best_s else "not faster"
    lines = [f"work split over unequal replicas (like devices per replica, micro-batches by speed): "
             f"{split.step_time_s:.3f} s, {verdict} than the best above ({best_s:.3f} s)",
             f"     {c.schedule_name} tp={c.tp} pp={c.pp} dp={c.dp} mbs={c.microbatch_size} "
             f"recompute={c.recompute.value}"]
    for d, r in enumerate(split.replicas):
        devices = ",".join(str(g) for group in r.groups for g in group)
        lines.append(f"     replica {d}: ranks {devices}: {r.num_microbatches} micro-batches, "
                     f"{r.estimate.step_time_s:.3f} s")
    if split.step_time_s < best_s:
        lines.append(f"with the split, heterogeneity-aware: {alike_s / split.step_time_s:.2f}x faster ({alike_s:.3f} s "
                     f"-> {split.step_time_s:.3f} s)")
    return lines


def what_if_lines(a: "WhatIfAnswer") -> list[str]:
    """The printed answer to one ``--what-if``."""
    before, after = a.before.step_time_s, a.after.step_time_s
    lines = [f"what if {a.what_if.text!r} ({a.what_if.describe()}):",
             f"  before: {format_placed(a.before)}",
             f"  after:  {after:.3f} s, the same plan on the changed cluster ({after / before - 1:+.1%})",
             "  responses (predicted on the changed cluster):"]
    for r in a.responses:
        if r.split is not None:
            shares = ", ".join(str(x.num_microbatches) for x in r.split.replicas)
            lines.append(f"    {r.name}: {r.step_time_s:.3f} s  micro-batches per replica {shares}")
        elif r.plan is not None:
            lines.append(f"    {r.name}: {format_placed(r.plan)}")
        else:
            lines.append(f"    {r.name}: nothing fits ({r.note})")
            continue
        lines.append(f"      {r.note}; {_recovery(a, r)}")
    best = a.best
    lines.append(f"  best response: {best.name} ({best.step_time_s:.3f} s; {_recovery(a, best)})")
    return lines


def _recovery(a: "WhatIfAnswer", r: object) -> str:
    share = a.recovered(r)  # type: ignore[arg-type]
    if share != share:  # NaN: the change cost nothing
        return "the change cost this plan nothing"
    if share < 0:
        return "slower than keeping the plan as it is"
    return f"recovers {share:.0%} of what the change cost"
