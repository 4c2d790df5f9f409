"""Pipeline your own ``nn.Module`` parts with any evenpipe schedule under ``torchrun`` (the public API).

    from evenpipe.pipeline import Pipeline, PipelineParts
    parts = PipelineParts(first=embed, blocks=list(layers), last=head)          # your modules
    pipe = Pipeline(parts, loss=my_loss, schedule="bpipe", microbatches=8)     # torchrun sets the world
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)                        # this rank's parameters
    for tokens, targets in batches:                                            # whole global batch, every rank
        result = pipe.step(tokens, targets)                                    # forward + backward, grads set
        opt.step()
        print(result.loss, result.peak_activation_bytes)                       # loss; this rank's memory

``first`` maps the model input of one micro-batch to hidden states, every block maps hidden to hidden, ``last``
maps hidden to what ``loss(output, targets)`` takes. Every process builds the same parts (same initial weights);
each keeps only its stages' parameters in the optimizer. The world is ``pp x dp`` processes (``dp`` given,
``pp = world / dp``). Loss and gradients equal un-pipelined training on the whole batch with a mean loss.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from evenpipe.errors import ConfigError
from evenpipe.models.adapter import LossFn
from evenpipe.models.lm import PipelineParts
from evenpipe.runtime.comm import DEFAULT_TIMEOUT_S, build_groups, init_from_env
from evenpipe.runtime.executor import PipelineExecutor, StepResult
from evenpipe.runtime.stages import StageModule, build_stage_modules
from evenpipe.schedule import ScheduleFamily, build_schedule

__all__ = ["Pipeline", "PipelineParts", "StepResult"]


class Pipeline:
    """This process's stages of ``parts`` and the executor that runs them with ``schedule``.

    ``schedule``: gpipe, 1f1b, interleaved, looped-bfs, zb-h1 or bpipe (``chunks`` stages per rank for the
    interleaved families); ``layout``: blocks per stage (default: balanced by parameter count, embedding and head
    counted on their stages); ``recompute``: full activation recomputation; ``bpipe_budget``: BPipe's per-rank
    activation units. Initialises torch.distributed from torchrun's environment when it is not yet (gloo on CPU,
    nccl on GPUs).
    """

    def __init__(self, parts: PipelineParts, *, loss: LossFn, schedule: "str | ScheduleFamily" = "1f1b",
                 microbatches: int, chunks: int = 1, dp: int = 1, layout: Sequence[int] | None = None,
                 bpipe_budget: int | None = None, recompute: bool = False, free_outputs: bool = True,
                 device: "torch.device | str | None" = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        family = ScheduleFamily.parse(schedule)
        if not dist.is_initialized():
            init_from_env("nccl" if torch.cuda.is_available() else "gloo", timeout_s=timeout_s)
        world = dist.get_world_size()
        if dp < 1 or world % dp:
            raise ConfigError(f"dp {dp} does not divide the world of {world} processes")
        pp = world // dp
        groups = build_groups(pp, dp, timeout_s=timeout_s)
        assert groups is not None
        self.groups = groups
        self.schedule = build_schedule(family, num_ranks=pp, num_microbatches=microbatches, num_chunks=chunks,
                                       bpipe_budget=bpipe_budget if family is ScheduleFamily.BPIPE else None,
                                       recompute=recompute)
        if device is None:
            device = (torch.device(f"cuda:{torch.cuda.current_device()}")
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        self.stages: dict[int, StageModule] = build_stage_modules(
            parts, num_stages=self.schedule.num_stages, stages=self.schedule.stages_of(groups.pp_rank),
            layout=layout)
        for mod in self.stages.values():
            mod.to(self.device)
        from evenpipe.runtime.stash import ActivationStash
        self.executor = PipelineExecutor(schedule=self.schedule, stages=self.stages, groups=groups, loss_fn=loss,
                                         free_outputs=free_outputs, stash=ActivationStash(), device=self.device)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for its optimizer."""
        return list({id(p): p for m in self.stages.values() for p in m.parameters()}.values())

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """One global batch (the whole batch, identical on every rank): sets this rank's ``.grad``s and returns
        the mean loss and this rank's measured activation memory (``peak_activation_bytes`` and parts)."""
        return self.executor.step(inputs, targets)

    @property
    def rank(self) -> int:
        """This process's pipeline rank."""
        return self.groups.pp_rank


