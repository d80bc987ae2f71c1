"""WorkerGroup: one Ray actor per rank of a plan, joined in a torch.distributed process group.

The driver (your notebook) is the single controller: it calls methods on the group with the dispatch
modes of ``rlkit.workers.base`` (``call``, ``call_rank0``, ``call_dp``, ``apply``), which say who runs
them and how results come back. Each has an ``*_async`` variant returning a ``GroupFuture``. Every wait
has a timeout. A worker
exception arrives as ``rlkit.WorkerError`` (rank, node, remote traceback); a dead worker tears the
group down (the others would hang in their next collective) and the cluster stays usable.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from rlkit.batch import pad, rows, split
from rlkit.errors import PlanError, WorkerError
from rlkit.workers.base import BaseWorkerGroup, bound_method, join_dp_results, method_name

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.cluster import Cluster
    from rlkit.plan.topology import ParallelPlan
    from rlkit.pools import ResourcePool

_POLL_S = 0.2  # how often a wait wakes up: keeps Ctrl-C responsive and failures reported early
_GRACE_S = 1.0  # after one rank fails, how long to let its peers' failures (a dead process) arrive
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Every rank's env unless the caller sets these: no progress bars (HF "Loading weights", tqdm) flooding the
# notebook / terminal once per rank. Warnings and errors still come through (and tracebacks reach WorkerError).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Some ranks did not answer in time (often: stuck in a collective waiting for a peer)."""


HEARTBEAT_S = 2.0  # how often a rank's heartbeat thread reports (Cluster.table, WorkerGroup.heartbeats)


def beat_key(group_id: str, rank: int) -> str:
    """The key of rank ``rank``'s heartbeat in Ray's key-value store (the GCS: reachable from every node)."""
    return f"rlkit:beat:{group_id}:{rank}"


class _RankWorker:
    """The actor behind one rank: sets up env and process group, then hosts the user's object. A daemon thread
    reports its heartbeat every ``HEARTBEAT_S``: the time, its memory (RSS) and the call it is in, so a rank
    busy in a long call or stuck in a collective still shows alive, and a dead one stops reporting."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str], beat: str | None = None) -> None:
        os.environ.update(env)
        self.rank, self.world_size, self.obj = rank, world_size, None
        self._busy: tuple[str, float] | None = None  # (the call it is in, since when)
        if beat is not None:
            import threading

            threading.Thread(target=self._beat, args=(beat,), name="rlkit-heartbeat", daemon=True).start()

    def _beat(self, key: str) -> None:
        import json

        import psutil
        from ray.experimental import internal_kv

        me = psutil.Process()
        while True:
            busy = self._busy
            try:
                internal_kv._internal_kv_put(key, json.dumps({
                    "t": time.time(), "rss": me.memory_info().rss, "busy": busy[0] if busy else None,
                    "busy_since": busy[1] if busy else None}), overwrite=True)
            except Exception:  # the cluster going away: the next beat tries again, the process ends with it
                pass
            time.sleep(HEARTBEAT_S)

    def info(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "host": socket.gethostname()}

    def free_port(self, host: str) -> int:
        """A free TCP port on this node (the rendezvous port must be free where rank 0 runs)."""
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def setup(self, env: dict[str, str], threads: int, init_pg: bool, backend: str | None,
              dist_timeout_s: float, worker_cls: Callable, args: tuple, kwargs: dict) -> dict[str, float]:
        os.environ.update(env)
        t0 = time.perf_counter()
        _quiet_progress_bars()
        if init_pg or "torch" in sys.modules:  # a worker that never touches torch stays light
            import torch

            torch.set_num_threads(threads)  # several ranks share a node's cores: no oversubscription
        t_import = time.perf_counter() - t0
        if init_pg:
            import torch
            import torch.distributed as dist

            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            if backend == "nccl":
                torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves this rank's GPU as cuda:0
            dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=dist_timeout_s))
        t_pg = time.perf_counter() - t0 - t_import
        self.obj = worker_cls(*args, **kwargs)
        return {"import_s": t_import, "process_group_s": t_pg, "construct_s": time.perf_counter() - t0 - t_import - t_pg}

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._busy = (name, time.time())
        try:
            return bound_method(self.obj, name)(*args, **kwargs)
        finally:
            self._busy = None

    def apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        self._busy = (getattr(fn, "__name__", "apply"), time.time())
        try:
            return fn(self.obj, *args, **kwargs)
        finally:
            self._busy = None

    def close(self) -> bool:
        close = getattr(self.obj, "close", None)
        if callable(close):
            close()
        if "torch" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        return True


def _quiet_progress_bars() -> None:
    """Progress bars off in this worker when asked by env (QUIET_ENV): for transformers / huggingface_hub
    already imported too (the env variables only reach libraries imported later)."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "1":
        return
    if "transformers" in sys.modules:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # an old / odd transformers: the env variables still apply
            pass
    if "huggingface_hub" in sys.modules:
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except Exception:
            pass


