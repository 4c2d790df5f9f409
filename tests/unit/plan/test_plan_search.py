"""Branch and bound returns exactly what exhaustive estimation would; the bound never exceeds the estimate."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from evenpipe.cost import (
    Attention,
    Hardware,
    ModelSpec,
    ParallelConfig,
    Recompute,
    check_config,
    estimate,
    hardware_preset,
    memory_per_stage,
    model_preset,
)
from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.runtime_memory import Runtime, RuntimeConventions, TrainPrecision
from evenpipe.cost.timing import Efficiency
from evenpipe.errors import ConfigError, EvenpipeError
from evenpipe.plan import Searcher, SearchSpace, enumerate_configs, plan_configs, step_time_lower_bound
from evenpipe.plan.bounds import offload_bound, step_bound, work_lower_bound
from evenpipe.plan.order_bound import order_bound
from evenpipe.schedule import ScheduleFamily

A100 = hardware_preset("a100-80gb")
A100_40 = hardware_preset("a100-40gb")
SMALL = model_preset("gpt-1.7b")
# a small but non-trivial space: 16 GPUs, every family, micro-batches up to 4
SPACE = SearchSpace(max_microbatch_size=4, max_chunks=4, attention=Attention.EAGER)


def _exhaustive(model: ModelSpec, hw: Hardware, gpus: int, batch: int,
                space: SearchSpace) -> list[tuple[float, ParallelConfig]]:
    out = []
    for cfg in enumerate_configs(model, hw, num_gpus=gpus, global_batch=batch, space=space):
        try:
            check_config(model, hw, cfg, gpus)
            est = estimate(model, hw, cfg)
        except EvenpipeError:
            continue
        if est.fits:
            out.append((est.step_time_s, cfg))
    out.sort(key=lambda t: t[0])
    return out


@pytest.fixture(scope="module")
def exhaustive_40gb() -> list[tuple[float, ParallelConfig]]:
    # gpt-1.7b on 8 x A100-40GB, batch 32: memory binds for large micro-batches without recomputation
    return _exhaustive(SMALL, A100_40, 8, 32, SPACE)


def test_top_k_matches_exhaustive_search(exhaustive_40gb: list[tuple[float, ParallelConfig]]) -> None:
    result = plan_configs(SMALL, A100_40, num_gpus=8, global_batch=32, space=SPACE, top_k=5)
    got = [c.step_time_s for c in result.candidates]
    want = [t for t, _ in exhaustive_40gb[:5]]
    assert got == pytest.approx(want, rel=1e-12)
    assert result.best.step_time_s == exhaustive_40gb[0][0]
    assert all(c.estimate.fits for c in result.candidates)
    s = result.stats
    assert s.num_estimated < len(exhaustive_40gb)  # the bound saved simulations
    assert s.num_enumerated == s.num_invalid + s.num_over_memory + s.num_bounded + s.num_dominated \
        + s.num_estimated


def test_best_per_schedule_matches_exhaustive(exhaustive_40gb: list[tuple[float, ParallelConfig]]) -> None:
    result = Searcher(SMALL, A100_40).search(num_gpus=8, global_batch=32, space=SPACE, top_k=1,
                                             best_per_schedule=True)
    for family in SPACE.schedules:
        times = [t for t, c in exhaustive_40gb if c.schedule is family]
        if times:
            assert result.best_by_schedule[family].step_time_s == pytest.approx(min(times), rel=1e-12)


def test_dominated_configurations_are_really_slower(exhaustive_40gb: list[tuple[float, ParallelConfig]]) -> None:
    # the dominance rule: all else equal, lighter recomputation is never slower (under BPipe: when it also
    # evicts no more bytes, which with eager attention it never does: selective recomputation saves less, full
    # recomputation evicts only its checkpoint; test_moving_activations_never_makes_a_step_faster checks BPipe and
    # offload with flash attention)
    by_cfg = {c: t for t, c in exhaustive_40gb}
    searcher = Searcher(SMALL, A100_40)
    checked = {ScheduleFamily.ONE_F_ONE_B: 0}
    for cfg, t in by_cfg.items():
        for lighter in (Recompute.NONE, Recompute.SELECTIVE):
            if lighter is cfg.recompute or (lighter is Recompute.SELECTIVE and cfg.recompute is Recompute.NONE):
                continue
            twin = dataclasses.replace(cfg, recompute=lighter)
            if twin not in by_cfg:
                continue
            if cfg.uses_bpipe and not searcher._moves_no_more(twin, cfg):
                continue
            assert by_cfg[twin] <= t * (1 + 1e-12), (twin.describe(), cfg.describe())
            if cfg.schedule in checked:
                checked[cfg.schedule] += 1
    assert all(n > 0 for n in checked.values()), checked


@pytest.mark.parametrize("name,hw,gpus,batch", [("gpt-1.7b", A100_40, 8, 32), ("llama-7b", A100, 8, 16),
                                                ("gpt-7.5b", A100, 16, 32)])
def test_lower_bound_never_exceeds_the_estimate(name: str, hw: Hardware, gpus: int, batch: int) -> None:
    model = model_preset(name)
    space = SearchSpace(max_microbatch_size=2, max_chunks=2)
    checked = 0
    for cfg in enumerate_configs(model, hw, num_gpus=gpus, global_batch=batch, space=space):
        try:
            check_config(model, hw, cfg, gpus)
            est = estimate(model, hw, cfg)
        except EvenpipeError:
            continue
        bound = step_time_lower_bound(model, hw, cfg)
        assert bound <= est.step_time_s * (1 + 1e-9), cfg.describe()
        if len(set(est.layout)) == 1:  # and it is useful on even stages: within 20% (looser on uneven ones)
            assert bound >= 0.8 * est.step_time_s, cfg.describe()
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("name,hw,gpus,batch", [("gpt3-175b", A100, 1024, 1536), ("llama2-70b", A100, 64, 256)])
def test_work_bound_never_exceeds_the_lower_bound(name: str, hw: Hardware, gpus: int, batch: int) -> None:
    # the search skips on the cheap work bound only what the exact bound would skip: it must never exceed it,
    # and it should often be close (that is what makes it pay)
    model = model_preset(name)
    ratios = []
    for cfg in enumerate_configs(model, hw, num_gpus=gpus, global_batch=batch, space=SearchSpace()):
        try:
            check_config(model, hw, cfg, gpus)
        except EvenpipeError:
            continue
        exact = step_time_lower_bound(model, hw, cfg)
        work = work_lower_bound(model, hw, cfg)
        assert 0.0 < work <= exact, cfg.describe()
        ratios.append(work / exact)
    assert len(ratios) > 1000 and sorted(ratios)[len(ratios) // 2] > 0.5


def test_candidates_fit_and_are_sorted() -> None:
    result = plan_configs(model_preset("gpt-7.5b"), A100, num_gpus=16, global_batch=64, top_k=4)
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times) and len(times) == 4
    for c in result.candidates:
        assert c.config.num_gpus == 16
        assert c.peak_memory_gib <= A100.usable_memory_gib
        peak = max(m.total for m in memory_per_stage(c.estimate.model, A100, c.config))
        assert peak == pytest.approx(c.peak_memory_gib)
        d = c.to_dict()
        for key in ("tp", "pp", "dp", "chunks", "microbatch_size", "recompute", "schedule", "step_time_s", "mfu",
                    "peak_memory_gib"):
            assert key in d


def test_cache_makes_a_second_search_free() -> None:
    searcher = Searcher(SMALL, A100)
    searcher.search(num_gpus=8, global_batch=32, space=SPACE, top_k=3)
    n = searcher.num_estimated
    again = searcher.search(num_gpus=8, global_batch=32, space=SPACE, top_k=3)
    assert searcher.num_estimated == n
    assert again.stats.num_estimated > 0


def test_nothing_fits_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="fits in 8 x a100-40gb"):
        plan_configs(model_preset("gpt-1t"), A100_40, num_gpus=8, global_batch=64)


def test_unfactorable_gpu_count_is_a_config_error() -> None:
    # 29 GPUs: tp=29 does not divide 24 heads, pp=29 exceeds 24 layers, dp=29 does not divide 64
    with pytest.raises(ConfigError, match="--gpus 29"):
        plan_configs(SMALL, A100, num_gpus=29, global_batch=64)


@pytest.mark.parametrize("kwargs", [dict(num_gpus=0, global_batch=8), dict(num_gpus=8, global_batch=0),
                                    dict(num_gpus=8, global_batch=8, top_k=0)])
def test_bad_numbers_are_config_errors(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        plan_configs(SMALL, A100, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name,gpus,batch", [("gpt-1.7b", 8, 64), ("llama-7b", 16, 32)])
def test_peak_memory_grows_with_the_microbatch_size(name: str, gpus: int, batch: int) -> None:
    # the search assumes it: once a micro-batch size overflows, larger ones (all else equal) are not checked
    model = model_preset(name)
    peaks: dict[tuple[object, ...], list[tuple[int, float]]] = {}
    for cfg in enumerate_configs(model, A100, num_gpus=gpus, global_batch=batch,
                                 space=SearchSpace(max_microbatch_size=8, max_chunks=4)):
        try:
            check_config(model, A100, cfg, gpus)
            peak = max(m.total for m in memory_per_stage(model, A100, cfg))
        except EvenpipeError:
            continue
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.schedule, cfg.bpipe, cfg.chunks, cfg.recompute, cfg.layout,
               cfg.distributed_optimizer)
        peaks.setdefault(key, []).append((cfg.microbatch_size, peak))
    series = [sorted(v) for v in peaks.values() if len(v) > 1]
    assert len(series) > 5
    for s in series:
        values = [p for _, p in s]
        assert values == sorted(values), s


NEW_FAMILIES = (ScheduleFamily.ZB_H2, ScheduleFamily.ZB_V, ScheduleFamily.V_HALF, ScheduleFamily.V_MIN,
                ScheduleFamily.DUALPIPE_V)


def test_lower_bound_holds_for_the_v_shaped_and_zero_bubble_families() -> None:
    """The bound reads the family's placement: a V puts the last stage on rank 0, where round-robin would not."""
    model = model_preset("gpt-1.7b")
    space = SearchSpace(max_microbatch_size=2, schedules=NEW_FAMILIES)
    checked: dict[ScheduleFamily, int] = {f: 0 for f in NEW_FAMILIES}
    for cfg in enumerate_configs(model, A100, num_gpus=8, global_batch=32, space=space):
        try:
            check_config(model, A100, cfg, 8)
            est = estimate(model, A100, cfg)
        except EvenpipeError:
            continue
        assert cfg.chunks == cfg.schedule.traits.chunks.chunks(None)
        bound = step_time_lower_bound(model, A100, cfg)
        assert bound <= est.step_time_s * (1 + 1e-9), cfg.describe()
        checked[cfg.schedule] += 1
    assert all(n > 0 for n in checked.values()), checked


