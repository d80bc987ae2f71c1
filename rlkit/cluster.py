"""Cluster: one handle on a Ray cluster (embedded on this machine, or an existing one by address).

It answers three questions for the layers above: what is there (``resources()``, ``num_devices``,
``devices_per_node``), where do the ranks of a plan go (``placement_group_for`` -> a ``ResourcePool``,
``rlkit.pools``), and which roles share devices (``role_pools``). ``rlkit.workers.WorkerGroup`` then puts one actor on
each rank's bundle.

On a CPU-only cluster, CPU slots stand in for devices (``CPUs // cpus_per_worker``), so every plan
runs on a laptop.

>>> import rlkit
>>> cluster = rlkit.Cluster(num_cpus=4)          # doctest: +SKIP
>>> cluster.num_devices                           # doctest: +SKIP
4
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rlkit.errors import ClusterError, PlanError
from rlkit.pools import ResourcePool, bundles_that_fit, format_bundle, rank_groups

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.plan.topology import ParallelPlan

# Ray's standard resources; everything else a node reports (but "node:<ip>" markers) is custom.
_STD = {"CPU", "GPU", "memory", "object_store_memory"}
_CURRENT: Cluster | None = None  # the one Cluster of this process: notebook re-runs reuse or replace it


class OversubscribedWarning(UserWarning):
    """More ranks than devices: each rank gets a fraction of a CPU (slow, but it runs)."""


def _split_address(address: str) -> tuple[str, int] | None:
    """'ray://h:p' or 'h:p' -> (h, p); None for 'auto' / 'local' (Ray finds those itself)."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if rest in ("auto", "local"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        if not host:
            raise ValueError(port)
        return host.strip("[]"), int(port)
    except ValueError:
        raise ClusterError(f"address={address!r} is not 'host:port', 'ray://host:port' or 'auto'") from None


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast on a dead address: ray.init would otherwise retry the GCS for a long time."""
    hp = _split_address(address)
    if hp is None:
        return
    try:
        socket.create_connection(hp, timeout=timeout_s).close()
    except OSError as e:
        raise ClusterError(f"cannot reach a Ray cluster at {address!r} ({type(e).__name__}: {e}) within "
                           f"{timeout_s:.0f} s; start one with `ray start --head --port={hp[1]}`, fix the "
                           f"address, or use rlkit.Cluster() for an embedded local cluster") from None


def _enable_token_auth_if_token_exists() -> None:
    """Ray enables token auth by itself for new local clusters and for 'auto', but not for an explicit
    address. Clusters started with a token (Ray's default) then reject us, so send the token if this
    machine has one and the user did not choose a mode (RAY_AUTH_MODE)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # older/newer Ray without token auth: nothing to do
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


@contextlib.contextmanager
def _quiet_ray_start() -> Iterator[None]:
    """Ray's start-up chatter off, its behaviour unchanged: the token-auth notice (auth stays on, as Ray
    chose) and the one-time log-dedup banner (dedup itself stays on: repeated worker lines still show
    as "[repeated Nx across cluster]"). Worker warnings, errors and tracebacks are not touched."""
    try:
        from ray.util.debug import log_once

        log_once("log_dedup_warning")  # consumes Ray's once-only banner flag
    except ImportError:
        pass
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        auth_log.setLevel(level)


def _start_embedded(*, num_cpus: int, num_gpus: int | None, namespace: str, tries: int = 2) -> None:
    """``ray.init`` of a new local instance. Ray gives its raylet a fixed 30 s to register and raises a
    bare ``Exception`` ("timed out during startup") past it, which a loaded machine can hit (measured:
    a 2-core runner with two test lanes busy); such a start is torn down and tried once more."""
    import ray

    for attempt in range(1, tries + 1):
        try:
            with _quiet_ray_start():
                ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                         _node_ip_address="127.0.0.1", namespace=namespace, logging_level="WARNING")
            return
        except Exception as e:  # Ray's start-up failures are plain Exception / RuntimeError
            ray.shutdown()      # the half-started processes of this attempt
            if attempt == tries:
                raise ClusterError(f"the embedded Ray did not start ({tries} tries): {str(e).splitlines()[0]} "
                                   "-- the machine may be overloaded; close other Ray sessions or retry") from e
            warnings.warn(f"the embedded Ray did not start ({str(e).splitlines()[0]}); trying once more",
                          stacklevel=3)


