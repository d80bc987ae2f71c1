"""rlkit: RL post-training of LLMs from a notebook, with real DP/TP/PP parallelism on Ray.

Heavy libraries (torch, transformers, ray) load only when a part that needs them is touched,
so `import rlkit` and the plan math stay fast.

>>> import rlkit
>>> rlkit.ParallelPlan(dp=4, tp=8, pp=16).world_size
512
"""

from __future__ import annotations

import importlib
import os
import shutil

from rlkit.errors import CheckpointError, PlanError, RlkitError, TrainerError, WorkerError

__version__ = "0.1.0"

# DeepSpeed (extra `deepspeed`), once installed, is imported by transformers' save/load paths too, and on a
# machine without a GPU it prints an accelerator warning on every first import: name its CPU accelerator up
# front there (nvidia-smi is how the Makefile tells the two apart; a value the user set is kept).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Plan objects show themselves with views of the widgets layer, which rlkit.plan may not import: the
# widgets package registers them with rlkit.display here, by name (ipywidgets loads on first display).
importlib.import_module("rlkit.widgets")

# public name -> module that defines it (imported on first access)
_LAZY = {
    "ParallelPlan": "rlkit.plan",
    "ModelSpec": "rlkit.plan",
    "search_plans": "rlkit.plan",
    "recommend": "rlkit.plan",
    "models": "rlkit.models",
    "tasks": "rlkit.tasks",
    "data": "rlkit.data",
    "plan": "rlkit.plan",
    "parallel": "rlkit.parallel",
    "doctor": "rlkit.doctor",
    "algos": "rlkit.algos",
    "Cluster": "rlkit.cluster",
    "WorkerGroup": "rlkit.workers",
    "Placement": "rlkit.workers",
    "Rollout": "rlkit.rollout",
    "rewards": "rlkit.rewards",
    "RewardModel": "rlkit.rewards",
    "Batch": "rlkit.batch",
    "Trainer": "rlkit.trainer",
    "TrainerConfig": "rlkit.trainer",
    "ParallelModel": "rlkit.parallel",
    "Backend": "rlkit.backends",
    "backends": "rlkit.backends",
    "rollout": "rlkit.rollout",
    "workers": "rlkit.workers",
    "agent": "rlkit.agent",
    "MultiTurn": "rlkit.agent",
    "EnvStep": "rlkit.agent",
    "CurriculumSampler": "rlkit.sampler",
    "PromptSampler": "rlkit.sampler",
    "MathAnswer": "rlkit.rewards",
    "Judge": "rlkit.rewards",
    "evaluation": "rlkit.evaluation",
}

__all__ = ["CheckpointError", "PlanError", "RlkitError", "TrainerError", "WorkerError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rlkit' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if module.__name__ == f"rlkit.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