def test_planner_searches_the_new_families() -> None:
    space = SearchSpace(max_microbatch_size=2, schedules=(ScheduleFamily.ONE_F_ONE_B,) + NEW_FAMILIES)
    result = Searcher(SMALL, A100).search(num_gpus=8, global_batch=32, space=space, top_k=3,
                                          best_per_schedule=True)
    assert set(result.best_by_schedule) >= {ScheduleFamily.ZB_V, ScheduleFamily.DUALPIPE_V}


def test_the_default_space_tries_interleaved_with_bpipe(exhaustive_40gb: list[tuple[float, ParallelConfig]]) -> None:
    """BPipe on interleaved is a configuration of its own (``bpipe=True``), searched exactly like the others (the
    exhaustive top-k above includes it), only where a partner exists (pp >= 3)."""
    tried = [c for _, c in exhaustive_40gb if c.bpipe]
    assert tried and all(c.schedule is ScheduleFamily.INTERLEAVED and c.pp >= 3 and c.uses_bpipe for c in tried)
    assert all(c.schedule_name == "interleaved+bpipe" for c in tried)
    plain = {dataclasses.replace(c, bpipe=False) for c in tried}
    assert plain & {c for _, c in exhaustive_40gb}  # and its twins without eviction are there too
    assert SPACE.bpipe_families == (ScheduleFamily.INTERLEAVED,)
    # by default only where the space tries both interleaved and bpipe; or as asked
    assert SearchSpace(schedules=(ScheduleFamily.INTERLEAVED, ScheduleFamily.ZB_H1)).bpipe_families == ()
    assert SearchSpace(schedules=(), bpipe_schedules=(ScheduleFamily.GPIPE,)).bpipe_families == (ScheduleFamily.GPIPE,)


