"""Runs that recover from lost workers by themselves (``TrainerConfig(checkpoint_every=N, max_restarts=R)``).

Long RL runs lose workers: a preemption, an out-of-memory kill, a node rebooting. ``Trainer.fit`` writes the
run's checkpoint (``run_dir/checkpoint``) every N steps. When a worker process dies, the group reports a
``WorkerError`` with ``lost=True`` (an exception a worker raised is not a loss, and is never retried). ``fit``
hands it to ``restart``, which:

1. reports the loss;
2. tears every group of the trainer down;
3. starts them again on what the cluster has, waiting up to ``restart_timeout_s`` for room (a replacement node,
   the lost one's CPUs given back);
4. loads the checkpoint, the same way ``Trainer.load`` does (``TrainerIO._resume``).

``fit`` then runs the steps after the checkpoint again; their first rows move to ``metrics.rolled_back.jsonl``.
A restart under the same plan is exact, so the run equals an uninterrupted one of the same seed. Past R restarts,
or with no room in time, the error goes to the caller, naming the checkpoint that was kept.

>>> from rlkit.errors import WorkerError
>>> restart(None, WorkerError("boom", rank=1))    # raised by the worker, not a lost process: not retried
Traceback (most recent call last):
...
rlkit.errors.WorkerError: rank 1 failed: boom
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rlkit import checkpoint
from rlkit.errors import ClusterError, PlanError, WorkerError

RETRY_S = 2.0  # between a restart's tries to start the groups while the cluster has no room


def restart(trainer: Any, error: Exception) -> None:
    """After ``error`` lost one of ``trainer``'s workers: its groups started again and the last checkpoint loaded,
    ``trainer.restarts`` extended by one record. Raises ``error`` when it is not a lost process or restarts are
    off, and a ``WorkerError`` naming the checkpoint kept when they are used up or no room came in time."""
    if not getattr(error, "lost", False) or not trainer.config.max_restarts:
        raise error
    c, ckpt = trainer.config, trainer.checkpoint_path
    saved = (ckpt / "trainer.json").is_file()
    from_step = checkpoint.read_state(ckpt)["step"] if saved else None
    kept = (f"the checkpoint of step {from_step} is kept at {ckpt}: Trainer.load({str(ckpt)!r}, dataset=...) goes "
            f"on from it") if saved else f"no checkpoint was written yet (checkpoint_every={c.checkpoint_every})"
    rank = getattr(error, "rank", None)
    if len(trainer.restarts) >= c.max_restarts or not saved:
        why = f"max_restarts={c.max_restarts} used up" if saved else "nothing to restart from"
        raise WorkerError(f"{error}\nrlkit: not restarted ({why}); {kept}", rank=rank, lost=True) from None
    failed, t0 = trainer.step + 1, time.perf_counter()
    first = str(error).splitlines()[0]
    print(f"rlkit: {first}\nrlkit: restart {len(trainer.restarts) + 1}/{c.max_restarts} in step {failed}: the "
          f"workers start again and load the checkpoint of step {from_step} ({ckpt})", file=sys.stderr, flush=True)
    _tear_down(trainer)
    deadline = time.monotonic() + c.restart_timeout_s
    while True:
        try:
            trainer._start_workers()
            break
        except (PlanError, ClusterError, WorkerError, TimeoutError) as e:
            if time.monotonic() > deadline:
                raise WorkerError(f"{error}\nrlkit: the restart found no room for {trainer.plan.describe()} within "
                                  f"restart_timeout_s={c.restart_timeout_s:g} s ({str(e).splitlines()[0]}); {kept}",
                                  rank=rank, lost=True) from None
            time.sleep(RETRY_S)
    trainer._resume(ckpt, checkpoint.verified_state(ckpt)[0])
    trainer.restarts.append({"failed_step": failed, "from_step": trainer.step, "rank": rank,
                             "node": getattr(error, "node", None), "error": first,
                             "seconds": time.perf_counter() - t0})


def _tear_down(trainer: Any) -> None:
    """Every group of ``trainer`` shut down (the lost worker's group already is), its resources given back."""
    from rlkit.workers.rl_workers import shutdown_groups

    workers, trainer.workers = trainer.workers, None
    if workers is not None:
        workers.close()
    shutdown_groups(trainer._held)


__all__ = ["restart"]
