"""Every process group a rank uses, built in one place, in one documented order.

Creating a process group is collective: every rank of the world must create every group, in the same
order, or the ranks pair up the wrong communicators and hang (or worse, mix data). So no module makes
groups of its own; they ask for them here, and each builder runs the same steps on every rank:

1. ``build_groups(plan)``: the plan's ``DeviceMesh`` with dims ``pp`` / ``dp`` / ``tp`` (for HSDP the dp
   dim is ``dp_replicate x dp_shard``, flattened to ``dp`` for data; with expert parallelism it is
   ``edp x ep``, flattened the same way: ``mesh["ep"]`` holds the ranks that share one copy of the experts,
   ``mesh["edp"]`` the ranks holding the same experts). Every sub-group (``mesh["tp"]``,
   ``mesh["dp"]``, ``mesh["pp"]``) is made by ``init_device_mesh`` here.
2. Then, when ``tied_ends=True`` (a tied input/output embedding under ``pp > 1``): one group of two ranks
   per pipeline, its first and last stage, which sum the two copies' gradients (Megatron's embedding
   group). In pipeline order, every rank making every group.
3. ``build_generation_groups(plan, t_g)`` (the 3D-HybridEngine, after 1 and 2): a ``DeviceMesh`` over the
   generation layout with dims ``gen_dp x micro_dp x gen_tp`` (engines of ``t_g`` ranks along the last,
   resharding groups along the middle), then one group per DP replica (its ``tp * pp`` ranks, which
   gather the replica's samples), in DP order.

``rlkit.workers.rl.RLWorker`` builds 1 to 3 once and hands the result to every model on the rank (actor,
reference, critic share one mesh) and to the generation layout.

>>> from rlkit.plan import ParallelPlan
>>> groups = build_groups(ParallelPlan(dp=2, tp=2, pp=2), tied_ends=True)   # on 8 ranks  # doctest: +SKIP
>>> groups.mesh.mesh_dim_names, groups.tied_ends is not None                            # doctest: +SKIP
(('pp', 'dp', 'tp'), True)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlkit.errors import PlanError
from rlkit.plan.hybrid import GenerationLayout
from rlkit.plan.topology import ParallelPlan

# torch 2.13 warns on every mesh["dp"] of a flattened dp (HSDP, EP) that such slicing "will be deprecated in PT
# 2.11"; it works, and the warning would land in every worker's log on each call
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ProcessGroups:
    """One rank's groups for training under ``plan`` (steps 1 and 2 of the module docstring).

    ``mesh``: the plan's DeviceMesh. ``tied_ends``: this rank's group of its pipeline's first and last
    stage (None on the stages between, and unless built with ``tied_ends=True`` and ``pp > 1``);
    ``has_tied_ends``: whether those groups were built.
    """

    plan: ParallelPlan
    mesh: DeviceMesh
    tied_ends: Any = None
    has_tied_ends: bool = False

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1D mesh of the ranks sharing one copy of the experts (None without expert parallelism)."""
        return self.mesh["ep"] if self.plan.ep > 1 else None

    @property
    def edp_group(self) -> Any:
        """The ranks holding the same experts, which average their gradients (None without EP, or one copy)."""
        return self.mesh["edp"].get_group() if self.plan.ep > 1 and self.plan.expert_dp > 1 else None

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The sub-mesh FSDP2 shards over: 1D "dp", or 2D (dp_replicate, dp_shard) for HSDP."""
        names = self.mesh.mesh_dim_names or ()
        return self.mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else self.mesh["dp"]


@dataclass
class GenerationGroups:
    """One rank's groups for the generation layout ``layout`` (step 3 of the module docstring).

    ``mesh``: dims ``gen_dp x micro_dp x gen_tp``. ``replica``: this rank's DP replica group, and
    ``replica_ranks`` its ranks in order.
    """

    layout: GenerationLayout
    mesh: DeviceMesh
    replica: Any
    replica_ranks: list[int]

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The engine's TP group (``t_g`` ranks)."""
        return self.mesh["gen_tp"]

    @property
    def micro_dp(self) -> Any:
        """The ranks sharing this rank's generation shard (the resharding gathers inside it)."""
        return self.mesh["micro_dp"].get_group()


def build_groups(plan: ParallelPlan, *, tied_ends: bool = False, device: str | None = None) -> ProcessGroups:
    """Steps 1 and 2: the plan's mesh, then (``tied_ends`` and ``pp > 1``) the pipeline-ends groups.

    A collective: every rank calls it, with the same arguments."""
    world = dist.get_world_size()
    if world != plan.world_size:
        raise PlanError(f"plan {plan.describe()} needs world_size={plan.world_size} processes but this "
                        f"group has {world}; launch with --nproc-per-node {plan.world_size} or change the plan")
    shape, names = plan.mesh_shape()
    hsdp = plan.dp_shard in ("hybrid_shard", "replicate")
    if hsdp:
        i = names.index("dp")
        rep = plan.dp_replicate_degree
        shape = shape[:i] + (rep, plan.dp // rep) + shape[i + 1:]
        names = names[:i] + ("dp_replicate", "dp_shard") + names[i + 1:]
    if plan.ep > 1 and hsdp:
        raise PlanError(f"ep={plan.ep} with dp_shard={plan.dp_shard!r} is not supported (HSDP and EP both split the DP "
                        f"ranks); use dp_shard='full_shard' or 'shard_grad_op' with ep > 1")
    if plan.ep > 1:  # consecutive DP ranks share the experts (EP inner, expert-DP outer, as Megatron)
        i = names.index("dp")
        shape = shape[:i] + (plan.expert_dp, plan.ep) + shape[i + 1:]
        names = names[:i] + ("edp", "ep") + names[i + 1:]
    mesh = init_device_mesh(device or device_type(), shape, mesh_dim_names=names)
    if hsdp:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if plan.ep > 1:
        mesh["edp", "ep"]._flatten("dp")
    built = tied_ends and plan.pp > 1
    ends = _pipeline_ends(plan, dist.get_rank()) if built else None
    return ProcessGroups(plan, mesh, ends, built)


def build_generation_groups(layout: GenerationLayout, device: str | None = None) -> GenerationGroups:
    """Step 3: the generation layout's mesh, then one group per DP replica. A collective."""
    plan, rank = layout.plan, dist.get_rank()
    mesh = DeviceMesh(device or device_type(), torch.tensor(layout.mesh()),
                      mesh_dim_names=("gen_dp", "micro_dp", "gen_tp"))
    mine, mine_ranks = None, []
    for d in range(plan.dp):
        ranks = sorted(r for r in range(plan.world_size) if plan.coords(r)["dp"] == d)
        group = dist.new_group(ranks)
        if rank in ranks:
            mine, mine_ranks = group, ranks
    return GenerationGroups(layout, mesh, mine, mine_ranks)


def _pipeline_ends(plan: ParallelPlan, rank: int) -> Any:
    """This rank's group of its pipeline's first and last pipeline rank: one per (dp, tp) coordinate,
    every rank making every group, in the same (sorted) order."""
    mine = None
    pipelines = sorted({tuple(sorted(plan.group_of(r, "pp"), key=lambda q: plan.coords(q)["pp"]))
                        for r in range(plan.world_size)})
    for ranks in pipelines:
        group = dist.new_group([ranks[0], ranks[-1]])
        if rank in (ranks[0], ranks[-1]):
            mine = group
    return mine


__all__ = ["GenerationGroups", "ProcessGroups", "build_generation_groups", "build_groups", "device_type"]
