"""LocalWorkerGroup: a one-rank plan's worker in the driver's own process, without Ray.

A plan of one rank has no peers to talk to, so a Ray actor buys it nothing but cost: Ray's head (the
GCS, the raylet and five helper processes) takes ~13 s to start on a 2-core machine and ~1.3 GB of
memory, the worker process imports torch and transformers again, and every call pickles its tensors
through the object store. TRL runs in one process; so does this.

The worker is the same class a ``WorkerGroup`` would host (``RLWorker``), inside a world-of-one
process group, and the group has the same dispatch methods (``call``, ``call_rank0``, ``call_dp``,
``apply`` and their ``*_async`` forms), results and errors (``rlkit.WorkerError``) as
``WorkerGroup``. Differences, by design: calls run synchronously in this process (there is no peer to
wait for, so there is no timeout to bound), arguments are passed by reference (not copied), and the
worker shares this process's torch threads and random state.

``rlkit.Trainer`` uses it for a one-rank colocated plan when no ``cluster`` is given.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from rlkit.batch import pad, rows
from rlkit.errors import PlanError, WorkerError
from rlkit.workers.base import BaseWorkerGroup, bound_method, join_dp_results, method_name

_PG_USERS: list[Any] = []  # local groups using the process group this module started (destroyed with the last)


class _Done:
    """A finished call, shaped like ``GroupFuture`` (``done()``, ``result(timeout)``)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self._value


class LocalWorkerGroup(BaseWorkerGroup):
    """``worker_cls(*args, **kwargs)`` as rank 0 of a one-rank process group in this process.

    >>> from rlkit.workers.local import LocalWorkerGroup
    >>> class Adder:
    ...     def __init__(self, base): self.base = base
    ...     def add(self, x): return self.base + x
    >>> with LocalWorkerGroup(1, Adder, 10, init_process_group=False) as g:
    ...     g.call("add", 1), g.call_rank0("add", 2)
    ([11], 12)
    """

    def __init__(self, plan: Any, worker_cls: Callable, *args: Any, init_process_group: bool = True,
                 name: str | None = None, owner: Any = None, **kwargs: Any) -> None:
        import weakref

        from rlkit.plan.topology import ParallelPlan

        if isinstance(plan, bool) or not isinstance(plan, (int, ParallelPlan)):
            raise PlanError(f"plan={plan!r} must be a ParallelPlan or a world size (int)")
        self.plan = ParallelPlan(dp=plan) if isinstance(plan, int) else plan
        if self.plan.world_size != 1:
            raise PlanError(f"a LocalWorkerGroup runs one rank in this process, but {self.plan.describe()} has "
                            f"{self.plan.world_size}; use rlkit.workers.WorkerGroup on an rlkit.Cluster")
        self.worker_cls, self.name = worker_cls, name or getattr(worker_cls, "__name__", "workers")
        self.world_size, self.cluster = 1, None
        self._closed, self._broken, self._owns_pg = False, None, False
        self._owner = weakref.ref(owner) if owner is not None else None
        self.info = [{"ip": "127.0.0.1", "node_id": "local", "pid": os.getpid(), "host": socket.gethostname()}]
        self.nodes = ["local"]
        t0 = time.perf_counter()
        if init_process_group:
            self._join_process_group()
        t_pg = time.perf_counter() - t0
        try:
            with _no_progress_bars():
                self.obj = worker_cls(*args, **kwargs)
        except BaseException:
            self.shutdown()
            raise
        construct = time.perf_counter() - t0 - t_pg
        self.timings = {"reserve_s": 0.0, "actors_s": 0.0, "setup_s": t_pg + construct, "spawn_s": t_pg + construct}

    def _join_process_group(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != 1:
                raise PlanError(f"this process is already rank {dist.get_rank()} of a {dist.get_world_size()}-rank "
                                f"torch.distributed process group, so a one-rank worker cannot run in it; pass "
                                f"cluster=rlkit.Cluster() to run it in a Ray worker instead")
            if _PG_USERS:  # another local group's process group: share it (the last one out destroys it)
                _PG_USERS.append(self)
                self._owns_pg = True
            return  # else the caller's own process group: used, never destroyed
        # a HashStore: a world of one needs no rendezvous, so no port is opened
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        _PG_USERS.append(self)
        self._owns_pg = True

    # ---- dispatch (the protocol of rlkit.workers.base) ----------------------------------------------
    def _where(self) -> str:
        return ", in this process"

    def _run(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> _Done:
        """Run ``fn`` now; errors arrive as they do from a Ray worker (``WorkerError``)."""
        self._check_usable()
        try:
            return _Done(fn(*args, **kwargs))
        except KeyboardInterrupt:
            # stopped half-way (an optimizer step, a weight load): the worker's state cannot be trusted
            self._broken = f"interrupted (KeyboardInterrupt) during {what!r}"
            self.shutdown()
            raise
        except (SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # an Exception, or a library's BaseException (never past a caller's except)
            raise WorkerError(f"{type(e).__name__}: {e} (in {what!r})", rank=0, node="this process",
                              remote_traceback=traceback.format_exc()) from None

    def call_async(self, method: str | Callable, *args: Any, **kwargs: Any) -> _Done:
        """``method(*args, **kwargs)`` on the rank, now; the result is a one-item list (as ``WorkerGroup``)."""
        name = method_name(method)
        return self._run(name, lambda: [bound_method(self.obj, name)(*args, **kwargs)])

    def call_rank0_async(self, method: str | Callable, *args: Any, **kwargs: Any) -> _Done:
        name = method_name(method)
        return self._run(name, lambda: bound_method(self.obj, name)(*args, **kwargs))

    def call_dp_async(self, method: str | Callable, batch: Any, *args: Any, **kwargs: Any) -> _Done:
        """``method(batch, ...)``; the result joined as ``WorkerGroup.call_dp`` joins one DP rank's."""
        name = method_name(method)
        padded, n = pad(batch, 1)
        return self._run(name, lambda: join_dp_results([bound_method(self.obj, name)(padded, *args, **kwargs)],
                                                       rows(padded), n))

    def apply_async(self, fn: Callable, *args: Any, **kwargs: Any) -> _Done:
        return self._run(getattr(fn, "__name__", "fn"), lambda: [fn(self.obj, *args, **kwargs)])

    # ---- lifecycle -----------------------------------------------------------------------------
    def shutdown(self, polite: bool = True, timeout_s: float = 10) -> None:
        """Close the worker and leave the process group (when the last local group goes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        obj, self.obj = getattr(self, "obj", None), None
        close = getattr(obj, "close", None)
        if polite and callable(close):
            try:
                close()
            except Exception:
                pass
        del obj
        if self._owns_pg and self in _PG_USERS:
            _PG_USERS.remove(self)
            if not _PG_USERS:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        import gc

        gc.collect()  # the model's memory comes back now, not at the next collection



@contextmanager
def _no_progress_bars():
    """No "Loading weights" bars while the worker loads its model (the Ray path sets QUIET_ENV in the
    worker's own process; here the process is the user's, so the setting is put back afterwards)."""
    restore = []
    try:
        from transformers.utils import logging as hf_logging

        if hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.append(hf_logging.enable_progress_bar)
    except Exception:  # an old / odd transformers: its bars stay as they are
        pass
    try:
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )

        if not are_progress_bars_disabled():
            disable_progress_bars()
            restore.append(enable_progress_bars)
    except Exception:
        pass
    try:
        yield
    finally:
        for fn in restore:
            fn()
