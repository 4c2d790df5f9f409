"""The typed configuration of one ``evenpipe train`` job: one kw_only, slots, frozen record per concern.

``TrainConfig`` holds the slices (model, schedule, data, optimizer, checkpoint, runtime, output). Each slice checks
its own values in ``__post_init__``; ``TrainConfig`` checks what needs two slices (the batch splits into micro-
batches and replicas, the layout fits the model). The CLI builds it once; it crosses to the worker processes once,
as JSON (:meth:`TrainConfig.to_json` / :meth:`TrainConfig.from_json`), and every component receives only the slice
it needs. Strings (schedule names, backends, data sources) are parsed into enums here, at the edge.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from evenpipe.cost.parallel import Recompute
from evenpipe.cost.runtime_memory import StateSharding as Sharding  # one closed set for the runtime and the planner
from evenpipe.errors import ConfigError, parse_choice
from evenpipe.runtime.data import TokenSource as DataSource
from evenpipe.runtime.precision import TrainDtype
from evenpipe.schedule import ScheduleFamily
from evenpipe.schedule.rank_set import parse_rank_set

__all__ = [
    "Backend",
    "Sharding",
    "DataSource",
    "LrSchedule",
    "ModelOptions",
    "ScheduleOptions",
    "DataOptions",
    "OptimizerOptions",
    "CheckpointOptions",
    "RuntimeOptions",
    "OutputOptions",
    "TrainConfig",
    "Recompute",
    "parse_recompute",
    "parse_offload",
]


class Backend(enum.Enum):
    """torch.distributed backend."""

    GLOO = "gloo"
    """CPU (and CPU tensors on GPU hosts)."""
    NCCL = "nccl"
    """NVIDIA GPUs."""


def _at_least(name: str, value: Any, low: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ConfigError(f"--{name} must be >= {low:g}, got {value!r}")


def _finite_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--{name} must be a finite number > 0, got {value!r}")


def _coerce(obj: Any, name: str, value: Any) -> None:
    """Set a field of a frozen record during ``__post_init__`` (string -> enum, list -> tuple)."""
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelOptions:
    """Which model to build."""

    preset: str = "gpt-tiny"
    """Model preset name (see ``evenpipe.models.PRESETS``); unused with ``hf_config``."""
    hf_config: str | None = None
    """A Hugging Face ``config.json`` or a directory holding one (with or without safetensors weights)."""
    dtype: TrainDtype = TrainDtype.FLOAT32
    """Weights and activations; bfloat16 keeps fp32 master weights and optimizer state."""
    seq_len: int | None = None
    """Tokens per sequence; None keeps the preset's."""
    init_seed: int = 0
    """Seed of the parameter initialisation (each parameter's value depends only on it and its name)."""

    def __post_init__(self) -> None:
        _coerce(self, "dtype", TrainDtype.parse(self.dtype))
        if self.seq_len is not None:
            _at_least("seq-len", self.seq_len, 1)
        if self.hf_config is not None:
            from evenpipe.models.hf import require_transformers
            require_transformers()

    @property
    def name(self) -> str:
        """The preset name or the Hugging Face path."""
        return self.hf_config or self.preset

    def resolve(self) -> Any:
        """The model record: a :class:`evenpipe.models.ModelConfig` for a preset, the
        :class:`evenpipe.cost.ModelSpec` of a Hugging Face config (ConfigError for unknown names or bad files)."""
        if self.hf_config is not None:
            from evenpipe.cost.specs import from_hf_config
            spec = from_hf_config(self.hf_config, seq_len=self.seq_len)
            positions = spec.max_positions or spec.seq_len
            if self.seq_len is not None and self.seq_len > positions:
                raise ConfigError(f"--seq-len {self.seq_len} exceeds the {positions} positions of {self.hf_config}")
            return spec
        from evenpipe.models.config import model_config
        return model_config(self.preset, **({"seq_len": self.seq_len} if self.seq_len else {}))

    def build(self, device: Any) -> Any:
        """The :class:`evenpipe.models.adapter.PipelineModel` on ``device`` in ``dtype``."""
        if self.hf_config is not None:
            from evenpipe.models.hf import hf_model
            built = hf_model(self.hf_config, seed=self.init_seed)
        else:
            from evenpipe.models.adapter import reference_model
            built = reference_model(self.resolve(), seed=self.init_seed, source=self.preset)
        built.module.to(device=device, dtype=self.dtype.torch_dtype)
        return built


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleOptions:
    """The pipeline schedule and how the model is cut."""

    family: ScheduleFamily = ScheduleFamily.ONE_F_ONE_B
    """Schedule family (see :class:`ScheduleFamily`)."""
    num_ranks: int = 4
    """Pipeline ranks P (1 runs un-pipelined)."""
    num_chunks: int | None = None
    """Stages per rank V (interleaved, looped-bfs); None: the family's own (1, or 2 for the V-shaped ones)."""
    num_microbatches: int = 8
    """Micro-batches per step M."""
    recompute: tuple[Recompute, ...] = ()
    """Activation recomputation of each stage, in pipeline order (none, selective: the attention core, full:
    the whole stage). Given as one mode for every stage (a :class:`Recompute`, its name, or a bool: full or
    none), or one per stage (a sequence, or a comma-separated string); stored as one mode when every stage has
    it (so a resume may change the stage count), else one per stage."""
    free_outputs: bool = True
    """Free each stage output once sent."""
    bpipe: bool = False
    """Apply the BPipe transform to the family (``bpipe`` is 1F1B with it)."""
    bpipe_budget: int | None = None
    """BPipe: activation units of one stage a rank may hold (None: the lowest balanced peak)."""
    layout: tuple[int, ...] | None = None
    """Blocks per stage (per virtual chunk), in pipeline order; None balances by parameter count."""
    offload: tuple[int, ...] = ()
    """Pipeline ranks that copy each micro-batch's saved activations to host memory after its forward and back
    before its backward (``train --offload``: ``all``, or a list or ranges such as ``0,1`` or ``0-1``)."""
    link_latency: float | None = None
    """latency-aware: order for every message between pipeline ranks taking this long, in forwards of one rank's
    layers (``train --plan-link-latency``, e.g. 0.25); None: free links."""

    def __post_init__(self) -> None:
        _coerce(self, "family", ScheduleFamily.parse(self.family))
        if self.num_chunks is None:
            fam = self.family
            _coerce(self, "num_chunks", 1 if fam.has_chunks else fam.traits.chunks.chunks(None))
        for name, value in (("stages", self.num_ranks), ("chunks", self.num_chunks),
                            ("microbatches", self.num_microbatches)):
            _at_least(name, value, 1)
        if self.layout is not None:
            _coerce(self, "layout", tuple(self.layout))
        _coerce(self, "offload", parse_offload(self.offload, self.num_ranks))
        modes = parse_recompute(self.recompute, self.num_stages)
        _coerce(self, "recompute", modes[:1] if len(set(modes)) == 1 else modes)
        if self.num_ranks == 1 and self.family is ScheduleFamily.BPIPE:
            raise ConfigError("--schedule bpipe needs --stages >= 2 (ranks exchange activations in pairs)")
        if self.link_latency is not None:
            if not (self.link_latency >= 0 and math.isfinite(self.link_latency)):
                raise ConfigError(f"--plan-link-latency must be a finite number >= 0 (forwards), got "
                                  f"{self.link_latency}")
            if self.family is not ScheduleFamily.LATENCY_AWARE:
                warnings.warn(f"--plan-link-latency has no effect on schedule {self.family.value!r} (only "
                              "latency-aware orders for it)", stacklevel=3)
        self.build()  # the schedule's own checks (micro-batch counts, BPipe budget)

    @property
    def num_stages(self) -> int:
        """Stages in pipeline order, virtual chunks counted."""
        assert self.num_chunks is not None
        return self.num_ranks * self.num_chunks

    def stages_recomputing(self, mode: Recompute) -> frozenset[int]:
        """The stages whose recomputation is ``mode``."""
        modes = self.recompute * self.num_stages if len(self.recompute) == 1 else self.recompute
        return frozenset(s for s, r in enumerate(modes) if r is mode)

    def build(self) -> Any:
        """The validated :class:`evenpipe.schedule.Schedule` (``R`` actions on the fully recomputed stages)."""
        from evenpipe.schedule import LinkPlan, build_schedule
        plan = None
        if self.link_latency is not None and self.family is ScheduleFamily.LATENCY_AWARE:
            plan = LinkPlan.uniform(num_ranks=self.num_ranks, latency=self.link_latency)
        return build_schedule(self.family, num_ranks=self.num_ranks, num_microbatches=self.num_microbatches,
                              num_chunks=self.num_chunks, recompute=self.stages_recomputing(Recompute.FULL),
                              bpipe=self.bpipe, offload_ranks=frozenset(self.offload), link_plan=plan,
                              bpipe_budget=self.bpipe_budget if self.family is ScheduleFamily.BPIPE or self.bpipe
                              else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataOptions:
    """Training data and batch size."""

    source: DataSource = DataSource.CORPUS
    """Where tokens come from."""
    path: str | None = None
    """Corpus file (absolute path); None: the shipped corpus."""
    seed: int = 0
    """Seed of the batch order."""
    global_batch: int = 16
    """Sequences per optimizer step, over all replicas."""
    token_dtype: str = "uint16"
    """Element type of a token file (uint16 or uint32)."""
    eval_every: int | None = None
    """Report a held-out loss every this many steps (and after the last); None: no evaluation, no held-out split."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    microbatching: str | None = None
    """Documents only: how they are grouped into micro-batches, pad, pack or balance (None: pack)."""
    tokenizer: str | None = None
    """Documents given as text: a local Hugging Face tokenizer.json (or its directory)."""
    split_long_documents: bool = False
    """Documents only: cut a document longer than a row into pieces instead of refusing it."""
    microbatch_order: str | None = None
    """Documents only: each step's micro-batch order, ``planned`` (the planner's, None) or ``simulated`` (chosen by
    :class:`evenpipe.plan.order_choice.MicrobatchOrderer`)."""
    microbatch_memory: int | None = None
    """Documents only: the activation bytes one micro-batch may save on its largest stage, by the profile's cost
    model (``--predict``); None: no limit beyond the rows."""

    def __post_init__(self) -> None:
        _coerce(self, "source", parse_choice(DataSource, self.source, "data source"))
        self._check_documents()
        _at_least("global-batch", self.global_batch, 1)
        if self.path is not None and self.source is DataSource.RANDOM:
            raise ConfigError("a corpus path was given but the data source is 'random'; drop one of them")
        from evenpipe.runtime.token_file import parse_token_dtype
        parse_token_dtype(self.token_dtype)
        if self.eval_every is not None:
            _at_least("eval-every", self.eval_every, 1)
        _at_least("eval-batches", self.eval_batches, 1)

    def _check_documents(self) -> None:
        documents = self.source is DataSource.DOCUMENTS
        if not documents:
            given = [name for name, on in (("--microbatching", self.microbatching is not None),
                                           ("--tokenizer", self.tokenizer is not None),
                                           ("--split-long-documents", self.split_long_documents),
                                           ("--microbatch-order", self.microbatch_order is not None),
                                           ("--microbatch-memory", self.microbatch_memory is not None)) if on]
            if given:
                raise ConfigError(f"{given[0]} applies to documents only; add --documents PATH")
            return
        from evenpipe.plan.microbatch import parse_policy
        _coerce(self, "microbatching", parse_policy(self.microbatching or "pack").value)
        if self.microbatch_order not in (None, "planned", "simulated"):
            raise ConfigError(f"--microbatch-order {self.microbatch_order!r}: choose planned or simulated")
        if self.path is None:
            raise ConfigError("the data source 'documents' needs a file (--documents PATH)")
        if self.eval_every is not None:
            raise ConfigError("--eval-every is not supported with --documents yet (no held-out split of documents)")
        if self.microbatch_memory is not None:
            _at_least("microbatch-memory", self.microbatch_memory, 1)

    def eval_due(self, steps_done: int, total_steps: int) -> bool:
        """Whether to evaluate after ``steps_done`` steps."""
        return self.eval_every is not None and (steps_done % self.eval_every == 0 or steps_done == total_steps)


class LrSchedule(enum.Enum):
    """Shape of the learning rate over the steps after warm-up."""

    CONSTANT = "constant"
    """The peak learning rate throughout."""
    COSINE = "cosine"
    """Half a cosine from the peak down to ``min_lr`` at ``decay_steps``, then ``min_lr`` (Loshchilov & Hutter,
    2017, without restarts)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerOptions:
    """AdamW, its learning-rate schedule, weight decay and gradient clipping."""

    lr: float = 1e-3
    """Peak learning rate."""
    schedule: LrSchedule = LrSchedule.CONSTANT
    """Learning-rate shape after warm-up."""
    warmup_steps: int = 0
    """Steps of linear warm-up: step ``k`` (0-based) uses ``lr * (k + 1) / warmup_steps``."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    decay_steps: int | None = None
    """Step at which the cosine reaches ``min_lr`` (warm-up included); None: the job's last step."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to matrices and embeddings only (not to biases or norm gains)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    clip_grad_norm: float | None = None
    """Scale gradients so the whole model's L2 norm is at most this (None: no clipping; the norm is logged
    either way)."""

    def __post_init__(self) -> None:
        _finite_positive("lr", self.lr)
        _coerce(self, "schedule", parse_choice(LrSchedule, self.schedule, "learning-rate schedule"))
        _at_least("warmup-steps", self.warmup_steps, 0)
        if not (0 <= self.min_lr <= self.lr):
            raise ConfigError(f"--min-lr must be between 0 and --lr {self.lr:g}, got {self.min_lr!r}")
        if self.decay_steps is not None:
            _at_least("decay-steps", self.decay_steps, 1)
        _at_least("weight-decay", self.weight_decay, 0)
        _coerce(self, "betas", tuple(self.betas))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"AdamW betas must be two numbers in [0, 1), got {self.betas!r}")
        _finite_positive("adam-eps", self.eps)
        if self.clip_grad_norm is not None:
            _finite_positive("clip-grad-norm", self.clip_grad_norm)

    def lr_at(self, step: int, *, total_steps: int) -> float:
        """Learning rate of 0-based ``step`` in a job of ``total_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule is LrSchedule.CONSTANT:
            return self.lr
        end = self.decay_steps if self.decay_steps is not None else total_steps
        span = max(1, end - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointOptions:
    """Saving and resuming (see :mod:`evenpipe.training.checkpoint`)."""

    directory: str | None = None
    """Checkpoint directory (absolute path, shared by all ranks); None: no checkpoints."""
    every: int | None = None
    """Save every this many steps (and after the last step); None: only after the last step."""
    resume: bool = False
    """Start from the newest complete checkpoint in ``directory`` when there is one."""
    keep: int = 2
    """Newest checkpoints kept; older ones are deleted after a save (never the one just saved nor a newer one)."""
    overwrite: bool = False
    """Start at step 0 in a directory holding checkpoints; they are deleted once this job's first save is
    complete. Without it (or ``resume``) such a directory is refused."""
    synchronous: bool = False
    """Hold the step for the whole save; by default files are written in the background (``dcp.async_save``)."""

    def __post_init__(self) -> None:
        if self.every is not None:
            _at_least("checkpoint-every", self.every, 1)
        _at_least("keep-checkpoints", self.keep, 1)
        if self.directory is None and (self.every is not None or self.resume):
            raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")
        if self.overwrite and (self.directory is None or self.resume):
            raise ConfigError("--overwrite-checkpoints needs --checkpoint-dir and contradicts --resume")

    def due(self, steps_done: int, total_steps: int) -> bool:
        """Whether to save after ``steps_done`` steps."""
        if self.directory is None:
            return False
        return steps_done == total_steps or (self.every is not None and steps_done % self.every == 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeOptions:
    """Processes, communication and length of the job."""

    steps: int = 20
    """Optimizer steps."""
    dp: int = 1
    """Data-parallel replicas (world = stages x dp x tp)."""
    tp: int = 1
    """Tensor-parallel ranks per stage (DTensor; see :mod:`evenpipe.runtime.tensor_parallel`)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism with ``tp > 1``: norms, dropout and residual adds, and what crosses a stage
    boundary or moves under BPipe, on ``seq_len / tp`` positions (:mod:`evenpipe.runtime.sequence_parallel`)."""
    sharding: Sharding = Sharding.NONE
    """Sharded data parallelism: none, optimizer (distributed optimizer) or full (FSDP2)."""
    backend: Backend = Backend.GLOO
    """torch.distributed backend."""
    timeout_s: float | None = None
    """Seconds a rank may wait for a peer before the job fails; None: ``DEFAULT_TIMEOUT_S`` for the first step,
    then a multiple of the measured step time (:func:`evenpipe.training.fault.timeout_after_step`)."""
    slow_rank_threshold: float = 1.3
    """A rank whose compute, against its reference, is this many times its peers' is slow in that step
    (:mod:`evenpipe.plan.slow_rank`)."""
    slow_rank_steps: int = 4
    """Consecutive slow steps before a slow rank is named and a layout re-planned."""
    emulate_slow_rank: str | None = None
    """For tests and benchmarks: ``RANK:FACTOR[@STEP]`` slows a pipeline rank's computes
    (:mod:`evenpipe.runtime.emulation`)."""
    emulate_link_delays: tuple[str, ...] = ()
    """For tests and benchmarks: ``A-B:MS`` delays each message between two pipeline ranks."""

    def __post_init__(self) -> None:
        _coerce(self, "backend", parse_choice(Backend, self.backend, "backend"))
        _coerce(self, "sharding", parse_choice(Sharding, self.sharding, "sharding mode"))
        _at_least("steps", self.steps, 1)
        _at_least("dp", self.dp, 1)
        _at_least("tp", self.tp, 1)
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError(f"--sequence-parallel needs --tp 2 or more (got --tp {self.tp}): it shards over the "
                              "tensor-parallel ranks")
        if self.timeout_s is not None:
            _finite_positive("timeout", self.timeout_s)
        _coerce(self, "emulate_link_delays", tuple(self.emulate_link_delays))
        self.emulation()  # the specs' own checks
        from evenpipe.plan.slow_rank import DetectorConfig
        DetectorConfig(threshold=self.slow_rank_threshold, patience=self.slow_rank_steps)

    def emulation(self) -> Any:
        """The emulated slow rank and links (:class:`evenpipe.runtime.emulation.Emulation`)."""
        from evenpipe.runtime.emulation import Emulation, parse_link_delay, parse_slow_rank
        links = tuple(parse_link_delay(t) for t in self.emulate_link_delays)
        return Emulation(slow=parse_slow_rank(self.emulate_slow_rank), links=tuple(x for x in links if x))

    @property
    def initial_timeout_s(self) -> float:
        """The wait timeout of the first step."""
        return self.timeout_s if self.timeout_s is not None else DEFAULT_TIMEOUT_S

    @property
    def group_timeout_s(self) -> float:
        """Timeout of the process groups themselves: start-up, checkpoints and the final summary, where ranks may
        drift apart by seconds (never shorter than ``DEFAULT_TIMEOUT_S``; the watchdog bounds the steps)."""
        return max(self.initial_timeout_s, DEFAULT_TIMEOUT_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputOptions:
    """What the job writes besides its log."""

    json_out: str | None = None
    """Summary JSON file (losses, step time, memory, throughput)."""
    trace: str | None = None
    """Chrome/Perfetto trace of the last step."""
    trace_json: str | None = None
    """The measured trace of the last step as evenpipe Trace JSON (``evenpipe compare`` reads it)."""
    predict: str | None = None
    """Profile JSON: print the profile's prediction of the run against the measurement (and add it to json_out)."""
    metrics: str | None = None
    """JSON-lines file, one record per step."""
    tensorboard: str | None = None
    """TensorBoard log directory (needs the ``tensorboard`` package)."""
    log_every: int | None = None
    """Log a progress line every this many steps (None: about 50 lines per job); metrics cover every step."""

    def __post_init__(self) -> None:
        if self.log_every is not None:
            _at_least("log-every", self.log_every, 1)

    def log_every_for(self, steps: int) -> int:
        """The progress-line interval of a job of ``steps`` steps."""
        return self.log_every if self.log_every is not None else max(1, steps // 50)


DEFAULT_TIMEOUT_S = 300.0
"""Timeout of the first step when ``--timeout`` is not given (start-up, shape handshake, first allocations)."""


_SLICES: dict[str, type] = {
    "model": ModelOptions, "schedule": ScheduleOptions, "data": DataOptions, "optimizer": OptimizerOptions,
    "checkpoint": CheckpointOptions, "runtime": RuntimeOptions, "output": OutputOptions,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Everything one training job needs, by concern."""

    model: ModelOptions = field(default_factory=ModelOptions)
    """Which model."""
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    """Pipeline schedule and stage layout."""
    data: DataOptions = field(default_factory=DataOptions)
    """Training data and batch size."""
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """Saving and resuming."""
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    """Processes, backend, timeouts, number of steps."""
    output: OutputOptions = field(default_factory=OutputOptions)
    """Files the job writes."""

    def __post_init__(self) -> None:
        cfg = self.model.resolve()
        sched, dp = self.schedule, self.runtime.dp
        if self.data.global_batch % (sched.num_microbatches * dp):
            raise ConfigError(f"--global-batch {self.data.global_batch} is not divisible by microbatches x dp = "
                              f"{sched.num_microbatches} x {dp}")
        from evenpipe.runtime.stages import partition_layers
        partition_layers(cfg.num_layers, sched.num_stages, layout=sched.layout)
        _check_tp(cfg, self.runtime.tp, self.model.hf_config)
        if self.runtime.sequence_parallel:
            _check_sequence_parallel(self.seq_len, self.runtime.tp, self.model.hf_config)
        self.runtime.emulation().check(sched.num_ranks)
        self.token_batches(cfg.vocab)  # the data source's own checks (file readable, vocabulary large enough)

    def _orderer(self) -> Any:
        """The micro-batch orderer of ``--microbatch-order simulated`` (None otherwise)."""
        if self.data.microbatch_order != "simulated":
            return None
        from evenpipe.plan.order_choice import MicrobatchOrderer
        return MicrobatchOrderer(self.schedule.build())

    def token_batches(self, vocab: int) -> Any:
        """The deterministic batch source (:class:`evenpipe.runtime.data.TokenBatches`, or
        :class:`evenpipe.runtime.document_batches.DocumentBatches` for documents) for a model of ``vocab``."""
        if self.data.source is DataSource.DOCUMENTS:
            from evenpipe.runtime.document_batches import DocumentBatches
            m, dp = self.schedule.num_microbatches, self.runtime.dp
            assert self.data.path is not None
            return DocumentBatches(path=self.data.path, seq_len=self.seq_len, vocab=vocab, seed=self.data.seed,
                                   policy=self.data.microbatching or "pack", num_replicas=dp, num_microbatches=m,
                                   rows_per_microbatch=self.data.global_batch // (m * dp),
                                   token_dtype=self.data.token_dtype, tokenizer=self.data.tokenizer,
                                   split_long=self.data.split_long_documents,
                                   length_multiple=math.lcm(8, self.runtime.tp), orderer=self._orderer(),
                                   max_bytes=self.data.microbatch_memory,
                                   bytes_per_token=self._bytes_per_token())
        from evenpipe.runtime.data import TokenBatches
        return TokenBatches(source=self.data.source, seq_len=self.seq_len, vocab=vocab, seed=self.data.seed,
                            path=self.data.path, token_dtype=self.data.token_dtype,
                            held_out=self.data.eval_every is not None)

    def _bytes_per_token(self) -> float:
        """With ``--microbatch-memory``: the profile's activation bytes per position of the largest stage."""
        if self.data.microbatch_memory is None:
            return 1.0
        planned = self.parallel_config()
        if self.output.predict is None or planned is None:
            raise ConfigError("--microbatch-memory needs --predict PROFILE (the profile's bytes per token price each "
                              "micro-batch) and one --recompute mode for every stage")
        from evenpipe.plan.predict import profiled_source
        from evenpipe.plan.varlen_predict import stage_bytes_per_token
        source = profiled_source(self.output.predict, dtype=self.model.dtype.value,
                                 sharding=self.runtime.sharding.value)
        return stage_bytes_per_token(source, planned)

    def parallel_config(self) -> Any:
        """The planner's record of this run's parallelism (a :class:`evenpipe.cost.parallel.ParallelConfig`: what
        its memory prediction takes); None when its stages recompute differently (the planner takes one mode for
        every stage) or it offloads on other ranks than the first k (the planner's offload lever)."""
        from evenpipe.cost.parallel import ParallelConfig
        sched, rt, m = self.schedule, self.runtime, self.schedule.num_microbatches
        if len(set(sched.recompute)) != 1 or sched.offload != tuple(range(len(sched.offload))):
            return None
        return ParallelConfig(tp=rt.tp, pp=sched.num_ranks, dp=rt.dp, chunks=sched.num_chunks or 1,
                              microbatch_size=self.data.global_batch // (m * rt.dp),
                              global_batch=self.data.global_batch, recompute=sched.recompute[0],
                              schedule=sched.family, distributed_optimizer=rt.sharding is not Sharding.NONE,
                              bpipe=sched.bpipe, sequence_parallel=rt.sequence_parallel,
                              bpipe_budget=sched.bpipe_budget, layout=sched.layout,
                              offload_ranks=len(sched.offload))

    @property
    def world_size(self) -> int:
        """Processes of the job: pipeline ranks x replicas x tensor-parallel ranks."""
        return self.schedule.num_ranks * self.runtime.dp * self.runtime.tp

    @property
    def seq_len(self) -> int:
        """Tokens per sequence (the preset's unless overridden)."""
        return int(self.model.resolve().seq_len)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form (enums as their values)."""
        return {name: _plain(getattr(self, name)) for name in _SLICES}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are a ConfigError."""
        unknown = set(raw) - set(_SLICES)
        if unknown:
            raise ConfigError(f"unknown training config section(s) {sorted(unknown)}; known: {list(_SLICES)}")
        return cls(**{name: _SLICES[name](**raw.get(name, {})) for name in _SLICES})

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls.from_dict(json.loads(text))


_TP_HF_TYPES = ("llama", "mistral", "qwen2")
"""Hugging Face ``model_type`` values with a tensor-parallel plan (separate q/k/v/o and gate/up/down linears)."""


def _check_tp(cfg: Any, tp: int, hf_config: str | None) -> None:
    """Tensor parallelism splits heads, key/value heads and the MLP width: each must be divisible by tp; a
    Hugging Face model needs a Llama-family architecture."""
    if tp > 1 and hf_config is not None:
        from evenpipe.cost.specs import hf_model_type
        kind = hf_model_type(hf_config)
        if kind not in _TP_HF_TYPES:
            raise ConfigError(f"--tp {tp} cannot split Hugging Face model_type {kind!r} ({hf_config}): tensor "
                              f"parallelism has a plan for {', '.join(_TP_HF_TYPES)} only (use --tp 1)")
    for what, n in (("query heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                    ("MLP width", cfg.ffn_hidden)):
        if tp > 1 and n % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {n} {what}; tensor parallelism splits "
                              f"them across ranks (heads {cfg.num_heads}, key/value heads {cfg.num_kv_heads})")


def parse_recompute(value: Any, num_stages: int) -> tuple[Recompute, ...]:
    """One recomputation mode per stage from one mode (a :class:`Recompute`, its name, a bool: full or none) or
    one per stage (a sequence or a comma-separated string); ConfigError naming the value otherwise."""
    if isinstance(value, bool):
        value = Recompute.FULL if value else Recompute.NONE
    if isinstance(value, Recompute):
        return (value,) * num_stages
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else list(value)
    if not items:  # the field's default
        return (Recompute.NONE,) * num_stages
    allowed = ", ".join(r.value for r in Recompute)
    try:
        modes = tuple(Recompute.parse(v) for v in items)
    except ConfigError:
        raise ConfigError(f"--recompute {_text(value)}: each entry must be one of {allowed}") from None
    if len(modes) == 1:
        return modes * num_stages
    if len(modes) != num_stages:
        raise ConfigError(f"--recompute {_text(value)}: {len(modes)} entries for {num_stages} stages; give one of "
                          f"{allowed}, or one per stage ({num_stages}, comma-separated)")
    return modes


def parse_offload(value: Any, num_ranks: int) -> tuple[int, ...]:
    """The sorted pipeline ranks that offload, from ``train --offload``'s text (:func:`parse_rank_set`) or a
    collection of ranks; ConfigError naming the value and what is allowed otherwise."""
    if isinstance(value, str):
        return tuple(sorted(parse_rank_set(value, option="--offload", num_ranks=num_ranks)))
    ranks = tuple(sorted(set(value)))
    if any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < num_ranks for r in ranks):
        raise ConfigError(f"--offload {list(value)}: pipeline ranks must lie in 0..{num_ranks - 1}")
    return ranks


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ",".join(getattr(v, "value", str(v)) for v in value)


def _check_sequence_parallel(seq_len: int, tp: int, hf_config: str | None) -> None:
    """Sequence parallelism cuts every sequence into ``tp`` equal slices of the reference blocks."""
    if seq_len % tp:
        raise ConfigError(f"--sequence-parallel with --tp {tp} cannot split --seq-len {seq_len}: use a sequence "
                          f"length divisible by {tp}")
    if hf_config is not None:
        raise ConfigError(f"--sequence-parallel cannot run the Hugging Face model {hf_config}: its layers compute "
                          "positions and masks from the sequence they receive (drop --sequence-parallel)")


def _plain(record: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = [v.value if isinstance(v, enum.Enum) else v for v in value]
        out[f.name] = value
    return out
