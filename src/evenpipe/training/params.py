"""This rank's parameters under canonical names, and which of them it *owns* in whole-model reductions.

A parameter's canonical name is its name in the whole model (``blocks.3.attn.qkv.weight``), so it does not depend
on how the model is cut into stages or placed on ranks; checkpoints store parameters under it. A parameter that
several stages share (a tied embedding) has one canonical name (the whole model's first) and is *owned* by the
lowest stage that holds it, so a sum over ranks (a gradient norm) counts it once. Data-parallel replicas hold
identical gradients after their all-reduce; whole-model sums run inside one replica's pipeline group, never across
replicas, so every parameter counts exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from torch import nn

__all__ = ["RankParameters", "rank_parameters", "build_rank_stages"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankParameters:
    """The parameters one pipeline rank holds, by canonical name."""

    named: dict[str, nn.Parameter]
    """Canonical name -> parameter, for every parameter this rank's stages use (each object once)."""
    owned: frozenset[str]
    """Names this rank counts in whole-model sums (it holds the lowest stage using the parameter)."""

    @property
    def owned_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named.items() if name in self.owned]


def rank_parameters(model: nn.Module, all_stages: Mapping[int, nn.Module], mine: set[int] | frozenset[int], *,
                    prepare: Callable[[dict[int, nn.Module]], None] | None = None) -> RankParameters:
    """Canonical names of the parameters of stages ``mine``; ``all_stages`` holds every stage of the model (cheap
    wrappers sharing the model's modules), so the owner of a shared parameter is known on every rank.

    ``prepare``, when given, runs on the stages ``mine`` after their parameters are named and may replace them
    (tensor parallelism and FSDP do, and FSDP gives each end of a tied weight its own object): the names and
    owners found before it are attached to the parameters found at the same place in the stages after it."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, int] = {}
    for s in sorted(all_stages):
        for p in all_stages[s].parameters():
            owner.setdefault(id(p), s)
    places = {(s, where): (canonical[id(p)], owner[id(p)]) for s in sorted(mine)
              for where, p in all_stages[s].named_parameters(remove_duplicate=False)}
    if prepare is not None:
        prepare({s: all_stages[s] for s in sorted(mine)})
    named: dict[str, nn.Parameter] = {}
    owned: set[str] = set()
    for s in sorted(mine):
        for where, p in all_stages[s].named_parameters(remove_duplicate=False):
            name, first = places[(s, where)]
            named.setdefault(name, p)
            if first in mine:
                owned.add(name)
    return RankParameters(named=named, owned=frozenset(owned))


def build_rank_stages(module: nn.Module, parts: Any, schedule: Any, pp_rank: int, *,
                      layout: Sequence[int] | None = None,
                      prepare: Callable[[dict[int, nn.Module]], None] | None = None) -> \
        tuple[dict[int, nn.Module], RankParameters]:
    """The stage modules pipeline rank ``pp_rank`` runs under ``schedule``, cut from ``parts`` (the pipeline parts
    of the whole model ``module``, sharing its parameters), and its :class:`RankParameters`. ``prepare`` runs on
    those stages (see :func:`rank_parameters`)."""
    from evenpipe.runtime.stages import build_stage_modules
    every = build_stage_modules(parts, num_stages=schedule.num_stages, stages=range(schedule.num_stages),
                                layout=layout)
    mine = set(schedule.stages_of(pp_rank))
    return {s: every[s] for s in sorted(mine)}, rank_parameters(module, every, mine, prepare=prepare)
