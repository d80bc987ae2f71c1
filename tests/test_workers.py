"""WorkerGroup on a real embedded Ray cluster: env, gloo process group, dispatch modes, failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from conftest import settled_cpu_free, wait_cpu_free

from rlkit.batch import cat, pad, rows, split, truncate
from rlkit.errors import PlanError, WorkerError
from rlkit.plan.topology import ParallelPlan
from rlkit.workers import WorkerGroup, WorkerTimeoutError

pytestmark = pytest.mark.ray


class DPWorker:
    """A per-rank object: a tiny linear model with identical init on every rank, DP-averaged grads."""

    def __init__(self, plan: ParallelPlan, seed: int = 0):
        import torch.distributed as dist

        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 1)
        self.rank = dist.get_rank()
        # every rank must create every DP group, in the same order (torch.distributed's rule)
        for ranks in plan.groups("dp"):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.dp_group, self.dp_size = group, len(ranks)

    def env(self):
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "OMP_NUM_THREADS", "MY_FLAG"]
        return {**{k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads(), "pid": os.getpid()}

    def all_reduce(self, x: float):
        """All-reduce ``x * (rank + 1)``: every rank contributes a different value."""
        import torch.distributed as dist

        t = torch.tensor([x * (self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def train_step(self, batch):
        """Mean-squared loss on this DP rank's chunk, grads averaged over the DP group (= DDP)."""
        import torch.distributed as dist

        self.model.zero_grad()
        loss = ((self.model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()
        loss.backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad /= self.dp_size
        return loss.item()

    def grads(self):
        return torch.cat([p.grad.flatten() for p in self.model.parameters()])

    def echo(self, batch, scale=1):
        return {"y": batch["x"] * scale, "text": [t.upper() for t in batch["text"]],
                "rank": [self.rank] * rows(batch), "meta": "m"}

    def fail_on(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        return self.rank

    def sleep(self, s: float):
        time.sleep(s)
        return self.rank

    def noop(self):
        return None


class Plain:
    """A worker that needs no torch.distributed (init_process_group=False)."""

    def __init__(self, tag="p"):
        self.tag, self.rank = tag, int(os.environ["RANK"])

    def who(self, batch):
        return {"rank": [self.rank] * len(batch["i"]), "i": batch["i"]}

    def sleep(self, s: float):
        time.sleep(s)
        return self.rank

    def pid(self):
        return os.getpid()


@pytest.fixture(scope="module")
def dp_group(ray_make_cluster):
    """dp=2 x tp=2 = 4 ranks in a gloo group, shared by the tests below (spawn ~3-10 s)."""
    plan = ParallelPlan(dp=2, tp=2)
    # half a CPU per rank: 2 of the 4 test CPUs stay free for the tests that make their own groups
    with WorkerGroup(ray_make_cluster(), plan, DPWorker, plan, timeout_s=60, dist_timeout_s=30,
                     env={"MY_FLAG": "on"}, cpus_per_worker=0.5) as group:
        yield group


def test_env_and_process_group(dp_group):
    envs = dp_group.call("env")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]  # one node: local == global
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}  # all ranks on one node: loopback
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["MY_FLAG"] for e in envs} == {"on"}
    assert {e["threads"] for e in envs} == {1} and {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert len({e["pid"] for e in envs}) == 4  # one process per rank
    # a real gloo all-reduce of rank-dependent values: 1 + 2 + 3 + 4, exactly, on every rank
    assert dp_group.call("all_reduce", 1.0) == [10.0] * 4
    assert dp_group.call_async("all_reduce", 2.5).result(timeout=30) == [25.0] * 4


def test_dp_gradient_average_matches_single_process(dp_group):
    torch.manual_seed(1)
    batch = {"x": torch.randn(8, 3), "y": torch.randn(8)}
    losses = dp_group.call_dp("train_step", batch)
    grads = dp_group.call("grads")
    # reference: the same model on the full batch in this process
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1)
    loss = ((ref(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])
    for g in grads:  # every rank (both TP replicas of each DP rank) holds the DP-averaged grad
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)
    # a scalar per DP rank comes back as a list of 2; their mean is the full-batch loss (equal halves)
    assert len(losses) == 2
    assert abs(sum(losses) / 2 - loss.item()) < 1e-5


def test_call_dp_splits_pads_and_orders(dp_group):
    batch = {"x": torch.arange(5.0), "text": list("abcde"), "temperature": 0.7}
    out = dp_group.call_dp("echo", batch, scale=10)
    torch.testing.assert_close(out["y"], torch.arange(5.0) * 10)  # padding row removed, DP order kept
    assert out["text"] == list("ABCDE")
    # 5 rows over dp=2 -> padded to 6, chunks of 3; results come from tp=0 of each DP group: ranks 0, 2
    assert out["rank"] == [0, 0, 0, 2, 2]
    assert out["meta"] == "m"
    assert dp_group.call_rank0("fail_on", 99) == 0  # rank 0 only


