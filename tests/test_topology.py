"""ParallelPlan topology and validation, checked against torch's own DeviceMesh."""

import os
import socket

import pytest

from rlkit import ParallelPlan, PlanError
from rlkit.plan import ModelSpec


def test_seed_example_512_gpus():
    plan = ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8)
    assert plan.world_size == 512
    tp, pp, dp = plan.groups("tp"), plan.groups("pp"), plan.groups("dp")
    assert (len(tp), len(pp), len(dp)) == (64, 32, 128)
    assert {len(g) for g in tp} == {8} and {len(g) for g in pp} == {16} and {len(g) for g in dp} == {4}
    # Megatron order: TP groups are consecutive ranks, DP stride tp, PP stride tp*dp
    assert tp[0] == list(range(8))
    assert dp[0] == [0, 8, 16, 24]
    assert pp[0] == [32 * i for i in range(16)]
    # every rank is in exactly one group per dimension
    for groups in (tp, pp, dp):
        assert sorted(r for g in groups for r in g) == list(range(512))
    assert plan.placement_warnings() == []  # TP of 8 inside 8-device nodes


def test_coords_rank_roundtrip_and_orders():
    for order in ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-dp-tp"):
        plan = ParallelPlan(dp=2, tp=3, pp=4, order=order)
        for r in range(plan.world_size):
            assert plan.rank(**plan.coords(r)) == r
    plan = ParallelPlan(dp=2, tp=2, pp=2, order="tp-pp-dp")
    assert plan.coords(2) == {"dp": 0, "tp": 0, "pp": 1}


def _fake_mesh_groups(plan, rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The fake backend lets one process build the real DeviceMesh of a 512-rank world; the groups
    # below are computed by DeviceMesh itself, which is what we compare against.
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        shape, names = plan.mesh_shape()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return {d: (dist.get_process_group_ranks(mesh.get_group(d)), mesh[d].get_local_rank()) for d in names}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("plan", [ParallelPlan(dp=4, tp=8, pp=16), ParallelPlan(dp=2, tp=4, pp=3, order="tp-pp-dp")])
def test_groups_match_devicemesh(plan):
    for rank in (0, 1, plan.world_size // 2 + 3, plan.world_size - 1):
        for dim, (ranks, local) in _fake_mesh_groups(plan, rank).items():
            assert ranks == plan.group_of(rank, dim)
            assert local == plan.coords(rank)[dim]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank, world, port, plan, out_dir):
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    shape, names = plan.mesh_shape()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    sums = {}
    for dim in names:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(dim))
        sums[dim] = t.item()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
        f.write(repr(sums))


def test_groups_real_gloo_allreduce(tmp_path):
    """4 real gloo processes: an all-reduce of rank ids over each mesh dim sums the plan's group."""
    import torch.multiprocessing as mp

    plan = ParallelPlan(dp=2, tp=2, pp=1)
    # a hang is bounded by the process group's 60 s timeout inside each worker
    mp.start_processes(_allreduce_worker, args=(plan.world_size, _free_port(), plan, str(tmp_path)),
                       nprocs=plan.world_size, start_method="spawn", join=True)
    for rank in range(plan.world_size):
        sums = eval((tmp_path / f"{rank}.txt").read_text())
        for dim, value in sums.items():
            assert value == sum(plan.group_of(rank, dim)), (rank, dim)


