"""The planner (pure Python): search parallel configurations and schedules, and explain whether BPipe
(or which memory lever) pays.

:func:`plan_configs` (or a :class:`Searcher`, which caches across searches; ``Searcher.over(source)`` for any
cost source, analytic or profiled) returns a :class:`PlanResult` of :class:`Candidate` records;
:func:`explain_bpipe` returns a :class:`BPipeExplanation`; :func:`explain_memory` a :class:`MemoryAnswer`. Presentation lives in
``evenpipe.commands.plan`` (and ``evenpipe.commands.plan_explain`` for ``--explain bpipe``).

The explanations (``explain_bpipe``, ``explain_memory`` and their records) load on first use: a plain search never
needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evenpipe import lazy_exports
from evenpipe.plan.bounds import (PipelineBounds, pipeline_bounds, stage_layout, step_bound, step_time_lower_bound,
                                  work_bound)
from evenpipe.plan.search import (
    PLANNED_BPIPE_SCHEDULES,
    PLANNED_SCHEDULES,
    Candidate,
    PlanResult,
    Searcher,
    SearchSpace,
    SearchStats,
    enumerate_configs,
    plan_configs,
)

__all__ = [
    "PLANNED_SCHEDULES", "PLANNED_BPIPE_SCHEDULES", "Candidate", "PlanResult", "Searcher", "SearchSpace", "SearchStats", "enumerate_configs",
    "plan_configs", "PipelineBounds", "pipeline_bounds", "stage_layout", "step_time_lower_bound", "step_bound",
    "work_bound", "TIME_COMPONENTS", "BPipeExplanation", "ComponentDelta", "Eater", "Lever", "Verdict",
    "explain_bpipe", "answer_text", "MemoryLever", "LeverResult", "MemoryAnswer", "explain_memory",
]

_LAZY: dict[str, str] = {
    **dict.fromkeys(("TIME_COMPONENTS", "BPipeExplanation", "ComponentDelta", "Eater", "Lever", "Verdict",
                     "answer_text", "explain_bpipe"), "evenpipe.plan.explain"),
    **dict.fromkeys(("LeverResult", "MemoryAnswer", "MemoryLever", "explain_memory"), "evenpipe.plan.levers"),
}
"""Exported name -> the module that defines it, imported on first access (PEP 562)."""


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:
    from evenpipe.plan.explain import (TIME_COMPONENTS, BPipeExplanation, ComponentDelta, Eater, Lever, Verdict,
                                       answer_text, explain_bpipe)
    from evenpipe.plan.levers import LeverResult, MemoryAnswer, MemoryLever, explain_memory
