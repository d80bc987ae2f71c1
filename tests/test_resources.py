"""Waiting for resources is bounded and explained: who holds the CPUs, groups of gone owners released,
oversubscription warned about, and a notebook cell that builds a Trainer can run twice (real kernel)."""

from __future__ import annotations

import gc
import os
import time

import pytest
from conftest import wait_cpu_free

from rlkit.cluster import ClusterError, OversubscribedWarning
from rlkit.workers import WorkerGroup

pytestmark = pytest.mark.ray


class Light:
    """A worker that never imports torch (spawns in about a second)."""

    def pid(self) -> int:
        return os.getpid()


class Owner:
    """Stands in for a Trainer: what a WorkerGroup is made for, held weakly by it."""

    def __init__(self, label: str) -> None:
        self._holder_label = label
        self.groups: list[WorkerGroup] = []

    def close(self) -> None:
        for g in self.groups:
            g.shutdown()


def _light(cluster, n: int, **kw) -> WorkerGroup:
    return WorkerGroup(cluster, n, Light, init_process_group=False, timeout_s=60, **kw)


def _wait_free(cluster, cpus: float) -> None:
    assert wait_cpu_free(cluster, at_least=cpus) >= cpus


@pytest.mark.timeout(120)
def test_placement_fails_within_its_bound_naming_the_holder(ray_cluster):
    c = ray_cluster
    _wait_free(c, 4)
    holder = _light(c, 3, name="holder")
    try:
        # 2 s bound (the default is the cluster's timeout_s); pytest-timeout guards against a hang
        with pytest.raises(ClusterError) as info:
            _light(c, 2, name="second", placement_timeout_s=2)
        msg = str(info.value)
        assert "could not reserve 2 bundles of {'CPU': 1.0} (2 x 1 CPU" in msg, msg
        assert "within 2 s; free now: {'CPU': 1.0} of {'CPU': 4.0}" in msg, msg
        assert "held by: WorkerGroup 'holder' (3 x 1 CPU): free it with group.shutdown()" in msg, msg
        assert len(c._groups) == 1  # the failed group left nothing registered
    finally:
        holder.shutdown()
    _wait_free(c, 4)
    assert c.holders() == []


@pytest.mark.timeout(120)
def test_group_of_a_gone_owner_is_released_when_room_is_needed(ray_cluster):
    c = ray_cluster
    _wait_free(c, 4)
    owner = Owner("Trainer(test)")
    old = _light(c, 3, name="rl", owner=owner)
    assert c.holders() == ["WorkerGroup 'rl' (3 x 1 CPU) of Trainer(test): free it with trainer.close()"]
    del owner  # the owner object is gone; its workers still hold 3 CPUs
    gc.collect()
    new = _light(c, 2, name="new", placement_timeout_s=30)
    try:
        assert old._closed and old not in c._groups
        assert new.call("pid")
    finally:
        new.shutdown()


@pytest.mark.timeout(120)
def test_make_room_replaces_older_owners_only_when_asked(ray_cluster):
    c = ray_cluster
    _wait_free(c, 4)
    first, second = Owner("Trainer(first)"), Owner("Trainer(second)")
    first.groups.append(_light(c, 3, name="rl", owner=first))
    try:
        assert c.make_room({"CPU": 2.0}, second, replace_older=False) == []
        assert not first.groups[0]._closed
        assert c.make_room({"CPU": 1.0}, second, replace_older=True) == []  # it fits: nobody closed
        assert c.make_room({"CPU": 2.0}, second, replace_older=True) == ["Trainer(first)"]
        assert first.groups[0]._closed
        second.groups.append(_light(c, 2, name="rl", owner=second, placement_timeout_s=30))
    finally:
        first.close()
        second.close()


def test_more_ranks_than_devices_warns_with_the_numbers(ray_cluster):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ray_cluster.cpus_per_rank(4) == 1.0  # fits: no warning
    with pytest.warns(OversubscribedWarning, match=r"8 ranks on 4 device\(s\) of 1 CPU: each rank gets 0.5 CPU"):
        assert ray_cluster.cpus_per_rank(8) == 0.5


# ---- a real Jupyter kernel: the cell that builds a Trainer, run twice ------------------------
def run_cell(kc, code: str, timeout_s: float = 240) -> dict[str, str]:
    """Execute ``code`` in the kernel; return its stdout, stderr and error text (bounded wait)."""
    msg_id = kc.execute(code)
    out = {"stdout": "", "stderr": "", "error": ""}
    deadline = time.monotonic() + timeout_s
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out[content["name"]] += content["text"]
        elif kind == "error":
            out["error"] += "\n".join(content["traceback"])
        elif kind == "status" and content["execution_state"] == "idle":
            return out


@pytest.fixture
def kernel(tmp_path):
    """A real IPython kernel (this venv's python) with its cwd in tmp_path; shut down afterwards."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path),
                              env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        yield kc
    finally:
        try:
            run_cell(kc, "import rlkit\nc = rlkit.Cluster.current()\nc and c.shutdown()", timeout_s=60)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


BUILD_CELL = """
import rlkit
previous = globals().get("trainer")
cluster = rlkit.Cluster(num_cpus=2)
trainer = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat,
                        plan=rlkit.ParallelPlan(dp=2), rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                        prompts_per_step=2, run_dir="run", cluster=cluster)
print("PIDS", [i["pid"] for i in trainer.group.info])
"""


@pytest.mark.timeout(400)
def test_notebook_cell_building_a_trainer_runs_twice(kernel):
    import psutil
    from test_quiet import assert_quiet

    first = run_cell(kernel, BUILD_CELL)
    assert not first["error"], first["error"]
    assert_quiet(first["stderr"])  # starting Ray and the workers: no progress bars, no Ray banners
    pids1 = eval(first["stdout"].split("PIDS", 1)[1].strip())
    assert len(pids1) == 2 and all(psutil.pid_exists(p) for p in pids1)
    # the second run returns (it used to wait forever for the CPUs the first Trainer still held)
    second = run_cell(kernel, BUILD_CELL)
    assert not second["error"], second["error"]
    pids2 = eval(second["stdout"].split("PIDS", 1)[1].strip())
    assert len(pids2) == 2 and not set(pids1) & set(pids2)
    assert "closed the earlier Trainer(grpo, dp=2" in second["stderr"], second["stderr"]
    deadline = time.monotonic() + 60  # ray.kill is asynchronous: bounded wait for the processes to exit
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids1) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids1)
    # the old object says it is closed; the new one trains
    res = run_cell(kernel, "try:\n    previous.fit(steps=1, view='none')\nexcept rlkit.trainer.TrainerError as e:\n"
                           "    print('OLD', e)\nprint('ROWS', len(trainer.fit(steps=1, view='none')))")
    assert not res["error"], res["error"]
    assert "OLD this Trainer was closed" in res["stdout"] and "ROWS 1" in res["stdout"], res
    assert_quiet(res["stderr"])  # fit in a notebook kernel: no progress bars
    # worker errors still arrive, with their traceback (Ray's forwarding of plain worker prints into a
    # kernel is asynchronous and was seen to miss a 60 s window in CI, so it is not asserted here)
    res = run_cell(kernel, "try:\n    trainer.group.call_rank0('no_such_method')\nexcept rlkit.WorkerError as e:\n"
                           "    print('CAUGHT', type(e).__name__, 'no_such_method' in str(e))")
    assert "CAUGHT WorkerError True" in res["stdout"], res
