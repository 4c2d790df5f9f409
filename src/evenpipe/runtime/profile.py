"""Measure a model on this machine: per-layer times and bytes, the optimizer step, point-to-point messages.

Each layer kind (embedding, transformer blocks, the head with its loss) is run the way the pipeline executor
runs a stage: its forward inside the activation stash's capture (the stash's hooks cost time, and they are what
counts the saved bytes), the full backward through the autograd engine, the zero-bubble split with the
executor's own :func:`~evenpipe.runtime.split_backward.backward_input` / ``backward_weight``, and a recompute
(another forward with graph). Blocks are timed as a stage runs them: ``block_chain`` distinct blocks of the model
one after another, the time divided by their number (one block timed again and again keeps its weights in the
CPU's caches, which a stage of several blocks does not: on a 2-core Xeon one gpt-mini block alone ran its forward
10% and its backward 13% faster than each of four in a row), and gradients accumulate from run to run as over a
step's micro-batches instead of being allocated afresh; the byte counts are one block's. Every time is the mean
of ``repeats`` runs after ``warmup`` untimed ones (a training step adds up many actions, so their mean, slow
outliers included, is what predicts it; the median was 5-12% below the mean of the same actions in training on a
CPU host), taken in rounds that run every kind at every size once (a
slow spell of a shared host then lands on all sizes alike rather than on one, where it would bend the fit); on CUDA
with CUDA events, on CPU with ``time.perf_counter`` and one thread per process, as training uses.

Concurrency: on a CPU host the pipeline's ranks share the machine, so ``num_processes`` processes measure the
same layers at the same time, in step (a barrier before every timed run: pipeline ranks compute at once most of a
step, and two processes left to drift apart overlap only part of the time), and so include the contention
training sees (shared caches and memory bandwidth); each time is the median over processes of their means. The
same processes then time ping-pong messages between ranks 0 and 1 over the runtime's backend (gloo on CPU, NCCL
with two GPUs), one small broadcast (the per-step fixed cost of sharing the loss) and, on a CPU host, how much a
compute slows down while both processes send and receive 16 MiB (``Profile.transfer_cpu_s_per_byte``) and how
long the model's boundary message takes when the two processes hand it back and forth between computes of its
block as pipeline ranks do: when its receive was waiting (``Profile.handoff_latency_s``) and how much longer
when the receive came after the send (``Profile.late_receive_s``; gloo moves a message only once its receive is
posted). Replaying measured steps of every schedule with their own compute times (``evenpipe.sim.replay``) left
up to 7% of the step unexplained with the idle ping-pong's latency of 0.1 ms, and at most 2.8% with a 2 ms cost
for late receives; this probe measures 0.2-2.3 ms for that cost, so part of it stays unexplained.

Several stages on one rank: an interleaved rank runs its chunks in turn, and on a CPU host each chunk's weights,
gradients and saved activations have cooled in the caches by its next turn. The processes time one rank's
interleaved order over two chunks of half a chain each against each chunk's forward and backward back to back
(``Profile.alternation_forward`` / ``alternation_backward``; a tiny Llama's chunks of two blocks ran their forward
2-6% and backward 4-7% slower in turn, gpt-mini's 0-4% and 0-6%, over 74 profiles).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from evenpipe.cost.profile import (
    TIME_FIELDS,
    LayerKind,
    LayerSample,
    LinkSample,
    Machine,
    ModelInfo,
    Profile,
    ProfileError,
)
from evenpipe.runtime.rendezvous import hosted_rendezvous
from evenpipe.runtime.split_backward import backward_input, backward_weight, run_backward
from evenpipe.runtime.stages import StageModule

__all__ = ["ProfileOptions", "profile_model", "measure_layers", "DTYPES", "WorkerResult", "WorkerFailure"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` names."""

