"""One rank without Ray: ``Trainer(cluster=None)`` on a one-rank plan runs its RLWorker in this process
(``rlkit.workers.local.LocalWorkerGroup``), and that worker generates with the actor's own tensors.

The numbers must be the ones the same Trainer gives on a Ray worker (``cluster=``): same samples,
same losses, to the last bit (both are the same code on the same seeds, one process each)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rlkit
from rlkit.errors import PlanError, WorkerError
from rlkit.models import tiny_lm
from rlkit.workers.local import LocalWorkerGroup

torch.set_num_threads(1)


def _trainer(tmp_path, name, **kw):
    return rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                         plan=rlkit.ParallelPlan(), rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=8),
                         prompts_per_step=4, lr=2e-3, seed=3, run_dir=str(tmp_path / name), **kw)


@pytest.mark.ray
def test_in_process_trainer_equals_the_ray_worker_and_shares_the_actors_weights(tmp_path, ray_cluster, capfd):
    local = _trainer(tmp_path, "local")
    try:
        assert isinstance(local.group, LocalWorkerGroup) and local.cluster is None
        assert local.group.info[0]["pid"] == __import__("os").getpid()
        worker = local.group.obj
        # the engine is the actor: the generation layout with t_g = 1 aliases the training tensors
        assert worker.engine is None and worker.hybrid is not None and worker.hybrid.gen_layout.tp == 1
        shards, _ = worker.hybrid.resharder.reshard()
        actor = dict(worker.actor.named_parameters())
        assert all(shards[n].data_ptr() == actor[n].data_ptr() for n in shards if n in actor)
        worker.hybrid.resharder.release()
        m_local = local.fit(steps=3, view="none")
        # worker errors arrive as they do from Ray, and the group stays usable
        with pytest.raises(WorkerError, match="no_such_method"):
            local.group.call_rank0("no_such_method")
        assert local.group.call("rss_gb")[0] > 0
    finally:
        local.close()
    assert not dist.is_initialized()  # the last local group took its process group with it
    assert "Loading weights" not in capfd.readouterr().err

    remote = _trainer(tmp_path, "ray", cluster=ray_cluster)
    try:
        assert type(remote.group).__name__ == "WorkerGroup"
        m_ray = remote.fit(steps=3, view="none")
    finally:
        remote.close()
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
        assert m_local[key].tolist() == m_ray[key].tolist(), (key, m_local[key].tolist(), m_ray[key].tolist())
    assert (m_local["sync/bytes"] == 0).all()  # nothing is copied: the engine reads the actor's tensors


def test_two_local_groups_share_one_process_group_and_bad_plans_are_refused(tmp_path):
    class Adder:
        def __init__(self, base):
            self.base = base

        def add(self, x):
            return self.base + x

        def rank(self):
            return dist.get_rank(), dist.get_world_size()

    with pytest.raises(PlanError, match="one rank in this process"):
        LocalWorkerGroup(rlkit.ParallelPlan(dp=2), Adder, 1)
    a = LocalWorkerGroup(1, Adder, 10)
    b = LocalWorkerGroup(1, Adder, 20)
    assert a.call("rank") == [(0, 1)] and b.call_rank0("add", 1) == 21
    a.shutdown()
    assert dist.is_initialized() and b.call("add", 2) == [22]  # b still uses it
    b.shutdown()
    assert not dist.is_initialized()
    with pytest.raises(WorkerError, match="shut down"):
        b.call("add", 1)
