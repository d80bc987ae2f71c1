"""The asynchronous queue: generations sampled ahead of training (``TrainerConfig.off_policy_steps = k > 0``).

Each entry is one generation round in flight on the rollout workers (one step's batch, or with dynamic
sampling a part of one): its round, the pending batch, and the weight sync it was sampled after. ``Trainer.generate`` takes the oldest (``next``) and launches more;
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

    step: int     # the generation round (the step it is trained at, without dynamic sampling)
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

    def fill(self, workers: Any, step: int, depth: int,
             new_round: Callable[[], tuple[int, list[dict[str, Any]], int]]) -> InFlight:
        """The oldest generation in the queue, taken, after launching new rounds until ``depth`` are in flight
        (``off_policy_steps + 1``, counting the one taken). Each new round is sampled with the actor's weights
        of now, step ``step``'s, on the prompts and seed ``new_round()`` gives (the dataset's next rows); when
        the queue is empty (the first step, or after ``load``) the round taken is launched now, on-policy."""
        while len(self._q) < depth:
            self._launch(workers, step, new_round)
        return self.next()

    def _launch(self, workers: Any, actor_step: int, new_round: Callable) -> None:
        """Queue the next round's generation on the rollout workers with the weights of actor step
        ``actor_step`` (synced first unless the engines hold them already: the actor's gather runs now, the
        engines load it in turn)."""
        if self.engine_version != actor_step:
            self._last_sync = workers.sync_weights_async()
            self.engine_version = actor_step
        rnd, prompts, seed = new_round()
        pending = workers.generate_async(prompts, seed=seed, policy_version=actor_step)
        self.launched(rnd, pending, self._last_sync)

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
