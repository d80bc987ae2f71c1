"""Ray fixtures: one small embedded cluster shared by the tests that need it (Ray starts in ~4 s)."""

from __future__ import annotations

import pytest

RAY_TEST_CPUS = 4  # logical CPUs: test actors sleep or all-reduce tiny tensors; 2 real cores are plenty


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: tiny matmuls gain nothing from 2 threads, and on a busy 2-core box
    they lose a lot to oversubscription."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
