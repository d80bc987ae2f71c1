"""Ray worker groups: one actor per rank, dispatch modes, failure reports. See ``group.py``."""

from rlkit.workers.batch import batch_size, concat_batches, pad_batch, split_batch, truncate_batch
from rlkit.workers.group import GroupFuture, WorkerGroup, WorkerTimeoutError

__all__ = ["GroupFuture", "WorkerGroup", "WorkerTimeoutError", "batch_size", "concat_batches", "pad_batch",
           "split_batch", "truncate_batch"]
