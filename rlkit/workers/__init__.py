"""Worker groups (Ray, or this process for one rank) and the RL roles on them.

``base`` (the dispatch protocol), ``group`` (Ray: one actor per rank), ``local`` (one rank in this
process), ``layout`` (where a sample's tokens sit), ``rl`` (the
per-rank roles), ``hybrid`` (the 3D-HybridEngine's rollout), ``placement`` (roles to pools) and
``rl_workers`` (the controller's typed calls).
"""

from rlkit.workers.base import BaseWorkerGroup
from rlkit.workers.group import GroupFuture, WorkerGroup, WorkerTimeoutError
from rlkit.workers.layout import SequenceLayout
from rlkit.workers.placement import Placement

__all__ = ["BaseWorkerGroup", "GroupFuture", "Placement", "SequenceLayout", "WorkerGroup", "WorkerTimeoutError"]
