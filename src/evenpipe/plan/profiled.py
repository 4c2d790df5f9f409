"""Planning from a measured profile: estimate one pipeline configuration, search them, and say whether BPipe
pays on the machine the profile was measured on.

Pure. A configuration is what ``evenpipe train`` runs: ``num_ranks`` pipeline ranks (one device each) times ``dp``
replicas, a schedule, a micro-batch size ``b`` and ``M = global_batch / (dp * b)`` micro-batches. Its step time is
:func:`~evenpipe.cost.profile_fit.predict_step` (the simulated schedule under measured costs, plus the optimizer);
replicas add nothing here (``dp > 1`` would add a gradient all-reduce the profile does not measure, so the search
keeps ``dp = 1`` unless asked). Memory per device: parameters, gradients and AdamW's two moments in the profile's
dtype (``torch.optim.AdamW`` keeps its state in the parameters' dtype: 4 copies), plus the simulated peak of
activation bytes (own plus hosted).

Whether BPipe pays (Kim et al. 2023, re-evaluated by Huang et al. 2024): BPipe balances activation memory, which
can only pay if the memory it frees lets a faster configuration fit, in practice a larger micro-batch whose
measured per-block efficiency is higher, and if that gain beats its transfers. :func:`explain_bpipe_profiled`
compares the fastest fitting configuration with BPipe against the fastest without, with the measured numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from evenpipe.cost.profile import LayerKind
from evenpipe.cost.profile_fit import ProfileModel, StepPrediction, even_layout, predict_step
from evenpipe.errors import ConfigError
from evenpipe.schedule import ScheduleFamily, build_schedule

__all__ = ["ProfiledConfig", "ProfiledEstimate", "estimate_profiled", "plan_profiled", "BPipeAnswer",
           "explain_bpipe_profiled", "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the profile's dtypes."""
ADAMW_STATE_COPIES = 4
"""Parameters, gradients and AdamW's two moments, all in the parameters' dtype (``torch.optim.AdamW``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfiledConfig:
    """One configuration ``evenpipe train`` can run."""

    schedule: ScheduleFamily
    """Schedule family."""
    num_ranks: int
    """Pipeline ranks P."""
    microbatch_size: int
    """Sequences per micro-batch b."""
    num_microbatches: int
    """Micro-batches per step M."""
    num_chunks: int = 1
    """Stages per rank V."""
    dp: int = 1
    """Data-parallel replicas."""
    bpipe_budget: int | None = None
    """BPipe activation units per rank (default ceil((P+1)/2))."""
    bpipe: bool = False
    """Apply BPipe's transform to ``schedule`` (``--bpipe``)."""

    def describe(self) -> str:
        v = f" V={self.num_chunks}" if self.num_chunks > 1 else ""
        dp = f" dp={self.dp}" if self.dp > 1 else ""
        return f"{self.schedule.value}{'+bpipe' if self.bpipe else ''} P={self.num_ranks}{v}{dp} b={self.microbatch_size} M={self.num_microbatches}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfiledEstimate:
    """A configuration's predicted step and memory on the profiled machine."""

    config: ProfiledConfig
    """What was estimated."""
    prediction: StepPrediction
    """Simulated schedule, optimizer and fixed cost."""
    state_bytes: tuple[float, ...]
    """Per rank, parameters + gradients + optimizer state."""
    tokens_per_step: int
    """Tokens per optimizer step (all replicas)."""
    memory_budget_bytes: float | None
    """Per-device budget, if any."""

    @property
    def step_time_s(self) -> float:
        return self.prediction.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def activation_bytes(self) -> tuple[float, ...]:
        return self.prediction.peak_activation_bytes

    @property
    def peak_bytes(self) -> tuple[float, ...]:
        """Per rank, state plus peak activations."""
        return tuple(s + a for s, a in zip(self.state_bytes, self.activation_bytes))

    @property
    def fits(self) -> bool:
        return self.memory_budget_bytes is None or max(self.peak_bytes) <= self.memory_budget_bytes

    @property
    def bubble_fraction(self) -> float:
        return self.prediction.trace.bubble_fraction

    @property
    def exposed_transfer_s(self) -> float:
        return self.prediction.trace.exposed_transfer_time

    def to_dict(self) -> dict[str, object]:
        c = self.config
        return {"schedule": c.schedule.value, "bpipe": c.bpipe or c.schedule is ScheduleFamily.BPIPE, "num_ranks": c.num_ranks, "num_chunks": c.num_chunks, "dp": c.dp,
                "microbatch_size": c.microbatch_size, "num_microbatches": c.num_microbatches,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "peak_bytes": list(self.peak_bytes), "state_bytes": list(self.state_bytes),
                "activation_bytes": list(self.activation_bytes), "fits": self.fits,
                "bubble_fraction": self.bubble_fraction, "exposed_transfer_s": self.exposed_transfer_s}


