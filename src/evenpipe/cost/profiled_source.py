"""The profiled cost source: the fits of a measured profile (:class:`~evenpipe.cost.profile_fit.ProfileModel`) on the
machine it was measured on, one device per pipeline rank, with the evenpipe runtime's conventions.

Model states: parameters, gradients and AdamW's two moments, all in the profile's dtype (``torch.optim.AdamW``
keeps its state in the parameters' dtype; no master copy). Activations: per block its saved bytes and the input it
saves; a stage receiving its input from another keeps that input for its backward anyway (the boundary bytes);
the runtime holds a stage's output until its send is posted. Step: each rank runs its optimizer after its own last
action, plus the profile's fixed per-step cost. A data-parallel reduction (not measured) is a ring all-reduce of
the gradients over the profiled link.

Tensor parallelism (a preset model only): each rank keeps the block's replicated activations as profiled and its
share of the split ones (:mod:`evenpipe.cost.split_activations`), and its share of the split parameters, the
embedding and head whole (as ``train --tp`` keeps them). The profile measures no tensor parallelism, so its layer
times stay those of whole layers.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from evenpipe.errors import ConfigError
from evenpipe.sim.costs import Link, SimCosts

from evenpipe.cost.activations import ActivationBytes
from evenpipe.cost.flops import attention_core_flops, layer_forward_flops
from evenpipe.cost.hardware import Hardware
from evenpipe.cost.parallel import ParallelConfig, Recompute, check_pipeline, check_tensor_parallel, stage_layers
from evenpipe.cost.profile import LayerKind, LayerSample
from evenpipe.cost.profile_fit import ProfileModel, link_from_profile
from evenpipe.cost.runtime_memory import RuntimeConventions
from evenpipe.cost.source import Holding, MicrobatchShape, ParamCounts, StateBytes, shape_of
from evenpipe.cost.specs import MODEL_PRESETS, Arch, ModelSpec, replace_spec
from evenpipe.cost.split_activations import tp_block_bytes
from evenpipe.cost.states import layer_params_per_rank
from evenpipe.cost.timing import LayerTimes, allreduce_time, plan_durations_of

__all__ = ["ProfiledSource", "DTYPE_BYTES", "ADAMW_STATE_COPIES"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the profile's dtypes."""
ADAMW_STATE_COPIES = 4
"""Parameters, gradients and AdamW's two moments, all in the parameters' dtype (``torch.optim.AdamW``)."""


def _preset_of(fits: ProfileModel) -> ModelSpec | None:
    """The preset of the profiled model when its sizes agree (None otherwise)."""
    info = fits.profile.model
    preset = MODEL_PRESETS.get(info.name.lower())
    return preset if preset is not None and (preset.num_layers, preset.hidden) == (info.num_layers, info.hidden) \
        else None


def _model_of(fits: ProfileModel) -> ModelSpec:
    """The profiled model as a ModelSpec: its preset when the sizes agree, else built from the profile's record."""
    info, seq = fits.profile.model, fits.profile.seq_lens[-1]
    preset = _preset_of(fits)
    if preset is not None:
        return replace_spec(preset, seq_len=seq)
    return ModelSpec(name=info.name, arch=Arch.parse(info.arch), num_layers=info.num_layers, hidden=info.hidden,
                     num_heads=1, num_kv_heads=1, ffn_hidden=4 * info.hidden, vocab=info.vocab, seq_len=seq,
                     tied_embeddings=False)


def _freed_by_input_grad(sample: LayerSample) -> float:
    """What a layer's ``I`` frees of its saved bytes (the profile's weight-gradient bytes are the rest)."""
    return max(0.0, sample.saved_bytes - sample.weight_grad_bytes)