def _labels(node: dict[str, Any]) -> str:
    """A node's own labels (``ray start --labels``), ``k=v`` joined by commas."""
    return ", ".join(f"{k}={v}" for k, v in sorted(node.get("labels", {}).items()))


class Cluster:
    """A Ray cluster: embedded on this machine, or an existing one reached by address.

    Args:
        address: None (and no RAY_ADDRESS) starts an embedded local Ray; ``"host:port"``, ``"auto"``
            or ``"ray://host:port"`` connects to an existing cluster. A Ray already initialised in this
            process (``ray.init`` by the user) is reused and never shut down by rlkit.
        num_cpus, num_gpus: resources of the embedded cluster (default: all CPUs, detected GPUs).
        cpus_per_worker: CPUs one rank's actor gets; on CPU-only clusters a device is this many CPUs.
        gpus_per_worker: GPUs per rank (default 1 when the cluster has GPUs, else 0).
        timeout_s: bound on connecting and on reserving resources (placement groups).
        namespace: Ray namespace of the actors (named actors of other users stay separate).

    Re-running ``Cluster(...)`` with the same arguments returns the live cluster (a notebook cell run
    twice does not start a second Ray); different arguments shut the previous embedded one down first.

    >>> cluster = Cluster(num_cpus=2)                  # doctest: +SKIP
    >>> cluster.resources()[["node_ip", "CPU", "CPU_free"]]   # doctest: +SKIP
    >>> with Cluster(num_cpus=2) as c: print(c.num_devices)   # doctest: +SKIP
    2
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Cluster:
        prev = _CURRENT
        if prev is not None and prev.alive and prev._key == cls._key_of(*args, **kwargs):
            return prev
        return super().__new__(cls)

    @classmethod
    def _key_of(cls, *args: Any, **kwargs: Any) -> tuple:
        """The arguments with defaults filled in, to tell a notebook re-run from a new request."""
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        bound.apply_defaults()
        return tuple((k, v) for k, v in bound.arguments.items() if k != "self")

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 num_gpus: int | None = None, cpus_per_worker: float = 1, gpus_per_worker: float | None = None,
                 timeout_s: float = 30, namespace: str = "rlkit") -> None:
        global _CURRENT
        if getattr(self, "_key", None) is not None:  # reused live instance (see __new__)
            return
        import ray

        if cpus_per_worker <= 0:
            raise PlanError(f"cpus_per_worker={cpus_per_worker!r} must be > 0 (fractions are fine, e.g. 0.5)")
        if timeout_s <= 0:
            raise PlanError(f"timeout_s={timeout_s!r} must be > 0 seconds")
        self.cpus_per_worker, self.timeout_s = cpus_per_worker, float(timeout_s)
        self._gpus_per_worker = gpus_per_worker
        self._owns = False          # we called ray.init, so shutdown() calls ray.shutdown
        self._closed = False
        self._pools: list[ResourcePool] = []
        self._groups: list[Any] = []  # WorkerGroups made on this cluster (shut down with it)
        address_arg, address = address, address or os.environ.get("RAY_ADDRESS") or None
        if address is not None:  # check before replacing a working cluster with an unreachable one
            _check_reachable(address, min(self.timeout_s, 10.0))
        prev = _CURRENT
        if prev is not None and prev is not self and prev.alive:
            prev.shutdown()  # cleanly replace the cluster of an earlier cell: no leaked Ray sessions
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phone-home attempt (often offline)

        t0 = time.perf_counter()
        if ray.is_initialized():
            self.mode = "existing"  # the user's own ray.init: use it, never shut it down
        elif address is None:
            self.mode = "embedded"
            # address="local": always a new embedded instance, never the `ray start` head that may be
            # running on this machine (ray.init() alone would join it and reject num_cpus)
            _start_embedded(num_cpus=num_cpus or os.cpu_count(), num_gpus=num_gpus, namespace=namespace)
            self._owns = True
        else:
            self.mode = "remote"
            try:
                with _quiet_ray_start():
                    _enable_token_auth_if_token_exists()
                    ray.init(address=address, namespace=namespace, logging_level="WARNING")
            except Exception as e:  # Ray raises ConnectionError / RuntimeError / AuthenticationError
                hint = ("; the cluster uses token auth: put its token in ~/.ray/auth_token or RAY_AUTH_TOKEN "
                        "and set RAY_AUTH_MODE=token") if "auth" in str(e).lower() else ""
                raise ClusterError(f"could not connect to the Ray cluster at {address!r}: "
                                   f"{str(e).splitlines()[0]}{hint}") from e
            self._owns = True
        self.address = address
        self.start_s = time.perf_counter() - t0
        self._key = self._key_of(address_arg, num_cpus=num_cpus, num_gpus=num_gpus,
                                 cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker,
                                 timeout_s=timeout_s, namespace=namespace)
        _CURRENT = self

    @classmethod
    def current(cls) -> Cluster | None:
        """The live Cluster of this process, if any."""
        return _CURRENT if _CURRENT is not None and _CURRENT.alive else None

    # ---- what is there -----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        import ray

        return not self._closed and ray.is_initialized()

    def _check_alive(self) -> None:
        if not self.alive:
            raise ClusterError("this Cluster was shut down (or replaced by a newer rlkit.Cluster()); "
                               "use rlkit.Cluster.current() or make a new one")

    def _nodes(self) -> list[dict[str, Any]]:
        """Alive nodes: id, ip, head flag, total and free resources."""
        import ray

        self._check_alive()
        try:  # per-node free resources: only in Ray's state module (no public API without the dashboard)
            from ray._private.state import available_resources_per_node
            free = available_resources_per_node()
        except Exception:
            free = {}
        out = []
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            total = {k: v for k, v in n["Resources"].items() if not k.startswith("node:")}
            labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
            out.append(dict(node_id=n["NodeID"], ip=n["NodeManagerAddress"],
                            head="node:__internal_head__" in n["Resources"], total=total, labels=labels,
                            free={k: v for k, v in free.get(n["NodeID"], total).items() if k in total}))
        return sorted(out, key=lambda n: (not n["head"], n["node_id"]))

    @property
    def gpus_per_worker(self) -> float:
        if self._gpus_per_worker is not None:
            return self._gpus_per_worker
        return 1.0 if any(n["total"].get("GPU", 0) for n in self._nodes()) else 0.0

    def _node_slots(self, node: dict[str, Any], key: str = "total") -> int:
        """Devices on a node: GPUs // gpus_per_worker, or CPU slots on CPU-only workers."""
        gpw = self.gpus_per_worker
        res = node[key]
        if gpw > 0:
            return int(res.get("GPU", 0) // gpw + 1e-9)
        return int(res.get("CPU", 0) / self.cpus_per_worker + 1e-9)

    @property
    def num_devices(self) -> int:
        """Devices in all: GPUs, or CPU slots (CPUs // cpus_per_worker) on a CPU-only cluster."""
        return sum(self._node_slots(n) for n in self._nodes())

    @property
    def devices_per_node(self) -> int:
        """Devices of the smallest node (the safe size for keeping a TP group on one node)."""
        return min((self._node_slots(n) for n in self._nodes()), default=0)

    @property
    def num_nodes(self) -> int:
        return len(self._nodes())

    def resources(self) -> pd.DataFrame:
        """One row per alive node: id, IP, CPUs / GPUs total and free, memory, devices, custom resources."""
        import pandas as pd

        rows = []
        for n in self._nodes():
            t, f = n["total"], n["free"]
            row = {"node": n["node_id"][:8], "node_ip": n["ip"], "head": n["head"],
                   "CPU": t.get("CPU", 0.0), "CPU_free": f.get("CPU", 0.0),
                   "GPU": t.get("GPU", 0.0), "GPU_free": f.get("GPU", 0.0),
                   "memory_GiB": round(t.get("memory", 0) / 2**30, 2),
                   "object_store_GiB": round(t.get("object_store_memory", 0) / 2**30, 2),
                   "devices": self._node_slots(n), "devices_free": self._node_slots(n, "free")}
            custom = {k: v for k, v in t.items() if k not in _STD and not k.startswith("accelerator_type")}
            row["custom"] = ", ".join(f"{k}={v:g}" for k, v in sorted(custom.items()))
            row["labels"] = _labels(n)
            rows.append(row)
        df = pd.DataFrame(rows)
        df.attrs.update(num_devices=int(df["devices"].sum()) if len(df) else 0)
        return df

    def table(self) -> pd.DataFrame:
        """Who runs where: one row per rank of every worker group on this cluster (a Trainer's actor, rollout
        and teacher groups, groups of your own): the group and its owner, the rank's dp/tp/pp coordinates, its
        node (id, IP, labels), pid, memory (RSS), the call it is in and for how long, and its last heartbeat
        (seconds ago; ``alive`` False once a rank missed three). Read from the ranks' heartbeats, so it answers
        while they are busy, or stuck in a collective.

        >>> cluster.table()[["group", "rank", "dp", "node", "node_labels", "rss_gb", "heartbeat_s"]]  # doctest: +SKIP
        """
        import pandas as pd

        labels = {n["node_id"][:8]: _labels(n) for n in self._nodes()}
        frames = []
        for g in list(self._groups):
            df = g.heartbeats()
            if len(df):
                df.insert(0, "group", g.name)
                df.insert(1, "owner", g._owner_label)
                df.insert(df.columns.get_loc("ip") + 1, "node_labels", df["node"].map(labels).fillna("(node gone)"))
                frames.append(df)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=["group", "owner", "rank", "dp", "tp", "pp", "node", "ip", "node_labels", "pid", "rss_gb",
                     "busy", "busy_s", "heartbeat_s", "alive"])

    def __repr__(self) -> str:
        if not self.alive:
            return f"Cluster({self.mode}, shut down)"
        nodes = self._nodes()
        cpus = sum(n["total"].get("CPU", 0) for n in nodes)
        gpus = sum(n["total"].get("GPU", 0) for n in nodes)
        return (f"Cluster({self.mode}, {len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs, "
                f"{self.num_devices} devices)")

    def _repr_html_(self) -> str:
        """Nodes as rows of device boxes (filled = in use), then the resources table."""
        if not self.alive:
            return f"<pre>{self!r}</pre>"
        kind = "GPU" if self.gpus_per_worker > 0 else f"CPU slot ({self.cpus_per_worker:g} CPU)"
        lines = [f"<div><b>{self!r}</b> &mdash; one box per device ({kind}); dark = in use</div>"]
        for n in self._nodes():
            total, free = self._node_slots(n), self._node_slots(n, "free")
            boxes = "".join(
                f'<span style="display:inline-block;width:14px;height:14px;margin:1px;border:1px solid #555;'
                f'background:{"#4a6fa5" if i < total - free else "#eef"}"></span>' for i in range(total))
            lines.append(f'<div style="font-family:monospace">{n["ip"]} {n["node_id"][:8]}'
                         f'{" (head)" if n["head"] else ""}: {boxes}</div>')
        return "\n".join(lines) + self.resources().to_html(index=False)

    # ---- who holds what -----------------------------------------------------------------------
    def cpus_per_rank(self, ranks: int) -> float:
        """CPUs for each of ``ranks`` ranks: ``cpus_per_worker``, or a fraction of it when there are more
        ranks than devices (then an ``OversubscribedWarning`` gives the numbers).

        >>> cluster.cpus_per_rank(8)   # on 2 CPUs   # doctest: +SKIP
        OversubscribedWarning: 8 ranks on 2 devices: ...
        0.25
        """
        devices = self.num_devices
        if ranks <= devices:
            return float(self.cpus_per_worker)
        cpus = self.cpus_per_worker * devices / ranks
        warnings.warn(f"rlkit: {ranks} ranks on {devices} device(s) of {self.cpus_per_worker:g} CPU: each rank gets "
                      f"{cpus:.3g} CPU (oversubscribed: it runs, slowly); shrink the plan or add CPUs/nodes",
                      OversubscribedWarning, stacklevel=3)
        return cpus

    def holders(self) -> list[str]:
        """One line per live worker group / bare resource pool made here: what it holds and how to free it."""
        lines = []
        pooled = set()
        for g in list(self._groups):
            pool = getattr(g, "pool", None)
            if pool is not None:
                pooled.add(id(pool))
            lines.append(g.holder_line())
        for pool in self._pools:
            if id(pool) not in pooled:
                lines.append(f"ResourcePool {pool.name!r} ({pool.world_size} x {format_bundle(pool.bundle)}): free it with "
                             f"pool.remove()")
        return lines

    def forget_pool(self, pool: ResourcePool) -> None:
        """Drop ``pool`` from this cluster's pools (its ``remove`` calls this)."""
        if pool in self._pools:
            self._pools.remove(pool)

    def release_orphans(self) -> int:
        """Shut down worker groups whose owner (a Trainer) no longer exists; returns how many."""
        import gc

        gc.collect()  # owners caught in reference cycles: their finalizers run now
        gone = [g for g in list(self._groups) if g.owner_gone()]
        for g in gone:
            g.shutdown(polite=False)
        return len(gone)

    def make_room(self, need: dict[str, float], owner: Any, replace_older: bool) -> list[str]:
        """Before ``owner`` reserves ``need`` (e.g. ``{"CPU": 2.0}``): release groups of owners that are
        gone, and with ``replace_older`` close older owners of the same type (a notebook cell that builds
        a Trainer, run again) oldest first until ``need`` fits. Returns the labels of those closed."""
        import ray

        self._check_alive()
        self.release_orphans()
        free = dict(ray.available_resources())
        closed: list[str] = []
        seen: set[int] = set()
        for g in list(self._groups):
            if all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items()) or not replace_older:
                break
            o = g._owner() if g._owner is not None else None
            if o is None or o is owner or type(o) is not type(owner) or id(o) in seen:
                continue
            seen.add(id(o))
            for h in [h for h in self._groups if h._owner is not None and h._owner() is o]:
                pool = getattr(h, "pool", None)
                if pool is not None:
                    for k, v in pool.bundle.items():
                        free[k] = free.get(k, 0.0) + v * h.world_size / pool.colocate
            o.close()
            closed.append(g._owner_label or type(o).__name__)
        return closed

    # ---- placement ---------------------------------------------------------------------------
    def placement_group_for(self, plan: ParallelPlan | int, *, name: str | None = None,
                            cpus_per_worker: float | None = None, gpus_per_worker: float | None = None,
                            resources: dict[str, float] | None = None, colocate: int = 1,
                            timeout_s: float | None = None) -> ResourcePool:
        """Reserve one bundle per rank, each TP group of ``plan`` kept on one node.

        How: ranks are cut into node-sized chunks of whole TP groups, and each chunk is one placement
        group with ``STRICT_PACK`` (all its bundles on one node). That guarantees TP locality while
        letting Ray choose the nodes, so it works with any node IDs and with the simulated multi-node
        clusters of tests; node affinity or bundle labels would tie us to node IDs we must look up
        first. ``colocate=k`` lets k worker groups (roles) share the bundles: each gets 1/k of them.

        Waits at most ``timeout_s`` (default: the cluster's) and then says what was missing.

        >>> pool = cluster.placement_group_for(ParallelPlan(dp=2, tp=2))   # doctest: +SKIP
        >>> pool.table()                                                  # doctest: +SKIP
        """
        self._check_alive()
        world, tp, groups = rank_groups(plan)
        cpw = self.cpus_per_worker if cpus_per_worker is None else cpus_per_worker
        gpw = self.gpus_per_worker if gpus_per_worker is None else gpus_per_worker
        if cpw < 0 or gpw < 0 or (cpw == 0 and gpw == 0):
            raise PlanError(f"cpus_per_worker={cpw}, gpus_per_worker={gpw}: a rank needs some CPU or GPU")
        bundle = {"CPU": float(cpw)} if cpw else {}
        if gpw:
            bundle["GPU"] = float(gpw)
        bundle.update(resources or {})
        nodes = self._nodes()
        per_node = max((bundles_that_fit(n["total"], bundle) for n in nodes), default=0)
        if per_node < tp:
            raise PlanError(f"tp={tp} ranks must share one node, but the largest node holds {per_node} "
                            f"ranks of {bundle}; lower tp to <= {per_node} or cpus/gpus_per_worker")
        capacity = sum(bundles_that_fit(n["total"], bundle) for n in nodes)
        if capacity < world:
            raise PlanError(f"{world} ranks of {bundle} need more than this cluster has: it holds {capacity} "
                            f"such ranks in all ({len(nodes)} node(s)); shrink the plan, lower cpus/gpus_per_worker"
                            f" (fractions are fine on CPU) or add nodes")
        chunk_groups = max(1, per_node // tp)  # whole TP groups per node-sized chunk
        chunks = [sum(groups[i:i + chunk_groups], []) for i in range(0, len(groups), chunk_groups)]
        pool = ResourcePool(self, name or f"pool{len(self._pools)}", world, bundle, chunks, colocate)
        pool._reserve(self.timeout_s if timeout_s is None else timeout_s)
        self._pools.append(pool)
        return pool

    def role_pools(self, pools: dict[str, ParallelPlan | int | ResourcePool],
                   roles: dict[str, str], **placement: Any) -> dict[str, ResourcePool]:
        """Map roles (actor, rollout, reference, critic, reward...) to resource pools.

        Roles given the same pool name are colocated: they share its bundles (each role's worker group
        gets an equal fraction of every bundle). Different pool names reserve disjoint resources.

        >>> p = cluster.role_pools({"train": ParallelPlan(dp=2), "gen": 1},
        ...                        {"actor": "train", "reference": "train", "rollout": "gen"})  # doctest: +SKIP
        >>> p["actor"] is p["reference"], p["rollout"].world_size                 # doctest: +SKIP
        (True, 1)
        """
        unknown = sorted({p for p in roles.values() if p not in pools})
        if unknown:
            raise PlanError(f"roles refer to pool(s) {unknown} that are not in pools={sorted(pools)}; "
                            f"add them to pools or fix the role mapping")
        made: dict[str, ResourcePool] = {}
        try:
            for pool_name, spec in pools.items():
                users = sum(1 for p in roles.values() if p == pool_name)
                if users == 0:
                    continue
                if isinstance(spec, ResourcePool):
                    spec.colocate = max(spec.colocate, users)
                    made[pool_name] = spec
                else:
                    made[pool_name] = self.placement_group_for(spec, name=pool_name, colocate=users, **placement)
        except BaseException:  # one pool could not be reserved: give back the ones reserved for this call
            for name, pool in made.items():
                if not isinstance(pools[name], ResourcePool):
                    pool.remove()
            raise
        return {role: made[p] for role, p in roles.items()}

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop worker groups and placement groups made here; stop Ray if this Cluster started or
        connected it (a user's own ``ray.init`` is left running)."""
        global _CURRENT
        if self._closed:
            return
        import ray

        for group in list(self._groups):
            try:
                group.shutdown()
            except Exception as e:  # keep going: the rest must still be released
                warnings.warn(f"worker group shutdown failed: {e}", stacklevel=2)
        for pool in list(self._pools):
            pool.remove()
        self._closed = True
        if self._owns and ray.is_initialized():
            ray.shutdown()
        if _CURRENT is self:
            _CURRENT = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


__all__ = ["Cluster", "ClusterError", "OversubscribedWarning", "ResourcePool"]
