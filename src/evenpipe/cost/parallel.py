"""One parallel configuration (tp, pp, dp, chunks, micro-batching, recomputation, schedule) and its checks.

Placement of GPUs is tensor-parallel first, then pipeline, then data parallel: global GPU index
``g = t + tp·(r + pp·d)`` for tensor rank t, pipeline rank r, data-parallel rank d. So a tensor-parallel group
shares a node since tp divides ``gpus_per_node``, and pipeline ranks r and r' share a node when
``(r·tp) // gpus_per_node == (r'·tp) // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from evenpipe.errors import ConfigError, parse_choice
from evenpipe.schedule.family import ScheduleFamily, Transform
from evenpipe.schedule.memo import KeyEnum

from evenpipe.cost.hardware import Hardware
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.cost.specs import ModelSpec

__all__ = ["Recompute", "Attention", "ParallelConfig", "check_config", "check_pipeline", "check_tensor_parallel", "ScheduleFamily", "check_layout",
           "end_lighter_layout", "balanced_layout", "stage_layers", "layers_per_rank", "split_bpipe", "join_bpipe", "candidate_layouts", "describe_layout"]


class Recompute(KeyEnum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    """Keep every activation the backward needs."""
    SELECTIVE = "selective"
    """Recompute only the attention core (scores, softmax, dropout); keeps the GEMM inputs."""
    FULL = "full"
    """Keep only each layer's input; re-run the whole forward of a stage before its backward."""

    @classmethod
    def parse(cls, name: "str | Recompute") -> "Recompute":
        return parse_choice(cls, name, "recompute mode")