def test_interleaved_with_bpipe_balances_what_plain_interleaved_piles_on_rank_0() -> None:
    plain = ParallelConfig(pp=4, dp=2, chunks=2, global_batch=64, schedule=ScheduleFamily.INTERLEAVED,
                           attention=Attention.EAGER)
    moved = dataclasses.replace(plain, bpipe=True)
    a, b = (memory_per_stage(SMALL, A100, c) for c in (plain, moved))
    assert b[0].activations < 0.8 * a[0].activations  # rank 0 evicts
    assert b[-1].hosted > 0 and a[-1].hosted == 0  # its partner hosts
    assert max(m.activations + m.hosted for m in b) < max(m.activations + m.hosted for m in a)
    assert estimate(SMALL, A100, moved).config.uses_bpipe


def test_bpipe_on_a_family_it_does_not_apply_to_is_refused() -> None:
    with pytest.raises(ConfigError, match="bpipe does not apply to schedule zb-v"):
        SearchSpace(bpipe_schedules=(ScheduleFamily.ZB_V,))
    cfg = ParallelConfig(pp=4, dp=2, chunks=2, global_batch=32, schedule=ScheduleFamily.ZB_V, bpipe=True)
    with pytest.raises(ConfigError, match="bpipe does not apply to schedule zb-v"):
        check_config(SMALL, A100, cfg, 8)


