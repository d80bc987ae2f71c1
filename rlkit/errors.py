"""The errors rlkit raises on purpose: each names the bad value and the fix."""

from __future__ import annotations


class RlkitError(Exception):
    """Base class of rlkit's own errors."""


class PlanError(RlkitError, ValueError):
    """A ParallelPlan that cannot work: the message names the bad value and a fix.

    >>> from rlkit import ParallelPlan
    >>> ParallelPlan(tp=0)
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: tp=0 must be a positive integer; use tp=1 for no tensor parallelism
    """


class ClusterError(RlkitError, ConnectionError):
    """Ray could not be started or reached, or resources not reserved; the message says what was tried
    and how to fix it."""


class WorkerError(RlkitError, RuntimeError):
    """A remote worker failed; carries its rank, node and the remote traceback. ``lost``: its process died
    (killed, out of memory, its node gone), as opposed to an exception it raised; what ``Trainer.fit``
    recovers from (``TrainerConfig.max_restarts``)."""

    def __init__(self, message: str, *, rank: int | None = None, node: str | None = None,
                 remote_traceback: str | None = None, lost: bool = False):
        self.rank, self.node, self.remote_traceback, self.lost = rank, node, remote_traceback, lost
        where = f"rank {rank}" + (f" on node {node}" if node else "") if rank is not None else "a worker"
        full = f"{where} failed: {message}"
        if remote_traceback:
            full += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(full)


class TrainerError(RlkitError, ValueError):
    """A trainer input that cannot work (dataset, reward, sizes); the message names the value and the fix."""


class RewardError(TrainerError):
    """A reward function that raised or returned something other than one number per completion."""


class CheckpointError(RlkitError):
    """A checkpoint that cannot be read or written: a missing or damaged file, another model's or a newer
    rlkit's checkpoint. The message names the file and what to do (``rlkit.checkpoint``).

    >>> from rlkit.checkpoint import read_state
    >>> read_state("no/such/checkpoint")
    Traceback (most recent call last):
    ...
    rlkit.errors.CheckpointError: no checkpoint at ...no/such/checkpoint: the folder does not exist; pass the folder that trainer.save(...) returned
    """
