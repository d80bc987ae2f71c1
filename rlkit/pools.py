"""ResourcePool: devices reserved for the ranks of a worker group, in Ray placement groups.

A pool holds one bundle per rank (CPUs, GPUs, custom resources), cut into node-sized placement groups
of whole TP groups (``STRICT_PACK``: a TP group never spans nodes). ``Cluster.placement_group_for`` and
``Cluster.role_pools`` make them; ``rlkit.workers.WorkerGroup`` puts one actor on each rank's bundle,
and roles colocated on the same devices share a pool (each gets ``1/colocate`` of every bundle).

>>> format_bundle({"CPU": 1.0, "GPU": 0.5}), bundles_that_fit({"CPU": 4.0}, {"CPU": 1.5})
('1 CPU + 0.5 GPU', 2)
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from rlkit.errors import ClusterError, PlanError

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.plan.topology import ParallelPlan


class PoolOwner(Protocol):
    """What a ``ResourcePool`` asks of the cluster that made it (``rlkit.Cluster``), so this module needs no
    import of the cluster's."""

    def release_orphans(self) -> int: ...

    def holders(self) -> list[str]: ...

    def forget_pool(self, pool: ResourcePool) -> None: ...


def format_bundle(bundle: dict[str, float]) -> str:
    """{'CPU': 1.0, 'GPU': 0.5} -> '1 CPU + 0.5 GPU'."""
    return " + ".join(f"{v:g} {k}" for k, v in bundle.items()) or "nothing"


def bundles_that_fit(res: dict[str, float], bundle: dict[str, float]) -> int:
    """How many bundles fit in a node's resources."""
    return int(min((res.get(k, 0.0) / v for k, v in bundle.items() if v > 0), default=0) + 1e-9)


def rank_groups(plan: ParallelPlan | int) -> tuple[int, int, list[list[int]]]:
    """(world size, tp, TP groups in rank order) of a plan or a plain rank count."""
    if isinstance(plan, bool) or not (isinstance(plan, int) or hasattr(plan, "groups")):
        raise PlanError(f"expected a ParallelPlan or a number of ranks, got {plan!r}")
    if isinstance(plan, int):
        if plan < 1:
            raise PlanError(f"n_ranks={plan} must be a positive integer")
        return plan, 1, [[r] for r in range(plan)]
    return plan.world_size, plan.tp, sorted(plan.groups("tp"))