def ship_by_value(obj: Any) -> None:
    """Send the code of ``obj``'s module with it when workers may not be able to import it.

    Ray pickles classes by reference (module + name). That fails for modules that live only next to
    the driver: a test file, a local helpers.py, any module outside site-packages; workers on other
    nodes would not have them either. Notebook classes (``__main__``) are already sent by value."""
    import ray.cloudpickle

    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    path = getattr(module, "__file__", None) or ""
    rlkit_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if (module is None or module.__name__ == "__main__" or not path or "site-packages" in path
            or "dist-packages" in path or os.path.abspath(path).startswith(rlkit_root + os.sep)):
        return
    ray.cloudpickle.register_pickle_by_value(module)


_ACTOR_CLS = None


def _actor_cls():
    global _ACTOR_CLS
    if _ACTOR_CLS is None:
        import ray

        # max_restarts=0: a restarted rank could not rejoin the process group anyway
        _ACTOR_CLS = ray.remote(max_restarts=0)(_RankWorker)
    return _ACTOR_CLS


class GroupFuture:
    """A dispatched call in flight. ``result(timeout)`` waits (bounded) and returns the gathered value.

    >>> fut = group.call_async("step")      # doctest: +SKIP
    >>> fut.done(), fut.result(timeout=30)  # doctest: +SKIP
    """

    def __init__(self, group: WorkerGroup, what: str, refs: list, ranks: list[int],
                 finish: Callable[[list], Any]) -> None:
        self.group, self.what, self.refs, self.ranks, self._finish = group, what, refs, ranks, finish
        self._done, self._value = False, None

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self, timeout: float | None = None) -> Any:
        if not self._done:
            values = self.group._gather(self.refs, self.ranks, timeout, self.what)
            self._value, self._done = self._finish(values), True
        return self._value

    def death(self, within_s: float) -> WorkerError | None:
        """The report of a rank of this call that died (a death seen within ``within_s`` seconds), else None.
        For a failure elsewhere that a dead peer may have caused: the death is the error to report."""
        import ray

        if self._done:
            return None
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=within_s)
        dead = []
        for ref in ready:
            try:
                ray.get(ref, timeout=_POLL_S * 10)
            except ray.exceptions.RayActorError as e:
                dead.append((self.ranks[self.refs.index(ref)], e))
            except Exception:
                pass
        return self.group._report(dead, self.what) if dead else None

    def __repr__(self) -> str:
        return f"GroupFuture({self.what}, {len(self.refs)} rank(s), done={self.done()})"


