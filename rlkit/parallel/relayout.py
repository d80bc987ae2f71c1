"""Re-layout: weights from any training layout into a generation layout (TP-only or full replicas).

Rollout engines want ``pp=1``: every rank holds whole layers, split over ``tp`` Megatron-style (or full
replicas with ``tp=1``). The training layout's weights stream out one full tensor at a time
(``ParallelModel.iter_full_weights``); each rank keeps only its target TP slice, so no rank ever holds
more than its target shards plus one full tensor in flight.
"""

from __future__ import annotations

import fnmatch
import time
from typing import TYPE_CHECKING, Any

import torch

from rlkit.errors import PlanError
from rlkit.parallel.apply import DEFAULT_LAYER_PLAN
from rlkit.plan.topology import ParallelPlan

if TYPE_CHECKING:
    from rlkit.parallel.model import ParallelModel


def shard_dim(name: str, config: Any = None) -> int | None:
    """Which dim of HF weight ``name`` a TP layout splits (None: replicated), as ``apply_tp`` does:
    colwise -> dim 0 (weight and bias), rowwise -> dim 1 of the weight (bias replicated), embedding and
    lm_head -> dim 0 (vocab)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    plan = dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_LAYER_PLAN)
    module, _, kind = name.removeprefix("model.").rpartition(".")
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            if style == "colwise":
                return 0
            if style == "rowwise":
                return 1 if kind == "weight" else None
    return None


def tp_shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, config: Any = None) -> torch.Tensor:
    """This TP rank's slice of a full weight (``torch.chunk`` split, as DTensor's Shard does)."""
    dim = shard_dim(name, config)
    if dim is None or tp == 1:
        return full
    return full.chunk(tp, dim)[tp_rank].clone()


def relayout(pm: ParallelModel, target: ParallelPlan) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """This rank's weights under ``target`` (same world size, ``pp=1``); returns ``(shards, stats)`` with
    stats ``bytes`` (received by this rank), ``seconds`` and ``held_bytes`` (what it keeps).

    >>> shards, stats = relayout(pm, ParallelPlan(dp=4, tp=2))   # doctest: +SKIP
    """
    if target.world_size != pm.plan.world_size:
        raise PlanError(f"relayout keeps the ranks: target world {target.world_size} != training world "
                        f"{pm.plan.world_size}; choose dp*tp = {pm.plan.world_size}")
    if target.pp != 1:
        raise PlanError(f"relayout targets generation layouts (pp=1: TP-only or full replicas); got pp={target.pp}")
    target.validate(model=pm.config)
    t0 = time.perf_counter()
    tp_rank = target.coords(pm.rank)["tp"]
    shards = {name: tp_shard(name, t, target.tp, tp_rank, pm.config) for name, t in pm.iter_full_weights(to="all")}
    held = sum(t.numel() * t.element_size() for t in shards.values())
    return shards, {"bytes": pm.last_transfer["bytes"], "seconds": time.perf_counter() - t0, "held_bytes": float(held)}
