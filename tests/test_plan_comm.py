"""rlkit.plan.comm: hand-computed collectives per step."""

from __future__ import annotations

import pytest

from rlkit.errors import PlanError
from rlkit.plan import ModelSpec, ParallelPlan
from rlkit.plan.comm import BANDWIDTHS, bandwidth, estimate_communication

N7B = 6_738_415_616
SPEC7B = ModelSpec.from_name("llama-2-7b")
ACT = 2048 * 4096 * 2  # micro_batch x seq x hidden x bf16 = 16 MiB


def row(df, dim, collective):
    sel = df[(df.dim == dim) & (df.collective == collective)]
    assert len(sel) == 1, df.to_string()
    return sel.iloc[0]


def test_replicate_all_reduces_fp32_grads():
    # dp=8 replicate, bf16-mixed (fp32 reduce), 1 micro-batch: one all-reduce per FSDP unit
    # (32 layers + root) of the whole model's grads; ring all-reduce sends 2(n-1)/n of it
    df = estimate_communication(ParallelPlan(dp=8, dp_shard="replicate"), "llama-2-7b", global_batch=8)
    assert df[["dim", "collective"]].values.tolist() == [["dp", "all-reduce"]]
    r = row(df, "dp", "all-reduce")
    assert (r.group_size, r.calls_per_step, r.bytes_per_call) == (8, 33, 4 * N7B // 33)
    assert r.bytes_per_step == 4 * N7B * 2 * 7 // 8
    assert r.link == "intra" and r.bandwidth == 450e9 and r.time_s == pytest.approx(r.bytes_per_step / 450e9)
    assert df.attrs["micro_batches"] == 1 and df.attrs["total_time_s"] == pytest.approx(r.time_s)


def test_full_shard_gathers_every_micro_batch_and_reduce_scatters_once():
    # dp=8 full_shard, global batch 16 -> 2 micro-batches per rank. Each layer is all-gathered in
    # forward and again in backward (bf16), the root (embedding, norm, lm_head) once, per
    # micro-batch; grads sync after the last micro-batch only: every unit is reduce-scattered (fp32)
    # once per step. No padding: every llama-2-7b dim divides 8.
    layer, root = SPEC7B.layer_params, 2 * 32000 * 4096 + 4096
    assert 32 * layer + root == N7B
    df = estimate_communication(ParallelPlan(dp=8), "llama-2-7b", global_batch=16)
    ag, rs = row(df, "dp", "all-gather"), row(df, "dp", "reduce-scatter")
    assert ag.calls_per_step == (2 * 32 + 1) * 2
    assert ag.bytes_per_step == 2 * (2 * 32 * layer + root) * 2 * 7 // 8
    assert rs.calls_per_step == 33
    assert rs.bytes_per_step == N7B * 4 * 7 // 8
    # ZeRO-2 (reshard_after_forward=False): one gather per unit per micro-batch
    z2 = estimate_communication(ParallelPlan(dp=8, dp_shard="shard_grad_op"), "llama-2-7b", global_batch=16)
    assert row(z2, "dp", "all-gather").bytes_per_step == 2 * N7B * 2 * 7 // 8


def test_hybrid_shard_adds_a_replica_all_reduce_of_the_shards():
    # llama-3-8b (every dim divides 4), dp=8 in shard groups of 4 on one 8-GPU node... and two nodes
    n = ModelSpec.from_name("llama-3-8b").num_params
    plan = ParallelPlan(dp=8, dp_shard="hybrid_shard", dp_shard_size=4, devices_per_node=4)
    df = estimate_communication(plan, "llama-3-8b", global_batch=8)
    ar = row(df, "dp", "all-reduce")
    assert ar.group_size == 2 and ar.calls_per_step == 33
    assert ar.bytes_per_step == n * 4 // 4  # fp32 shard (n/4 params), 2(2-1)/2 = 1
    assert ar.link == "inter" and row(df, "dp", "reduce-scatter").link == "intra"
    assert row(df, "dp", "reduce-scatter").bytes_per_step == n * 4 * 3 // 4


def test_fsdp_messages_are_padded_like_torch():
    # tiny llama (h=48, i=100, V=251, 3 layers) on dp=3 fp32: FSDP2 pads each tensor to ceil(d0/3)
    # rows, 29680 elements per rank (see test_plan_memory), so each reduce-scatter input is 3x that
    cfg = dict(model_type="llama", vocab_size=251, hidden_size=48, intermediate_size=100, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2)
    df = estimate_communication(ParallelPlan(dp=3), cfg, precision="fp32", seq_len=8, global_batch=3)
    rs = row(df, "dp", "reduce-scatter")
    assert rs.calls_per_step == 4 and rs.bytes_per_step == 3 * 29680 * 4 * 2 // 3


def test_tensor_parallel_all_reduces_per_layer():
    # tp=8: 2 forward + 2 backward all-reduces per layer per micro-batch, + the vocab-parallel
    # embedding's forward one and the lm_head's backward one: 4 * 32 + 2 = 130 of 16 MiB
    df = estimate_communication(ParallelPlan(tp=8), "llama-2-7b", global_batch=1)
    ar = row(df, "tp", "all-reduce")
    assert (ar.group_size, ar.calls_per_step, ar.bytes_per_call) == (8, 130, ACT)
    assert ar.bytes_per_step == 130 * ACT * 2 * 7 // 8
    # recomputation repeats the 2 forward ones
    ac = estimate_communication(ParallelPlan(tp=8), "llama-2-7b", global_batch=1, activation_checkpointing=True)
    assert row(ac, "tp", "all-reduce").calls_per_step == 6 * 32 + 2
    # sequence parallelism: all-gather + reduce-scatter, same bytes in all
    sp = estimate_communication(ParallelPlan(tp=8), "llama-2-7b", global_batch=1, sequence_parallel=True)
    assert sp.bytes_per_step.sum() == ar.bytes_per_step
    assert set(sp.collective) == {"all-gather", "reduce-scatter"}
    # gathered logits (lm_head output_layouts=Replicate): + an all-gather of b x s x V bf16 per micro-batch
    g = estimate_communication(ParallelPlan(tp=8), "llama-2-7b", global_batch=1, gathered_logits=True)
    assert row(g, "tp", "all-gather (logits)").bytes_per_step == 2048 * 32000 * 2 * 7 // 8


def test_pipeline_send_recv_per_micro_batch_and_boundary():
    plan = ParallelPlan(pp=4, micro_batches=8)
    mid = estimate_communication(plan, "llama-2-7b", stage=1)
    assert row(mid, "pp", "send/recv forward").calls_per_step == 8
    assert row(mid, "pp", "send/recv backward").bytes_per_step == 8 * ACT
    assert estimate_communication(plan, "llama-2-7b", stage=0).collective.tolist() == ["send/recv forward"]
    assert estimate_communication(plan, "llama-2-7b", stage=3).collective.tolist() == ["send/recv backward"]
    # interleaved, vpp=2: rank 0 holds virtual stages 0 and 4 of 8: sends forward from both,
    # backward only from 4
    il = estimate_communication(ParallelPlan(pp=4, vpp=2, micro_batches=8), "llama-2-7b", stage=0)
    assert row(il, "pp", "send/recv forward").calls_per_step == 16
    assert row(il, "pp", "send/recv backward").calls_per_step == 8


def test_fsdp_under_pipelining_syncs_once_per_step():
    # torch.distributed.pipelining: grads reduced once per step, params not resharded after
    # backward: a layer is gathered in the first min(m, pp - stage) forwards and in every backward
    plan = ParallelPlan(dp=2, pp=2, micro_batches=4)
    df = estimate_communication(plan, "llama-2-7b", stage=0)
    assert row(df, "dp", "all-gather").calls_per_step == 16 * (2 + 4) + 1
    assert row(df, "dp", "reduce-scatter").calls_per_step == 16 + 1


def test_links_follow_nodes():
    # tp=8 over nodes of 4 GPUs: TP crosses nodes and runs at InfiniBand speed
    df = estimate_communication(ParallelPlan(tp=8, devices_per_node=4), "llama-2-7b", global_batch=1)
    ar = row(df, "tp", "all-reduce")
    assert ar.link == "inter" and ar.bandwidth == 50e9 and ar.time_s == pytest.approx(ar.bytes_per_step / 50e9)
    # tp=4 inside a node, dp=2 across two nodes; custom bandwidths in bytes/s
    df = estimate_communication(ParallelPlan(dp=2, tp=4), "llama-2-7b", devices_per_node=4, global_batch=2,
                                intra_node_bw="pcie4", inter_node_bw=12.5e9)
    assert row(df, "tp", "all-reduce").link == "intra" and row(df, "tp", "all-reduce").bandwidth == 25e9
    assert row(df, "dp", "all-gather").link == "inter" and row(df, "dp", "all-gather").bandwidth == 12.5e9
    # pipeline neighbours on different nodes
    pp = estimate_communication(ParallelPlan(pp=2, tp=4, devices_per_node=4), "llama-2-7b", stage=0)
    assert row(pp, "pp", "send/recv forward").link == "inter"


def test_default_stage_is_the_slowest_and_delegate_matches():
    plan = ParallelPlan(dp=2, tp=2, pp=2)
    df = plan.communication("qwen2.5-7b", seq_len=1024)
    per_stage = [estimate_communication(plan, "qwen2.5-7b", seq_len=1024, stage=p).time_s.sum() for p in (0, 1)]
    assert df.attrs["stage"] == per_stage.index(max(per_stage))
    assert df.attrs["total_time_s"] == pytest.approx(max(per_stage))
    assert estimate_communication(ParallelPlan(), "qwen2.5-0.5b").empty  # one rank: nothing to send


def test_bandwidth_presets():
    assert BANDWIDTHS["nvlink"] == 450e9 and BANDWIDTHS["ib-ndr"] == 50e9 and BANDWIDTHS["100gbe"] == 12.5e9
    assert bandwidth("PCIe4") == 25e9 and bandwidth(1e9) == 1e9
    for bad in ("warp-drive", 0, -1, True):
        with pytest.raises(PlanError):
            bandwidth(bad)


@pytest.mark.parametrize("kw, needle", [
    (dict(global_batch=12), "global_batch=12"),
    (dict(global_batch=16, micro_batch=2), "fewer than pp=4"),
    (dict(seq_len=0), "seq_len=0"),
    (dict(precision="int8"), "int8"),
    (dict(intra_node_bw="carrier-pigeon"), "carrier-pigeon"),
    (dict(stage=7), "stage=7"),
])
def test_bad_inputs_name_the_value(kw, needle):
    with pytest.raises(PlanError, match=needle):
        estimate_communication(ParallelPlan(dp=8, pp=4), "llama-2-7b", **kw)
