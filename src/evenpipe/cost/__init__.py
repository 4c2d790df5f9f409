"""Analytic cost model (pure Python): model and hardware specs, memory per pipeline rank, FLOP-based timing,
and :func:`estimate`, which simulates the configuration's actual schedule.

Layers: ``specs`` (ModelSpec, presets, HF configs), ``hardware`` (GPU presets), ``parallel`` (ParallelConfig and
its checks), ``flops``, ``activations``, ``states``, ``timing`` (Efficiency, stage_sim_costs), ``source`` (the
CostSource protocol; ``analytic_source`` and ``profiled_source`` implement it), ``memory`` (StageMemory),
``estimate``.
"""

from evenpipe.cost.analytic_source import AnalyticSource
from evenpipe.cost.estimate import LIMITS, Estimate, TimeBreakdown, estimate, estimate_with
from evenpipe.cost.flops import executed_flops_per_step, model_flops_per_step
from evenpipe.cost.hardware import GIB, HARDWARE_PRESETS, Hardware, hardware_preset, load_hardware
from evenpipe.cost.memory import StageMemory, activation_bytes, layer_activation_bytes, memory_per_stage
from evenpipe.cost.parallel import (Attention, ParallelConfig, Recompute, ScheduleFamily, check_config,
                                    candidate_layouts, check_layout, end_lighter_layout, stage_layers)
from evenpipe.cost.source import CostSource, MicrobatchShape
from evenpipe.cost.specs import MODEL_PRESETS, Arch, ModelSpec, from_hf_config, model_preset
from evenpipe.cost.timing import Efficiency, stage_sim_costs

__all__ = [
    "Arch", "ModelSpec", "MODEL_PRESETS", "model_preset", "from_hf_config",
    "Hardware", "HARDWARE_PRESETS", "hardware_preset", "load_hardware", "GIB",
    "ParallelConfig", "Recompute", "Attention", "ScheduleFamily", "check_config", "check_layout",
    "end_lighter_layout", "stage_layers", "candidate_layouts",
    "Efficiency", "stage_sim_costs",
    "StageMemory", "memory_per_stage", "activation_bytes", "layer_activation_bytes",
    "Estimate", "TimeBreakdown", "estimate", "estimate_with", "LIMITS",
    "CostSource", "MicrobatchShape", "AnalyticSource",
    "model_flops_per_step", "executed_flops_per_step",
]