def _state_bytes(model: ProfileModel, layout: Sequence[int], stage_to_rank: Sequence[int], num_ranks: int) -> tuple[float, ...]:
    info, n = model.profile.model, len(layout)
    per_elem = DTYPE_BYTES.get(model.profile.machine.dtype, 4) * ADAMW_STATE_COPIES
    params = [layout[s] * info.params_of(LayerKind.BLOCK) + (info.params_of(LayerKind.EMBEDDING) if s == 0 else 0)
              + (info.params_of(LayerKind.HEAD) if s == n - 1 else 0) for s in range(n)]
    out = [0.0] * num_ranks
    for s, r in enumerate(stage_to_rank):
        out[r] += params[s] * per_elem
    return tuple(out)


def estimate_profiled(model: ProfileModel, config: ProfiledConfig, *, memory_budget_bytes: float | None = None,
                      layout: Sequence[int] | None = None) -> ProfiledEstimate:
    """Predict one configuration (ConfigError if the schedule cannot be built for it)."""
    c = config
    sched = build_schedule(c.schedule, num_ranks=c.num_ranks, num_microbatches=c.num_microbatches,
                           num_chunks=c.num_chunks, bpipe_budget=c.bpipe_budget, bpipe=c.bpipe)
    counts = tuple(layout) if layout is not None else even_layout(model.profile.model.num_layers, sched.num_stages)
    pred = predict_step(model, sched, microbatch_size=c.microbatch_size, layout=counts)
    tokens = c.dp * c.num_microbatches * c.microbatch_size * model.profile.seq_lens[-1]
    return ProfiledEstimate(config=c, prediction=pred,
                            state_bytes=_state_bytes(model, counts, sched.stage_to_rank, sched.num_ranks),
                            tokens_per_step=tokens, memory_budget_bytes=memory_budget_bytes)