class WorkerGroup(BaseWorkerGroup):
    """One Ray actor per rank of ``plan``, in a process group, each hosting ``worker_cls(*args, **kwargs)``.

    Each actor gets the env a process group needs (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR = rank 0's node (loopback when all ranks share a node), MASTER_PORT = a free port
    there; on CPU OMP_NUM_THREADS and torch threads = its CPUs; on GPU Ray sets CUDA_VISIBLE_DEVICES),
    runs ``init_process_group`` (gloo on CPU, NCCL on GPU, with ``dist_timeout_s``) and then builds
    ``worker_cls``. Pass ``init_process_group=False`` if the class sets up torch.distributed itself
    from that env.

    Args:
        cluster: the ``rlkit.Cluster``.
        plan: a ``ParallelPlan`` or a world size (then every rank is its own DP rank).
        worker_cls: the per-rank class; must be importable or picklable (notebook classes are fine).
        pool: a ``ResourcePool`` to place ranks on (shared by colocated roles); default: a new one.
        owns_pool: remove ``pool`` when this group shuts down (a pool reserved for this group alone, e.g.
            by ``Cluster.role_pools`` for a Trainer's role). A pool the group makes itself is always removed.
        timeout_s: default bound on every wait (spawn and calls), in seconds.
        dist_timeout_s: torch.distributed timeout: how long a collective waits for a missing peer.
        env: extra environment variables for every rank.
        cpus_per_worker: CPUs per rank when making the pool (default: the cluster's).
        placement_timeout_s: how long to wait for the pool's resources (default: the cluster's
            ``timeout_s``, 30 s); then a ``ClusterError`` says what is needed, what is free and which
            groups hold the rest.
        owner: the object this group works for (a ``Trainer``). Held weakly: once it is gone, the
            cluster releases the group when it needs room. Its ``_holder_label`` (if any) names it in
            "held by" reports.

    >>> class Adder:
    ...     def __init__(self, base): self.base = base
    ...     def add(self, x): return self.base + x
    ...     def add_each(self, xs): return [self.base + x for x in xs]
    >>> with WorkerGroup(cluster, 2, Adder, 10) as g:   # doctest: +SKIP
    ...     g.call(Adder.add, 1), g.call_dp(Adder.add_each, [1, 2, 3])
    ([11, 11], [11, 12, 13])
    """

    def __init__(self, cluster: Cluster, plan: ParallelPlan | int, worker_cls: Callable, *args: Any,
                 pool: ResourcePool | None = None, timeout_s: float = 300, dist_timeout_s: float = 300,
                 env: dict[str, str] | None = None, init_process_group: bool = True,
                 backend: str | None = None, name: str | None = None, cpus_per_worker: float | None = None,
                 placement_timeout_s: float | None = None, owner: Any = None, owns_pool: bool = False,
                 **kwargs: Any) -> None:
        import ray

        from rlkit.plan.topology import ParallelPlan

        cluster._check_alive()
        if isinstance(plan, bool) or not isinstance(plan, (int, ParallelPlan)):
            raise PlanError(f"plan={plan!r} must be a ParallelPlan or a world size (int)")
        self.plan = ParallelPlan(dp=plan) if isinstance(plan, int) else plan
        self.cluster, self.worker_cls, self.name = cluster, worker_cls, name or getattr(worker_cls, "__name__", "workers")
        self.timeout_s, self.world_size = float(timeout_s), self.plan.world_size
        self._closed, self._broken = False, None
        self.beat_id = f"{os.getpid()}-{id(self):x}-{time.monotonic_ns()}"  # its ranks' heartbeat keys
        self._owner = weakref.ref(owner) if owner is not None else None
        self._owner_label = getattr(owner, "_holder_label", None) or (type(owner).__name__ if owner is not None else None)
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        if pool is None:
            pool = cluster.placement_group_for(self.plan, name=self.name, timeout_s=placement_timeout_s,
                                               cpus_per_worker=cpus_per_worker)
            self._owns_pool = True
        else:
            if pool.world_size != self.world_size:
                raise PlanError(f"pool {pool.name!r} has {pool.world_size} ranks but the plan needs "
                                f"{self.world_size}; make the pool from the same plan")
            self._owns_pool = owns_pool
        pool._claim()
        self.pool = pool
        self.timings["reserve_s"] = time.perf_counter() - t0
        cluster._groups.append(self)

        try:
            ship_by_value(worker_cls)
            actor = _actor_cls()
            user_env = {**QUIET_ENV, **{k: str(v) for k, v in (env or {}).items()}}
            self.actors = [actor.options(**pool.actor_options(r), name=None).remote(r, self.world_size, user_env,
                                                                                  beat_key(self.beat_id, r))
                           for r in range(self.world_size)]
            self.info = self._gather([a.info.remote() for a in self.actors], list(range(self.world_size)),
                                     timeout_s, "start")
            self.timings["actors_s"] = time.perf_counter() - t0 - self.timings["reserve_s"]
            self.nodes = [i["node_id"] for i in self.info]
            # Loopback when all ranks share rank 0's node: the rendezvous never listens on the network.
            one_node = len(set(self.nodes)) == 1
            master = "127.0.0.1" if one_node else self.info[0]["ip"]
            port = ray.get(self.actors[0].free_port.remote(master), timeout=timeout_s)
            threads = max(1, int(pool.cpus_per_rank))
            refs = []
            for r, a in enumerate(self.actors):
                same = [q for q in range(self.world_size) if self.nodes[q] == self.nodes[r]]
                rank_env = {"RANK": str(r), "WORLD_SIZE": str(self.world_size),
                            "LOCAL_RANK": str(same.index(r)), "LOCAL_WORLD_SIZE": str(len(same)),
                            "MASTER_ADDR": master, "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads),
                            **user_env}
                if one_node and "GLOO_SOCKET_IFNAME" not in user_env:
                    rank_env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise pick the host's interface
                refs.append(a.setup.remote(rank_env, threads, init_process_group, backend, dist_timeout_s,
                                           worker_cls, args, kwargs))
            setup = self._gather(refs, list(range(self.world_size)), timeout_s, "setup")
            self.master_addr, self.master_port = master, port
            self.timings["setup_s"] = max(s["process_group_s"] + s["construct_s"] + s["import_s"] for s in setup)
            self.timings["spawn_s"] = time.perf_counter() - t0
        except BaseException:
            self.shutdown(polite=False)
            raise

    # ---- dispatch (the protocol of rlkit.workers.base) ---------------------------------------------
    def _where(self) -> str:
        return ""

    def ship_code(self, obj: Any) -> None:
        """``obj``'s module travels by value when the worker processes may not import it."""
        ship_by_value(obj)

    def call_async(self, method: str | Callable, *args: Any, **kwargs: Any) -> GroupFuture:
        """``method(*args, **kwargs)`` on every rank; the future gives a list in rank order."""
        self._check_usable()
        name = method_name(method)
        refs = [a.call.remote(name, *args, **kwargs) for a in self.actors]
        return GroupFuture(self, name, refs, list(range(self.world_size)), lambda values: values)

    def call_rank0_async(self, method: str | Callable, *args: Any, **kwargs: Any) -> GroupFuture:
        """``method`` on rank 0 only (the others are not called: no collectives inside it)."""
        self._check_usable()
        name = method_name(method)
        return GroupFuture(self, name, [self.actors[0].call.remote(name, *args, **kwargs)], [0],
                           lambda values: values[0])

    def call_dp_async(self, method: str | Callable, batch: Any, *args: Any, **kwargs: Any) -> GroupFuture:
        """Split ``batch`` by DP rank and call ``method(chunk, *args, **kwargs)`` on every rank.

        A batch whose size does not divide by dp is padded by repeating its last row; per-sample
        results are cut back to the original size. Results are gathered once per DP group, from its
        last pipeline stage's tp=0 rank (where the loss / log-probs of a pipeline come out). Per-sample
        results (a dict / tensor / list with one row per row of the chunk) are joined in DP order; any
        other result (a scalar loss, a gradient) comes back as a list with one entry per DP rank.
        """
        import ray

        self._check_usable()
        name = method_name(method)
        plan = self.plan
        padded, n = pad(batch, plan.dp)
        chunks = split(padded, plan.dp)
        if plan.tp * plan.pp > 1:  # one copy per DP group in the object store, shared by its ranks
            chunks = [ray.put(c) for c in chunks]
        # else each chunk has one reader: passed as the argument (Ray stores a large one itself), which
        # saves a put and a lookup per call (~2 ms each on a small batch)
        refs = [a.call.remote(name, chunks[plan.coords(r)["dp"]], *args, **kwargs)
                for r, a in enumerate(self.actors)]
        collect = [plan.rank(dp=d, tp=0, pp=plan.pp - 1) for d in range(plan.dp)]

        total = rows(padded)
        return GroupFuture(self, name, refs, list(range(self.world_size)),
                           lambda values: join_dp_results([values[r] for r in collect], total, n))

    def apply_async(self, fn: Callable, *args: Any, **kwargs: Any) -> GroupFuture:
        """``fn(worker, *args, **kwargs)`` on every rank, ``worker`` being that rank's object."""
        self._check_usable()
        refs = [a.apply.remote(fn, *args, **kwargs) for a in self.actors]
        return GroupFuture(self, getattr(fn, "__name__", "fn"), refs, list(range(self.world_size)), lambda v: v)

    # ---- waiting and failures ----------------------------------------------------------------
    def _gather(self, refs: list, ranks: list[int], timeout: float | None, what: str) -> list[Any]:
        """Wait for all refs (bounded); the first failure is raised at once as a WorkerError."""
        import ray

        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        rank_of = {ref: r for ref, r in zip(refs, ranks)}
        values: dict[Any, Any] = {}
        pending = list(refs)
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(rank_of[p] for p in pending)
                    raise WorkerTimeoutError(
                        f"{what!r} did not finish within {timeout:g} s on rank(s) {missing} "
                        f"(of {len(refs)}); they may be stuck in a collective waiting for a peer. Raise "
                        f"timeout=, or group.shutdown() and make a new group", rank=missing[0],
                        node=self._node(missing[0]))
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(_POLL_S, left))
                errors = self._collect(ready, values, rank_of)
                if errors:
                    # A dead peer often shows first as a gloo/NCCL error on a live rank: give the death a
                    # moment to surface, so the report names the rank that really failed.
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
                    errors += self._collect(more, values, rank_of)
                    raise self._report(errors, what) from None
        except KeyboardInterrupt:
            # Ctrl-C in the notebook: stop everything we started, leave the cluster usable.
            for ref in pending:
                try:
                    ray.cancel(ref)
                except Exception:
                    pass
            self._broken = f"interrupted (KeyboardInterrupt) during {what!r}"
            self.shutdown(polite=False)
            raise
        return [values[ref] for ref in refs]

    def _node(self, rank: int) -> str | None:
        info = getattr(self, "info", None)
        return f"{info[rank]['ip']} ({info[rank]['node_id'][:8]})" if info else None

    @staticmethod
    def _collect(ready: list, values: dict, rank_of: dict) -> list[tuple[int, Exception]]:
        import ray

        errors = []
        for ref in ready:
            try:
                values[ref] = ray.get(ref, timeout=_POLL_S * 10)  # ready: returns at once
            except Exception as e:
                errors.append((rank_of[ref], e))
        return errors

    def _report(self, errors: list[tuple[int, Exception]], what: str) -> WorkerError:
        """One WorkerError for the failures seen: a dead process first (and then the group is torn
        down: its peers would block in their next collective), else the lowest failing rank."""
        import ray

        dead = [(r, e) for r, e in errors if isinstance(e, ray.exceptions.RayActorError)]
        failed = sorted({r for r, _ in errors})
        also = f"; rank(s) {failed} failed in all" if len(failed) > 1 else ""
        if dead:
            rank, e = min(dead, key=lambda x: x[0])
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._broken, self._lost = f"rank {rank} died during {what!r}", True
            self.shutdown(polite=False)
            return WorkerError(f"the worker process died during {what!r} (killed, out of memory or crashed): "
                               f"{reason}{also}. The group was shut down; the cluster is still usable, make a "
                               f"new WorkerGroup", rank=rank, node=self._node(rank), lost=True)
        rank, e = min(errors, key=lambda x: x[0])
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = getattr(e, "cause", None)
            msg = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
            tb = _ANSI.sub("", getattr(e, "traceback_str", None) or str(e))
            return WorkerError(f"{msg} (in {what!r}){also}", rank=rank, node=self._node(rank), remote_traceback=tb)
        return WorkerError(f"{type(e).__name__}: {e} (in {what!r}){also}", rank=rank, node=self._node(rank))

    # ---- ownership ---------------------------------------------------------------------------
    def holder_line(self) -> str:
        """What this group holds and how to free it, in one line (for "could not reserve" reports)."""
        pool = getattr(self, "pool", None)
        held = f"{self.world_size} x " + (" + ".join(f"{v / pool.colocate:g} {k}" for k, v in pool.bundle.items())
                                          if pool is not None else "?")
        if self._owner_label is not None:
            how = "trainer.close()" if "Trainer" in self._owner_label else "close its owner"
            return f"WorkerGroup {self.name!r} ({held}) of {self._owner_label}: free it with {how}"
        return f"WorkerGroup {self.name!r} ({held}): free it with group.shutdown()"

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self, polite: bool = True, timeout_s: float = 10) -> None:
        """Destroy the process group (politely, bounded by ``timeout_s``), kill the actors and release
        the resources. Idempotent."""
        import ray

        if self._closed:
            return
        self._closed = True
        actors = getattr(self, "actors", [])
        if polite and actors and ray.is_initialized():
            try:
                ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
            except Exception:
                pass
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        if getattr(self, "pool", None) is not None:
            self.pool._release()
            if self._owns_pool:
                self.pool.remove()
        if self in self.cluster._groups:
            self.cluster._groups.remove(self)
        try:
            from ray.experimental import internal_kv

            if ray.is_initialized():
                internal_kv._internal_kv_del(f"rlkit:beat:{self.beat_id}:", del_by_prefix=True)
        except Exception:  # the cluster is gone, and its store with it
            pass

    def heartbeats(self) -> pd.DataFrame:
        """One row per rank: where it runs (node, ip, pid), its memory, the call it is in and for how long, and
        its last heartbeat (seconds ago; a rank that stopped reporting for 3 heartbeats shows ``alive`` False).

        >>> group.heartbeats()[["rank", "node", "rss_gb", "busy", "heartbeat_s", "alive"]]   # doctest: +SKIP
        """
        import json

        import pandas as pd
        from ray.experimental import internal_kv

        now, out = time.time(), []
        for r, info in enumerate(getattr(self, "info", None) or []):
            try:
                raw = internal_kv._internal_kv_get(beat_key(self.beat_id, r))
            except Exception:
                raw = None
            beat = json.loads(raw) if raw else {}
            age = now - beat["t"] if "t" in beat else float("nan")
            out.append({"rank": r, **self.plan.coords(r), "node": info["node_id"][:8], "ip": info["ip"],
                        "pid": info["pid"], "rss_gb": beat.get("rss", float("nan")) / 2**30,
                        "busy": beat.get("busy"), "busy_s": now - beat["busy_since"] if beat.get("busy_since") else 0.0,
                        "heartbeat_s": age, "alive": bool(age <= 3 * HEARTBEAT_S) and not self._closed})
        return pd.DataFrame(out)

