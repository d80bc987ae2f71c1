"""Runs that recover from lost workers by themselves: ``checkpoint_every`` writes the run's checkpoint every N
steps, and when a worker process dies (SIGKILL: what an OOM kill or a preemption does) ``fit`` reports it,
tears the groups down, starts them again on what the cluster still has (waiting up to ``restart_timeout_s``),
loads the last checkpoint and goes on, up to ``max_restarts`` times.

The expected values come from an uninterrupted run of the same seed, not from the code under test: a resume
under the same plan is exact, so every metric but timings and memory must equal it, step by step.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import multi_node

import rlkit
from rlkit.errors import WorkerError
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

pytestmark = pytest.mark.ray

# what differs between two runs of the same seed: clocks, memory, and the bytes a fresh engine's first sync moves
VOLATILE = ("timing/", "memory/", "tokens_per_s", "sync/")


def _trainer(cluster, run_dir, **kw):
    return Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, run_dir=str(run_dir),
                   rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2, cluster=cluster, **kw)


def _uninterrupted(cluster, run_dir, steps, **kw):
    """The metrics of a run of the same seed that loses nothing: what a recovered run must equal."""
    ref = _trainer(cluster, run_dir, **kw)
    try:
        return ref.fit(steps=steps, view="none")
    finally:
        ref.close()


def _kill_at(trainer, group, step):
    """A callback that SIGKILLs rank 1 of ``group`` (rank 0 if it has one rank) at the end of ``step``, once (the
    restarted run takes that step again)."""
    victims = [group.apply(lambda w: os.getpid())[min(1, group.world_size - 1)]]

    def kill(_trainer, row):
        if row["step"] == step and victims:
            os.kill(victims.pop(), signal.SIGKILL)
    return kill


def _same_metrics(got, want):
    cols = [c for c in want.columns if not c.startswith(VOLATILE)]
    assert list(got["step"]) == list(want["step"])
    for c in cols:
        a, b = got[c].tolist(), want[c].tolist()
        assert all(x == y or (x != x and y != y) for x, y in zip(a, b)), (c, a, b)


@pytest.mark.timeout(600)
def test_a_killed_rank_is_replaced_and_the_run_equals_the_uninterrupted_one(tmp_path, ray_cluster):
    plan = rlkit.ParallelPlan(dp=2)
    want = _uninterrupted(ray_cluster, tmp_path / "ref", 4, plan=plan)

    tr = _trainer(ray_cluster, tmp_path / "run", plan=plan, checkpoint_every=2, max_restarts=1)
    try:
        tr.callbacks.append(_kill_at(tr, tr.group, step=3))  # after the checkpoint of step 2
        got = tr.fit(steps=4, view="none")
        assert tr.step == 4
        [r] = tr.restarts  # one restart, from the checkpoint of step 2, after step 4 failed
        assert (r["failed_step"], r["from_step"], r["rank"]) == (4, 2, 1), r
        assert r["seconds"] > 0 and "died" in r["error"]
        _same_metrics(got, want)
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [1, 2, 3, 4]  # one history: step 3 re-run, its first row replaced
        rolled = (tmp_path / "run" / "metrics.rolled_back.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in rolled] == [3]
        assert json.loads((tmp_path / "run" / "checkpoint" / "trainer.json").read_text())["step"] == 4

        # the second loss is past max_restarts=1: the run stops with the error, naming the checkpoint it kept
        tr.callbacks[-1] = _kill_at(tr, tr.group, step=5)
        with pytest.raises(WorkerError, match=r"(?s)died.*max_restarts=1.*checkpoint of step 4 .*Trainer.load"):
            tr.fit(steps=2, view="none")
        assert json.loads((tmp_path / "run" / "checkpoint" / "trainer.json").read_text())["step"] == 4
    finally:
        tr.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lost", ["rollout_worker", "actor_with_one_step_off_in_flight"])
def test_a_killed_worker_is_replaced_in_split_placement(tmp_path, ray_cluster, lost):
    kw = dict(plan=rlkit.ParallelPlan(), placement="split", rollout_workers=1)
    if lost != "rollout_worker":  # a generation in flight when the actor goes: the checkpoint's, trained next
        kw["off_policy_steps"] = 1
    want = _uninterrupted(ray_cluster, tmp_path / "ref", 3, **kw)
    tr = _trainer(ray_cluster, tmp_path / "run", checkpoint_every=1, max_restarts=2, **kw)
    try:
        tr.callbacks.append(_kill_at(tr, tr.rollout_group if lost == "rollout_worker" else tr.group, step=2))
        got = tr.fit(steps=3, view="none")
        [r] = tr.restarts
        assert (r["failed_step"], r["from_step"]) == (3, 2), r
        _same_metrics(got, want)
    finally:
        tr.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_node_is_replaced_by_the_nodes_left(tmp_path, ray_session_end):
    """Ray's own multi-node test cluster (each node a raylet process of its own): the run's ranks on one node,
    that node's raylet removed (its workers die with it), the run restarted on the other node."""
    with multi_node(2, 2) as (c, sim, nodes):
        assert c.num_nodes == 3 and c.num_devices == 4
        plan = rlkit.ParallelPlan(dp=2)
        want = _uninterrupted(c, tmp_path / "ref", 3, plan=plan)
        tr = _trainer(c, tmp_path / "run", plan=plan, checkpoint_every=1, max_restarts=1)
        try:
            where = set(tr.group.table()["node"])
            assert len(where) == 1  # both ranks on one node (a dp=2 plan fits on one)
            [victim] = [n for n in nodes if n.node_id.startswith(next(iter(where)))]

            def lose_node(_trainer, row):
                if row["step"] == 1 and victim in nodes:
                    nodes.remove(victim)
                    sim.remove_node(victim)  # the raylet and every worker on it
            tr.callbacks.append(lose_node)
            got = tr.fit(steps=3, view="none")
            [r] = tr.restarts
            assert (r["failed_step"], r["from_step"]) == (2, 1), r
            assert set(tr.group.table()["node"]) != where  # on the node that is left
            _same_metrics(got, want)
        finally:
            tr.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restart_with_no_room_left_gives_up_after_its_timeout_naming_the_checkpoint(tmp_path, ray_session_end):
    """The run's only worker node removed: the restart waits restart_timeout_s for room (a replacement node),
    none comes, and the run stops with the lost worker's error and the checkpoint it kept."""
    import time

    with multi_node(2) as (c, sim, nodes):
        tr = _trainer(c, tmp_path / "run", plan=rlkit.ParallelPlan(dp=2), checkpoint_every=1, max_restarts=2,
                      restart_timeout_s=10)
        try:
            def lose_node(_trainer, row):
                if row["step"] == 1 and nodes:
                    sim.remove_node(nodes.pop())
            tr.callbacks.append(lose_node)
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match=r"(?s)died.*found no room for dp=2 x tp=1 x pp=1.*within "
                                                  r"restart_timeout_s=10 s.*checkpoint of step 1 is kept"):
                tr.fit(steps=3, view="none")
            assert time.monotonic() - t0 >= 10  # it waited the bound out
            assert tr.restarts == [] and tr.workers is None
            assert json.loads((tmp_path / "run" / "checkpoint" / "trainer.json").read_text())["step"] == 1
        finally:
            tr.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restart_waits_for_a_replacement_node_and_goes_on_there(tmp_path, ray_session_end, monkeypatch):
    """The run's only worker node removed; a replacement node joins 5 s later (a raylet of its own, as an
    operator or an autoscaler would add): the restart waits for it and the run goes on there, equal to an
    uninterrupted run."""
    import threading
    import time

    import ray._private.utils

    with multi_node(2) as (c, sim, nodes):
        plan = rlkit.ParallelPlan(dp=2)
        want = _uninterrupted(c, tmp_path / "ref", 3, plan=plan)
        # The replacement joins from a thread while the main thread waits in the restart. Ray's in-process node
        # registers a SIGTERM handler, which Python allows on the main thread only: that registration is skipped.
        # Its raylet dies with the thread that started it (the parent-death signal follows the thread), so the
        # thread lives until the test ends.
        monkeypatch.setattr(ray._private.utils, "set_sigterm_handler", lambda handler: None)
        done = threading.Event()

        def join_a_node_later():
            time.sleep(5.0)
            nodes.append(sim.add_node(num_cpus=2))
            done.wait(600)

        tr = _trainer(c, tmp_path / "run", plan=plan, checkpoint_every=1, max_restarts=1, restart_timeout_s=120)
        try:
            def lose_node_then_replace(_trainer, row):
                if row["step"] == 1 and len(nodes) == 1:
                    sim.remove_node(nodes.pop())
                    threading.Thread(target=join_a_node_later, daemon=True).start()
            tr.callbacks.append(lose_node_then_replace)
            got = tr.fit(steps=3, view="none")
            [r] = tr.restarts
            assert (r["failed_step"], r["from_step"]) == (2, 1) and r["seconds"] >= 5, r  # it waited for the node
            assert set(tr.group.table()["node"]) == {nodes[0].node_id[:8]}  # on the replacement
            _same_metrics(got, want)
        finally:
            tr.close()
            done.set()
