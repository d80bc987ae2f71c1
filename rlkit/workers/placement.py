"""Where the Trainer's roles run: pools of devices, and which role's workers go on which pool.

The device mapping is verl's: pools of devices by name, and roles mapped to pools. rlkit's worker
roles are

* ``"actor"``: the ``RLWorker`` group, one rank per device of the actor's ``ParallelPlan``. It hosts the
  actor, the reference model and the critic (fused, like verl's ActorRolloutRef worker), and, when the
  rollout is colocated (the HybridEngine), the rollout engines too;
* ``"rollout"``: a ``RolloutWorker`` group of its own (split placement), ``n`` engines on their own devices;
* ``"teacher"``: a distillation teacher (``TrainerConfig.teacher``) on a pool of its own, a ``TeacherWorker``
  group sharded by that pool's ``ParallelPlan`` (``rlkit.workers.teacher``). Unmapped, the teacher takes the
  reference's place in the actor's workers, sharded by the actor's plan.

``Placement.colocated(plan)`` maps only the actor (the engines live in its workers);
``Placement.split(plan, n)`` maps the rollout to a second pool of ``n`` devices; either takes
``teacher=ParallelPlan(...)`` for a teacher pool. A placement reserves its
pools with ``Cluster.role_pools(placement.pools, placement.roles)``, so a hand-written mapping and the
Trainer's ``placement="colocated" | "split"`` are the same thing:

>>> from rlkit.plan import ParallelPlan
>>> p = Placement.split(ParallelPlan(dp=2), rollout_workers=1)
>>> p.roles, {k: getattr(v, "world_size", v) for k, v in p.pools.items()}, p.world_size
({'actor': 'train', 'rollout': 'gen'}, {'train': 2, 'gen': 1}, 3)
>>> Placement(pools={"train": ParallelPlan(dp=2), "gen": 1}, roles={"actor": "train", "rollout": "gen"}) == p
True
>>> t = Placement.colocated(ParallelPlan(dp=2), teacher=ParallelPlan(dp=2))
>>> t.roles, t.teacher_plan.world_size, t.world_size
({'actor': 'train', 'teacher': 'teacher'}, 2, 4)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import PlanError
from rlkit.plan.topology import ParallelPlan

ROLES = ("actor", "rollout", "teacher")


@dataclass(frozen=True)
class Placement:
    """Pools of devices by name (a ``ParallelPlan`` or a number of workers) and the pool of each worker
    role (``"actor"``, ``"rollout"`` for split placement, ``"teacher"`` for a teacher pool). Checked on
    construction."""

    pools: dict[str, ParallelPlan | int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted(set(self.roles) - set(ROLES))
        if bad:
            raise PlanError(f"Placement roles {bad} are not worker roles; rlkit places {list(ROLES)} (the actor's "
                            f"workers host the reference model and the critic too)")
        if "actor" not in self.roles:
            raise PlanError(f"Placement(roles={self.roles}) has no 'actor': map it to the pool of the actor's "
                            f"ParallelPlan, e.g. roles={{'actor': 'train'}}")
        unknown = sorted({p for p in self.roles.values() if p not in self.pools})
        if unknown:
            raise PlanError(f"roles refer to pool(s) {unknown} that are not in pools={sorted(self.pools)}; add them "
                            f"to pools or fix the role mapping")
        if not isinstance(self.pools[self.roles["actor"]], ParallelPlan):
            raise PlanError(f"the actor's pool {self.roles['actor']!r} must be a ParallelPlan (its layout), got "
                            f"{self.pools[self.roles['actor']]!r}")
        if "rollout" in self.roles:
            if self.roles["rollout"] == self.roles["actor"]:
                raise PlanError("the rollout is mapped to the actor's pool: colocated engines run inside the "
                                "actor's workers, so map only the actor (Placement.colocated), or give the "
                                "rollout a pool of its own (Placement.split)")
            n = self.pools[self.roles["rollout"]]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise PlanError(f"the rollout pool {self.roles['rollout']!r} must be a positive number of workers "
                                f"(each one engine), got {n!r}")
        if "teacher" in self.roles:
            pool = self.roles["teacher"]
            if pool in (self.roles["actor"], self.roles.get("rollout")):
                raise PlanError(f"the teacher is mapped to pool {pool!r}, which another role uses: a teacher in the "
                                f"actor's workers is the default (leave the teacher role out), or give it a pool of "
                                f"its own")
            if not isinstance(self.pools[pool], ParallelPlan):
                raise PlanError(f"the teacher's pool {pool!r} must be a ParallelPlan (how the teacher is sharded "
                                f"over its ranks), got {self.pools[pool]!r}; e.g. ParallelPlan(dp=2)")

    @classmethod
    def colocated(cls, plan: ParallelPlan, teacher: ParallelPlan | None = None) -> Placement:
        """The HybridEngine: the engines run inside the actor's workers (a ``teacher`` plan: a teacher pool)."""
        return cls(pools={"train": plan}, roles={"actor": "train"})._with_teacher(teacher)

    @classmethod
    def split(cls, plan: ParallelPlan, rollout_workers: int = 1, teacher: ParallelPlan | None = None) -> Placement:
        """``rollout_workers`` engines on devices of their own (a ``teacher`` plan: a teacher pool)."""
        return cls(pools={"train": plan, "gen": rollout_workers},
                   roles={"actor": "train", "rollout": "gen"})._with_teacher(teacher)

    def _with_teacher(self, teacher: ParallelPlan | None) -> Placement:
        if teacher is None:
            return self
        return Placement(pools={**self.pools, "teacher": teacher}, roles={**self.roles, "teacher": "teacher"})

    @classmethod
    def of(cls, placement: Any, plan: ParallelPlan, rollout_workers: int = 1) -> Placement:
        """A ``Placement`` from the Trainer's ``placement=`` argument: "colocated", "split" or a Placement.

        >>> Placement.of("colocated", ParallelPlan()).kind
        'colocated'
        """
        if isinstance(rollout_workers, bool) or not isinstance(rollout_workers, int) or rollout_workers < 1:
            raise PlanError(f"rollout_workers={rollout_workers!r} must be a positive integer")
        if isinstance(placement, Placement):
            if placement.plan != plan:
                raise PlanError(f"the placement's actor pool is {placement.plan.describe()} but plan= is "
                                f"{plan.describe()}; give the same ParallelPlan (or leave plan= out)")
            if rollout_workers != 1:
                raise PlanError("rollout_workers= is for placement='split'; a Placement sets the rollout pool's "
                                "size itself")
            return placement
        if placement == "colocated":
            if rollout_workers != 1:
                raise PlanError(f"rollout_workers={rollout_workers} needs placement='split' (colocated engines "
                                f"run one per DP group inside the actor's workers)")
            return cls.colocated(plan)
        if placement == "split":
            return cls.split(plan, rollout_workers)
        raise PlanError(f"placement={placement!r}: choose 'colocated' (HybridEngine) or 'split', or give an "
                        f"rlkit.Placement(pools=..., roles=...)")

    # ---- what it says ----------------------------------------------------------------------------
    @property
    def plan(self) -> ParallelPlan:
        """The actor's ParallelPlan."""
        return self.pools[self.roles["actor"]]

    @property
    def kind(self) -> str:
        """"colocated" or "split"."""
        return "split" if "rollout" in self.roles else "colocated"

    @property
    def rollout_workers(self) -> int:
        """Workers of the rollout pool (0 when colocated)."""
        return self.pools[self.roles["rollout"]] if "rollout" in self.roles else 0

    @property
    def teacher_plan(self) -> ParallelPlan | None:
        """The teacher pool's ParallelPlan (None: the teacher, if any, is in the actor's workers)."""
        return self.pools[self.roles["teacher"]] if "teacher" in self.roles else None

    @property
    def world_size(self) -> int:
        """Worker processes in all."""
        return self.plan.world_size + self.rollout_workers + (self.teacher_plan.world_size if self.teacher_plan else 0)

    def reserve(self, cluster: Any, **placement: Any) -> dict[str, Any]:
        """Reserve the pools on ``cluster`` (``Cluster.role_pools``): role -> ResourcePool."""
        used = {p: self.pools[p] for p in set(self.roles.values())}
        return cluster.role_pools(used, dict(self.roles), **placement)


__all__ = ["ROLES", "Placement"]