@pytest.mark.timeout(120)
def test_worker_exception_is_worker_error(dp_group):
    with pytest.raises(WorkerError) as info:
        dp_group.call("fail_on", 2)
    err = info.value
    assert err.rank == 2 and err.node == dp_group._node(2) and "on node" in str(err)
    assert "ValueError: deliberate failure on rank 2" in str(err)
    assert "fail_on" in err.remote_traceback and "\x1b[" not in err.remote_traceback
    assert dp_group.call("fail_on", 99) == [0, 1, 2, 3]  # a Python error does not break the group
    with pytest.raises(WorkerError, match="has no method 'nope'"):
        dp_group.call_rank0("nope")


@pytest.mark.timeout(120)
def test_call_timeout_names_ranks(dp_group):
    # the timeout fired (not the sleeps finishing): the error says so and names every rank
    with pytest.raises(WorkerTimeoutError, match=r"did not finish within 0.5 s on rank\(s\) \[0, 1, 2, 3\]"):
        dp_group.call("sleep", 1.5, timeout=0.5)
    assert dp_group.call("noop") == [None] * 4  # the sleeps finish; the group goes on


def test_batch_helpers():
    b = {"a": torch.arange(10).view(5, 2), "s": list("vwxyz"), "m": {"n": [1, 2, 3, 4, 5]}, "k": 3}
    padded, n = pad(b, 4)
    assert n == 5 and rows(padded) == 8 and padded["s"][-3:] == ["z", "z", "z"]
    parts = split(padded, 4)
    assert [rows(p) for p in parts] == [2, 2, 2, 2] and parts[3]["k"] == 3
    back = truncate(cat(parts), n)
    assert torch.equal(back["a"], b["a"]) and back["s"] == b["s"] and back["m"]["n"] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="different lengths"):
        rows({"a": [1, 2], "b": [1]})
    with pytest.raises(ValueError, match="pad"):
        split({"a": [1, 2, 3]}, 2)


def test_last_pipeline_stage_results_and_bad_args(ray_cluster):
    plan = ParallelPlan(dp=2, pp=2)  # ranks: (dp, pp) = 0:(0,0) 1:(1,0) 2:(0,1) 3:(1,1)
    with WorkerGroup(ray_cluster, plan, Plain, init_process_group=False, timeout_s=60,
                     cpus_per_worker=0.5) as group:
        out = group.call_dp("who", {"i": [10, 11, 12, 13]})
        assert out == {"rank": [2, 2, 3, 3], "i": [10, 11, 12, 13]}
    with pytest.raises(PlanError, match="must be a ParallelPlan or a world size"):
        WorkerGroup(ray_cluster, "4", Plain)


@pytest.mark.timeout(120)
def test_killed_worker_tears_down_group_cluster_stays_usable(ray_cluster):
    # light workers (no torch import) keep this in the default suite; the peer is blocked in a call
    free_before = settled_cpu_free(ray_cluster)
    group = WorkerGroup(ray_cluster, 2, Plain, init_process_group=False, timeout_s=60)
    victim = group.call("pid")[1]
    fut = group.call_async("sleep", 30)
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    # detected as a death (not the 30 s sleep ending, not a timeout): the report names the dead rank
    with pytest.raises(WorkerError, match="worker process died") as info:
        fut.result(timeout=30)
    assert info.value.rank == 1 and not isinstance(info.value, WorkerTimeoutError)
    with pytest.raises(WorkerError, match="torn down"):
        group.call("pid")
    # the rest was stopped and its resources released; a new group works
    # (at least: a group an earlier test closed may come back to the count meanwhile)
    assert wait_cpu_free(ray_cluster, at_least=free_before) >= free_before
    with WorkerGroup(ray_cluster, 2, Plain, init_process_group=False, timeout_s=60) as again:
        assert again.call("sleep", 0) == [0, 1]


@pytest.mark.timeout(120)
def test_keyboard_interrupt_stops_group(ray_cluster):
    import ray

    group = WorkerGroup(ray_cluster, 2, Plain, init_process_group=False, timeout_s=60)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):  # raised by the interrupt, not after the 30 s sleep
        group.call("sleep", 30)
    assert group._closed
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(group.actors[0].info.remote(), timeout=10)


class CheckWorker:
    """Hosts rlkit.parallel's own equivalence check (ParallelModel vs the single-process model)."""

    def __init__(self, model_path: str):
        self.model_path = model_path

    def check(self, plan: ParallelPlan):
        from rlkit.parallel.check import run_check

        return run_check(self.model_path, plan, steps=2, seq_len=16)


@pytest.mark.slow
def test_3d_parallel_model_through_worker_group_matches_single_process(ray_cluster):
    from rlkit.models import tiny_lm

    path = tiny_lm("qwen2", size="test")
    plan = ParallelPlan(dp=2, tp=2, pp=2, micro_batches=2)
    with WorkerGroup(ray_cluster, plan, CheckWorker, path, cpus_per_worker=0.5, timeout_s=400,
                     dist_timeout_s=120) as group:
        rep = group.call("check", plan)[0]  # rank 0 holds the complete report
    # the same tolerances as tests/test_parallel.py (fp32)
    assert rep["world_size"] == 8
    assert rep["max_dlogprob"] <= 2e-6 and rep["max_dgrad"] <= 1e-6 and rep["max_dweight"] <= 1e-5, rep
    assert abs(rep["loss"] - rep["ref_loss"]) <= 1e-6 * max(1.0, abs(rep["ref_loss"])), rep
    assert rep["strict_load"] is True
