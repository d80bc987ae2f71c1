"""rlkit.Cluster on real Ray: embedded cluster, views, placement, roles, bad addresses, a real head
started by the test and a simulated 2-node cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import multi_node, settled_cpu_free, wait_cpu_free

from rlkit.cluster import Cluster, ClusterError
from rlkit.errors import PlanError
from rlkit.plan.topology import ParallelPlan
from rlkit.workers import WorkerGroup

pytestmark = pytest.mark.ray


class RankInfo:
    """A tiny per-rank object: its env and a real all-reduce over the group's gloo process group."""

    def env(self):
        return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR")}

    def all_reduce(self):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_embedded_cluster_views(ray_cluster):
    c = ray_cluster
    assert c.mode in ("embedded", "existing") and c.alive
    assert Cluster(num_cpus=4, timeout_s=20) is c  # a notebook re-run reuses the live cluster
    assert Cluster.current() is c
    assert (c.num_devices, c.devices_per_node, c.num_nodes) == (4, 4, 1)
    df = c.resources()
    assert list(df.columns[:7]) == ["node", "node_ip", "head", "CPU", "CPU_free", "GPU", "GPU_free"]
    assert df["CPU"].tolist() == [4.0] and df["GPU"].tolist() == [0.0] and df["memory_GiB"][0] > 0
    html = c._repr_html_()
    assert html.count("display:inline-block") == 4 and df["node_ip"][0] in html  # 4 device boxes
    assert "4 devices" in repr(c)
    assert ParallelPlan(dp=2, tp=2).validate(cluster=c)
    with pytest.raises(PlanError, match="needs dp\\*tp\\*pp=2\\*2\\*2=8 devices but only 4"):
        ParallelPlan(dp=2, tp=2, pp=2).validate(cluster=c)


@pytest.mark.timeout(120)
def test_placement_keeps_tp_together_and_reports_missing_resources(ray_cluster):
    c = ray_cluster
    free0 = settled_cpu_free(c)
    pool = c.placement_group_for(ParallelPlan(dp=2, tp=2), name="t")
    assert len(pool.placement_groups) == 1 and len({pool.node_of(r) for r in range(4)}) == 1
    assert pool.table()["bundle"].tolist() == [0, 1, 2, 3]
    assert wait_cpu_free(c, at_most=free0 - 4) == free0 - 4
    pool.remove()
    with pytest.raises(PlanError, match="tp=4 ranks must share one node, but the largest node holds 2"):
        c.placement_group_for(ParallelPlan(tp=4), cpus_per_worker=2)
    with pytest.raises(PlanError, match="5 ranks of .* need more than this cluster has"):
        c.placement_group_for(5)
    busy = c.placement_group_for(3)
    # the wait is bounded: it raises (pytest-timeout guards against a hang) and says what was missing
    with pytest.raises(ClusterError, match=r"could not reserve 2 bundles .* within 1 s; free now: \{'CPU': 1.0\}"):
        c.placement_group_for(2, timeout_s=1)
    busy.remove()
    assert wait_cpu_free(c, at_least=free0) >= free0


def test_role_pools_colocate_or_split(ray_cluster):
    c = ray_cluster
    pools = c.role_pools({"train": 2, "gen": 1}, {"actor": "train", "reference": "train", "rollout": "gen"})
    train, gen = pools["actor"], pools["rollout"]
    assert pools["reference"] is train and gen is not train
    assert (train.colocate, gen.colocate, train.world_size, gen.world_size) == (2, 1, 2, 1)
    assert train.actor_options(0)["num_cpus"] == 0.5 and gen.actor_options(0)["num_cpus"] == 1.0
    # two roles' worker groups share the train bundles (3 CPUs reserved in all, 4 actors)
    actor = WorkerGroup(c, 2, RankInfo, pool=train, init_process_group=False, timeout_s=60)
    ref = WorkerGroup(c, 2, RankInfo, pool=train, init_process_group=False, timeout_s=60)
    try:
        assert actor.nodes == ref.nodes
        with pytest.raises(PlanError, match="already hosts 2 worker group"):
            WorkerGroup(c, 2, RankInfo, pool=train, init_process_group=False)
        with pytest.raises(PlanError, match="pool 'gen' has 1 ranks but the plan needs 2"):
            WorkerGroup(c, 2, RankInfo, pool=gen)
    finally:
        actor.shutdown()
        ref.shutdown()
        train.remove()
        gen.remove()
    with pytest.raises(PlanError, match=r"pool\(s\) \['nope'\]"):
        c.role_pools({"train": 2}, {"actor": "nope"})