_LINK_SIZES = (4, 2**12, 2**16, 2**18, 2**20, 2**22, 2**24)
"""Message sizes (bytes) of the ping-pong."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOptions:
    """What to profile and how."""

    model_name: str
    """Preset name or HF config path (recorded in the profile, checked by its users)."""
    model_config: Any
    """The :class:`~evenpipe.models.ModelConfig` to build (its sizes; see ``hf_config``)."""
    hf_config: str | None = None
    """A Hugging Face config.json (or save_pretrained directory): profile the transformers modules themselves,
    as ``train --hf-config`` runs them, not evenpipe's reference model of the same sizes."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4)
    """Micro-batch sizes to measure."""
    seq_lens: tuple[int, ...] = ()
    """Sequence lengths to measure (default: the model's)."""
    dtype: str = "float32"
    """Parameter and activation dtype (a key of :data:`DTYPES`)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    repeats: int = 5
    """Timed runs per median."""
    warmup: int = 2
    """Untimed runs first."""
    num_processes: int = 2
    """Processes measuring at once (CPU); each time is the median over them."""
    link_sizes: tuple[int, ...] = _LINK_SIZES
    """Ping-pong message sizes in bytes."""
    seed: int = 0
    """Model init and input seed."""
    block_chain: int = 4
    """Distinct blocks timed one after another for a block's times (at most the model's blocks): a stage runs
    several, and their weights do not all stay in cache as one block's do."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ProfileError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in ("cpu", "cuda"):
            raise ProfileError(f"--device {self.device!r} must be cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ProfileError("--device cuda needs a CUDA GPU and none is visible; use --device cpu")
        if not self.microbatch_sizes or min(self.microbatch_sizes) < 1:
            raise ProfileError(f"--microbatch-sizes must be positive integers, got {list(self.microbatch_sizes)}")
        if self.repeats < 1 or self.warmup < 0:
            raise ProfileError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats}, {self.warmup}")
        if self.num_processes < 1:
            raise ProfileError(f"--processes must be >= 1, got {self.num_processes}")
        if self.block_chain < 1:
            raise ProfileError(f"--block-chain must be >= 1, got {self.block_chain}")
        too_long = [s for s in self.seq_lens if s < 1 or s > self.model_config.seq_len]
        if too_long:
            raise ProfileError(f"--seq-len {too_long[0]} must be between 1 and the model's {self.model_config.seq_len}")

    @property
    def chain_length(self) -> int:
        """Blocks actually timed in a row: ``block_chain``, at most the model's blocks."""
        return min(self.block_chain, self.model_config.num_layers)


# ---- timing ---------------------------------------------------------------------------------------------------

class _Timer:
    """Seconds of a region: CUDA events on a GPU, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


class _Progress:
    """Progress on stderr when ``enabled``: a one-line bar redrawn in place on a terminal, else one line per
    finished step (a log file or a pipe gets no carriage returns), flushed as it happens."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.t0 = time.perf_counter()
        self.bar = enabled and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if not self.bar:
            sys.stderr.write(f"profiling {self.done}/{self.total}: {what} done ({elapsed:.0f} s)\n")
            sys.stderr.flush()
            return
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        end = "\n" if self.done >= self.total else ""
        sys.stderr.write(f"\rprofiling [{bar}] {self.done}/{self.total} {what:<34.34s} {elapsed:5.0f} s{end}")
        sys.stderr.flush()


# ---- one layer kind -------------------------------------------------------------------------------------------

class _Head(nn.Module):
    """The last part plus the model's loss, as the last stage runs it."""

    def __init__(self, last: nn.Module, loss: Any) -> None:
        super().__init__()
        self.last, self.loss = last, loss

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.last(x), targets)


def _build(options: ProfileOptions, device: torch.device, dtype: torch.dtype) -> Any:
    """The :class:`~evenpipe.models.adapter.PipelineModel` training would build (HF modules or the reference)."""
    if options.hf_config is not None:
        from evenpipe.models.hf import hf_model
        built = hf_model(options.hf_config, seed=options.seed)
    else:
        from evenpipe.models.adapter import reference_model
        built = reference_model(options.model_config, seed=options.seed, source=options.model_name)
    built.module.to(device=device, dtype=dtype)
    return built


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _matrix_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


def _block_flops(block: nn.Module, cfg: Any, b: int, s: int) -> float:
    """Forward FLOPs of one block: 2 per matrix weight per token, plus the attention scores and their use
    (``4 b s^2 h``: Q K^T and P V, the causal half counted in full as the kernels do)."""
    return 2.0 * _matrix_params(block) * b * s + 4.0 * b * s * s * cfg.hidden