def test_memory_capped_families_plan_with_the_cost_models_durations() -> None:
    """zb-h2, v-half and v-min order their actions for the F, I, W durations the cost model predicts (not
    1:1:1): the estimate simulates that order, and the memory check counts the same one. (zb-v's order is a
    fixed pattern: no durations.)"""
    from evenpipe.cost.memory import build_cost_schedule, counting_schedule
    from evenpipe.cost.timing import cost_plan_durations
    from evenpipe.sim import simulate
    from evenpipe.cost import stage_sim_costs
    cfg = ParallelConfig(tp=8, pp=4, dp=1, chunks=2, global_batch=16, schedule=ScheduleFamily.V_MIN)
    assert cost_plan_durations(SMALL, A100, dataclasses.replace(cfg, schedule=ScheduleFamily.ZB_V)) is None
    plan = cost_plan_durations(SMALL, A100, cfg)
    assert plan is not None and plan != (1, 1, 1)  # tensor parallelism makes W shorter than F and I
    assert cost_plan_durations(SMALL, A100, dataclasses.replace(cfg, schedule=ScheduleFamily.ONE_F_ONE_B,
                                                                chunks=1)) is None
    full, unit = build_cost_schedule(cfg, plan), build_cost_schedule(cfg, (1, 1, 1))
    assert full.meta["plan_durations"] == list(plan) and full.actions != unit.actions
    costs = stage_sim_costs(SMALL, A100, cfg)
    trace = simulate(full, costs)
    assert trace.step_time < simulate(unit, costs).step_time  # planning for the real durations pays here
    est = estimate(SMALL, A100, cfg)
    assert est.activation_peak_simulated_gib == pytest.approx(tuple(b / 2**30 for b in trace.peak_activation_bytes))
    assert counting_schedule(cfg, plan).meta["plan_durations"] == list(plan)


def test_the_bound_counts_every_ranks_own_gradient_reduction() -> None:
    """Zero-bubble's rank 0 ends on weight gradients while the last rank, busiest with the head, may end last;
    each rank reduces its own gradients after its last compute, so the bound takes the latest of those ends plus
    that rank's exposed reduction: tighter than rank 0's alone, and still below the estimate."""
    from evenpipe.cost import stage_sim_costs
    from evenpipe.cost.memory import layer_params_per_rank
    from evenpipe.cost.timing import Efficiency, dp_allreduce_time
    from evenpipe.plan.bounds import pipeline_bounds, stage_layout

    model = model_preset("gpt3-175b")
    cfg = ParallelConfig(tp=4, pp=8, dp=32, chunks=1, microbatch_size=1, global_batch=1536,
                         recompute=Recompute.NONE, sequence_parallel=True, attention=Attention.FLASH,
                         schedule=ScheduleFamily.ZB_H1, distributed_optimizer=False)
    eff = Efficiency()
    b = pipeline_bounds(stage_sim_costs(model, A100, cfg, eff), stage_layout(cfg.schedule, cfg.pp, cfg.chunks),
                        cfg.num_microbatches, recompute=False, split_backward=True)
    last = cfg.pp - 1
    layers = model.num_layers // cfg.pp
    exposed = dp_allreduce_time(layer_params_per_rank(model, cfg.tp) * layers, cfg, A100, eff) - b.rank_hideable[last]
    assert exposed > 0 and b.rank_ends[last] == max(b.rank_ends)
    bound = step_time_lower_bound(model, A100, cfg)
    assert bound >= b.rank_ends[last] + exposed > b.makespan
    assert bound <= estimate(model, A100, cfg).step_time_s



