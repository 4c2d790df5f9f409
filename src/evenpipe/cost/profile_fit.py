"""From a measured :class:`~evenpipe.cost.profile.Profile` to predictions: fits, stage costs, step time.

Pure. Every per-layer time and byte count is fitted by least squares against the micro-batch size ``b``
(``y = a + c*b``), or, when the profile holds more than one sequence length ``s``, against the tokens
(``y = a + c*b*s + d*b*s^2``: linear layers scale with tokens, attention scores with ``b*s^2``). Residuals are
reported relative to the measurement; sizes that were not profiled are predicted from the fit.

Stage costs (one micro-batch on one stage, the layers it holds): durations add up over its layers; its activation
unit is what the runtime's activation stash counts: every layer's saved bytes, plus each layer's input where the
layer saves it, except that a stage receiving its input from another stage keeps that input for its backward
anyway (``output_bytes`` of the block before it). Recomputation keeps only that input (``checkpoint_bytes``).

Step time: the simulator runs the schedule's actions; a training step also runs the optimizer on every rank after
its last action and a few fixed operations (sharing the loss). The predicted step is the latest rank's last action
plus its optimizer time, plus the fixed overhead. The next step starts on rank 0, which holds the first and, in
every schedule here, the last computation, so this is also the period of back-to-back steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from evenpipe.cost.profile import QUANTITIES, LayerKind, LayerSample, Profile, ProfileError
from evenpipe.cost.shape import MicrobatchShape
from evenpipe.schedule.ir import ActionKind, Schedule
from evenpipe.sim.costs import Link, SimCosts, StageCosts
from evenpipe.sim.dispatch import simulate
from evenpipe.sim.trace import Trace

__all__ = ["Fit", "fit_least_squares", "ProfileModel", "link_from_profile", "StepPrediction",
           "predict_step", "held_output_bytes", "even_layout", "EfficiencyPoint"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """A linear least-squares fit ``y = sum(coef_i * feature_i)``."""

    features: tuple[str, ...]
    """Names of the features, e.g. ``("1", "b")``."""
    coefficients: tuple[float, ...]
    """One per feature."""
    points: tuple[tuple[tuple[float, ...], float], ...]
    """The fitted points: feature values and the measured value."""

    def predict_features(self, xs: Sequence[float]) -> float:
        return sum(c * x for c, x in zip(self.coefficients, xs))

    @property
    def residuals(self) -> tuple[float, ...]:
        """Per point, ``(fit - measured) / measured`` (0 where the measurement is 0 and the fit agrees)."""
        out = []
        for xs, y in self.points:
            f = self.predict_features(xs)
            out.append((f - y) / y if y else (0.0 if abs(f) < 1e-12 else math.inf))
        return tuple(out)

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny systems); singular pivots give 0 coefficients."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[piv] = m[piv], m[c]
        if abs(m[c][c]) < 1e-300:
            continue
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(n)]


def fit_least_squares(features: Sequence[str], rows: Sequence[Sequence[float]], ys: Sequence[float], *,
                      relative: bool = False) -> Fit:
    """Least squares of ``ys`` on ``rows`` (one row of feature values per point). With fewer points than
    features, the leading features are dropped (one point: proportional to the last feature). ``relative``
    minimises relative instead of absolute residuals (for points spanning decades, like message sizes).

    Every quantity fitted here (a time, a byte count, FLOPs) is a fixed part plus parts that grow with the
    features, none negative; so no coefficient is negative: where the free fit gives one (noisy times, e.g. one
    slow sample at the smallest size), the most negative feature is dropped and the rest fitted again. A fit
    with no negative coefficient is the plain least-squares fit."""
    if relative:
        w = [1.0 / y if y > 0 else 1.0 for y in ys]
        weighted = fit_least_squares(features, [[v * wi for v in row] for row, wi in zip(rows, w)],
                                     [y * wi for y, wi in zip(ys, w)])
        return Fit(features=weighted.features, coefficients=weighted.coefficients,
                   points=tuple((tuple(float(v) for v in row), float(y)) for row, y in zip(rows, ys)))
    k = min(len(features), len(ys))
    keep = list(range(len(features)))
    if k < len(features):  # too few points: keep the slope(s), drop the intercept first
        keep = keep[len(features) - k:]
    while True:
        coef = _fit_on(keep, len(features), rows, ys)
        negative = [i for i in keep if coef[i] < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(min(negative, key=coef.__getitem__))
    return Fit(features=tuple(features), coefficients=tuple(coef),
               points=tuple((tuple(float(v) for v in row), float(y)) for row, y in zip(rows, ys)))


def _fit_on(keep: list[int], num_features: int, rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least-squares coefficients over the features ``keep`` (the others 0), columns scaled for conditioning."""
    sub = [[row[i] for i in keep] for row in rows]
    scale = [max((abs(r[j]) for r in sub), default=1.0) or 1.0 for j in range(len(keep))]
    norm = [[r[j] / scale[j] for j in range(len(keep))] for r in sub]
    ata = [[sum(r[i] * r[j] for r in norm) for j in range(len(keep))] for i in range(len(keep))]
    aty = [sum(r[i] * y for r, y in zip(norm, ys)) for i in range(len(keep))]
    sol = _solve(ata, aty)
    coef = [0.0] * num_features
    for j, i in enumerate(keep):
        coef[i] = sol[j] / scale[j]
    return coef


