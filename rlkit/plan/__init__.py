"""Plan layer: pure math about a DP x TP x PP layout (no processes, no torch import)."""

from rlkit.plan.backend_memory import backend_memory
from rlkit.plan.comm import BANDWIDTHS, estimate_communication, estimate_resharding
from rlkit.plan.hybrid import GenerationLayout
from rlkit.plan.memory import RolloutMemory, estimate_memory
from rlkit.plan.memory_report import compare_memory, explain_fit
from rlkit.plan.schedule import (
    bubble_fraction,
    idle_fraction,
    peak_in_flight,
    pipeline_order,
    pipeline_timeline,
)
from rlkit.plan.search import Recommendation, recommend, search_plans
from rlkit.plan.spec import LoraSpec, ModelSpec, as_spec, bundled_models, lora_params
from rlkit.plan.throughput import (
    GPUS,
    NETWORKS,
    estimate_generation,
    estimate_rl_step,
    estimate_throughput,
    phase_floors,
    predict_rl_step,
    rl_step_work,
)
from rlkit.plan.topology import SCHEDULES, SHARDING, ParallelPlan
from rlkit.plan.units import parse_bytes
from rlkit.plan.vision import image_tokens, smart_resize

__all__ = ["ModelSpec", "ParallelPlan", "SCHEDULES", "SHARDING", "as_spec", "bundled_models",
           "LoraSpec", "lora_params",
           "pipeline_order", "pipeline_timeline", "bubble_fraction", "idle_fraction", "peak_in_flight",
           "GPUS", "NETWORKS", "estimate_throughput", "estimate_generation", "estimate_rl_step", "predict_rl_step",
           "rl_step_work", "phase_floors",
           "search_plans", "recommend", "Recommendation",
           "backend_memory", "estimate_memory", "explain_fit", "compare_memory", "parse_bytes", "RolloutMemory",
           "estimate_communication", "estimate_resharding", "GenerationLayout", "BANDWIDTHS",
           "image_tokens", "smart_resize"]

# figures are drawn by the widgets layer, which this package may not import: say where they went
_MOVED = {"plot_timeline": "rlkit.widgets.figures", "plot_plans": "rlkit.widgets.figures"}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"rlkit.plan.{name} moved to {_MOVED[name]}: from {_MOVED[name]} import {name}")
    raise AttributeError(f"module 'rlkit.plan' has no attribute {name!r}")