class Attention(KeyEnum):
    """Attention kernel: the one enum of the cost model, the planner and the torch models."""

    EAGER = "eager"
    """Materialises the a·s² score matrix (softmax output and dropout mask are saved for backward)."""
    FLASH = "flash"
    """Fused kernel (Dao et al. 2022): scores are never stored; recomputed blockwise in the backward. The torch
    models run it as ``scaled_dot_product_attention(is_causal=True)`` (``"sdpa"`` is accepted as its name)."""

    @classmethod
    def parse(cls, name: "str | Attention") -> "Attention":
        if isinstance(name, str) and name.lower() == "sdpa":
            return cls.FLASH
        return parse_choice(cls, name, "attention kernel")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """How one training step is split over GPUs."""

    tp: int = 1
    """Tensor-parallel size (t)."""
    pp: int = 1
    """Pipeline-parallel size (p): ranks per pipeline."""
    dp: int = 1
    """Data-parallel size (d): pipeline replicas."""
    chunks: int = 1
    """Stages per pipeline rank (v); > 1 only for interleaved schedules."""
    microbatch_size: int = 1
    """Sequences per micro-batch (b)."""
    global_batch: int
    """Sequences per optimizer step (B), over all replicas."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation mode."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropouts split over tp; collectives become AG/RS."""
    attention: Attention = Attention.FLASH
    """Attention kernel."""
    schedule: ScheduleFamily = ScheduleFamily.ONE_F_ONE_B
    """Pipeline schedule family."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam moments over dp (Megatron's distributed optimizer)."""
    bpipe_budget: int | None = None
    """BPipe: activation units a rank may hold (own + hosted); None for the lowest balanced peak the pairing allows
    (``ceil((p+1)/2)`` for 1F1B)."""
    bpipe: bool = False
    """Apply BPipe's evict/load transform to ``schedule`` (``--bpipe``; schedule ``bpipe`` is 1F1B with it)."""
    offload_ranks: int = 0
    """Host offload: the first this many pipeline ranks copy every micro-batch's saved activations to host memory
    after its forward and back before its backward (0: none; the first ranks hold the most in flight)."""
    layout: tuple[int, ...] | None = None
    """Transformer layers of each stage in pipeline order (one entry per virtual chunk), e.g. Llama 3 405B's
    (7, 8, ..., 8, 7); ``None`` is :func:`stage_layers`' default (even, or lighter end stages)."""
    microbatch_shapes: tuple[MicrobatchShape, ...] | None = None
    """Each micro-batch's shape in the order one replica runs them (documents of varying length, issue 34):
    ``num_microbatches`` of them, each of ``microbatch_size`` rows; ``None``: every micro-batch full rows."""

    def __post_init__(self) -> None:
        if self.layout is not None:
            if not isinstance(self.layout, tuple) or len(self.layout) != self.pp * self.chunks:
                raise ConfigError(f"layout {list(self.layout)} needs one entry per stage: pp·chunks = "
                                  f"{self.pp}·{self.chunks} = {self.pp * self.chunks}")
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.layout):
                raise ConfigError(f"layout {list(self.layout)}: every stage needs at least 1 layer")
        for name in ("tp", "pp", "dp", "chunks", "microbatch_size", "global_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.offload_ranks, int) or not 0 <= self.offload_ranks <= self.pp:
            raise ConfigError(f"offload_ranks must be between 0 and pp = {self.pp}, got {self.offload_ranks!r}")
        if self.bpipe_budget is not None and self.bpipe_budget < 1:
            raise ConfigError(f"bpipe_budget must be >= 1, got {self.bpipe_budget}")
        shapes = self.microbatch_shapes
        if shapes is not None and (len(shapes) != self.num_microbatches
                                   or any(sh.size != self.microbatch_size for sh in shapes)):
            raise ConfigError(f"microbatch_shapes: need {self.num_microbatches} shapes (one per micro-batch) of "
                              f"{self.microbatch_size} rows each, got {len(shapes)} of sizes "
                              f"{sorted({sh.size for sh in shapes})}")

    @property
    def uses_bpipe(self) -> bool:
        """Whether ranks evict activations to their BPipe partners (``--bpipe``, or schedule ``bpipe``)."""
        return self.bpipe or split_bpipe(self.schedule)[1]

    @property
    def schedule_name(self) -> str:
        """The schedule as the command line names it: ``interleaved+bpipe`` with the transform."""
        return f"{self.schedule.value}+bpipe" if self.bpipe else self.schedule.value

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica per step (m = B / (d·b))."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        """Pipeline stages (p·v)."""
        return self.pp * self.chunks

    def describe(self) -> str:
        """A one-line summary such as ``tp=8 pp=8 dp=16 v=1 b=1 m=96 1f1b recompute=full``."""
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} v={self.chunks} b={self.microbatch_size} "
                f"m={self.num_microbatches} {self.schedule_name} recompute={self.recompute.value} "
                f"attention={self.attention.value}" + (" sp" if self.sequence_parallel else "")
                + (" distopt" if self.distributed_optimizer else "")
                + (f" offload={self.offload_ranks}" if self.offload_ranks else "")
                + (f" layout={describe_layout(self.layout)}" if self.layout is not None else ""))


def split_bpipe(family: ScheduleFamily) -> tuple[ScheduleFamily, bool]:
    """The family a schedule name orders its computes by, and whether the name carries BPipe's evict/load
    transform: ``bpipe`` is 1F1B with it. The one place that reads a family name as family plus transform."""
    return (ScheduleFamily.ONE_F_ONE_B, True) if family is ScheduleFamily.BPIPE else (family, False)


def join_bpipe(family: ScheduleFamily) -> ScheduleFamily | None:
    """The schedule name of ``family`` with BPipe's transform when one exists (``bpipe`` for 1F1B), else None
    (the inverse of :func:`split_bpipe`)."""
    named = ScheduleFamily.BPIPE
    return named if split_bpipe(named)[0] is family else None


def check_layout(num_layers: int, num_stages: int, layout: "tuple[int, ...] | list[int]") -> None:
    """One-line ConfigError unless ``layout`` has one positive entry per stage summing to ``num_layers``."""
    counts = list(layout)
    if len(counts) != num_stages:
        raise ConfigError(f"layout {counts} has {len(counts)} entries but there are {num_stages} stages "
                          "(one entry per stage, per virtual chunk when interleaved)")
    bad = [c for c in counts if not isinstance(c, int) or isinstance(c, bool) or c < 1]
    if bad:
        raise ConfigError(f"layout {counts} has a stage with {bad[0]!r} layers; every stage needs at least 1")
    if sum(counts) != num_layers:
        verb = "drops" if sum(counts) < num_layers else "duplicates"
        raise ConfigError(f"layout {counts} places {sum(counts)} layers but the model has {num_layers} "
                          f"(it {verb} {abs(sum(counts) - num_layers)}); the entries must sum to {num_layers}")


def _spread(base: int, extra: int, num_stages: int) -> list[int]:
    """``base`` layers a stage, the ``extra`` ones on the middle stages first (stage 1, 2, ..., then the ends)."""
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    for s in order[:extra]:
        counts[s] += 1
    return counts


def end_lighter_layout(num_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The Megatron / Llama 3 split: the embedding and the head each take one layer's place on the first and
    the last stage (Llama 3 405B: 126 layers on 16 stages as 7, 8 x 14, 7; Dubey et al. 2024, section 3.3.2;
    Megatron-LM's ``--decoder-first/last-pipeline-num-layers``). ``None`` when a stage would be left empty."""
    if num_stages < 2:
        return None
    counts = _spread(*divmod(num_layers + 2, num_stages), num_stages)
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts) if min(counts) >= 1 else None


