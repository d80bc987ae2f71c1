"""Plan layer: pure math about a DP x TP x PP layout (no processes, no torch import)."""

from rlkit.plan.spec import ModelSpec, as_spec, bundled_models
from rlkit.plan.topology import SCHEDULES, SHARDING, ParallelPlan

__all__ = ["ModelSpec", "ParallelPlan", "SCHEDULES", "SHARDING", "as_spec", "bundled_models"]
