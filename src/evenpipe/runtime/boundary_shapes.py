"""Shapes of the messages between stages, for every micro-batch of a step, known before any receive is posted.

Vocabulary: a *boundary* ``s`` is stage ``s``'s output on its way to stage ``s + 1``; when the two stages sit on
different pipeline ranks, the receiver allocates a buffer of the output's shape where its ``RECV_F`` stands (and
the sender one of the same shape for the gradient's ``RECV_B``), so both must know that shape beforehand.

Handshake. The first time, every stage runs one no-grad forward on placeholder input of the micro-batch's shape
(under a forked RNG) in stage order and sends its output's shape and dtype to the next stage's rank.

Micro-batches of different lengths. The micro-batches of a step may differ in their input's last dimension (the
sequence length ``T``: documents, :mod:`evenpipe.runtime.document_batches`). Every boundary's shape is affine in
``T`` (hidden states ``[b, T, h]``; ``[b, T / tp, h]`` under sequence parallelism), so once two lengths have been
handshaken, the shapes of any other length are *derived* (each dimension on the line through the two), on every
rank alike and with no message: every rank holds the whole global batch, so every receive's shape follows from
its micro-batch's input shape. At most two handshakes per input shape apart from its length, ever; a derived
shape that is not a whole number of elements is an error (a length the model cannot take, e.g. one that
sequence parallelism cannot divide).

Every pipeline rank of a replica runs :meth:`BoundaryShapes.for_microbatches` with the same micro-batches, so
each makes the same handshakes in the same order.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Mapping, Sequence

import torch
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.runtime.comm import ParallelGroups, Transfer, post_batch
from evenpipe.runtime.step_context import HANDSHAKE_TAG
from evenpipe.schedule.ir import Schedule

__all__ = ["BoundaryShapes", "ShapeMap"]

ShapeMap = Mapping[int, tuple[tuple[int, ...], torch.dtype]]
"""Boundary ``s`` -> shape and dtype of stage ``s``'s output (those this rank sends or receives)."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)
_MAX_DIMS = 8


class BoundaryShapes:
    """The boundary shapes of each input shape this rank's pipeline has seen (see the module docstring)."""

    def __init__(self, *, schedule: Schedule, stages: Mapping[int, nn.Module], groups: ParallelGroups,
                 device: torch.device) -> None:
        self.schedule, self.stages, self.groups, self.device = schedule, stages, groups, device
        self._known: dict[tuple[int, ...], ShapeMap] = {}
        self._probes: dict[tuple[int, ...], list[tuple[int, ShapeMap]]] = {}
        """Input shape less its length -> up to two ``(length, shapes)`` learned by handshake."""
        self.handshakes = 0
        """Handshakes made so far (each one message per boundary)."""

    def for_microbatches(self, mb_inputs: Sequence[torch.Tensor]) -> list[ShapeMap]:
        """The boundary shapes of each micro-batch, from its input's shape alone."""
        first = {tuple(x.shape): x for x in reversed(mb_inputs)}
        by_shape = {s: self._of(s, first[s].dtype) for s in sorted(first)}
        return [by_shape[tuple(x.shape)] for x in mb_inputs]

    def _of(self, shape: tuple[int, ...], dtype: torch.dtype) -> ShapeMap:
        if shape in self._known:
            return self._known[shape]
        probes = self._probes.setdefault(shape[:-1], [])
        if len(probes) == 2:
            shapes = _derive(probes, shape[-1])
        else:
            shapes = self._handshake(shape, dtype)
            probes.append((shape[-1], shapes))
        self._known[shape] = shapes
        return shapes

    def _handshake(self, input_shape: tuple[int, ...], input_dtype: torch.dtype) -> ShapeMap:
        """Run every stage once on placeholder input, sending each boundary's shape across ranks."""
        self.handshakes += 1
        g, sched = self.groups, self.schedule
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        x: torch.Tensor | None = None
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            for s in range(sched.num_stages - 1):
                here, nxt = sched.rank_of(s), sched.rank_of(s + 1)
                if here == g.pp_rank:
                    if x is None or s - 1 not in self.stages:
                        if s == 0:
                            x = torch.zeros(input_shape, dtype=input_dtype, device=self.device)
                        else:
                            shape, dtype = shapes[s - 1]
                            x = torch.zeros(shape, dtype=dtype, device=self.device)
                    x = self.stages[s](x)
                    shapes[s] = (tuple(x.shape), x.dtype)
                    if nxt != here:
                        header = torch.tensor(_encode(x), dtype=torch.int64, device=self.device)
                        self._exchange(header, send=True, peer=nxt, stage=s)
                elif nxt == g.pp_rank:
                    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                    self._exchange(header, send=False, peer=here, stage=s)
                    shapes[s] = _decode(header)
                    x = None
        return shapes

    def _exchange(self, header: torch.Tensor, *, send: bool, peer: int, stage: int) -> None:
        g = self.groups
        post_batch([Transfer(send=send, tensor=header, peer=g.global_rank(peer), group=g.pp_group,
                             tag=HANDSHAKE_TAG, what=f"shape of stage {stage} output")],
                   timeout_s=g.timeout_s).wait()


def _derive(probes: list[tuple[int, ShapeMap]], length: int) -> ShapeMap:
    """Each boundary's shape at ``length`` on the line through the two probes (dimension by dimension)."""
    (t1, a), (t2, b) = probes
    out: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    for s, (shape1, dtype) in a.items():
        shape2 = b[s][0]
        dims = []
        for d1, d2 in zip(shape1, shape2):
            d = d1 + Fraction(d2 - d1, t2 - t1) * (length - t1)
            if d.denominator != 1 or d < 1:
                raise ConfigError(f"a micro-batch of length {length} gives stage {s} an output dimension of {d} "
                                  f"(from {shape1} at length {t1} and {shape2} at {t2}); choose lengths the model "
                                  "divides evenly (sequence parallelism: a multiple of tp)")
            dims.append(int(d))
        out[s] = (tuple(dims), dtype)
    return out


def _encode(x: torch.Tensor) -> list[int]:
    if x.dim() > _MAX_DIMS:
        raise ConfigError(f"stage outputs of more than {_MAX_DIMS} dimensions are not supported, got "
                          f"{tuple(x.shape)}")
    return [x.dim(), _DTYPES.index(x.dtype), *x.shape, *([0] * (_MAX_DIMS - x.dim()))]


def _decode(header: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    vals = header.tolist()
    return tuple(vals[2:2 + vals[0]]), _DTYPES[vals[1]]