class ResourcePool:
    """Bundles reserved for ``world_size`` ranks (one per rank) in Ray placement groups.

    Made by ``Cluster.placement_group_for`` / ``Cluster.role_pools``. ``colocate`` worker groups may
    share it (the roles colocated on these devices); each gets ``1/colocate`` of every bundle.

    >>> pool = cluster.placement_group_for(4)                # doctest: +SKIP
    >>> pool.node_of(0) == pool.node_of(3)                   # doctest: +SKIP
    True
    """

    def __init__(self, cluster: PoolOwner, name: str, world_size: int, bundle: dict[str, float],
                 chunks: list[list[int]], colocate: int = 1) -> None:
        if isinstance(colocate, bool) or not isinstance(colocate, int) or colocate < 1:
            raise PlanError(f"colocate={colocate!r} must be a positive integer (roles sharing the bundles)")
        self.cluster, self.name, self.world_size = cluster, name, world_size
        self.bundle, self.chunks, self.colocate = dict(bundle), chunks, colocate
        self.placement_groups: list[Any] = []
        self._where: dict[int, tuple[int, int]] = {}  # rank -> (placement group index, bundle index)
        self._nodes: dict[int, str] = {}
        self._users = 0
        self.reserve_s = 0.0

    def _reserve(self, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        t0 = time.perf_counter()
        for i, ranks in enumerate(self.chunks):
            pg = placement_group([dict(self.bundle) for _ in ranks], strategy="STRICT_PACK",
                                 name=f"rlkit-{self.name}-{i}-{os.getpid()}-{id(self):x}")
            self.placement_groups.append(pg)
            for b, r in enumerate(ranks):
                self._where[r] = (i, b)
        refs = [pg.ready() for pg in self.placement_groups]
        deadline = time.monotonic() + timeout_s
        tried_orphans = False
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(left, 1.0)))
            if len(ready) == len(refs):
                break
            if not tried_orphans:  # groups of Trainers that no longer exist: give their resources back
                tried_orphans = True
                if self.cluster.release_orphans():
                    continue
            if left <= 0:
                self._fail(timeout_s)
        self.reserve_s = time.perf_counter() - t0
        for i, pg in enumerate(self.placement_groups):
            table = placement_group_table(pg)["bundles_to_node_id"]
            for b, r in enumerate(self.chunks[i]):
                self._nodes[r] = table[b]

    def _fail(self, timeout_s: float) -> None:
        """Give the half-made reservation back and say what was needed, what is free and who holds the rest."""
        import ray

        free = ray.available_resources()
        total = ray.cluster_resources()
        need = {k: v * self.world_size for k, v in self.bundle.items()}
        self.remove()
        holders = self.cluster.holders()
        held = ("; held by: " + "; ".join(holders)) if holders else \
            "; nothing of this rlkit.Cluster holds them (other Ray users or actors of this cluster do)"
        raise ClusterError(
            f"could not reserve {self.world_size} bundles of {self.bundle} ({self.world_size} x {format_bundle(self.bundle)}, "
            f"need {need} in all, in {len(self.chunks)} group(s) of up to {max(map(len, self.chunks))} bundles each "
            f"on one node) within {timeout_s:g} s; free now: { {k: round(free.get(k, 0.0), 2) for k in self.bundle} } "
            f"of { {k: round(total.get(k, 0.0), 2) for k in self.bundle} }{held}. Close those (trainer.close() / "
            f"group.shutdown()), lower the plan size or cpus/gpus_per_worker, or add nodes"
        ) from None

    def node_of(self, rank: int) -> str:
        """Node id holding ``rank``'s bundle."""
        return self._nodes[rank]

    def actor_options(self, rank: int) -> dict[str, Any]:
        """``.options(...)`` for the actor of ``rank``: its share of the bundle, pinned to the bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if rank not in self._where:
            raise PlanError(f"rank={rank} is outside this pool's {self.world_size} ranks")
        i, b = self._where[rank]
        share = {k: v / self.colocate for k, v in self.bundle.items()}
        opts: dict[str, Any] = {"num_cpus": share.pop("CPU", 0.0), "num_gpus": share.pop("GPU", 0.0),
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                    self.placement_groups[i], placement_group_bundle_index=b)}
        if share:
            opts["resources"] = share
        return opts

    @property
    def cpus_per_rank(self) -> float:
        """CPUs each colocated role's actor gets."""
        return self.bundle.get("CPU", 0.0) / self.colocate

    def _claim(self) -> None:
        if self._users >= self.colocate:
            raise PlanError(f"pool {self.name!r} already hosts {self._users} worker group(s) and was made "
                            f"for colocate={self.colocate}; make it with a larger colocate (or list the role "
                            f"in role_pools) to share its devices")
        self._users += 1

    def _release(self) -> None:
        self._users = max(0, self._users - 1)

    def table(self) -> pd.DataFrame:
        """One row per rank: rank, node, placement group and bundle."""
        import pandas as pd

        return pd.DataFrame([{"rank": r, "node": self._nodes.get(r, "?")[:8], "placement_group": i,
                              "bundle": b} for r, (i, b) in sorted(self._where.items())])

    def remove(self) -> None:
        """Give the reserved resources back to Ray."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for pg in self.placement_groups:
                try:
                    remove_placement_group(pg)
                except Exception:  # already gone (cluster shut down / removed before)
                    pass
        self.placement_groups = []
        self.cluster.forget_pool(self)

    def __repr__(self) -> str:
        return (f"ResourcePool({self.name!r}, {self.world_size} ranks of {self.bundle}, "
                f"{len(self.placement_groups)} placement group(s), colocate={self.colocate})")


__all__ = ["ResourcePool", "bundles_that_fit", "format_bundle", "rank_groups"]