def balanced_layout(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """As even as possible, the extra layers on the middle stages (ConfigError for more stages than layers)."""
    if num_stages > num_layers:
        raise ConfigError(f"{num_stages} stages need at least {num_stages} layers, the model has {num_layers}")
    return tuple(_spread(*divmod(num_layers, num_stages), num_stages))


def layers_per_rank(stage_layers: Sequence[int], stage_to_rank: Sequence[int], num_ranks: int) -> list[int]:
    """Layers each of ``num_ranks`` ranks holds, given each stage's layers and rank."""
    out = [0] * num_ranks
    for n, r in zip(stage_layers, stage_to_rank):
        out[r] += n
    return out


def stage_layers(model: ModelSpec, cfg: "ParallelConfig") -> tuple[int, ...]:
    """Layers of each stage: ``cfg.layout`` when given; else an even split when the layers divide, else the
    end-lighter split (:func:`end_lighter_layout`), else :func:`balanced_layout`."""
    if cfg.layout is not None:
        return cfg.layout
    num_layers, num_stages = model.num_layers, cfg.num_stages
    if num_layers % num_stages == 0:
        return (num_layers // num_stages,) * num_stages
    return end_lighter_layout(num_layers, num_stages) or balanced_layout(num_layers, num_stages)


def candidate_layouts(num_layers: int, num_stages: int) -> tuple[tuple[int, ...] | None, ...]:
    """The layouts the planner tries: the default (``None``), plus the end-lighter split when the layers divide
    evenly and it differs from the even one (it may be faster: the end stages also run embedding and head)."""
    if num_layers % num_stages:
        return (None,)
    lighter = end_lighter_layout(num_layers, num_stages)
    even = (num_layers // num_stages,) * num_stages
    return (None,) if lighter is None or lighter == even else (None, lighter)


def describe_layout(layout: "tuple[int, ...] | None") -> str:
    """``7,8x14,7``-style compact text (``even`` for ``None``)."""
    if layout is None:
        return "even"
    runs: list[tuple[int, int]] = []
    for n in layout:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return ",".join(f"{n}x{k}" if k > 2 else ",".join([str(n)] * k) for n, k in runs)


def check_config(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
    """Raise ConfigError (one line naming the value) when ``cfg`` cannot run ``model`` on ``hw``.

    Rules: tp divides the attention heads and the FFN size (KV heads are split when tp divides them and
    replicated when they divide tp); every stage holds at least one layer;
    chunks as the schedule family allows (its traits); M as the family allows; dp·b divides the global batch; the
    GPU count equals tp·pp·dp; tp divides the GPUs of a node (a tensor-parallel group never straddles two); BPipe needs pp >= 2 and a family it applies to. Uneven stages: the layout (given, or
    :func:`stage_layers`' default) must place every layer exactly once. The schedule generator adds its own rules (interleaved
    needs m % p == 0; a BPipe budget must be meetable) and raises ConfigError the same way.
    """
    if num_gpus is not None and num_gpus != cfg.num_gpus:
        raise ConfigError(f"--gpus {num_gpus} != tp·pp·dp = {cfg.tp}·{cfg.pp}·{cfg.dp} = {cfg.num_gpus}")
    check_tensor_parallel(model, cfg)
    if hw.gpus_per_node % cfg.tp:
        allowed = ", ".join(str(t) for t in range(1, hw.gpus_per_node + 1) if hw.gpus_per_node % t == 0)
        raise ConfigError(f"tp {cfg.tp} does not divide the {hw.gpus_per_node} GPUs of one {hw.name} node "
                          f"(--gpus-per-node {hw.gpus_per_node}): a tensor-parallel group must sit inside one node; "
                          f"allowed: {allowed}")
    check_pipeline(model, cfg)


def check_tensor_parallel(model: ModelSpec, cfg: ParallelConfig) -> None:
    """The tensor-parallel rules of :func:`check_config`: tp divides the attention heads and the FFN size, and KV
    heads and tp divide one another."""
    if model.num_heads % cfg.tp:
        raise ConfigError(f"tp {cfg.tp} does not divide the {model.num_heads} attention heads of {model.name}")
    if model.num_kv_heads % cfg.tp and cfg.tp % model.num_kv_heads:
        raise ConfigError(f"tp {cfg.tp} and the {model.num_kv_heads} KV heads of {model.name} do not divide "
                          f"one another")
    if model.ffn_hidden % cfg.tp:
        raise ConfigError(f"tp {cfg.tp} does not divide ffn_hidden {model.ffn_hidden}")


def check_pipeline(model: ModelSpec, cfg: ParallelConfig) -> None:
    """The device-independent rules of :func:`check_config`: chunks and micro-batches as the schedule family
    allows, enough layers for the stages, the layout, the batch split and BPipe's needs."""
    traits = cfg.schedule.traits
    if not traits.chunks.allows(cfg.chunks):
        raise ConfigError(f"chunks {cfg.chunks} is not allowed for schedule {cfg.schedule.value}: it takes "
                          f"{traits.chunks.value} (interleaved and looped-bfs let you choose)")
    why = traits.microbatch_error(cfg.pp, cfg.num_microbatches, cfg.chunks)
    if why is not None:
        raise ConfigError(f"schedule {cfg.schedule.value} {why}")
    if cfg.num_stages > model.num_layers:
        raise ConfigError(f"pp·chunks = {cfg.pp}·{cfg.chunks} = {cfg.num_stages} stages need at least as many "
                          f"layers; {model.name} has {model.num_layers}")
    check_layout(model.num_layers, cfg.num_stages, stage_layers(model, cfg))
    if cfg.global_batch % (cfg.dp * cfg.microbatch_size):
        raise ConfigError(f"global batch {cfg.global_batch} is not divisible by dp·microbatch_size = "
                          f"{cfg.dp}·{cfg.microbatch_size} = {cfg.dp * cfg.microbatch_size}")
    if cfg.uses_bpipe and cfg.pp < 2:
        raise ConfigError(f"bpipe needs pp >= 2, got pp {cfg.pp}")
    if cfg.bpipe and Transform.BPIPE not in traits.transforms:
        allowed = ", ".join(f.value for f in ScheduleFamily if Transform.BPIPE in f.traits.transforms)
        raise ConfigError(f"bpipe does not apply to schedule {cfg.schedule.value} (its stages hand activations "
                          f"over on the same rank); allowed: {allowed}")
