"""Ray fixtures: one small embedded cluster shared by the tests that need it (Ray starts in ~4 s)."""

from __future__ import annotations

import contextlib

import pytest

RAY_TEST_CPUS = 4  # logical CPUs: test actors sleep or all-reduce tiny tensors; 2 real cores are plenty


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left(request):
    """A test module that ends with this process still in a torch.distributed default process group would make
    the next module that starts one fail ("initialize the default process group twice"), far from the cause:
    the group is destroyed here and the module named in a warning (the run's warnings summary)."""
    yield
    import warnings

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from rlkit.workers import local

        holders = [type(g.obj).__name__ if g.obj is not None else g.name for g in local._PG_USERS]
        local._PG_USERS.clear()
        dist.destroy_process_group()
        warnings.warn(f"{request.module.__name__} left this process in a default process group (local groups "
                      f"holding it: {holders}); destroyed", stacklevel=1)


def ray_test_cluster():
    """The embedded test cluster. The same arguments return the live one (rlkit's registry), so tests
    share it; after a test replaced it (a real head, a 2-node cluster) the next call starts a new one."""
    from rlkit.cluster import Cluster

    return Cluster(num_cpus=RAY_TEST_CPUS, timeout_s=20)


@pytest.fixture(scope="session")
def ray_session_end():
    """Shut down whatever rlkit Cluster is live when the test session ends."""
    yield
    from rlkit.cluster import Cluster

    cluster = Cluster.current()
    if cluster is not None:
        cluster.shutdown()


@pytest.fixture(scope="session")
def ray_make_cluster(ray_session_end):
    """``ray_make_cluster()`` -> the live test cluster (for module-scoped fixtures)."""
    return ray_test_cluster


@pytest.fixture
def ray_cluster(ray_make_cluster):
    """A live embedded 4-CPU cluster."""
    return ray_make_cluster()


@contextlib.contextmanager
def multi_node(*cpus: int, labels: list[dict] | None = None):
    """Ray's own multi-node test cluster on this machine: a head that runs no ranks and one worker node per entry
    of ``cpus`` (each a raylet process of its own, with ``labels[i]``), the driver joined to it by address and an
    rlkit ``Cluster`` over it. Yields ``(cluster, sim, nodes)``; ``sim.remove_node(node)`` takes a node away."""
    import ray
    from ray.cluster_utils import Cluster as SimCluster

    from rlkit.cluster import Cluster

    current = Cluster.current()
    if current is not None:
        current.shutdown()
    sim = SimCluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [sim.add_node(num_cpus=n, **({"labels": labels[i]} if labels else {})) for i, n in enumerate(cpus)]
    try:
        ray.init(address=sim.address, logging_level="WARNING")
        c = Cluster()
        yield c, sim, nodes
        c.shutdown()
    finally:
        ray.shutdown()
        sim.shutdown()


def settled_cpu_free(cluster, quiet_s: float = 2.0, bound_s: float = 60.0) -> float:
    """Free CPUs once Ray's view has stopped changing for ``quiet_s``: a group closed by the test before
    comes back to the free count a little later, and much later on a busy machine (a test that read the
    count at once saw 0 free, then 2). Bounded: after ``bound_s`` the last reading is returned."""
    import time

    deadline = time.monotonic() + bound_s
    last, since = cluster.resources()["CPU_free"].sum(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = cluster.resources()["CPU_free"].sum()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return float(last)


def wait_cpu_free(cluster, at_least: float = 0.0, at_most: float = float("inf"), bound_s: float = 60.0) -> float:
    """Free CPUs once the count is in [at_least, at_most]: Ray updates it asynchronously. A bounded wait
    against a hang, not a timing check; the caller asserts on the value returned."""
    import time

    deadline = time.monotonic() + bound_s
    while not at_least <= (free := float(cluster.resources()["CPU_free"].sum())) <= at_most \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: tiny matmuls gain nothing from 2 threads, and on a busy 2-core box
    they lose a lot to oversubscription."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