def test_stage_layers_even_uneven_virtual():
    assert [list(r) for r in ParallelPlan(pp=4, micro_batches=4).stage_layers(8)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # 10 layers on 4 stages: the two extra layers go to the middle stages
    assert [len(r) for r in ParallelPlan(pp=4).stage_layers(10)] == [2, 3, 3, 2]
    plan = ParallelPlan(pp=2, vpp=2, micro_batches=4)
    assert [list(r) for r in plan.stage_layers(8)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # virtual stage s lives on pipeline rank s % pp: rank 0 holds stages 0 and 2
    assert plan.layers_of_rank(0, 8) == [0, 1, 4, 5]
    assert plan.layers_of_rank(1, 8) == [2, 3, 6, 7]
    assert [len(r) for r in ParallelPlan(pp=2).stage_layers(7, split=[3, 4])] == [3, 4]
    with pytest.raises(PlanError, match="split"):
        ParallelPlan(pp=2).stage_layers(7, split=[3, 3])


def test_table_and_nodes():
    plan = ParallelPlan(dp=2, tp=2, pp=2, devices_per_node=4)
    df = plan.table(model="qwen2.5-0.5b")
    assert list(df.columns[:6]) == ["rank", "node", "local_device", "dp", "tp", "pp"]
    assert df.node.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert df.layers.tolist() == ["0-11"] * 4 + ["12-23"] * 4
    # TP of 4 on nodes of 2 devices crosses nodes: warn with the fix
    warn = ParallelPlan(tp=4).placement_warnings(devices_per_node=2)
    assert warn and "span nodes" in warn[0] and "tp in [1, 2]" in warn[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "tp=0 must be a positive integer"),
    (dict(dp=-2), "dp=-2 must be a positive integer"),
    (dict(pp=1.5), "pp=1.5 must be a positive integer"),
    (dict(dp=True), "dp=True must be a positive integer"),
    (dict(order="tp-dp"), "order='tp-dp' must name each of dp, tp, pp"),
    (dict(dp_shard="zero9"), "dp_shard='zero9' is not a sharding mode"),
    (dict(dp=4, dp_shard="hybrid_shard", dp_shard_size=3), r"choose one of \[1, 2, 4\]"),
    (dict(vpp=2), "vpp=2 needs pipeline parallelism"),
    (dict(pp=4, micro_batches=2), "micro_batches=2 < pp=4"),
    (dict(pp=2, vpp=2, micro_batches=3), "interleaved 1F1B needs micro_batches divisible by pp=2"),
    (dict(schedule="zb"), "schedule='zb' is not a pipeline schedule"),
])
def test_bad_degrees(kwargs, message):
    with pytest.raises(PlanError, match=message):
        ParallelPlan(**kwargs)


def test_gpipe_allows_few_micro_batches():
    assert ParallelPlan(pp=4, micro_batches=1, schedule="gpipe").n_micro_batches == 1


def test_validate_against_model_cluster_batch():
    llama = ModelSpec.from_name("llama-3-8b")  # 32 heads, 8 kv heads, 32 layers
    with pytest.raises(PlanError, match=r"tp=3 does not divide num_attention_heads=32; choose tp in \{1, 2, 4, 8\}"):
        ParallelPlan(tp=3).validate(model=llama)
    with pytest.raises(PlanError, match=r"tp=16 does not divide num_key_value_heads=8"):
        ParallelPlan(tp=16).validate(model=llama)
    with pytest.raises(PlanError, match=r"pp=64 stages .* num_hidden_layers=32"):
        ParallelPlan(pp=64).validate(model=llama)
    with pytest.raises(PlanError, match=r"pp\*vpp=16\*4=64"):
        ParallelPlan(pp=16, vpp=4, micro_batches=16).validate(model=llama)
    with pytest.raises(PlanError, match="needs dp\\*tp\\*pp=2\\*2\\*2=8 devices but only 4"):
        ParallelPlan(dp=2, tp=2, pp=2).validate(devices=4)
    with pytest.raises(PlanError, match="global batch=30 is not divisible by dp=4"):
        ParallelPlan(dp=4).validate(batch=30)
    with pytest.raises(PlanError, match="micro_batches=4"):
        ParallelPlan(dp=2, pp=4).validate(batch=12)
    plan = ParallelPlan(dp=2, tp=4, pp=4, micro_batches=8)
    assert plan.validate(model=llama, devices=32, batch=64) is plan


def test_validate_never_imports_torch():
    """The plan layer stays pure math: importing rlkit and validating a 512-GPU plan loads no torch
    (its speed is measured in bench/, not asserted here)."""
    import subprocess
    import sys

    code = ("import sys; import rlkit; "
            "p = rlkit.ParallelPlan(dp=4, tp=8, pp=16, micro_batches=16); p.validate(model='llama-3-70b', devices=512); "
            "p.groups('dp'); assert 'torch' not in sys.modules, 'plan layer imported torch'; print(len(p.groups('dp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 128
