"""Time of one layer, one stage, the collectives and the links, from FLOPs, bytes and an :class:`Efficiency`.

Compute model (per layer, per micro-batch, per tensor-parallel rank):
- weight GEMMs run at ``peak · gemm_efficiency(m, n, k)``, a saturating function of the three GEMM dimensions
  (small GEMMs cannot fill the tensor cores: Narayanan et al. 2021, Fig. 10/17; NVIDIA's "Matrix Multiplication
  Background" guide);
- the attention core runs at ``peak · flash_fraction`` on the causal half of the s×s work (FlashAttention-2
  reaches 50-73% of A100 peak, Dao 2023) or, eager (full s×s, as Megatron-LM 2021 computes it), as batched
  GEMMs of shape (s×d)·(d×s) at ``gemm_efficiency`` plus the memory traffic of the materialised score matrix (mask, softmax, dropout) at ``hbm_fraction`` of HBM bandwidth;
- element-wise work (norms, activation function, bias-dropout-residual) is HBM traffic at ``hbm_fraction``;
- backward: input gradient = one forward of the GEMMs, weight gradient = another (so the full backward is 2×),
  attention core backward 2× (eager) or 2.5× (flash: it recomputes scores);
- tensor parallelism: 2 all-reduces of the s·b·h activation per layer in forward and 2 in backward (or the same
  volume as all-gather + reduce-scatter with sequence parallelism), ring algorithm over NVLink at
  ``nvlink_fraction``, not overlapped with compute (Megatron-LM 2021);
- full recomputation re-runs the forward (with its all-reduces) before the backward.
Links: pipeline messages go over NVLink when both ranks share a node (tensor-parallel-first placement) and over
the inter-node network otherwise, at ``p2p_fraction`` of the bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evenpipe.errors import ConfigError
from evenpipe.schedule.build import plan_durations_for
from evenpipe.schedule.memo import Memo
from evenpipe.sim.costs import Link, SimCosts, StageCosts

from evenpipe.cost.flops import attention_core_flops, head_gemm, layer_gemms, Gemm
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.activations import activation_bytes
from evenpipe.cost.parallel import Attention, ParallelConfig, Recompute, stage_layers
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.specs import Arch, ModelSpec

__all__ = ["Efficiency", "LayerTimes", "layer_times", "stage_sim_costs", "cost_plan_durations", "plan_durations_of", "pipeline_link", "allreduce_time",
           "gemm_efficiency", "same_node", "dp_allreduce_time", "optimizer_step_time"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Efficiency:
    """Achieved fractions of hardware peaks. Defaults were fitted to Narayanan et al. 2021, Table 1 (A100,
    ``benchmarks/fit_megatron.py``); the rest are fixed from the cited measurements."""

    gemm_peak_fraction: float = 0.6812
    """Fraction of dense peak a large GEMM reaches (fitted; cuBLAS half-precision GEMMs on A100 reach 70-85%
    in isolation, less inside a training step)."""
    gemm_size_scale: float = 32.39
    """Dimension scale of the saturation: eff = peak_fraction / (1 + scale·(1/m + 1/n + 1/k)) (fitted)."""
    flash_fraction: float = 0.55
    """Fraction of peak of causal FlashAttention forward/backward kernels on the FLOPs they execute (Dao 2023:
    FlashAttention-2 forward 50-73%, backward 40-63% of A100 peak; not fitted: the 2021 runs used eager)."""
    hbm_fraction: float = 1.0
    """Fraction of HBM bandwidth reached by element-wise kernels (fitted; it reaches the bound 1.0, so our
    element-wise and softmax traffic is probably over-counted by 10-20% against Megatron's fused kernels)."""
    nvlink_fraction: float = 0.7718
    """Achieved share of NVLink bandwidth by tensor-parallel collectives (fitted; nccl-tests all-reduce busbw on
    8 A100s is ~230 of 300 GB/s for large messages, i.e. 0.77)."""
    network_fraction: float = 1.0
    """Achieved share of inter-node bandwidth for collectives and point-to-point messages (fitted, at its
    bound: the data-parallel reduction hides more than our overlap model lets it)."""
    dp_overlap: bool = True
    """Overlap the gradient reduction with the backward of each rank's last micro-batch (Megatron's
    ``overlap_grad_reduce``: buckets are reduced as their gradients become final)."""

    def __post_init__(self) -> None:
        for name in ("gemm_peak_fraction", "flash_fraction", "hbm_fraction", "nvlink_fraction",
                     "network_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.gemm_size_scale < 0:
            raise ConfigError(f"efficiency gemm_size_scale must be >= 0, got {self.gemm_size_scale}")


def gemm_efficiency(gemm: Gemm, eff: Efficiency) -> float:
    """Fraction of peak one GEMM reaches: saturating in each of its dimensions."""
    scale = eff.gemm_size_scale
    return eff.gemm_peak_fraction / (1.0 + scale * (1.0 / gemm.m + 1.0 / gemm.n + 1.0 / gemm.k))


def _gemm_time(gemm: Gemm, hw: Hardware, eff: Efficiency) -> float:
    return gemm.flops / (hw.peak_tflops * 1e12 * gemm_efficiency(gemm, eff))


def same_node(rank_a: int, rank_b: int, cfg: ParallelConfig, hw: Hardware) -> bool:
    """Whether pipeline ranks a and b of one replica share a node (tensor-parallel-first placement)."""
    return (rank_a * cfg.tp) // hw.gpus_per_node == (rank_b * cfg.tp) // hw.gpus_per_node


def allreduce_time(num_bytes: float, group: int, *, bandwidth_gbps: float, latency_s: float) -> float:
    """Ring all-reduce of ``num_bytes`` per rank over ``group`` ranks (2·(g-1)/g of the bytes cross each link)."""
    if group <= 1:
        return 0.0
    return 2.0 * (group - 1) / group * num_bytes / (bandwidth_gbps * 1e9) + 2.0 * (group - 1) * latency_s


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTimes:
    """Seconds of one layer for one micro-batch on one tensor-parallel rank."""

    forward_compute: float
    """Forward GEMMs, attention and element-wise work."""
    backward_input_compute: float
    """Input-gradient GEMMs, attention backward and element-wise backward."""
    backward_weight_compute: float
    """Weight-gradient GEMMs."""
    tp_forward: float
    """Tensor-parallel collectives of the forward."""
    tp_backward: float
    """Tensor-parallel collectives of the backward."""
    selective_recompute: float
    """Attention-core forward re-run inside the backward under selective recomputation."""
    recompute_forward: float | None = None
    """A forward re-run under full recomputation, when it differs from ``forward`` (measured); None: ``forward``."""

    @property
    def forward(self) -> float:
        return self.forward_compute + self.tp_forward

    @property
    def recompute(self) -> float:
        """Seconds of one layer's recomputed forward."""
        return self.forward if self.recompute_forward is None else self.recompute_forward

    @property
    def backward_input(self) -> float:
        return self.backward_input_compute + self.tp_backward + self.selective_recompute


def layer_times(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, eff: Efficiency,
                shape: MicrobatchShape | None = None) -> LayerTimes:
    """Per-layer durations (see the module docstring) of one micro-batch of ``shape`` (default: ``b`` full rows
    of ``seq_len``). Documents of varying length: the matrices and element-wise work take its tokens, attention
    its squared lengths, and an eager score GEMM runs at the efficiency of the length-weighted mean document."""
    s, b, h, t = model.seq_len, cfg.microbatch_size, model.hidden, cfg.tp
    tokens, squares = (s * b, s * s * b) if shape is None or shape.padded else (shape.num_tokens, shape.sum_squares)
    sbh = float(tokens * h)
    hbm = hw.hbm_bandwidth_gbps * 1e9 * eff.hbm_fraction
    gemms = layer_gemms(model, tp=t, microbatch_size=b, tokens=tokens)
    gemm_fwd = sum(_gemm_time(g, hw, eff) for g in gemms)
    core_flops = attention_core_flops(model, tp=t, microbatch_size=b,
                                      squares=None if shape is None or shape.padded else squares)
    heads_per_rank = model.num_heads // t
    if cfg.attention is Attention.FLASH:
        # causal kernels skip the blocks above the diagonal: half of the full s×s work is executed
        attn_fwd = 0.5 * core_flops / (hw.peak_tflops * 1e12 * eff.flash_fraction)
        attn_bwd = 2.5 * attn_fwd
    else:
        if shape is None or shape.padded:
            score = Gemm(m=s, n=s, k=model.head_dim, count=2 * b * heads_per_rank)
            gemm_part = score.flops / (hw.peak_tflops * 1e12 * gemm_efficiency(score, eff))
        else:  # per document: its n x n scores; efficiency of the length-weighted mean document
            mean_len = max(1, round(squares / tokens))
            typical = Gemm(m=mean_len, n=mean_len, k=model.head_dim)
            flops = 2.0 * squares * model.head_dim * 2 * heads_per_rank
            gemm_part = flops / (hw.peak_tflops * 1e12 * gemm_efficiency(typical, eff))
        # Fused scale-mask-softmax reads and writes the a·s²·b/t scores (2 + 2 bytes each); dropout reads 2, writes
        # 2 and a 1-byte mask. Backward: softmax reads output and gradient, writes the gradient (6); dropout 5.
        elements = float(heads_per_rank * squares)
        fwd_bytes, bwd_bytes = (9.0, 11.0) if model.arch is Arch.GPT else (4.0, 6.0)
        attn_fwd = gemm_part + fwd_bytes * elements / hbm
        attn_bwd = 2.0 * gemm_part + bwd_bytes * elements / hbm
    sp_div = t if cfg.sequence_parallel else 1
    # Element-wise traffic: two norms (read+write 4·sbh each) and two residual adds/dropouts (~7·sbh each) on the
    # replicated (or sequence-split) stream, activation function on the f-wide split stream.
    act_passes = 8.0 if model.arch is Arch.LLAMA else 4.0  # SwiGLU reads two f-wide inputs and writes one
    elementwise = (22.0 * sbh / sp_div + act_passes * tokens * model.ffn_hidden / t) / hbm
    fwd_compute = gemm_fwd + attn_fwd + elementwise
    bwd_input = gemm_fwd + attn_bwd + 2.0 * elementwise
    bwd_weight = gemm_fwd
    tp_bytes = 2.0 * sbh
    tp_one = allreduce_time(tp_bytes, t, bandwidth_gbps=hw.nvlink_gbps * eff.nvlink_fraction,
                            latency_s=hw.nvlink_latency_s)
    selective = attn_fwd if cfg.recompute is Recompute.SELECTIVE else 0.0
    return LayerTimes(forward_compute=fwd_compute, backward_input_compute=bwd_input,
                      backward_weight_compute=bwd_weight, tp_forward=2.0 * tp_one, tp_backward=2.0 * tp_one,
                      selective_recompute=selective)


def _head_times(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, eff: Efficiency,
                shape: MicrobatchShape | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the output layer and loss on the last stage, one micro-batch."""
    g = head_gemm(model, tp=cfg.tp, microbatch_size=cfg.microbatch_size,
                  tokens=None if shape is None or shape.padded else shape.num_tokens)
    fwd = _gemm_time(g, hw, eff)
    logits_bytes = 4.0 * g.m * g.n  # fp32 softmax cross-entropy: read + write
    hbm = hw.hbm_bandwidth_gbps * 1e9 * eff.hbm_fraction
    return fwd + 2.0 * logits_bytes / hbm, 2.0 * fwd + 2.0 * logits_bytes / hbm


def pipeline_link(rank_a: int, rank_b: int, cfg: ParallelConfig, hw: Hardware, eff: Efficiency) -> Link:
    """The link between two pipeline ranks of one replica (each tensor rank sends its 1/t share in parallel)."""
    if same_node(rank_a, rank_b, cfg, hw):
        return Link(latency_s=hw.nvlink_latency_s, bandwidth_bytes_per_s=hw.nvlink_gbps * 1e9 * eff.nvlink_fraction)
    return Link(latency_s=hw.internode_latency_s,
                bandwidth_bytes_per_s=hw.internode_gbps * 1e9 * eff.network_fraction)


def _bpipe_partner(rank: int, p: int) -> int | None:
    partner = p - 1 - rank
    return None if partner == rank else partner


_SIM_COSTS_LIMIT = 1 << 14
"""Stage costs remembered before the cache starts over (a planner search asks for a few thousand)."""
_sim_costs: Memo[SimCosts] = Memo(_SIM_COSTS_LIMIT)


def stage_sim_costs(model: ModelSpec, hw: Hardware, cfg: ParallelConfig,
                    efficiency: Efficiency | None = None, shape: MicrobatchShape | None = None) -> SimCosts:
    """Per-stage durations and bytes (one tensor-parallel rank's share) and the links, for the simulator, of one
    micro-batch of ``shape`` (default: ``b`` full rows of ``seq_len``).

    Remembered on the fields they depend on (configurations differing in data parallelism, the optimizer's
    sharding or the schedule's order share one)."""
    eff = efficiency or Efficiency()
    shape = None if shape is None or shape.padded else shape
    key = (model, hw, eff, cfg.pp, cfg.chunks, cfg.layout, cfg.microbatch_size, cfg.tp, cfg.sequence_parallel,
           cfg.attention, cfg.recompute, cfg.uses_bpipe, cfg.offload_ranks, shape)
    return _sim_costs.get(key, lambda: _stage_sim_costs(model, hw, cfg, eff, shape))


def _stage_sim_costs(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, eff: Efficiency,
                     shape: MicrobatchShape | None) -> SimCosts:
    num_stages = cfg.pp * cfg.chunks
    layers_of = stage_layers(model, cfg)
    lt = layer_times(model, hw, cfg, eff, shape)
    act = activation_bytes(model, cfg, shape)
    head_fwd, head_bwd = _head_times(model, hw, cfg, eff, shape)
    recompute_on = cfg.recompute is Recompute.FULL
    output_bytes = 2.0 * model.seq_len * cfg.microbatch_size * model.hidden / cfg.tp if shape is None else \
        2.0 * shape.num_tokens * model.hidden / cfg.tp
    stages = []
    made: dict[tuple[float | None, ...], StageCosts] = {}  # equal stages share one object (built and checked once)
    for s in range(num_stages):
        layers = layers_of[s]
        extra_f = head_fwd if s == num_stages - 1 else 0.0
        extra_b = head_bwd if s == num_stages - 1 else 0.0
        extra_bytes = (act.embedding if s == 0 else 0.0) + (act.head if s == num_stages - 1 else 0.0)
        fwd = layers * lt.forward + extra_f
        saved = layers * act.layer_saved + extra_bytes
        fields = (fwd, layers * lt.backward_input + extra_b, layers * lt.backward_weight_compute,
                  layers * lt.forward if recompute_on else None, (saved + act.layer_full) if recompute_on else saved,
                  saved if recompute_on else 0.0, layers * act.layer_weight_grad)
        stage = made.get(fields)
        if stage is None:
            stage = made[fields] = StageCosts(
                forward=fields[0], backward_input=fields[1], backward_weight=fields[2], recompute=fields[3],
                activation_bytes=fields[4], checkpoint_bytes=fields[5], weight_grad_bytes=fields[6],
                output_bytes=output_bytes)
        stages.append(stage)
    links: dict[tuple[int, int], Link] = {}
    p = cfg.pp
    pairs = {(r, (r + 1) % p) for r in range(p)}
    if cfg.uses_bpipe:  # the transform pairs x with p-1-x wherever it evicts (profiles falling with the rank)
        pairs |= {(r, q) for r in range(p) if (q := _bpipe_partner(r, p)) is not None}
    by_node: dict[bool, Link] = {}  # a pair's link depends only on whether it shares a node
    for a, b in pairs:
        if a != b:
            near = same_node(a, b, cfg, hw)
            link = by_node.get(near)
            if link is None:
                link = by_node[near] = pipeline_link(a, b, cfg, hw, eff)
            links[(a, b)] = links[(b, a)] = link
    host = Link(latency_s=hw.host_latency_s, bandwidth_bytes_per_s=hw.host_gbps * 1e9)
    links.update({(r, r): host for r in range(cfg.offload_ranks)})  # OFFLOAD/RELOAD: the rank's PCIe link
    default = pipeline_link(0, p - 1, cfg, hw, eff) if p > 1 else Link()
    return SimCosts.from_stages(stages, default_link=default, links=links)


def cost_plan_durations(model: ModelSpec, hw: Hardware, cfg: ParallelConfig,
                        efficiency: Efficiency | None = None) -> tuple[int, int, int] | None:
    """The integer F, I, W durations a memory-capped family (zb-h2, v-half, v-min) plans its order with:
    the ratio of one layer's forward, input-gradient and weight-gradient times; ``None`` for the other families,
    whose order does not depend on durations."""
    if not cfg.schedule.traits.plans_with_durations:
        return None
    return plan_durations_of(layer_times(model, hw, cfg, efficiency or Efficiency()))


def plan_durations_of(lt: LayerTimes) -> tuple[int, int, int]:
    """One layer's F, I, W times as the smallest integer durations in their ratio."""
    f, i, w = plan_durations_for(lt.forward, lt.backward_input, lt.backward_weight_compute)
    common = math.gcd(f, i, w)  # (2, 2, 2) plans as (1, 1, 1): one cached schedule for both
    return (f // common, i // common, w // common)


def dp_allreduce_time(params_per_rank: float, cfg: ParallelConfig, hw: Hardware, eff: Efficiency) -> float:
    """Seconds to reduce one rank's fp32 gradients over data parallelism (ring all-reduce; with the distributed
    optimizer a reduce-scatter of fp32 gradients plus an all-gather of bf16 weights)."""
    d = cfg.dp
    if d <= 1:
        return 0.0
    within_node = cfg.num_gpus <= hw.gpus_per_node
    bw = (hw.nvlink_gbps * eff.nvlink_fraction) if within_node else (hw.internode_gbps * eff.network_fraction)
    lat = hw.nvlink_latency_s if within_node else hw.internode_latency_s
    if cfg.distributed_optimizer:
        volume = (d - 1) / d * params_per_rank * (4.0 + 2.0)
        return volume / (bw * 1e9) + 2.0 * (d - 1) * lat
    return allreduce_time(4.0 * params_per_rank, d, bandwidth_gbps=bw, latency_s=lat)


def optimizer_step_time(params_per_rank: float, cfg: ParallelConfig, hw: Hardware, eff: Efficiency) -> float:
    """Adam update: memory-bound, reads and writes the fp32 master weights, moments and gradient (about 32
    bytes per parameter) and writes the bf16 weights; sharded over dp with the distributed optimizer."""
    share = params_per_rank / (cfg.dp if cfg.distributed_optimizer else 1)
    return share * 34.0 / (hw.hbm_bandwidth_gbps * 1e9 * eff.hbm_fraction)