def _configs(model: ProfileModel, *, num_devices: int, global_batch: int, schedules: Iterable[ScheduleFamily],
             max_microbatch_size: int, chunks: int) -> Iterable[ProfiledConfig]:
    layers = model.profile.model.num_layers
    for p in range(2, num_devices + 1):
        if num_devices % p:
            continue
        for family in schedules:
            v = family.traits.chunks.chunks(chunks)
            if p * v > layers:
                continue
            for b in range(1, max_microbatch_size + 1):
                if global_batch % b:
                    continue
                yield ProfiledConfig(schedule=family, num_ranks=p, num_chunks=v, microbatch_size=b,
                                     num_microbatches=global_batch // b)


def plan_profiled(model: ProfileModel, *, num_devices: int, global_batch: int, memory_budget_bytes: float | None,
                  schedules: Sequence[ScheduleFamily], max_microbatch_size: int = 8, chunks: int = 2,
                  ) -> list[ProfiledEstimate]:
    """Every buildable configuration on ``num_devices`` pipeline ranks (one replica), fastest first; the ones
    that do not fit the budget are kept (``fits`` False) so a caller can say what memory would buy."""
    out = []
    for cfg in _configs(model, num_devices=num_devices, global_batch=global_batch, schedules=schedules,
                        max_microbatch_size=max_microbatch_size, chunks=chunks):
        try:
            out.append(estimate_profiled(model, cfg, memory_budget_bytes=memory_budget_bytes))
        except ConfigError:
            continue  # e.g. a schedule that needs M to be a multiple of P
    if not out:
        raise ConfigError(f"no pipeline configuration of {global_batch} sequences fits {num_devices} device(s) "
                          f"with this profile's {model.profile.model.num_layers} layers; try more sequences")
    return sorted(out, key=lambda e: e.step_time_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class BPipeAnswer:
    """Does BPipe pay on the profiled machine, with the numbers behind the answer."""

    pays: bool
    """True when the fastest fitting BPipe configuration beats the fastest fitting one without BPipe."""
    with_bpipe: ProfiledEstimate | None
    """Fastest fitting BPipe configuration (None if none fits)."""
    without: ProfiledEstimate | None
    """Fastest fitting configuration without BPipe (None if none fits)."""
    blocked: ProfiledEstimate | None
    """The fastest configuration without BPipe that does not fit (what BPipe might unlock)."""
    block_flops_per_s: dict[int, float]
    """Measured-and-fitted FLOP/s of one block per micro-batch size involved."""
    text: str
    """The answer in words, with its numbers."""


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def explain_bpipe_profiled(model: ProfileModel, *, num_devices: int, global_batch: int, memory_budget_bytes: float,
                           max_microbatch_size: int = 8) -> BPipeAnswer:
    """Compare the best BPipe configuration with the best other one under the budget."""
    others = [f for f in (ScheduleFamily.parse(n) for n in ("gpipe", "1f1b", "interleaved", "zb-h1"))]
    cands = plan_profiled(model, num_devices=num_devices, global_batch=global_batch,
                          memory_budget_bytes=memory_budget_bytes, schedules=others + [ScheduleFamily.BPIPE],
                          max_microbatch_size=max_microbatch_size)
    bp_fitting = [e for e in cands if e.fits and e.config.schedule is ScheduleFamily.BPIPE]
    bp = bp_fitting[0] if bp_fitting else None
    base = next((e for e in cands if e.fits and e.config.schedule is not ScheduleFamily.BPIPE), None)
    blocked = next((e for e in cands if not e.fits and e.config.schedule is not ScheduleFamily.BPIPE), None)
    sizes = sorted({e.config.microbatch_size for e in (bp, base, blocked) if e is not None})
    eff = {p.microbatch_size: p.predicted_flops_per_s for p in model.efficiency(sizes)} if sizes else {}
    m = model.profile.machine
    lines = [f"on {m.device_name} ({m.device}, {m.dtype}, {m.num_processes} process(es) measured together), "
             f"{num_devices} pipeline ranks, {global_batch} sequences per step, budget {_gib(memory_budget_bytes)} "
             "per device:"]

    def line(label: str, e: ProfiledEstimate) -> str:
        b = e.config.microbatch_size
        return (f"  {label}: {e.config.describe()}: {e.step_time_s * 1e3:.1f} ms/step, peak "
                f"{_gib(max(e.peak_bytes))} (activations {_gib(max(e.activation_bytes))}), bubble "
                f"{e.bubble_fraction:.1%}, exposed transfers {e.exposed_transfer_s * 1e3:.1f} ms, one block "
                f"{eff.get(b, 0.0) / 1e9:.2f} GFLOP/s at b={b}")
    if base is not None:
        lines.append(line("fastest without BPipe", base))
    else:
        lines.append("  no configuration without BPipe fits the budget")
    if bp is not None:
        lines.append(line("fastest with BPipe   ", bp))
    else:
        lines.append("  no BPipe configuration fits the budget")
    if blocked is not None and (base is None or blocked.step_time_s < base.step_time_s):
        lines.append(f"  memory is the limit: {blocked.config.describe()} would take {blocked.step_time_s * 1e3:.1f} "
                     f"ms/step but needs {_gib(max(blocked.peak_bytes))}")
    pays = bp is not None and (base is None or bp.step_time_s < base.step_time_s)
    if bp is not None and base is not None:
        gain = base.step_time_s / bp.step_time_s - 1
        b_bp, b_base = bp.config.microbatch_size, base.config.microbatch_size
        if b_bp > b_base:
            why = (f"its balanced memory fits b={b_bp} instead of b={b_base}, where one block runs at "
                   f"{eff.get(b_bp, 0.0) / 1e9:.2f} instead of {eff.get(b_base, 0.0) / 1e9:.2f} GFLOP/s")
        elif b_bp == b_base:
            why = (f"its memory buys no larger micro-batch under this budget (both b={b_bp}); what differs is the "
                   f"schedule: bubble {bp.bubble_fraction:.1%} vs {base.bubble_fraction:.1%}, exposed transfers "
                   f"{bp.exposed_transfer_s * 1e3:.1f} vs {base.exposed_transfer_s * 1e3:.1f} ms")
        else:
            same_b = next((e for e in bp_fitting if e.config.microbatch_size == b_base), None)
            why = (f"its fastest is b={b_bp}; at b={b_base} it takes {same_b.step_time_s * 1e3:.1f} ms/step"
                   if same_b is not None else
                   f"it fits b<={max(e.config.microbatch_size for e in bp_fitting)} against b={b_base}")
        verdict = "pays" if pays else "does not pay"
        lines.append(f"verdict: BPipe {verdict} here ({gain:+.1%} throughput; {why})")
    elif bp is not None:
        lines.append("verdict: BPipe pays here: only BPipe fits the budget")
    else:
        lines.append("verdict: BPipe does not pay here: no BPipe configuration fits")
    return BPipeAnswer(pays=pays, with_bpipe=bp, without=base, blocked=blocked, block_flops_per_s=eff,
                       text="\n".join(lines))
