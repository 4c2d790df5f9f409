"""From a planned configuration to the command that runs it: ``torchrun ... -m evenpipe train ...``.

Pure: builds argument lists, starts nothing. Every option of the printed ``train`` command exists in
``evenpipe train`` (a test runs one); what the runtime cannot do yet is said in :attr:`LaunchCommand.notes`
instead of being silently dropped:

- sequence parallelism for a Hugging Face model (the runtime shards the reference blocks only) or a sequence
  length that ``tp`` does not divide: the command runs without it.

Processes: ``tp * pp * dp`` in all, ``min(total, gpus_per_node)`` per node (tensor parallelism innermost in the
runtime's mesh, so a tensor-parallel group stays inside a node). One node uses ``--standalone``; more nodes use a
c10d rendezvous at ``$MASTER_ADDR:29500`` and the same command on every node. The layout is the one the plan
costed (:func:`evenpipe.cost.parallel.stage_layers`), so the run cuts the model where the plan did.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from evenpipe.cost.parallel import ParallelConfig, Recompute, stage_layers
from evenpipe.cost.specs import ModelSpec
from evenpipe.schedule.rank_set import rank_set_text

__all__ = ["LaunchCommand", "launch_command"]

RDZV_PORT = 29500
"""torchrun's customary rendezvous port."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchCommand:
    """The launcher and training arguments of one configuration."""

    num_nodes: int
    """Nodes (machines) the job spans."""
    procs_per_node: int
    """Processes (GPUs) per node."""
    torchrun: tuple[str, ...]
    """``torchrun`` and its options, up to the module to run."""
    train: tuple[str, ...]
    """``evenpipe train`` options."""
    notes: tuple[str, ...] = ()
    """What the planned configuration has that the command cannot ask of the runtime yet."""

    @property
    def argv(self) -> tuple[str, ...]:
        """The whole command line."""
        return (*self.torchrun, "-m", "evenpipe", "train", *self.train)

    def text(self) -> str:
        """The command as one shell line (the rendezvous address stays a shell variable)."""
        return " ".join(a if a.startswith("--rdzv-endpoint=$") else shlex.quote(a) for a in self.argv)

    def to_dict(self) -> dict[str, object]:
        return {"command": self.text(), "num_nodes": self.num_nodes, "procs_per_node": self.procs_per_node,
                "notes": list(self.notes)}


def launch_command(cfg: ParallelConfig, *, model: ModelSpec, model_args: tuple[str, ...],
                   gpus_per_node: int, dtype: str = "float32") -> LaunchCommand:
    """The command that trains ``cfg``; ``model_args`` name the model for ``train`` (e.g. ``("--model", "x")``);
    ``dtype`` is the precision the plan assumed (said when it is not train's default, float32)."""
    total = cfg.num_gpus
    per_node = min(total, gpus_per_node)
    nodes = -(-total // per_node)
    torchrun: tuple[str, ...] = ("torchrun", f"--nproc-per-node={per_node}")
    torchrun = (*torchrun, "--standalone") if nodes == 1 else (
        *torchrun, f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=$MASTER_ADDR:{RDZV_PORT}")
    notes = []
    train = [*model_args, "--seq-len", str(model.seq_len), "--schedule", cfg.schedule.value, "--stages", str(cfg.pp),
             "--chunks", str(cfg.chunks), "--tp", str(cfg.tp), "--dp", str(cfg.dp),
             "--sharding", "optimizer" if cfg.distributed_optimizer else "none",
             "--microbatches", str(cfg.num_microbatches), "--microbatch-size", str(cfg.microbatch_size),
             "--global-batch", str(cfg.global_batch),
             "--layout", ",".join(str(n) for n in stage_layers(model, cfg))]
    if dtype != "float32":
        train += ["--dtype", dtype]
    if cfg.recompute is not Recompute.NONE:
        train += ["--recompute", cfg.recompute.value]
    if cfg.bpipe:  # BPipe's transform on another family (interleaved+bpipe)
        train.append("--bpipe")
    if cfg.bpipe_budget is not None:
        train += ["--bpipe-budget", str(cfg.bpipe_budget)]
    if cfg.offload_ranks:  # host offload on the first k pipeline ranks
        train += ["--offload", rank_set_text(range(cfg.offload_ranks), cfg.pp)]
    if cfg.sequence_parallel and cfg.tp > 1:
        if "--hf-config" in model_args or model.seq_len % cfg.tp:
            notes.append("the runtime's sequence parallelism shards the reference models' sequences into tp equal "
                         "slices: this run keeps the norms replicated over tensor parallelism")
        else:
            train.append("--sequence-parallel")
    return LaunchCommand(num_nodes=nodes, procs_per_node=per_node, torchrun=torchrun, train=tuple(train),
                         notes=tuple(notes))