def test_transitive_domination_keeps_the_best() -> None:
    # with top 1, what a dominated configuration dominates is skipped too (e.g. selective recomputation with
    # offload when the plain twin fits); the best is the one the search without that shortcut (top 2) finds, on
    # every lever's space where memory binds (llama-7b on 8 x A100-40GB)
    from evenpipe.plan.levers import MemoryLever, lever_space
    model = model_preset("llama-7b")
    base = SearchSpace(max_microbatch_size=8, max_chunks=4, attention=Attention.EAGER)
    for lever in MemoryLever:
        space = lever_space(base, lever)
        one = Searcher(model, A100_40).search(num_gpus=8, global_batch=64, space=space, top_k=1)
        two = Searcher(model, A100_40).search(num_gpus=8, global_batch=64, space=space, top_k=2)
        assert (one.best.config, one.best.step_time_s) == (two.best.config, two.best.step_time_s), lever
        assert one.stats.num_estimated <= two.stats.num_estimated


def _evenpipe_source(model: ModelSpec, hw: Hardware) -> AnalyticSource:
    """The analytic source under plan's default conventions (evenpipe's runtime, bf16)."""
    return AnalyticSource(model, hw, Efficiency(),
                          conventions=RuntimeConventions(runtime=Runtime.EVENPIPE, dtype=TrainPrecision.BFLOAT16))


@pytest.mark.parametrize("name,gpus,batch", [("gpt-1.7b", 8, 32), ("llama-7b", 8, 16)])
def test_lower_bound_holds_under_the_evenpipe_runtime(name: str, gpus: int, batch: int) -> None:
    """Under evenpipe's runtime the embedding and the head are replicated over tp, so rank 0 and the last rank
    reduce and step markedly more than their layers: the bound counts them as the estimate does, and stays below
    it for every family, with BPipe and with host offload; so do the offload and compute-order bounds."""
    model = model_preset(name)
    source = _evenpipe_source(model, A100)
    space = SearchSpace(max_microbatch_size=2, max_chunks=2, schedules=SPACE.schedules + NEW_FAMILIES,
                        offload_fractions=(0.0, 0.5, 1.0))
    checked = 0
    for cfg in enumerate_configs(model, A100, num_gpus=gpus, global_batch=batch, space=space):
        try:
            source.check(cfg, gpus)
            est = estimate_with(source, cfg)
        except EvenpipeError:
            continue
        for bound in (step_bound, offload_bound, order_bound):  # the search's floors too
            assert bound(source, cfg) <= est.step_time_s * (1 + 1e-9), (bound.__name__, cfg.describe())
        checked += 1
    assert checked > 100


def test_the_bound_counts_the_replicated_embedding() -> None:
    """gpt3-175b at tp 4 under evenpipe's runtime: rank 0 holds the whole embedding (Megatron's runtime a quarter
    of it), so its gradient reduction is longer and the bound higher than under Megatron's conventions, whose
    stage costs are the same."""
    model = model_preset("gpt3-175b")
    cfg = ParallelConfig(tp=4, pp=8, dp=32, chunks=6, microbatch_size=1, global_batch=1536,
                         recompute=Recompute.NONE, sequence_parallel=True, attention=Attention.FLASH,
                         schedule=ScheduleFamily.INTERLEAVED, distributed_optimizer=True)
    megatron = AnalyticSource(model, A100, Efficiency(), conventions=RuntimeConventions(
        runtime=Runtime.MEGATRON, dtype=TrainPrecision.BFLOAT16))
    evenpipe = _evenpipe_source(model, A100)
    low, high = step_bound(megatron, cfg), step_bound(evenpipe, cfg)
    assert high > low + 0.05  # about 0.15 s more reduction on rank 0
    assert high <= estimate_with(evenpipe, cfg).step_time_s