class ProfiledSource:
    """Costs measured by ``evenpipe profile`` (uniform over ranks: every rank is the profiled device)."""

    def __init__(self, fits: ProfileModel, *, memory_budget_gib: float | None = None) -> None:
        if memory_budget_gib is not None and not memory_budget_gib > 0:
            raise ConfigError(f"memory budget must be > 0 GiB, got {memory_budget_gib}")
        self.fits = fits
        """The profile's fits."""
        self._model = _model_of(fits)
        self._budget = memory_budget_gib
        self._link = link_from_profile(fits.profile)
        self._costs: dict[tuple[Any, ...], SimCosts] = {}
        self.conventions: RuntimeConventions | None = None
        """Model-state bytes of this runtime; None: all four in the profile's dtype (see the module doc)."""

    def with_conventions(self, conventions: RuntimeConventions) -> "ProfiledSource":
        """This source with model-state bytes by ``conventions`` (the fits and caches shared)."""
        other = copy.copy(self)
        other.conventions = conventions
        return other

    @property
    def name(self) -> str:
        m = self.fits.profile.machine
        return f"{m.device_name} ({m.device}, {m.dtype}, profiled)"

    @property
    def model(self) -> ModelSpec:
        return self._model

    @property
    def hardware(self) -> Hardware | None:
        return None

    @property
    def uniform(self) -> bool:
        return True

    @property
    def reduction_overlaps_backward(self) -> bool:
        return False

    @property
    def step_overhead_s(self) -> float:
        return self.fits.profile.step_overhead_s

    @property
    def optimizer_waits_for_all_ranks(self) -> bool:
        return False

    @property
    def holds_sent_output(self) -> bool:
        return True

    def check(self, cfg: ParallelConfig, num_gpus: int | None = None) -> None:
        if num_gpus is not None and num_gpus != cfg.num_gpus:
            raise ConfigError(f"--gpus {num_gpus} != tp·pp·dp = {cfg.tp}·{cfg.pp}·{cfg.dp} = {cfg.num_gpus}")
        if cfg.tp != 1:
            self._check_tensor_parallel(cfg)
        check_pipeline(self._model, cfg)

    def _check_tensor_parallel(self, cfg: ParallelConfig) -> None:
        """tp > 1 needs the profiled model's heads and MLP width (a preset's) and no sequence parallelism."""
        name = self.fits.profile.model.name
        if _preset_of(self.fits) is None:
            raise ConfigError(f"tp {cfg.tp}: the profiled model {name} is no preset, so its heads and MLP width "
                              f"are unknown; profile a preset or use tp 1")
        if cfg.sequence_parallel:
            raise ConfigError("--sequence-parallel: a profile measures layers without it; use --gpu, or leave "
                              "it out")
        check_tensor_parallel(self._model, cfg)

    def memory_budget_gib(self, rank: int) -> float | None:
        return self._budget

    def peak_flops(self, rank: int) -> float | None:
        return None

    def _block(self, shape: MicrobatchShape) -> LayerSample:
        return self.fits.predict(LayerKind.BLOCK, shape.size, shape.seq_len, shape=shape)

    def layer_times(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> LayerTimes:
        """The block's times as the stage costs take them (alternation factors where ranks hold several stages;
        the backward as the schedule runs it, whole or as I and W)."""
        block, profile = self._block(shape), self.fits.profile
        fwd_f, bwd_f = (profile.alternation_forward, profile.alternation_backward) if cfg.chunks > 1 else (1.0, 1.0)
        if cfg.schedule.traits.split_backward:
            whole = min(block.backward_s, block.backward_input_s + block.backward_weight_s)
            bi = min(block.backward_input_s, whole)
            bw = whole - bi
        else:
            bi, bw = block.backward_s, 0.0
        return LayerTimes(forward_compute=fwd_f * block.forward_s, backward_input_compute=bwd_f * bi,
                          backward_weight_compute=bwd_f * bw, tp_forward=0.0, tp_backward=0.0,
                          selective_recompute=fwd_f * block.forward_s * self._core_share(cfg, shape)
                          if cfg.recompute is Recompute.SELECTIVE else 0.0,
                          recompute_forward=fwd_f * block.recompute_s)

    def _core_share(self, cfg: ParallelConfig, shape: MicrobatchShape) -> float:
        """The attention core's share of a block's forward (by FLOPs, :mod:`evenpipe.cost.flops`): what selective
        recomputation runs again in the backward, as a fraction of the profiled forward."""
        model = replace_spec(self._model, seq_len=shape.seq_len)
        varied = None if shape.padded else shape
        core = attention_core_flops(model, tp=1, microbatch_size=shape.size,
                                    squares=None if varied is None else varied.sum_squares)
        return core / layer_forward_flops(model, tp=1, microbatch_size=shape.size, shape=varied)

    def layer_flop_rate(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> float:
        return self.fits.efficiency([shape.size])[0].predicted_flops_per_s

    def layer_bytes(self, cfg: ParallelConfig, rank: int, shape: MicrobatchShape) -> ActivationBytes:
        b, s = shape.size, shape.seq_len
        block = self._block(shape)
        emb = self.fits.predict(LayerKind.EMBEDDING, b, s, shape=shape)
        head = self.fits.predict(LayerKind.HEAD, b, s, shape=shape)
        measured = block.saved_bytes + block.input_saved_bytes
        whole = tp_block_bytes(measured, self._model, tp=cfg.tp, microbatch_size=b, seq_len=s,
                               element_bytes=DTYPE_BYTES.get(self.fits.profile.machine.dtype, 4),
                               selective=cfg.recompute is Recompute.SELECTIVE)
        whole += self._document_extra(shape) / cfg.tp  # kept until W, as the block's other tensors (measured)
        # The profiled blocks run the fused kernel (SDPA), which saves no score matrix, only its log-sum-exp
        # (4·a·s·b bytes), which selective recomputation drops; tensor parallelism divides the tensors between
        # the column- and row-parallel linears (cost.split_activations).
        # documents: every message carries one more channel, each token's 0/1 document start (packed_forward)
        flags = 0.0 if shape.padded else self._document_extra(shape) / self.fits.profile.model.hidden
        sent = block.output_bytes + flags
        if cfg.recompute is Recompute.FULL:  # the stage keeps its input only, and rebuilds its layers one by one
            return ActivationBytes(layer_full=whole, layer_saved=0.0, layer_weight_grad=0.0, embedding=0.0,
                                   head=0.0, sent=sent, boundary=sent)
        return ActivationBytes(layer_full=whole, layer_saved=whole,
                               # I leaves W all but what it freed (the nodes above the split nodes: a loss's)
                               layer_weight_grad=max(0.0, whole - _freed_by_input_grad(block)),
                               embedding=emb.saved_bytes + emb.input_saved_bytes,
                               head=head.saved_bytes + head.input_saved_bytes, sent=sent,
                               boundary=max(0.0, block.output_bytes - block.input_saved_bytes),
                               head_weight_grad=max(0.0, head.saved_bytes + head.input_saved_bytes
                                                    - _freed_by_input_grad(head))
                               if cfg.schedule.traits.split_backward else 0.0)

    def _document_extra(self, shape: MicrobatchShape) -> float:
        """Bytes a block of a micro-batch of documents saves beyond the profiled plain rows: attention runs per
        document (:mod:`evenpipe.models.layers`), so its output and the projection's input are two tensors of
        ``tokens x hidden`` where the plain path shares one (measured: one ``hidden`` per token per block)."""
        if shape.padded:
            return 0.0
        profile = self.fits.profile
        return float(shape.num_tokens * profile.model.hidden * DTYPE_BYTES.get(profile.machine.dtype, 4))

    def param_counts(self, cfg: ParallelConfig) -> ParamCounts:
        info = self.fits.profile.model
        split = layer_params_per_rank(self._model, 1) - layer_params_per_rank(self._model, cfg.tp) if cfg.tp > 1 \
            else 0.0  # embedding and head stay whole on every tensor-parallel rank
        return ParamCounts(per_layer=float(info.params_of(LayerKind.BLOCK)) - split,
                           embedding=float(info.params_of(LayerKind.EMBEDDING)),
                           head=float(info.params_of(LayerKind.HEAD)))

    def state_bytes(self, cfg: ParallelConfig, rank: int) -> StateBytes:
        if self.conventions is not None:
            return self.conventions.state_bytes(cfg.dp, distributed_optimizer=cfg.distributed_optimizer)
        element = float(DTYPE_BYTES.get(self.fits.profile.machine.dtype, 4))
        shards = cfg.dp if cfg.distributed_optimizer else 1
        return StateBytes(parameters=element, gradients=element, master=0.0,
                          optimizer=(ADAMW_STATE_COPIES - 2) * element / shards)

    def optimizer_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        opt = self.fits.profile.optimizer_s
        return (held.layers * opt[LayerKind.BLOCK] + (opt[LayerKind.EMBEDDING] if held.embedding else 0.0)
                + (opt[LayerKind.HEAD] if held.head else 0.0))

    def reduce_time(self, cfg: ParallelConfig, rank: int, held: Holding) -> float:
        if cfg.dp <= 1:
            return 0.0
        grads = held.params(self.param_counts(cfg)) * self.state_bytes(cfg, rank).gradients
        bandwidth = self._link.bandwidth_bytes_per_s
        if math.isinf(bandwidth):
            return 2.0 * (cfg.dp - 1) * self._link.latency_s
        return allreduce_time(grads, cfg.dp, bandwidth_gbps=bandwidth / 1e9, latency_s=self._link.latency_s)

    def link(self, cfg: ParallelConfig, rank_a: int, rank_b: int) -> Link:
        return self._link

    def stage_costs(self, cfg: ParallelConfig, shape: MicrobatchShape) -> SimCosts:
        layout = stage_layers(self._model, cfg)
        split, alternating = cfg.schedule.traits.split_backward, cfg.chunks > 1
        selective = cfg.recompute is Recompute.SELECTIVE
        key = (layout, split, alternating, shape, selective)
        costs = self._costs.get(key)
        if costs is None:
            n = len(layout)
            stages = [self.fits.stage_costs(blocks=layout[s], first=s == 0, last=s == n - 1,
                                            microbatch_size=shape.size, split_backward=split,
                                            seq_len=shape.seq_len, alternating=alternating, shape=shape)
                      for s in range(n)]
            extra = self._document_extra(shape)
            if extra:
                stages = [dataclasses.replace(st, activation_bytes=st.activation_bytes + blocks * extra)
                          for st, blocks in zip(stages, layout)]
            if selective:  # each block's attention core runs again in the input-gradient part of the backward
                core = self.layer_times(cfg, 0, shape).selective_recompute
                stages = [dataclasses.replace(st, backward_input=st.backward_input + blocks * core)
                          for st, blocks in zip(stages, layout)]
            costs = self._costs[key] = SimCosts.from_stages(stages, default_link=self._link)
        return costs

    def plan_durations(self, cfg: ParallelConfig) -> tuple[int, int, int] | None:
        if not cfg.schedule.traits.plans_with_durations:
            return None
        return plan_durations_of(self.layer_times(cfg, 0, shape_of(self._model, cfg)))
