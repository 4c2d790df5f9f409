"""One parallel configuration (tp, pp, dp, chunks, micro-batching, recomputation, schedule) and its checks.

Placement of GPUs is tensor-parallel first, then pipeline, then data parallel: global GPU index
``g = t + tp·(r + pp·d)`` for tensor rank t, pipeline rank r, data-parallel rank d. So a tensor-parallel group
shares a node whenever ``tp <= gpus_per_node``, and pipeline ranks r and r' share a node when
``(r·tp) // gpus_per_node == (r'·tp) // gpus_per_node``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from evenpipe.errors import ConfigError, parse_choice
from evenpipe.schedule.family import ScheduleFamily

from evenpipe.cost.hardware import Hardware
from evenpipe.cost.specs import ModelSpec

__all__ = ["Recompute", "Attention", "ParallelConfig", "check_config", "ScheduleFamily"]


class Recompute(enum.Enum):
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


class Attention(enum.Enum):
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
    """BPipe: activation units a rank may hold (own + hosted); None for the default ceil((p+1)/2)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "chunks", "microbatch_size", "global_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.bpipe_budget is not None and self.bpipe_budget < 1:
            raise ConfigError(f"bpipe_budget must be >= 1, got {self.bpipe_budget}")

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
                f"m={self.num_microbatches} {self.schedule.value} recompute={self.recompute.value} "
                f"attention={self.attention.value}" + (" sp" if self.sequence_parallel else "")
                + (" distopt" if self.distributed_optimizer else ""))


_INTERLEAVED_FAMILIES = ("interleaved", "looped-bfs")


def check_config(model: ModelSpec, hw: Hardware, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
    """Raise ConfigError (one line naming the value) when ``cfg`` cannot run ``model`` on ``hw``.

    Rules: tp divides the attention heads and the FFN size (KV heads are split when tp divides them and
    replicated when they divide tp); pp·chunks divides the layers (uneven partitions are not modelled);
    chunks > 1 only with an interleaved/looped schedule; dp·b divides the global batch; the GPU count equals
    tp·pp·dp; tp fits in a node; BPipe needs pp >= 2. The schedule generator adds its own rules (interleaved
    needs m % p == 0; a BPipe budget must be meetable) and raises ConfigError the same way.
    """
    if num_gpus is not None and num_gpus != cfg.num_gpus:
        raise ConfigError(f"--gpus {num_gpus} != tp·pp·dp = {cfg.tp}·{cfg.pp}·{cfg.dp} = {cfg.num_gpus}")
    if model.num_heads % cfg.tp:
        raise ConfigError(f"tp {cfg.tp} does not divide the {model.num_heads} attention heads of {model.name}")
    if model.num_kv_heads % cfg.tp and cfg.tp % model.num_kv_heads:
        raise ConfigError(f"tp {cfg.tp} and the {model.num_kv_heads} KV heads of {model.name} do not divide "
                          f"one another")
    if model.ffn_hidden % cfg.tp:
        raise ConfigError(f"tp {cfg.tp} does not divide ffn_hidden {model.ffn_hidden}")
    if cfg.tp > hw.gpus_per_node:
        raise ConfigError(f"tp {cfg.tp} exceeds the {hw.gpus_per_node} GPUs of one {hw.name} node")
    if cfg.chunks > 1 and cfg.schedule.value not in _INTERLEAVED_FAMILIES:
        raise ConfigError(f"chunks {cfg.chunks} needs schedule interleaved or looped-bfs, "
                          f"not {cfg.schedule.value}")
    if model.num_layers % cfg.num_stages:
        raise ConfigError(f"pp·chunks = {cfg.pp}·{cfg.chunks} = {cfg.num_stages} does not divide the "
                          f"{model.num_layers} layers of {model.name} (uneven stages are not modelled)")
    if cfg.global_batch % (cfg.dp * cfg.microbatch_size):
        raise ConfigError(f"global batch {cfg.global_batch} is not divisible by dp·microbatch_size = "
                          f"{cfg.dp}·{cfg.microbatch_size} = {cfg.dp * cfg.microbatch_size}")
    if cfg.schedule.value == "bpipe" and cfg.pp < 2:
        raise ConfigError(f"schedule bpipe needs pp >= 2, got pp {cfg.pp}")
