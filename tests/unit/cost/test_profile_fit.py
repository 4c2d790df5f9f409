"""The profile schema and its fits: round trip, one-line refusals, exact recovery of linear data, stage costs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from evenpipe.cost.profile import PROFILE_VERSION, LayerKind, LayerSample, LinkSample, Machine, ModelInfo, Profile, \
    ProfileError
from evenpipe.cost.profile_fit import ProfileModel, even_layout, fit_least_squares, link_from_profile, predict_step
from evenpipe.cost import ParallelConfig
from evenpipe.cost.estimate import estimate_with
from evenpipe.cost.profiled_source import ProfiledSource
from evenpipe.schedule import build_schedule


def _sample(b: int, *, s: int = 16, t: float = 1e-3, saved: float = 1000.0, inp: float = 100.0,
            out: float = 100.0, curve: float = 0.0, fixed: float = 1.0) -> LayerSample:
    f = t * (fixed + 2 * b) + curve * b * b
    return LayerSample(microbatch_size=b, seq_len=s, forward_s=f, backward_s=2 * f, backward_input_s=1.1 * f,
                       backward_weight_s=1.0 * f, recompute_s=f, saved_bytes=saved * b, input_saved_bytes=inp * b,
                       output_bytes=out * b, weight_grad_bytes=0.5 * saved * b, forward_flops=1e6 * b)


def make_profile(sizes=(1, 2, 4), *, layers: int = 4, curve: float = 0.0, fixed: float = 1.0) -> Profile:
    return Profile(
        machine=Machine(device="cpu", device_name="test cpu", num_threads=1, num_processes=2, torch_version="x",
                        dtype="float32", backend="gloo"),
        model=ModelInfo(name="gpt-tiny", arch="gpt", num_layers=layers, hidden=64, vocab=256, seq_len=64,
                        params={"embedding": 10, "block": 100, "head": 20}),
        layers={LayerKind.EMBEDDING: tuple(_sample(b, t=1e-4, saved=8.0, inp=0.0) for b in sizes),
                LayerKind.BLOCK: tuple(_sample(b, curve=curve, fixed=fixed) for b in sizes),
                LayerKind.HEAD: tuple(_sample(b, t=5e-4, saved=300.0, out=0.0) for b in sizes)},
        optimizer_s={LayerKind.EMBEDDING: 1e-4, LayerKind.BLOCK: 1e-3, LayerKind.HEAD: 2e-4},
        link=(LinkSample(num_bytes=4, seconds=1e-4), LinkSample(num_bytes=10**6, seconds=1e-4 + 1e-3)),
        step_overhead_s=5e-5, repeats=3, warmup=1)


def test_profile_round_trips_json() -> None:
    p = make_profile()
    assert Profile.from_json(p.to_json()) == p


def test_block_chain_round_trips_and_older_profiles_read_as_one_block() -> None:
    p = dataclasses.replace(make_profile(), block_chain=4)
    assert Profile.from_json(p.to_json()).block_chain == 4
    doc = p.to_dict()
    del doc["block_chain"]
    assert Profile.from_dict(doc).block_chain == 1


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=PROFILE_VERSION + 1), "schema version"),
    (lambda d: d.update(format="something"), "not an evenpipe profile"),
    (lambda d: d["layers"].pop("head"), "head"),
    (lambda d: d["layers"]["block"][0].update(forward_s=-1), "forward_s"),
    (lambda d: d["machine"].pop("device"), "damaged"),
])
def test_bad_profiles_are_refused_in_one_line(edit, message: str) -> None:
    doc = make_profile().to_dict()
    edit(doc)
    with pytest.raises(ProfileError, match=message) as info:
        Profile.from_json(json.dumps(doc))
    assert "\n" not in str(info.value)


def test_other_model_is_refused() -> None:
    with pytest.raises(ProfileError, match="gpt-tiny.*not 'gpt-mini'"):
        make_profile().check_model("gpt-mini")
    with pytest.raises(ProfileError, match="layers 4 vs 8"):
        make_profile().check_model("gpt-tiny", num_layers=8)
    make_profile().check_model("gpt-tiny", num_layers=4, hidden=64)


def test_linear_data_is_recovered_with_zero_residuals() -> None:
    model = ProfileModel(make_profile())
    for (kind, q), fit in model.fits.items():
        assert fit.max_abs_residual < 1e-9, (kind, q)
    block3 = model.predict(LayerKind.BLOCK, 3)
    assert block3.forward_s == pytest.approx(1e-3 * 7)
    assert block3.saved_bytes == pytest.approx(3000.0)


def test_curvature_shows_in_residuals() -> None:
    model = ProfileModel(make_profile(curve=1e-3))
    assert model.fits[(LayerKind.BLOCK, "forward_s")].max_abs_residual > 0.01


def test_two_sequence_lengths_fit_tokens_and_attention_terms() -> None:
    rows, ys = [], []
    for s in (8, 16):
        for b in (1, 2, 4):
            rows.append((1.0, b * s, b * s * s))
            ys.append(0.5 + 2.0 * b * s + 0.1 * b * s * s)
    fit = fit_least_squares(("1", "b*s", "b*s^2"), rows, ys)
    assert fit.coefficients == pytest.approx((0.5, 2.0, 0.1))


def test_no_negative_coefficient_from_noisy_times() -> None:
    """A slow-looking trend (the free least-squares line is 2.571 b - 1.0, negative at b=0.39) would predict
    negative times for small sizes: the intercept is dropped and the line refitted through the origin."""
    rows = [(1.0, 1.0), (1.0, 2.0), (1.0, 4.0)]
    fit = fit_least_squares(("1", "b"), rows, [1.0, 5.0, 9.0])
    assert fit.coefficients == pytest.approx((0.0, 47 / 21))
    assert all(fit.predict_features((1.0, b)) > 0 for b in (0.25, 1.0, 3.0))
    plain = fit_least_squares(("1", "b"), rows, [3.0, 5.0, 9.0])  # no negative coefficient: least squares
    assert plain.coefficients == pytest.approx((1.0, 2.0))


def test_one_point_fit_is_proportional() -> None:
    fit = fit_least_squares(("1", "b"), [(1.0, 2.0)], [6.0])
    assert fit.predict_features((1.0, 5.0)) == pytest.approx(15.0)


def test_stage_unit_counts_layers_like_the_stash() -> None:
    model = ProfileModel(make_profile())
    # first stage: embedding (8 B saved, input not saved) + 2 blocks (1000 saved, input 100 saved each)
    first = model.stage_costs(blocks=2, first=True, last=False, microbatch_size=1, split_backward=False)
    assert first.activation_bytes == pytest.approx(8 + 2 * 1000 + 2 * 100)
    assert first.output_bytes == pytest.approx(100)
    # last stage: received input (100, held) + 2 blocks + head (300 saved, input 100 saved)
    last = model.stage_costs(blocks=2, first=False, last=True, microbatch_size=1, split_backward=False)
    assert last.activation_bytes == pytest.approx(100 + 2 * 1000 + 100 + 300 + 100)
    assert last.output_bytes == 0
    assert last.checkpoint_bytes == pytest.approx(100)
    # full backward vs the zero-bubble split
    block_b, head_b = 2 * 3e-3, 2 * 3 * 5e-4  # backward_s = 2 x forward; forward = t (1 + 2b)
    assert last.backward_weight == 0 and last.backward_input == pytest.approx(2 * block_b + head_b)
    split = model.stage_costs(blocks=2, first=False, last=True, microbatch_size=1, split_backward=True)
    assert split.backward_input == pytest.approx(1.1 * (2 * 3e-3 + 1.5e-3))
    assert split.backward_weight == pytest.approx(2 * 3e-3 + 1.5e-3)
    # the first stage's input (tokens) needs no gradient: I is empty, W the full backward, nothing freed at I
    first_split = model.stage_costs(blocks=2, first=True, last=False, microbatch_size=1, split_backward=True)
    first_full = model.stage_costs(blocks=2, first=True, last=False, microbatch_size=1, split_backward=False)
    assert first_split.backward_input == 0
    assert first_split.backward_weight == pytest.approx(first_full.backward_input)
    assert first_split.weight_grad_bytes == pytest.approx(first_split.activation_bytes)


def test_link_fit() -> None:
    link = link_from_profile(make_profile())
    assert link.latency_s == pytest.approx(1e-4, rel=1e-3)
    assert link.bandwidth_bytes_per_s == pytest.approx((10**6 - 4) / 1e-3, rel=1e-6)


def test_predicted_step_adds_optimizer_after_each_rank() -> None:
    model = ProfileModel(make_profile())
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    pred = predict_step(model, sched, microbatch_size=2)
    ends = [max(r.end for r in acts) for acts in pred.trace.actions]
    assert pred.optimizer_s == pytest.approx((1e-4 + 2e-3, 2e-3 + 2e-4))
    assert pred.step_time == pytest.approx(max(e + o + 5e-5 for e, o in zip(ends, pred.optimizer_s)))
    zb = predict_step(model, build_schedule("zb-h1", num_ranks=2, num_microbatches=4), microbatch_size=2)
    assert zb.trace.schedule.name.startswith("zb")


def test_even_layout() -> None:
    assert even_layout(8, 2) == (4, 4)
    assert even_layout(7, 3) == (2, 3, 2)
    with pytest.raises(ProfileError):
        even_layout(2, 3)


def test_efficiency_points() -> None:
    pts = ProfileModel(make_profile()).efficiency([1, 2, 3, 4])
    assert [p.measured_flops_per_s is None for p in pts] == [False, False, True, False]
    assert pts[0].measured_flops_per_s == pytest.approx(1e6 / 3e-3)
    assert dataclasses.asdict(pts[2])["predicted_flops_per_s"] == pytest.approx(3e6 / 7e-3)


def _explain(model: ProfileModel, *, budget_bytes: float):  # type: ignore[no-untyped-def]
    """The one BPipe explanation over the profiled source: 4 devices, one replica, b <= 4, 16 sequences."""
    from evenpipe.cost import Recompute
    from evenpipe.plan import Searcher, SearchSpace, explain_bpipe
    space = SearchSpace(data_parallel=False, max_tp=1, sequence_parallel=False, recomputes=(Recompute.NONE,),
                        bpipe_schedules=(),  # BPipe as the paper runs it: on 1F1B
                        distributed_optimizer=False, max_microbatch_size=4)
    searcher = Searcher.over(ProfiledSource(model, memory_budget_gib=budget_bytes / 2**30))
    return explain_bpipe(searcher, num_gpus=4, global_batch=16, space=space)


def test_bpipe_pays_when_its_memory_buys_a_more_efficient_microbatch() -> None:
    from evenpipe.schedule import ScheduleFamily
    model = ProfileModel(make_profile(layers=8, fixed=40.0))  # a large per-micro-batch cost: big b is efficient

    def peak(name: str, b: int) -> float:
        cfg = ParallelConfig(schedule=ScheduleFamily.parse(name), pp=4, microbatch_size=b, global_batch=16)
        return max(estimate_with(ProfiledSource(model), cfg).peak_bytes)
    assert peak("bpipe", 4) < peak("1f1b", 4)
    budget = (peak("bpipe", 4) + peak("1f1b", 4)) / 2
    ans = _explain(model, budget_bytes=budget)
    assert ans.pays and ans.with_bpipe is not None and ans.without is not None
    assert ans.with_bpipe.config.microbatch_size > ans.without.config.microbatch_size
    assert ans.blocked is not None and ans.blocked.config.microbatch_size == 4
    assert "BPipe pays" in ans.text and "balanced memory fits b=4" in ans.text and "memory is the limit" in ans.text


def test_bpipe_answer_names_its_time_at_the_larger_microbatch_it_could_have_used() -> None:
    # memory no object: BPipe's fastest micro-batch is smaller than the other schedules', though the larger fits
    from evenpipe.schedule import ScheduleFamily
    model = ProfileModel(make_profile(layers=8))
    ans = _explain(model, budget_bytes=1e12)
    assert ans.with_bpipe is not None and ans.without is not None and not ans.pays
    b_bp, b_base = ans.with_bpipe.config.microbatch_size, ans.without.config.microbatch_size
    assert b_bp < b_base
    at_base = estimate_with(ProfiledSource(model), ParallelConfig(schedule=ScheduleFamily.BPIPE, pp=4,
                                                                  microbatch_size=b_base, global_batch=16))
    assert at_base.step_time_s > ans.with_bpipe.step_time_s
    assert f"its fastest is b={b_bp}; at b={b_base} it takes {at_base.step_time_s * 1e3:.1f} ms/step" in ans.text


def test_transfer_cpu_cost_round_trips_and_reaches_the_link() -> None:
    p = dataclasses.replace(make_profile(), transfer_cpu_s_per_byte=3e-10)
    back = Profile.from_json(p.to_json())
    assert back.transfer_cpu_s_per_byte == 3e-10
    assert link_from_profile(back).cpu_s_per_byte == 3e-10
    old = make_profile().to_dict()
    old.pop("transfer_cpu_s_per_byte")  # a profile written before it was measured: no charge
    assert link_from_profile(Profile.from_dict(old)).cpu_s_per_byte == 0.0
    bad = p.to_dict()
    bad["transfer_cpu_s_per_byte"] = -1
    with pytest.raises(ProfileError, match="damaged.*transfer_cpu_s_per_byte") as info:
        Profile.from_dict(bad)
    assert "\n" not in str(info.value)


def test_transfer_cpu_cost_lengthens_a_bpipe_prediction() -> None:
    # the evicted unit (saved bytes of the stage) is moved twice; charging its copies to both ends of each move
    # can only delay computes, and here it does
    sched = build_schedule("bpipe", num_ranks=2, num_microbatches=8)
    base = predict_step(ProfileModel(make_profile()), sched, microbatch_size=4)
    charged = predict_step(ProfileModel(dataclasses.replace(make_profile(), transfer_cpu_s_per_byte=1e-6)), sched,
                           microbatch_size=4)
    assert charged.step_time > base.step_time
    assert charged.peak_activation_bytes == base.peak_activation_bytes


def test_measured_hand_offs_reach_the_link() -> None:
    """The link takes the hand-off's mean for a message of the hand-off's size whose receive waits (bandwidth
    from the ping-pong) and the late-receive cost as measured; a hand-off faster than the ping-pong's latency leaves
    it; older profiles read as not measured."""
    p = make_profile()  # ping-pong: 1e-4 s latency, 1e9 B/s
    slow = dataclasses.replace(p, handoff_latency_s=2e-3, late_receive_s=1.5e-3, handoff_bytes=500_000)
    link = link_from_profile(slow)
    assert link.transfer_time(500_000) == pytest.approx(2e-3, rel=1e-6)
    assert link.late_receive_s == 1.5e-3
    assert link.bandwidth_bytes_per_s == link_from_profile(p).bandwidth_bytes_per_s
    fast = dataclasses.replace(p, handoff_latency_s=5e-5, handoff_bytes=500_000)
    assert link_from_profile(fast).latency_s == pytest.approx(1e-4, rel=1e-3)
    back = Profile.from_json(slow.to_json())
    assert (back.handoff_latency_s, back.late_receive_s, back.handoff_bytes) == (2e-3, 1.5e-3, 500_000)
    old = slow.to_dict()
    del old["handoff_latency_s"], old["late_receive_s"], old["handoff_bytes"]
    assert link_from_profile(Profile.from_dict(old)) == link_from_profile(p)


def test_hand_offs_slow_the_predicted_step_where_messages_are_on_its_path() -> None:
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    p = make_profile()
    base = predict_step(ProfileModel(p), sched, microbatch_size=1).step_time
    slow = dataclasses.replace(p, handoff_latency_s=5e-3, handoff_bytes=100)
    assert predict_step(ProfileModel(slow), sched, microbatch_size=1).step_time > base + 5e-3
    late = dataclasses.replace(p, late_receive_s=5e-3)
    assert predict_step(ProfileModel(late), sched, microbatch_size=1).step_time > base + 5e-3


@pytest.mark.parametrize("field", ["handoff_latency_s", "late_receive_s"])
def test_a_negative_hand_off_is_refused_in_one_line(field: str) -> None:
    doc = make_profile().to_dict()
    doc[field] = -1.0
    with pytest.raises(ProfileError, match=field) as info:
        Profile.from_dict(doc)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family, chunks", [("interleaved", 2), ("zb-v", None)])
def test_alternation_factors_scale_blocks_where_a_rank_holds_several_stages(family: str, chunks: int | None) -> None:
    """Blocks' forward and recompute take the forward factor, their backward parts the backward factor; the
    embedding and the head keep their times; one-stage-per-rank schedules are untouched."""
    p = make_profile(layers=8)
    alt = dataclasses.replace(p, alternation_forward=1.25, alternation_backward=1.5, alternation_blocks=2)
    sched = build_schedule(family, num_ranks=2, num_microbatches=4, num_chunks=chunks)
    plain, scaled = ProfileModel(p).sim_costs(sched, microbatch_size=2), ProfileModel(alt).sim_costs(sched,
                                                                                                   microbatch_size=2)
    m = ProfileModel(p)
    block, emb, head = (m.predict(k, 2) for k in (LayerKind.BLOCK, LayerKind.EMBEDDING, LayerKind.HEAD))
    counts = even_layout(8, sched.num_stages)
    split = family == "zb-v"
    for s, (a, b) in enumerate(zip(plain.stages, scaled.stages)):
        n = counts[s]
        ends_f = (emb.forward_s if s == 0 else 0.0) + (head.forward_s if s == sched.num_stages - 1 else 0.0)
        assert b.forward == pytest.approx(a.forward + 0.25 * n * block.forward_s)
        assert b.forward - ends_f == pytest.approx(1.25 * (a.forward - ends_f))
        assert b.recompute == pytest.approx(a.recompute + 0.25 * n * block.recompute_s)
        if split and s > 0:
            assert b.backward_input == pytest.approx(a.backward_input + 0.5 * n * block.backward_input_s)
            assert b.backward_weight == pytest.approx(a.backward_weight + 0.5 * n * block.backward_weight_s)
        elif not split:
            assert b.backward_input == pytest.approx(a.backward_input + 0.5 * n * block.backward_s)
        assert (b.activation_bytes, b.weight_grad_bytes, b.output_bytes) == \
            (a.activation_bytes, a.weight_grad_bytes, a.output_bytes)
    one = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    assert ProfileModel(alt).sim_costs(one, microbatch_size=2) == ProfileModel(p).sim_costs(one, microbatch_size=2)
    assert predict_step(ProfileModel(alt), sched, microbatch_size=2).step_time > \
        predict_step(ProfileModel(p), sched, microbatch_size=2).step_time


def test_alternation_round_trips_and_older_profiles_read_as_not_measured() -> None:
    p = dataclasses.replace(make_profile(), alternation_forward=1.04, alternation_backward=1.07, alternation_blocks=2)
    back = Profile.from_json(p.to_json())
    assert (back.alternation_forward, back.alternation_backward, back.alternation_blocks) == (1.04, 1.07, 2)
    old = p.to_dict()
    del old["alternation_forward"], old["alternation_backward"], old["alternation_blocks"]
    assert (Profile.from_dict(old).alternation_forward, Profile.from_dict(old).alternation_backward) == (1.0, 1.0)


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), "fast"])
def test_a_non_positive_alternation_factor_is_refused_in_one_line(value: object) -> None:
    doc = make_profile().to_dict()
    doc["alternation_backward"] = value
    with pytest.raises(ProfileError, match="alternation_backward") as info:
        Profile.from_dict(doc)
    assert "\n" not in str(info.value)