@pytest.mark.timeout(120)
def test_unreachable_address_fails_fast_and_keeps_current_cluster(ray_cluster):
    port = _free_port()  # nothing listens here
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ClusterError, match=f"cannot reach a Ray cluster at '{address}'"):
            Cluster(address, timeout_s=5)
    with pytest.raises(ClusterError, match="is not 'host:port'"):
        Cluster("127.0.0.1:notaport")
    assert ray_cluster.alive and Cluster.current() is ray_cluster  # a bad address replaced nothing


# ---- a real `ray start` head, and a simulated 2-node cluster -------------------------------
def _kill_session(proc: subprocess.Popen) -> None:
    """Stop only the head this test started: SIGTERM to `ray start --block` (it drains and stops its
    children), then SIGKILL whatever is left in its own session. Never `ray stop` (it is global)."""
    import psutil

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        pass
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == proc.pid:
                p.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def _start_head(ray_bin: str, env: dict, tmp_path: Path, attempts: int = 2) -> tuple[subprocess.Popen, int, str]:
    """A real ``ray start --head`` on a free port with a temp dir of its own, up ("Ray runtime started." in
    its log) within 120 s. Ray's own startup gives up when its GCS answers too slowly (on a loaded 2-core
    machine: "The current node timed out during startup ... the GCS has become overloaded"); such a head is
    started once more, its log kept for the failure message."""
    import tempfile

    logs = []
    for attempt in range(attempts):
        port = _free_port()
        temp_dir = tempfile.mkdtemp(prefix="rlkh", dir="/tmp")  # short: Ray's unix socket paths are <= 107 bytes
        log = tmp_path / f"head{attempt}.log"
        # its own session and temp dir: we can stop exactly this head, and never another engineer's Ray
        proc = subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                                 "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", "--block",
                                 f"--temp-dir={temp_dir}"], env=env, start_new_session=True,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and "Ray runtime started" not in log.read_text():
            time.sleep(0.3)
        if proc.poll() is None and "Ray runtime started" in log.read_text():
            return proc, port, temp_dir
        _kill_session(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
        logs.append(log.read_text()[-1500:])
    raise AssertionError(f"ray start --head did not come up in {attempts} attempts of 120 s:\n" + "\n---\n".join(logs))


def test_real_head_by_address(tmp_path, ray_session_end):
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    if not (Path.home() / ".ray" / "auth_token").exists() and "RAY_AUTH_TOKEN" not in env:
        subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    t0 = time.perf_counter()
    proc, port, temp_dir = _start_head(ray_bin, env, tmp_path)
    try:
        head_s = time.perf_counter() - t0
        c = Cluster(f"127.0.0.1:{port}", timeout_s=30)
        connect_s = time.perf_counter() - t0 - head_s
        assert c.mode == "remote" and c.num_devices == 2
        with WorkerGroup(c, 2, RankInfo, timeout_s=60) as g:
            assert g.call("all_reduce") == [3.0, 3.0]
        c.shutdown()
        print(f"head start {head_s:.1f} s, connect {connect_s:.1f} s")
    finally:
        _kill_session(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_two_nodes_keep_tp_groups_on_one_node(ray_session_end):
    import ray
    from ray.cluster_utils import Cluster as SimCluster

    current = Cluster.current()
    if current is not None:
        current.shutdown()
    sim = SimCluster(initialize_head=True, head_node_args={"num_cpus": 2})
    sim.add_node(num_cpus=2)
    try:
        ray.init(address=sim.address, logging_level="WARNING")
        c = Cluster()  # reuses the caller's ray.init ("existing"), never shuts it down
        assert c.mode == "existing" and (c.num_nodes, c.devices_per_node, c.num_devices) == (2, 2, 4)
        plan = ParallelPlan(dp=2, tp=2)
        pool = c.placement_group_for(plan)
        nodes = [pool.node_of(r) for r in range(4)]
        for group in plan.groups("tp"):  # each TP group on one node, the two groups on different nodes
            assert len({nodes[r] for r in group}) == 1
        assert nodes[0] != nodes[2]
        with WorkerGroup(c, plan, RankInfo, pool=pool, timeout_s=60) as g:
            envs = g.call("env")
            assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
            assert envs[0]["MASTER_ADDR"] != "127.0.0.1"  # two nodes: rank 0's node address
            assert g.call("all_reduce") == [10.0] * 4
        c.shutdown()
        assert ray.is_initialized()  # not ours to stop
    finally:
        ray.shutdown()
        sim.shutdown()


@pytest.fixture
def two_labelled_nodes(ray_session_end):
    """Two worker nodes of 2 CPUs labelled zone=a and zone=b (``conftest.multi_node``)."""
    with multi_node(2, 2, labels=[{"zone": "a"}, {"zone": "b"}]) as (c, _sim, nodes):
        yield c, nodes


@pytest.mark.timeout(420)
def test_a_trainer_on_two_nodes_keeps_tp_inside_a_node_and_shows_who_runs_where(two_labelled_nodes, tmp_path):
    import rlkit
    from rlkit.models import tiny_lm
    from rlkit.widgets.plan_view import PlanView

    c, nodes = two_labelled_nodes
    res = c.resources()
    assert sorted(res["labels"]) == ["", "zone=a", "zone=b"] and c.num_devices == 4
    kw = dict(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, cluster=c, run_dir=str(tmp_path),
              rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2)
    # a TP group wider than any node is refused with the reason, before anything is reserved (2 CPUs a rank:
    # one rank a node)
    with pytest.raises(PlanError, match=r"tp=2 ranks must share one node, but the largest node holds 1 ranks"):
        c.placement_group_for(ParallelPlan(tp=2), cpus_per_worker=2)
    assert c.table().empty and c.resources()["CPU_free"].sum() == 4

    plan = ParallelPlan(dp=2, tp=2)
    tr = rlkit.Trainer(plan=plan, **kw)
    try:
        tr.fit(steps=1, view="none")  # gloo across the two raylets
        table = c.table()
        mine = table[table["owner"] == tr._holder_label].sort_values("rank")
        assert list(mine["rank"]) == [0, 1, 2, 3] and mine["alive"].all()
        node_of = dict(zip(mine["rank"], mine["node"]))
        for group in plan.groups("tp"):  # each TP group inside one node ...
            assert len({node_of[r] for r in group}) == 1
        assert node_of[0] != node_of[2]  # ... and DP across the two
        assert sorted(set(mine["node_labels"])) == ["zone=a", "zone=b"]
        assert (mine["rss_gb"] > 0.1).all() and (mine["heartbeat_s"] < 30).all()
        assert set(mine["node"]) == {n.node_id[:8] for n in nodes}
        panel = tr.workers_table()  # what the live view's worker panel shows
        assert list(panel["rank"]) == [0, 1, 2, 3] and set(panel["group"]) == {"rl"}
        from rlkit.widgets.live import LiveView

        assert all(f">{lab}<" in LiveView(mode="none", workers=tr.workers_table).workers_html()
                   for lab in ("zone=a", "zone=b"))
        view = PlanView(plan, dim="node", placed=tr.group)  # the grid coloured by node
        assert view.color_of(0) == view.color_of(1) != view.color_of(2) == view.color_of(3)
        assert "runs on node " + node_of[2] in view.facts.tooltip(2)
    finally:
        tr.close()
    assert c.table().empty  # the closed trainer's ranks are gone from it


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_split_placement_puts_the_rollout_pool_on_the_other_node(two_labelled_nodes, tmp_path):
    import rlkit
    from rlkit.models import tiny_lm

    c, _nodes = two_labelled_nodes
    # the actor's tp=2 group fills one node, so the rollout worker's pool lands on the other
    tr = rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, cluster=c,
                       run_dir=str(tmp_path), rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                       prompts_per_step=2, plan=ParallelPlan(tp=2), placement="split", rollout_workers=1)
    try:
        tr.fit(steps=1, view="none")  # the weights cross nodes over the weight channel
        table = tr.workers_table()
        actor, rollout = (set(table[table["group"] == g]["node_labels"]) for g in ("rl", "rollout"))
        assert len(actor) == 1 and len(rollout) == 1 and actor != rollout, table
    finally:
        tr.close()
