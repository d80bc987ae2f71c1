"""The asynchronous queue: generations sampled ahead of training (``TrainerConfig.off_policy_steps = k > 0``).

Each entry is one step's generation in flight on the rollout workers: the step it is for, the pending batch,
and the weight sync it was sampled after. ``Trainer.generate`` takes the oldest (``next``) and launches more;
a Ctrl-C at a safe point puts the untrained batch back first in line (``put_back``); a checkpoint keeps every
entry (``saved``) and a resumed run trains the same batches (``restore``).

>>> q = AheadQueue()
>>> len(q), bool(q), [e.step for e in q]
(0, False, [])
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rlkit.batch import Batch


@dataclass
class InFlight:
    """One step's generation, sampled ahead: ``pending.result()`` is its batch, ``sync.result(timeout)`` the
    report of the weight sync it was sampled after."""

    step: int
    pending: Any  # rlkit.workers.rl_workers.PendingBatch
    sync: Any     # rlkit.workers.rl_workers.SyncInFlight


class AheadQueue:
    """The generations in flight, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._q: collections.deque[InFlight] = collections.deque()
        self.engine_version = -1   # the actor step whose weights the rollout engines hold (or are loading)
        self._last_sync: Any = None

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._q)

    def launched(self, step: int, pending: Any, sync: Any) -> None:
        """A generation just queued on the rollout workers: last in line."""
        self._q.append(InFlight(step, pending, sync))

    def fill(self, workers: Any, step: int, depth: int, prompts_of: Callable[[int], list[dict[str, Any]]],
             seed_of: Callable[[int], int]) -> InFlight:
        """Step ``step``'s generation, taken from the queue, after launching the generations of the steps
        after it until ``depth`` are in flight (``off_policy_steps + 1``). Each is sampled with the actor's
        weights of now, step ``step``'s, on ``prompts_of(s)`` rows seeded ``seed_of(s)``; when the queue is
        empty (the first step, or after ``load``) step ``step``'s own is launched first, on-policy."""
        if not self._q:
            self._launch(workers, step, step, prompts_of, seed_of)
        while len(self._q) < depth:
            self._launch(workers, step + len(self._q), step, prompts_of, seed_of)
        return self.next()

    def _launch(self, workers: Any, step: int, actor_step: int, prompts_of: Callable, seed_of: Callable) -> None:
        """Queue step ``step``'s generation on the rollout workers with the weights of actor step
        ``actor_step`` (synced first unless the engines hold them already: the actor's gather runs now, the
        engines load it in turn)."""
        if self.engine_version != actor_step:
            self._last_sync = workers.sync_weights_async()
            self.engine_version = actor_step
        pending = workers.generate_async(prompts_of(step), seed=seed_of(step), policy_version=actor_step)
        self.launched(step, pending, self._last_sync)

    def next(self) -> InFlight:
        """The oldest generation: the one the next step trains on."""
        return self._q.popleft()

    def put_back(self, step: int, samples: Batch, prompts: list[dict[str, Any]], sync_report: Any) -> None:
        """A batch taken but not trained (a Ctrl-C before its update): first in line again, as it was."""
        from rlkit.workers.rl_workers import PendingBatch, SyncInFlight

        version = int(samples.policy_version[0])
        self._q.appendleft(InFlight(step, PendingBatch.ready(samples, prompts, version), SyncInFlight(sync_report)))

    def saved(self, timeout_s: float) -> list[tuple]:
        """Every entry, waited for, as plain data for a checkpoint: ``(step, batch, prompts, version, sync)``."""
        return [(e.step, e.pending.result(), e.pending.prompts, e.pending.policy_version, e.sync.result(timeout_s))
                for e in self._q]

    def restore(self, saved: list[tuple]) -> None:
        """Entries from ``saved``, after the ones already here, trained next as they were."""
        from rlkit.workers.rl_workers import PendingBatch, SyncInFlight

        for step, batch, prompts, version, sync in saved:  # Batch.of: a checkpoint from before rlkit.Batch kept dicts
            self._q.append(InFlight(step, PendingBatch.ready(Batch.of(batch), prompts, version), SyncInFlight(sync)))


__all__ = ["AheadQueue", "InFlight"]