@dataclass(frozen=True, slots=True, kw_only=True)
class EfficiencyPoint:
    """Achieved forward FLOP/s of one block at one micro-batch size."""

    microbatch_size: int
    """Sequences per micro-batch."""
    measured_flops_per_s: float | None
    """From the measured forward time (None for a size that was not profiled)."""
    predicted_flops_per_s: float
    """From the fitted forward time."""


class ProfileModel:
    """Fits of every quantity of every layer kind of one profile; predicts any size."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.multi_seq = len(profile.seq_lens) > 1
        self.features = ("1", "b*s", "b*s^2") if self.multi_seq else ("1", "b")
        self.fits: dict[tuple[LayerKind, str], Fit] = {}
        for kind, samples in profile.layers.items():
            rows = [self._row(s.microbatch_size, s.seq_len) for s in samples]
            for q in QUANTITIES:
                self.fits[(kind, q)] = fit_least_squares(self.features, rows, [s.value(q) for s in samples])

    def _row(self, b: int, s: int) -> tuple[float, ...]:
        return (1.0, float(b * s), float(b * s * s)) if self.multi_seq else (1.0, float(b))

    def _shape_row(self, shape: MicrobatchShape, seq_len: int) -> tuple[float, ...]:
        if self.multi_seq:
            return (1.0, float(shape.num_tokens), float(shape.sum_squares))
        return (1.0, shape.num_tokens / seq_len)

    def check_seq_len(self, seq_len: int) -> None:
        """ProfileError unless ``seq_len`` can be predicted (profiled, or several lengths profiled)."""
        self._seq(seq_len)

    def _seq(self, seq_len: int | None) -> int:
        if seq_len is None:
            return self.profile.seq_lens[-1]
        if not self.multi_seq and seq_len != self.profile.seq_lens[0]:
            raise ProfileError(f"the profile was measured at sequence length {self.profile.seq_lens[0]} only, "
                               f"not {seq_len}; profile with --seq-len {seq_len} (or several lengths)")
        return seq_len

    def predict(self, kind: LayerKind, microbatch_size: int, seq_len: int | None = None, *,
                shape: MicrobatchShape | None = None) -> LayerSample:
        """Every quantity of ``kind`` at ``microbatch_size`` (and ``seq_len``) from the fits, clipped at 0 (a
        :class:`LayerSample` as if measured; ``forward_flops`` is not predicted and stays 0). ``shape``: a
        micro-batch of documents of varying length, predicted at its tokens and squared lengths in place of
        ``b*s`` and ``b*s^2`` (a profile of one length fits ``b`` alone, so there its tokens count as
        ``tokens / s`` rows and attention's quadratic share is not told apart)."""
        if microbatch_size < 1:
            raise ProfileError(f"micro-batch size must be >= 1, got {microbatch_size}")
        s = self._seq(seq_len)
        row = self._row(microbatch_size, s) if shape is None or shape.padded else self._shape_row(shape, s)
        values = {q: max(0.0, self.fits[(kind, q)].predict_features(row)) for q in QUANTITIES}
        return LayerSample(microbatch_size=microbatch_size, seq_len=s, **values)

    def residual_table(self) -> list[tuple[LayerKind, str, float]]:
        """``(kind, quantity, max |relative residual|)`` for every fit."""
        return [(k, q, f.max_abs_residual) for (k, q), f in self.fits.items()]

    def efficiency(self, sizes: Sequence[int]) -> list[EfficiencyPoint]:
        """Achieved FLOP/s of one block's forward at each size (measured where profiled, and from the fit)."""
        samples = {s.microbatch_size: s for s in self.profile.layers[LayerKind.BLOCK]
                   if s.seq_len == self.profile.seq_lens[-1]}
        flops_fit = fit_least_squares(self.features, [self._row(s.microbatch_size, s.seq_len) for s in samples.values()],
                                      [s.forward_flops for s in samples.values()])
        out = []
        for b in sizes:
            row = self._row(b, self.profile.seq_lens[-1])
            flops = flops_fit.predict_features(row)
            pred_t = self.fits[(LayerKind.BLOCK, "forward_s")].predict_features(row)
            meas = samples.get(b)
            out.append(EfficiencyPoint(
                microbatch_size=b,
                measured_flops_per_s=meas.forward_flops / meas.forward_s if meas and meas.forward_s > 0 else None,
                predicted_flops_per_s=flops / pred_t if pred_t > 0 else 0.0))
        return out

    # -- stages -------------------------------------------------------------------------------------------
    def stage_costs(self, *, blocks: int, first: bool, last: bool, microbatch_size: int, split_backward: bool,
                    seq_len: int | None = None, action_overhead_s: float = 0.0,
                    alternating: bool = False, shape: MicrobatchShape | None = None) -> StageCosts:
        """Costs of one stage holding ``blocks`` transformer blocks (plus the embedding / head).

        ``split_backward``: the schedule runs ``I`` and ``W`` (zero-bubble), so the backward is their two
        measured parts (on the first stage, whose input needs no gradient, ``I`` is empty and ``W`` the full
        backward, as the runtime runs them); otherwise ``B`` is the measured full backward (``backward_weight``
        0). ``alternating``: the stage's rank holds other stages too, so its blocks take the profile's
        alternation factors times their times. ``shape``: a micro-batch of documents of varying length
        (:meth:`predict`)."""
        b = microbatch_size
        block = self.predict(LayerKind.BLOCK, b, seq_len, shape=shape)
        layers = ([self.predict(LayerKind.EMBEDDING, b, seq_len, shape=shape)] if first else []) + [block] * blocks \
            + ([self.predict(LayerKind.HEAD, b, seq_len, shape=shape)] if last else [])
        held_input = 0.0 if first else block.output_bytes
        unit = held_input + sum(lc.saved_bytes for lc in layers) + sum(lc.input_saved_bytes for lc in layers[1:])
        if first:
            unit += layers[0].input_saved_bytes
        elif layers:
            unit += max(0.0, layers[0].input_saved_bytes - held_input)

        factor = {q: self.profile.alternation_forward for q in ("forward_s", "recompute_s")} \
            | {q: self.profile.alternation_backward for q in ("backward_s", "backward_input_s", "backward_weight_s")} \
            if alternating else {}

        def total(q: str) -> float:  # the blocks' share taken ``factor`` times (bytes and the ends: once)
            return sum(getattr(lc, q) for lc in layers) + (factor.get(q, 1.0) - 1.0) * blocks * getattr(block, q)
        # I frees only what each layer's I frees (a loss's saved tensors): the inputs and the held one stay for W
        weight_grad = max(0.0, unit - (total("saved_bytes") - total("weight_grad_bytes")))
        if split_backward and first:
            # the first stage's input (tokens) needs no gradient: the runtime's I does nothing and W is the whole
            # backward, so everything saved is kept until W
            bi, bw, weight_grad = 0.0, total("backward_s"), unit
        elif split_backward:
            bi, bw = total("backward_input_s"), total("backward_weight_s")
        else:
            bi, bw = total("backward_s"), 0.0
        return StageCosts(forward=total("forward_s") + action_overhead_s, backward_input=bi + action_overhead_s,
                          backward_weight=bw + (action_overhead_s if split_backward else 0.0),
                          recompute=total("recompute_s") + action_overhead_s, activation_bytes=unit,
                          checkpoint_bytes=held_input, weight_grad_bytes=weight_grad,
                          output_bytes=0.0 if last else layers[-1].output_bytes)

    def sim_costs(self, schedule: Schedule, *, microbatch_size: int, layout: Sequence[int] | None = None,
                  seq_len: int | None = None, shapes: Sequence[MicrobatchShape] | None = None) -> SimCosts:
        """Per-stage costs of ``schedule`` with ``layout`` blocks per stage (default :func:`even_layout`) and the
        profile's link between every pair of ranks; where a rank holds several stages (interleaved, V-shaped),
        blocks take the profile's alternation factors. ``shapes``: one per micro-batch (documents of varying
        length), each priced at its own tokens and squared lengths."""
        n = schedule.num_stages
        counts = list(layout) if layout is not None else even_layout(self.profile.model.num_layers, n)
        if len(counts) != n or sum(counts) != self.profile.model.num_layers or min(counts) < 0:
            raise ProfileError(f"layout {counts} must give {n} stages blocks summing to the profiled model's "
                               f"{self.profile.model.num_layers}")
        split = any(a.kind is ActionKind.BACKWARD_INPUT for acts in schedule.actions for a in acts)
        alternating = any(len(schedule.stages_of(r)) > 1 for r in range(schedule.num_ranks))
        def row(shape: MicrobatchShape | None) -> list[StageCosts]:
            return [self.stage_costs(blocks=counts[s], first=s == 0, last=s == n - 1, microbatch_size=microbatch_size,
                                     split_backward=split, seq_len=seq_len, alternating=alternating, shape=shape)
                    for s in range(n)]
        link = link_from_profile(self.profile)
        if shapes is None:
            return SimCosts.from_stages(row(None), default_link=link)
        rows = {sh: row(sh) for sh in set(shapes)}
        return SimCosts.per_microbatch([rows[sh] for sh in shapes], default_link=link)

    def optimizer_s(self, schedule: Schedule, layout: Sequence[int] | None = None) -> tuple[float, ...]:
        """Per rank, the optimizer step's seconds for the parameters of the stages it holds."""
        n = schedule.num_stages
        counts = list(layout) if layout is not None else even_layout(self.profile.model.num_layers, n)
        opt = self.profile.optimizer_s
        per_stage = [counts[s] * opt[LayerKind.BLOCK] + (opt[LayerKind.EMBEDDING] if s == 0 else 0.0)
                     + (opt[LayerKind.HEAD] if s == n - 1 else 0.0) for s in range(n)]
        return tuple(sum(per_stage[s] for s in schedule.stages_of(r)) for r in range(schedule.num_ranks))


def even_layout(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Blocks per stage as even as possible, the extra blocks on the middle stages (embedding and head weigh on
    the ends). For the reference models' default split (balanced by parameters) with blocks dominating, this is
    the runtime's layout; pass the layout explicitly otherwise."""
    if num_stages < 1 or num_blocks < num_stages:
        raise ProfileError(f"{num_blocks} blocks cannot fill {num_stages} stages (each needs at least one)")
    base, extra = divmod(num_blocks, num_stages)
    order = sorted(range(num_stages), key=lambda s: (abs(s - (num_stages - 1) / 2), s))
    plus = set(order[:extra])
    return tuple(base + (1 if s in plus else 0) for s in range(num_stages))


def link_from_profile(profile: Profile) -> Link:
    """Latency and bandwidth fitted to the profile's message times, relative residuals weighted alike from 4 B
    to megabytes (a free link when none were measured), and the compute time a transfer takes from each end.
    Where the profile timed hand-offs between computing processes, the latency is raised so that a message of
    their size whose receive waits takes ``handoff_latency_s``, and a receive posted after its send costs
    ``late_receive_s`` more: a pipeline's messages travel between busy processes, and on a CPU host that costs
    more than the idle ping-pong shows."""
    cpu = profile.transfer_cpu_s_per_byte
    latency, per_byte = 0.0, 0.0
    if len(profile.link) == 1:
        latency = profile.link[0].seconds
    elif profile.link:
        fit = fit_least_squares(("1", "bytes"), [(1.0, float(s.num_bytes)) for s in profile.link],
                                [s.seconds for s in profile.link], relative=True)
        latency, per_byte = fit.coefficients
    per_byte = max(0.0, per_byte)
    latency = max(0.0, latency, profile.handoff_latency_s - per_byte * profile.handoff_bytes)
    late = profile.late_receive_s
    if per_byte <= 0:
        return Link(latency_s=latency, cpu_s_per_byte=cpu, late_receive_s=late)
    return Link(latency_s=latency, bandwidth_bytes_per_s=1.0 / per_byte, cpu_s_per_byte=cpu, late_receive_s=late)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPrediction:
    """A predicted training step."""

    trace: Trace
    """The simulated schedule (actions, transfers, memory)."""
    optimizer_s: tuple[float, ...]
    """Per rank, optimizer seconds after its last action."""
    overhead_s: float
    """Fixed per-step seconds."""
    output_bytes: tuple[float, ...] = ()
    """Per rank, the largest stage output it sends: the runtime holds a stage's output from the end of its forward
    until the send is posted, which is the moment activation memory peaks (it only grows at a forward)."""

    @property
    def rank_step_times(self) -> tuple[float, ...]:
        """Per rank, its last action's end plus its optimizer step plus the fixed overhead."""
        ends = [max((rec.end for rec in acts), default=0.0) for acts in self.trace.actions]
        return tuple(e + o + self.overhead_s for e, o in zip(ends, self.optimizer_s))

    @property
    def step_time(self) -> float:
        return max(self.rank_step_times, default=0.0)

    @property
    def peak_activation_bytes(self) -> tuple[float, ...]:
        """Per rank, the simulated peak plus the stage output held at that moment."""
        extra = self.output_bytes or (0.0,) * self.trace.num_ranks
        return tuple(p + o for p, o in zip(self.trace.peak_activation_bytes, extra))


def predict_step(model: ProfileModel, schedule: Schedule, *, microbatch_size: int,
                 layout: Sequence[int] | None = None, seq_len: int | None = None,
                 shapes: Sequence[MicrobatchShape] | None = None) -> StepPrediction:
    """Simulate ``schedule`` with the profile's costs (per micro-batch with ``shapes``) and add the optimizer and
    fixed per-step time."""
    costs = model.sim_costs(schedule, microbatch_size=microbatch_size, layout=layout, seq_len=seq_len, shapes=shapes)
    trace = simulate(schedule, costs)
    return StepPrediction(trace=trace, optimizer_s=model.optimizer_s(schedule, layout),
                          overhead_s=model.profile.step_overhead_s, output_bytes=held_output_bytes(schedule, costs))


def held_output_bytes(schedule: Schedule, costs: SimCosts) -> tuple[float, ...]:
    """Per rank, the largest stage output it sends: what the runtime holds on top of the simulated activations
    at the end of a forward, before the send is posted (see :attr:`StepPrediction.output_bytes`)."""
    return tuple(max((costs.stages[s].output_bytes for s in schedule.stages_of(r)), default=0.0)
                 for r in range(schedule.num_ranks))