def test_moving_fewer_activations_never_makes_a_step_slower() -> None:
    """What the search's dominance rule and its offload floor (``Searcher._offload_floor``) take: a configuration
    offloading on more ranks is never faster than the same offloading on fewer, and under offload or BPipe a
    lighter recomputation that moves no more bytes is never slower (a fully recomputed micro-batch moves only its
    checkpoint, so with offload full recomputation can beat selective, and the rule must not take it as
    dominated); checked on every configuration of a small space, fitting or not, under evenpipe's runtime, with
    flash attention (selective recomputation saves as much as none) and eager (it saves less)."""
    source = _evenpipe_source(SMALL, A100)
    searcher = Searcher.over(source)
    times = {}
    for attention in (Attention.FLASH, Attention.EAGER):
        space = SearchSpace(max_microbatch_size=2, max_chunks=2, distributed_optimizer=True, attention=attention,
                            offload_fractions=(0.0, 0.25, 0.5, 1.0))
        for cfg in enumerate_configs(SMALL, A100, num_gpus=8, global_batch=16, space=space):
            try:
                source.check(cfg, 8)
                times[cfg] = estimate_with(source, cfg).step_time_s
            except EvenpipeError:
                continue
    checked = {"offload": 0, "recompute with offload": 0, "recompute with bpipe": 0}
    lighter = {Recompute.SELECTIVE: (Recompute.NONE,), Recompute.FULL: (Recompute.NONE, Recompute.SELECTIVE)}
    for cfg, t in times.items():
        twins = [("offload", dataclasses.replace(cfg, offload_ranks=k)) for k in range(cfg.offload_ranks)]
        if cfg.uses_bpipe or cfg.offload_ranks:
            what = "recompute with bpipe" if cfg.uses_bpipe else "recompute with offload"
            twins += [(what, dataclasses.replace(cfg, recompute=r)) for r in lighter.get(cfg.recompute, ())]
        for what, twin in twins:
            if twin in times and (what == "offload" or searcher._moves_no_more(twin, cfg)):
                assert t >= times[twin] * (1 - 1e-12), (what, cfg.describe())
                checked[what] += 1
    assert all(n > 5 for n in checked.values()), checked


def test_search_pauses_cyclic_collection_and_restores_it() -> None:
    """A search allocates ~10^5 acyclic objects; collections meanwhile would only scan the growing caches. The
    pause ends with the search, also when it raises."""
    seen: list[bool] = []

    def where(cfg: ParallelConfig) -> bool:
        seen.append(gc.isenabled())
        return True
    assert gc.isenabled()
    Searcher(SMALL, A100).search(num_gpus=4, global_batch=8, space=SPACE, where=where)
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(ConfigError):
        Searcher(SMALL, A100).search(num_gpus=4, global_batch=8, space=SPACE, where=lambda cfg: False)
    assert gc.isenabled()


class _CountingChecks:
    """A source that counts the configurations it is asked to check (everything else is the wrapped source's)."""

    def __init__(self, source: AnalyticSource) -> None:
        self._source = source
        self.checks = 0

    def check(self, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
        self.checks += 1
        self._source.check(cfg, num_gpus)

    def __getattr__(self, name: str) -> object:
        return getattr(self._source, name)


def test_a_seeded_search_checks_only_what_could_beat_its_incumbent() -> None:
    """With an incumbent, what the work bound shows cannot beat it is skipped before the source checks it: the
    same best, far fewer checks."""
    from evenpipe.plan.levers import MemoryLever, lever_space
    model = model_preset("llama-7b")
    base = SearchSpace(max_microbatch_size=8, max_chunks=4, attention=Attention.EAGER)
    none = Searcher(model, A100_40).search(num_gpus=8, global_batch=64, top_k=1,
                                           space=lever_space(base, MemoryLever.NONE)).best
    space = lever_space(base, MemoryLever.ALL)
    plain = _CountingChecks(AnalyticSource(model, A100_40, Efficiency()))
    seeded = _CountingChecks(AnalyticSource(model, A100_40, Efficiency()))
    want = Searcher.over(plain).search(num_gpus=8, global_batch=64, top_k=1, space=space).best  # type: ignore[arg-type]
    got = Searcher.over(seeded).search(num_gpus=8, global_batch=64, top_k=1, space=space,  # type: ignore[arg-type]
                                       incumbent=none).best
    assert (got.config, got.step_time_s) == (want.config, want.step_time_s)
    assert seeded.checks < plain.checks / 2, (seeded.checks, plain.checks)
