"""Plan layer: pure math about a DP x TP x PP layout (no processes, no torch import)."""

from rlkit.plan.comm import BANDWIDTHS, estimate_communication, estimate_resharding
from rlkit.plan.hybrid import GenerationLayout
from rlkit.plan.memory import RolloutMemory, compare_memory, estimate_memory, explain_fit
from rlkit.plan.schedule import (
    bubble_fraction,
    idle_fraction,
    peak_in_flight,
    pipeline_order,
    pipeline_timeline,
    plot_timeline,
)
from rlkit.plan.search import Recommendation, plot_plans, recommend, search_plans
from rlkit.plan.spec import ModelSpec, as_spec, bundled_models
from rlkit.plan.throughput import GPUS, NETWORKS, estimate_generation, estimate_throughput
from rlkit.plan.topology import SCHEDULES, SHARDING, ParallelPlan
from rlkit.plan.units import parse_bytes

__all__ = ["ModelSpec", "ParallelPlan", "SCHEDULES", "SHARDING", "as_spec", "bundled_models",
           "pipeline_order", "pipeline_timeline", "bubble_fraction", "idle_fraction", "peak_in_flight",
           "plot_timeline", "GPUS", "NETWORKS", "estimate_throughput", "estimate_generation",
           "search_plans", "recommend", "plot_plans", "Recommendation",
           "estimate_memory", "explain_fit", "compare_memory", "parse_bytes", "RolloutMemory",
           "estimate_communication", "estimate_resharding", "GenerationLayout", "BANDWIDTHS"]