def _sample_inputs(options: ProfileOptions, b: int, s: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(b, s)`` and hidden states ``(b, s, hidden)`` of one micro-batch, seeded per size."""
    cfg = options.model_config
    gen = torch.Generator().manual_seed(options.seed + 1000 * b + s)
    tokens = torch.randint(0, cfg.vocab, (b, s), generator=gen).to(device)
    return tokens, (torch.randn(b, s, cfg.hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)


def _output_grad(out: torch.Tensor) -> torch.Tensor:
    """The gradient a profiled backward starts from: 1 for a loss, random for an activation."""
    return torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)


def _blocks_as_stage(blocks: Sequence[nn.Module]) -> StageModule:
    """The executor's own stage module holding just ``blocks`` (a middle stage: no embedding, no head)."""
    return StageModule(stage=1, num_stages=3, layers=range(len(blocks)), blocks=blocks, first=None, last=None)


class _LayerBench:
    """Runs one layer kind like the executor runs a stage, and measures it: ``count`` layers of the kind in a row
    (times are per layer), gradients accumulating from run to run as they do over a step's micro-batches."""

    def __init__(self, kind: LayerKind, module: nn.Module, *, device: torch.device, timer: _Timer,
                 count: int = 1) -> None:
        from evenpipe.runtime.stash import ActivationStash
        self.kind, self.module, self.device, self.timer, self.count = kind, module, device, timer, count
        self.stash = ActivationStash([module])
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.key = 0

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = x.detach().clone().requires_grad_(True)
        return x

    def _forward(self, x: torch.Tensor, extra: Sequence[torch.Tensor], *, hold: bool) -> tuple[float, Any, tuple]:
        self.key += 1
        key = (0, self.key)
        if hold and x.is_floating_point():
            self.stash.hold(key, x)
        with self.stash.capture(key):
            t, out = self.timer.time(lambda: self.module(x, *extra))
        return t, out, key

    def _done(self, key: tuple, x: torch.Tensor, hold: bool) -> None:
        if hold and x.is_floating_point():
            self.stash.release(key, x)
        self.stash.release_all_of(key)

    def once(self, x0: torch.Tensor, extra: Sequence[torch.Tensor], sizes: dict[str, float]) -> dict[str, float]:
        """One run of every timed part at one size: F + B, then F (as recompute) + I + W; the byte counts go
        into ``sizes`` on the first run (an empty dict)."""
        # full backward
        x = self._inputs(x0)
        t_f, out, key = self._forward(x, extra, hold=True)
        if not sizes:
            sizes.update(self._bytes(x, out, extra, key))
        g = _output_grad(out)
        t_b, _ = self.timer.time(lambda: run_backward([out], [g], keep_graph=False))
        self._done(key, x, True)
        # zero-bubble split
        x = self._inputs(x0)
        t_r, root, key = self._forward(x, extra, hold=True)
        roots, grads = [root], [_output_grad(root)]
        del root
        xs = (x,) if x.is_floating_point() else ()
        t_i, (_, state) = self.timer.time(lambda: backward_input(roots, grads, xs, self.params))
        # the executor lets go of the stage output at I: the nodes above the split nodes (a loss's) free theirs
        roots.clear()
        grads.clear()
        if "weight_grad_bytes" not in sizes:
            sizes["weight_grad_bytes"] = max(0.0, self.stash.bytes_of(key) - (_nbytes(x) if xs else 0))
        t_w, _ = self.timer.time(lambda: backward_weight(state, self.params))
        state = None  # drop the I -> W hand-off before the next run
        self._done(key, x, True)
        n = self.count
        return {"forward_s": t_f / n, "backward_s": t_b / n, "recompute_s": t_r / n, "backward_input_s": t_i / n,
                "backward_weight_s": t_w / n}

    def _bytes(self, x: torch.Tensor, out: torch.Tensor, extra: Sequence[torch.Tensor],
               held_key: tuple) -> dict[str, float]:
        """Saved bytes without the input (from the run that holds it) and the input's saved bytes (from a run
        that does not)."""
        in_bytes = _nbytes(x) if x.is_floating_point() else 0
        with_input = self.stash.bytes_of(held_key)
        saved = max(0, with_input - in_bytes)
        y = self._inputs(x.detach())
        _, out2, key2 = self._forward(y, extra, hold=False)
        input_saved = max(0, self.stash.bytes_of(key2) - saved)
        del out2
        self._done(key2, y, False)
        return {"saved_bytes": float(saved), "input_saved_bytes": float(input_saved),
                "output_bytes": float(_nbytes(out) if out.dim() > 0 else 0)}


@dataclass(slots=True, kw_only=True)
class _LayerCase:
    """One layer kind at one (micro-batch size, sequence length) in :func:`measure_layers`' rounds."""

    kind: LayerKind
    microbatch_size: int
    seq_len: int
    x: torch.Tensor
    """The layer's input."""
    extra: tuple[torch.Tensor, ...]
    """Further inputs (the head's targets)."""
    sizes: dict[str, float]
    """Byte counts (blocks: measured on one block before the rounds)."""
    times: dict[str, list[float]] = field(default_factory=lambda: {q: [] for q in TIME_FIELDS})
    """Seconds of each timed run, per time field."""


def measure_layers(options: ProfileOptions, *, progress: _Progress | None = None,
                   sync: Callable[[], None] = lambda: None) -> dict[LayerKind, list[LayerSample]]:
    """Samples of every layer kind at every (micro-batch size, sequence length): ``warmup + repeats`` rounds,
    each running every kind at every size once, so a slow spell of the host spreads over all of them instead of
    bending the fit; ``sync`` before every timed run (a barrier of the processes measuring together). Blocks are
    timed ``block_chain`` in a row; their byte counts come from one block, in a run before the rounds."""
    cfg = options.model_config
    device = torch.device(options.device)
    dtype = DTYPES[options.dtype]
    torch.manual_seed(options.seed)
    built = _build(options, device, dtype)
    parts = built.parts
    timer = _Timer(device)
    chain = list(parts.blocks)[:options.chain_length]
    benches = {LayerKind.EMBEDDING: _LayerBench(LayerKind.EMBEDDING, parts.first, device=device, timer=timer),
               LayerKind.BLOCK: _LayerBench(LayerKind.BLOCK, _blocks_as_stage(chain), device=device, timer=timer,
                                            count=len(chain)),
               LayerKind.HEAD: _LayerBench(LayerKind.HEAD, _Head(parts.last, built.loss), device=device, timer=timer)}
    one_block = _LayerBench(LayerKind.BLOCK, parts.blocks[0], device=device, timer=timer)
    cases: list[_LayerCase] = []
    for s in options.seq_lens or (cfg.seq_len,):
        for b in options.microbatch_sizes:
            tokens, hidden = _sample_inputs(options, b, s, device, dtype)
            for kind in benches:
                x, extra = (tokens, ()) if kind is LayerKind.EMBEDDING else \
                    (hidden, (tokens,) if kind is LayerKind.HEAD else ())
                sizes: dict[str, float] = {}
                if kind is LayerKind.BLOCK:
                    one_block.once(x, extra, sizes)
                cases.append(_LayerCase(kind=kind, microbatch_size=b, seq_len=s, x=x, extra=extra, sizes=sizes))
    rounds = options.warmup + options.repeats
    for i in range(rounds):
        for case in cases:
            sync()
            run = benches[case.kind].once(case.x, case.extra, case.sizes)
            if i >= options.warmup:
                for q, t in run.items():
                    case.times[q].append(t)
        if progress is not None:
            progress.step(f"layers, round {i + 1}/{rounds}")
    out: dict[LayerKind, list[LayerSample]] = {k: [] for k in LayerKind}
    for case in cases:
        kind, b, s = case.kind, case.microbatch_size, case.seq_len
        flops = _block_flops(parts.blocks[0], cfg, b, s) if kind is LayerKind.BLOCK else \
            2.0 * _matrix_params(parts.last) * b * s if kind is LayerKind.HEAD else 0.0
        out[kind].append(LayerSample(microbatch_size=b, seq_len=s, forward_flops=flops, **case.sizes,
                                     **{q: statistics.fmean(v) for q, v in case.times.items()}))
    return out


def _optimizer_times(options: ProfileOptions, *, repeats: int,
                     sync: Callable[[], None] = lambda: None) -> dict[LayerKind, float]:
    """Mean seconds per layer, per kind, of what training runs on a layer's gradients after the schedule: the
    gradient norm it reports (each gradient's float64 norm, as ``global_grad_norm`` sums them) and the AdamW step
    (gradients present). Blocks are timed ``block_chain`` at once, as a stage's optimizer steps them together.

    Each timed step follows a forward and backward of the same layers (the smallest profiled micro-batch), as in
    training, where the optimizer runs after the stage's computes: stepped again and again on its own, its
    parameters, gradients and moments stay in the CPU's caches, and it ran 25-30% faster than right after a
    forward and backward (4 tiny-Llama blocks on a 2-core Xeon: 9.4-10.4 ms against 12.6-13.0 ms)."""
    device, dtype = torch.device(options.device), DTYPES[options.dtype]
    built = _build(options, device, dtype)
    parts = built.parts
    timer = _Timer(device)
    out = {}
    chain = list(parts.blocks)[:options.chain_length]
    computes = _computes_before_the_optimizer(options, built, chain, device, dtype)
    for kind, modules in ((LayerKind.EMBEDDING, [parts.first]), (LayerKind.BLOCK, chain),
                          (LayerKind.HEAD, [parts.last])):
        params = [p for m in modules for p in m.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(params, lr=1e-4)
        before = computes[kind]

        def tail() -> float:
            total = torch.zeros((), dtype=torch.float64, device=device)
            for p in params:
                total += torch.linalg.vector_norm(p.grad, dtype=torch.float64) ** 2
            opt.step()
            return float(total)

        ts = []
        for _ in range(repeats + 2):
            before()
            sync()
            ts.append(timer.time(tail)[0])
        out[kind] = statistics.fmean(ts[2:]) / len(modules)
    return out


def _computes_before_the_optimizer(options: ProfileOptions, built: Any, chain: Sequence[nn.Module],
                                   device: torch.device, dtype: torch.dtype) -> dict[LayerKind, Callable[[], None]]:
    """Per kind, one forward and backward of its layers at the smallest profiled micro-batch size (gradients
    accumulate into theirs): what runs on a rank before its optimizer step."""
    b, s = min(options.microbatch_sizes), min(options.seq_lens or (options.model_config.seq_len,))
    tokens, hidden = _sample_inputs(options, b, s, device, dtype)
    stage = _blocks_as_stage(chain)
    head = _Head(built.parts.last, built.loss)

    def run(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def computes() -> None:
            out = forward()
            run_backward([out], [_output_grad(out)], keep_graph=False)
        return computes
    return {LayerKind.EMBEDDING: run(lambda: built.parts.first(tokens)),
            LayerKind.BLOCK: run(lambda: stage(hidden.detach().requires_grad_(True))),
            LayerKind.HEAD: run(lambda: head(hidden.detach().requires_grad_(True), tokens))}


# ---- two chunks on one rank -----------------------------------------------------------------------------------

_ALTERNATION_MICROBATCHES = 8
_ALTERNATION_ROUNDS_PER_REPEAT = 2  # a ratio of two ~0.5 s phases moves with the host: more rounds, their median


@dataclass(frozen=True)
class Alternation:
    """One process's timing of one rank's interleaved order over two chunks against each chunk run alone."""

    forward: float
    """Forward seconds in the interleaved order over forward seconds alone (1 where not measured)."""
    backward: float
    """The same for the backward."""
    blocks: int
    """Blocks per chunk (0: not measured)."""


def alternation_chunk_blocks(options: ProfileOptions) -> int:
    """Blocks in each of the two chunks timed: half a timed chain (an interleaved rank's chunks are stages cut
    smaller), 0 when the model has too few blocks for two chunks."""
    k = max(1, options.chain_length // 2)
    return k if 2 * k <= options.model_config.num_layers else 0


def _alternation(options: ProfileOptions, device: torch.device, dtype: torch.dtype, *,
                 sync: Callable[[], None] = lambda: None) -> Alternation:
    """Rank 0's computes of an interleaved schedule (P=2, V=2, M=8; sample hidden states stand in for received
    inputs, no messages) on two chunks of the model's blocks, against each chunk's forward and backward back to
    back M times as the layer times are measured: ``warmup + 2 repeats`` rounds of both, ``sync`` before each,
    the median of the rounds' ratios.
    On a CPU host a chunk's weights, gradients and saved activations cool in the caches while the other chunk
    runs; a GPU streams its weights from memory either way (expect 1)."""
    from evenpipe.schedule import ActionKind, build_schedule
    k = alternation_chunk_blocks(options)
    if k == 0:
        return Alternation(1.0, 1.0, 0)
    torch.manual_seed(options.seed)
    blocks = list(_build(options, device, dtype).parts.blocks)
    schedule = build_schedule("interleaved", num_ranks=2, num_microbatches=_ALTERNATION_MICROBATCHES, num_chunks=2)
    chunks = {stage: _blocks_as_stage(blocks[i * k:(i + 1) * k]) for i, stage in enumerate(schedule.stages_of(0))}
    order = [a for a in schedule.actions[0] if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
    b, s = min(options.microbatch_sizes), min(options.seq_lens or (options.model_config.seq_len,))
    _, hidden = _sample_inputs(options, b, s, device, dtype)
    timer = _Timer(device)

    def forward(stage: int) -> tuple[float, torch.Tensor]:
        return timer.time(lambda: chunks[stage](hidden.detach().requires_grad_(True)))

    def backward(out: torch.Tensor) -> float:
        g = _output_grad(out)
        return timer.time(lambda: run_backward([out], [g], keep_graph=False))[0]

    def interleaved() -> tuple[float, float]:
        f = bw = 0.0
        live: dict[tuple[int, int], torch.Tensor] = {}
        for a in order:
            if a.kind is ActionKind.FORWARD:
                t, live[a.key] = forward(a.stage)
                f += t
            else:
                bw += backward(live.pop(a.key))
        return f, bw

    def alone() -> tuple[float, float]:
        f = bw = 0.0
        for stage in chunks:
            for _ in range(_ALTERNATION_MICROBATCHES):
                t, out = forward(stage)
                f, bw = f + t, bw + backward(out)
        return f, bw

    forward_ratios, backward_ratios = [], []
    for i in range(options.warmup + _ALTERNATION_ROUNDS_PER_REPEAT * options.repeats):
        sync()
        mixed = interleaved()
        sync()
        apart = alone()
        if i >= options.warmup:
            forward_ratios.append(mixed[0] / apart[0])
            backward_ratios.append(mixed[1] / apart[1])
    return Alternation(statistics.median(forward_ratios), statistics.median(backward_ratios), k)


# ---- point to point -------------------------------------------------------------------------------------------

def _ping_pong(rank: int, sizes: Sequence[int], repeats: int, device: torch.device) -> list[LinkSample]:
    """Ranks 0 and 1 bounce each size; one-way time = half the median round trip (measured on rank 0)."""
    out = []
    for n in sizes:
        buf = torch.zeros(max(1, n // 4), dtype=torch.float32, device=device)
        trips = []
        for i in range(repeats + 2):
            if rank == 0:
                t0 = time.perf_counter()
                dist.send(buf, 1)
                dist.recv(buf, 1)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    trips.append(time.perf_counter() - t0)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        if rank == 0:
            out.append(LinkSample(num_bytes=_nbytes(buf), seconds=statistics.median(trips) / 2))
    return out


_CONTENTION_BYTES = 16 * 2**20
"""Bytes each process sends (and receives) while it computes, to measure what a transfer costs a compute."""


def _contention_compute() -> Callable[[], float]:
    """A fixed single-thread compute (an MLP's forward and backward, tens of milliseconds on a CPU core, longer
    than moving :data:`_CONTENTION_BYTES`); returns its seconds when called."""
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(256, 1024, generator=gen, requires_grad=True)
    w2 = torch.randn(1024, 256, generator=gen, requires_grad=True)
    x = torch.randn(256, 256, generator=gen)

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(2):
            (torch.nn.functional.gelu(x @ w1) @ w2).sum().backward()
        w1.grad = w2.grad = None
        return time.perf_counter() - t0
    return run


def _transfer_cpu_cost(rank: int, repeats: int, num_bytes: int = _CONTENTION_BYTES) -> float:
    """Ranks 0 and 1 time a compute alone and while both send and receive ``num_bytes`` (alternating, median
    of each); the slowdown per byte this rank moved (``2 * num_bytes``), 0 if the transfer cost nothing. CPU and
    gloo only: there the backend's threads copy on the cores that compute. Every rank of the group calls it (its
    barriers are the group's); ranks beyond 1 compute alongside and return 0."""
    compute = _contention_compute()
    peer = 1 - rank if rank < 2 else -1
    out = torch.ones(max(1, num_bytes // 4))
    into = torch.empty_like(out)
    alone, busy = [], []
    for i in range(2 * repeats + 2):
        dist.barrier()
        t_alone = compute()
        dist.barrier()
        works = [w for w in (dist.isend(out, peer, tag=7), dist.irecv(into, peer, tag=7)) if w is not None] \
            if peer >= 0 else []
        t_busy = compute()
        for w in works:
            w.wait()
        if i >= 2:
            alone.append(t_alone)
            busy.append(t_busy)
    if peer < 0:
        return 0.0
    return max(0.0, statistics.median(busy) - statistics.median(alone)) / (2 * _nbytes(out))


def _broadcast_time(repeats: int, device: torch.device) -> float:
    t = torch.zeros(1, dtype=torch.float64, device=device)
    ts = []
    for i in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, dist.get_world_size() - 1)
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


_HANDOFF_ROUNDS = 100
"""Hand-offs timed by :func:`_handoffs` (after 4 untimed ones; their mean has a heavy tail)."""


@dataclass(frozen=True, slots=True)
class Handoffs:
    """What :func:`_handoffs` measured on one rank: its messages' delivery times, split by which was posted first."""

    receive_first: tuple[float, ...]
    """Seconds from the send's post to arrival, for messages whose receive was already posted."""
    send_first: tuple[float, ...]
    """Seconds from the receive's post to arrival, for messages whose send was posted before it."""
    num_bytes: int
    """Bytes per message."""


def _handoffs(rank: int, options: ProfileOptions, device: torch.device, dtype: torch.dtype) -> Handoffs:
    """Ranks 0 and 1 run 1F1B's steady state between two stages of one block each, the executor's way, and time
    every message from the moment it is both sent and awaited (the later of the send's post time, carried in the
    payload, and the receive's) to its arrival. Rank 0 runs a forward, posts ``[send activation, receive
    gradient]``, waits for the gradient and runs the backward of an earlier micro-batch; rank 1 posts ``[send
    gradient, receive activation]``, waits, runs forward and backward. Their cycles are as long, so as in a
    pipeline either side is sometimes late: a receive posted after its message was sent waits for the sender's
    communication thread, which on a CPU host competes with the sender's compute (gloo moves a message only once
    its receive is posted). At the smallest profiled size. Every rank of the group calls it; ranks beyond 1 compute
    alongside and time nothing."""
    from evenpipe.runtime.comm import Transfer, post_batch
    peer = 1 - rank if rank < 2 else -1
    built = _build(options, device, dtype)
    stage = _blocks_as_stage([built.parts.blocks[0]])
    _, hidden = _sample_inputs(options, min(options.microbatch_sizes), (options.seq_lens or
                                                                         (options.model_config.seq_len,))[0],
                               device, dtype)
    grad = torch.randn_like(hidden)
    words = max(1, _nbytes(hidden) // 8)  # float64 words: the first carries the send's post time
    group = dist.group.WORLD
    receive_first: list[float] = []
    send_first: list[float] = []
    sending = None
    held: list[torch.Tensor] = []  # rank 0: outputs of forwards whose backward comes a round later

    def forward() -> None:
        held.append(stage(hidden.detach().requires_grad_(True)))

    def backward() -> None:
        held.pop(0).backward(grad)

    if rank == 0:
        forward()
    for i in range(_HANDOFF_ROUNDS + 4):
        if peer < 0:
            forward()
            backward()
            continue
        if rank == 0:
            forward()
        out = torch.zeros(words, dtype=torch.float64)
        into = torch.empty_like(out)
        posted = time.perf_counter()
        out[0] = posted
        batch = post_batch([Transfer(send=True, tensor=out, peer=peer, group=group, tag=100 + i),
                            Transfer(send=False, tensor=into, peer=peer, group=group, tag=100 + i)])
        batch.wait_for(into)
        arrived = time.perf_counter()
        if sending is not None:
            sending.wait_sends()
        sending = batch
        sent = float(into[0])
        if i >= 4:
            (send_first if sent < posted else receive_first).append(arrived - max(posted, sent))
        if rank == 1:
            forward()
        backward()
    if sending is not None:
        sending.wait_sends()
    held.clear()
    for p in stage.parameters():
        p.grad = None
    return Handoffs(tuple(receive_first), tuple(send_first), 8 * words)


def _handoff_terms(per_rank: Sequence[Handoffs]) -> tuple[float, float, int]:
    """The link's latency for a message whose receive waits (mean over both ranks) and the extra a message takes
    when its receive is posted after its send (difference of the means, at least 0), and their message size."""
    first = [t for h in per_rank for t in h.receive_first]
    late = [t for h in per_rank for t in h.send_first]
    if not first and not late:
        return 0.0, 0.0, 0
    waiting = statistics.fmean(first) if first else 0.0
    extra = max(0.0, statistics.fmean(late) - waiting) if late and first else 0.0
    return waiting, extra, per_rank[0].num_bytes


# ---- processes ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerResult:
    """What one profiling process measured (sent to the parent through a queue)."""

    rank: int
    layers: dict[LayerKind, list[LayerSample]]
    """Samples per layer kind (empty where this process did not measure layers: one GPU, rank > 0)."""
    optimizer_s: dict[LayerKind, float]
    """Optimizer seconds per layer, per kind (empty where layers were not measured)."""
    link: list[LinkSample]
    """Ping-pong times per message size (empty with one process)."""
    step_overhead_s: float
    """Seconds of one small collective (0 with one process)."""
    backend: str
    transfer_cpu_s_per_byte: float
    """Compute slowdown per byte moved (CPU only; 0 where not measured)."""
    handoffs: Handoffs
    """1F1B hand-off times (CPU ranks 0 and 1; empty elsewhere)."""
    alternation: Alternation
    """Interleaved-order factors (1.0 where not measured)."""


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """A profiling process failed: ``message`` names the rank and the error, with a short traceback."""

    message: str


def _worker(rank: int, world: int, port: int, options: ProfileOptions, show: bool, queue: Any) -> None:
    try:
        torch.set_num_threads(1 if options.device == "cpu" else torch.get_num_threads())
        backend = "nccl" if options.device == "cuda" and torch.cuda.device_count() >= world else "gloo"
        device = torch.device(options.device)
        if world > 1:
            if backend == "nccl":
                torch.cuda.set_device(rank)
                device = torch.device(f"cuda:{rank}")
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=600))
        measuring = options.device == "cpu" or rank == 0  # one GPU: only rank 0 measures layers on it
        steps = options.warmup + options.repeats + 3
        progress = _Progress(steps, enabled=show and rank == 0)
        sync = dist.barrier if world > 1 and options.device == "cpu" else (lambda: None)
        layers = measure_layers(options, progress=progress, sync=sync) if measuring else {}
        opt = _optimizer_times(options, repeats=options.repeats, sync=sync) if measuring else {}
        progress.step("optimizer step")
        alternation = _alternation(options, device, DTYPES[options.dtype], sync=sync) if measuring \
            else Alternation(1.0, 1.0, 0)
        progress.step("two chunks in turn")
        link: list[LinkSample] = []
        overhead = cpu_per_byte = 0.0
        handoff = Handoffs((), (), 0)
        if world > 1 and (backend == "nccl" or device.type == "cpu"):
            dist.barrier()
            link = _ping_pong(rank, options.link_sizes, options.repeats, device if backend == "nccl"
                              else torch.device("cpu"))
            overhead = _broadcast_time(options.repeats, device if backend == "nccl" else torch.device("cpu"))
            if device.type == "cpu":
                dist.barrier()
                cpu_per_byte = _transfer_cpu_cost(rank, options.repeats)
                dist.barrier()
                handoff = _handoffs(rank, options, device, DTYPES[options.dtype])
        progress.step("point-to-point messages")
        queue.put(WorkerResult(rank=rank, layers=layers, optimizer_s=opt, link=link, step_overhead_s=overhead,
                               backend=backend, transfer_cpu_s_per_byte=cpu_per_byte, handoffs=handoff,
                               alternation=alternation))
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:  # report to the parent, never hang it
        queue.put(WorkerFailure(f"profiling rank {rank} failed: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc(limit=4)}"))


def _machine(options: ProfileOptions, backend: str, world: int) -> Machine:
    if options.device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = _cpu_name()
    return Machine(device=options.device, device_name=name, num_threads=1 if options.device == "cpu" else
                   torch.get_num_threads(), num_processes=world, torch_version=str(torch.__version__),
                   dtype=options.dtype, backend=backend, hostname=platform.node())


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def _model_info(options: ProfileOptions) -> ModelInfo:
    cfg = options.model_config
    arch = getattr(cfg.arch, "value", str(cfg.arch))
    return ModelInfo(name=options.model_name, arch=arch, num_layers=cfg.num_layers, hidden=cfg.hidden,
                     vocab=cfg.vocab, seq_len=cfg.seq_len,
                     params={"embedding": cfg.embedding_params, "block": cfg.params_per_layer,
                             "head": cfg.final_norm_params + cfg.vocab * cfg.hidden})  # the head's own copy


def profile_model(options: ProfileOptions, *, show_progress: bool = True, timeout_s: float = 3600.0) -> Profile:
    """Run the whole measurement in ``options.num_processes`` processes and return the profile (their rendezvous
    store hosted by this process, as ``train``'s launcher hosts its workers')."""
    world = options.num_processes
    if options.device == "cuda":
        world = 2 if torch.cuda.device_count() >= 2 and world >= 2 else 1
    with hosted_rendezvous(world) as port:
        return _profile_in(options, world, port, show_progress=show_progress, timeout_s=timeout_s)


def _profile_in(options: ProfileOptions, world: int, port: int, *, show_progress: bool,
                timeout_s: float) -> Profile:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1" if options.device == "cpu" else (env_threads or "")
    procs = [ctx.Process(target=_worker, args=(r, world, port, options, show_progress, queue), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        results: dict[int, WorkerResult] = {}
        while len(results) < world:
            try:
                item = queue.get(timeout=2.0)
            except Exception:  # queue.Empty
                if time.monotonic() > deadline or all(not p.is_alive() for p in procs):
                    raise ProfileError("profiling processes stopped without a result") from None
                continue
            if isinstance(item, WorkerFailure):
                raise ProfileError(item.message.splitlines()[0] + "\n" + "\n".join(item.message.splitlines()[1:]))
            results[item.rank] = item
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    return _combine(options, world, results)


def _combine(options: ProfileOptions, world: int, results: dict[int, WorkerResult]) -> Profile:
    """One profile from every process's result (rank 0's link, overhead and backend)."""
    first = results[0]
    measured = [r for r in results.values() if r.layers]
    pair = [results[r].transfer_cpu_s_per_byte for r in (0, 1) if r in results]  # the two that exchanged
    waiting, late, handoff_bytes = _handoff_terms([results[r].handoffs for r in (0, 1) if r in results])
    alternations = [r.alternation for r in measured]
    return Profile(machine=_machine(options, first.backend, world), model=_model_info(options),
                   layers=_merge_layers([r.layers for r in measured]),
                   optimizer_s={k: statistics.median(r.optimizer_s[k] for r in measured) for k in first.optimizer_s},
                   link=tuple(first.link), step_overhead_s=first.step_overhead_s,
                   transfer_cpu_s_per_byte=statistics.mean(pair) if world > 1 else 0.0,
                   handoff_latency_s=waiting, late_receive_s=late, handoff_bytes=handoff_bytes,
                   alternation_forward=statistics.mean(a.forward for a in alternations),
                   alternation_backward=statistics.mean(a.backward for a in alternations),
                   alternation_blocks=alternations[0].blocks,
                   repeats=options.repeats, warmup=options.warmup,
                   block_chain=options.chain_length)


def _merge_layers(per_process: list[dict[LayerKind, list[LayerSample]]]) -> dict[LayerKind, tuple[LayerSample, ...]]:
    """Every process's samples in one: times are the median over processes of their means (the processes
    measured the same layers at the same time), bytes are rank 0's (they are the same everywhere)."""
    import dataclasses
    first = per_process[0]
    out = {}
    for kind, samples in first.items():
        merged = []
        for i, s in enumerate(samples):
            times: dict[str, Any] = {q: statistics.median(p[kind][i].value(q) for p in per_process)
                                     for q in TIME_FIELDS}
            merged.append(dataclasses.replace(s, **times))
        out[kind] = tuple(merged)
    return out
