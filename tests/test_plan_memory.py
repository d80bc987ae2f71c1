"""rlkit.plan.memory: hand-computed cases, and (slow) a byte-exact check against real torch FSDP2/TP/PP.

Run as a script, this file is the torch worker of the slow check (one process per rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlkit.errors import PlanError
from rlkit.plan import ModelSpec, ParallelPlan
from rlkit.plan.memory import RolloutMemory, estimate_memory
from rlkit.plan.memory_report import compare_memory, explain_fit
from rlkit.plan.units import parse_bytes

N7B = 6_738_415_616  # llama-2-7b parameters
GB = 10**9

# tiny configs with dims that do not divide 2 or 3, so FSDP2 pads and ranks differ
TINY_LLAMA = dict(model_type="llama", vocab_size=251, hidden_size=48, intermediate_size=100, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
TINY_QWEN_TIED = dict(TINY_LLAMA, model_type="qwen2", tie_word_embeddings=True)


def persistent(df):
    return (df.weights + df.grads + df.optimizer).tolist()


# ---- model state ---------------------------------------------------------------------------------
def test_llama7b_full_shard_bf16_mixed_is_16_bytes_per_param_over_dp():
    # ZeRO's 2+2+12 = 16 bytes/param; FSDP2 bf16-mixed splits it 4 (fp32 params) + 4 (fp32 grads)
    # + 8 (Adam m, v): every dim of llama-2-7b divides 8, so there is no padding.
    df = estimate_memory(ParallelPlan(dp=8), "llama-2-7b", precision="bf16-mixed", optimizer="adamw")
    assert len(df) == 8
    assert persistent(df) == [16 * N7B // 8] * 8
    assert df.weights[0] == 4 * N7B // 8 and df.grads[0] == 4 * N7B // 8 and df.optimizer[0] == 8 * N7B // 8
    # pure bf16: 2 + 2 + 4; SGD keeps no state; replicate keeps everything on every rank
    assert persistent(estimate_memory(ParallelPlan(dp=8), "llama-2-7b", precision="bf16"))[0] == 8 * N7B // 8
    assert estimate_memory(ParallelPlan(dp=8), "llama-2-7b", optimizer="sgd").optimizer[0] == 0
    rep = estimate_memory(ParallelPlan(dp=8, dp_shard="replicate"), "llama-2-7b")
    assert persistent(rep)[0] == 16 * N7B
    # HSDP over groups of 4: sharded 4 ways
    hsdp = estimate_memory(ParallelPlan(dp=8, dp_shard="hybrid_shard", dp_shard_size=4), "llama-2-7b")
    assert persistent(hsdp)[0] == 16 * N7B // 4


def test_plan_memory_delegates():
    plan = ParallelPlan(dp=2, pp=2)
    a = plan.memory("qwen2.5-0.5b", seq_len=512)
    b = estimate_memory(plan, "qwen2.5-0.5b", seq_len=512)
    assert a.equals(b)


def test_qwen05b_tied_pp2_copies_embedding_to_last_stage():
    # qwen2.5-0.5b: V=151936, h=896, 24 layers of 14,912,384 params, tied embeddings.
    # pp=2: stage 0 = embedding + layers 0-11; stage 1 = layers 12-23 + final norm + its own copy of
    # the embedding for the output projection. fp32, dp=1: 4 bytes per parameter.
    V, h, layer = 151936, 896, 14_912_384
    df = estimate_memory(ParallelPlan(pp=2), "qwen2.5-0.5b", precision="fp32")
    assert df.weights.tolist() == [4 * (V * h + 12 * layer), 4 * (12 * layer + h + V * h)]
    assert df.weights.tolist() == [1_260_333_056, 1_260_336_640]
    assert df.weights.tolist() == [4 * n for n in ModelSpec.from_name("qwen2.5-0.5b").stage_params(ParallelPlan(pp=2))]
    # one stage: the tied matrix once
    one = estimate_memory(ParallelPlan(), "qwen2.5-0.5b", precision="fp32")
    assert one.weights[0] == 4 * 494_032_768
    assert df.layers.tolist() == [12, 12]


def test_tp_splits_matmuls_and_replicates_norms():
    # llama-2-7b, tp=8, fp32, dp=1: each layer's 4 attention + 3 MLP matrices split 8 ways, its two
    # RMSNorm weights (h each) replicated; embedding and lm_head split over the vocab; final norm
    # replicated.
    h, i, V, L = 4096, 11008, 32000, 32
    matmuls = 4 * h * h + 3 * h * i
    per_rank = L * (matmuls // 8 + 2 * h) + 2 * (V // 8) * h + h
    df = estimate_memory(ParallelPlan(tp=8), "llama-2-7b", precision="fp32")
    assert df.weights.tolist() == [4 * per_rank] * 8
    assert df.grads.tolist() == [4 * per_rank] * 8 and df.optimizer.tolist() == [8 * per_rank] * 8
    # without vocab parallelism the embedding and lm_head are whole on every TP rank
    whole = estimate_memory(ParallelPlan(tp=8), "llama-2-7b", precision="fp32", vocab_parallel=False)
    assert whole.weights[0] == 4 * (L * (matmuls // 8 + 2 * h) + 2 * V * h + h)


def test_tp_keeps_tied_embeddings_one_vocab_sharded_matrix():
    # apply_tp re-ties the Rowwise embedding and the Colwise lm_head to one Shard(0) DTensor, so with
    # tp > 1 a tied model holds one vocab shard: every matrix halves, the norms stay whole
    V, h = 151936, 896
    tp1 = estimate_memory(ParallelPlan(), "qwen2.5-0.5b", precision="fp32").weights[0]
    tp2 = estimate_memory(ParallelPlan(tp=2), "qwen2.5-0.5b", precision="fp32").weights[0]
    replicated = 24 * 2 * h + h  # RMSNorm weights stay whole on both TP ranks
    assert 2 * tp2 == tp1 + 4 * replicated
    assert tp1 == 4 * 494032768  # the tied matrix counted once (V*h = 136,134,656 of the 494M)
    assert V * h == 136134656


def test_fsdp_padding_and_uneven_shards_hand_computed():
    # Tiny llama (h=48, q=48, kv=24, i=100, V=251, 3 layers, untied) on dp=3 full_shard, fp32 AdamW.
    # FSDP2 pads each tensor to ceil(dim0/3) rows on every rank (params and grads):
    #   per layer: q 16x48 + k 8x48 + v 8x48 + o 16x48 + gate 34x48 + up 34x48 + down 16x100
    #              + 2 norms x 16 = 7200; root: embed 84x48 + lm_head 84x48 + norm 16 = 8080
    padded = 3 * 7200 + 8080
    assert padded == 29680
    # Adam states are zeros_like the unpadded shard: rank 2 holds 100-68 = 32 rows of gate/up and
    # 251-168 = 83 rows of embed/lm_head: 3 * 2 * 2 * 48 + 2 * 48 = 672 fewer elements
    df = estimate_memory(ParallelPlan(dp=3), TINY_LLAMA, precision="fp32", seq_len=8, micro_batch=2)
    assert df.weights.tolist() == [4 * padded] * 3 == [118720] * 3
    assert df.grads.tolist() == [4 * padded] * 3
    assert df.optimizer.tolist() == [8 * padded, 8 * padded, 8 * (padded - 672)] == [237440, 237440, 232064]
    assert df.param_tensors.tolist() == [3 * 9 + 3] * 3


def test_fsdp2_tp_padding_hand_computed():
    # Tiny qwen2 (h=48, q=48, kv=24, i=100, V=251, 3 layers, qkv bias, tied) on dp=2 x tp=2, fp32.
    # TP-local rows, then FSDP2 pads each to ceil(rows/2) on both shards:
    #   q 24->12 x48, k/v 12->6 x48, o 48->24 x24, gate/up 50->25 x48, down 48->24 x50, 2 norms 24,
    #   biases 12+6+6: 576+288+288+576+1200+1200+1200+48+24 = 5400 per layer.
    #   root: the tied embedding is one tensor (apply_tp re-ties it); vocab 251 -> 126 / 125 rows per
    #   TP rank, ceil(./2) = 63 rows x 48 = 3024, + final norm 24: 3048.
    per_rank = 3 * 5400 + 3048
    assert 4 * per_rank == 76992
    # Adam states are zeros_like the unpadded shard: TP rank 1, shard 1 holds 125 - 63 = 62 rows of
    # the vocab tensor, 48 fewer elements. Ranks are tp-fastest: rank 3 = (dp 1, tp 1).
    df = estimate_memory(ParallelPlan(dp=2, tp=2), TINY_QWEN_TIED, precision="fp32")
    assert df.weights.tolist() == df.grads.tolist() == [4 * per_rank] * 4
    assert df.optimizer.tolist() == [8 * per_rank] * 3 + [8 * (per_rank - 48)]


def test_matches_bytes_recorded_from_the_torch_check():
    # per-rank (weights, grads, optimizer) as recorded from a run of the slow torch check below
    # (test_torch_fsdp2_tp_pp_bytes_match_estimate, torch 2.13 on gloo), which measures them for real
    cases = {
        (("dp", 2), ("tp", 2)): (TINY_QWEN_TIED, [(76992, 76992, 153984)] * 3 + [(76992, 76992, 153600)]),
        (("dp", 2), ("pp", 2)): (TINY_QWEN_TIED, [(110208, 110208, 220416), (110208, 110208, 220032),
                                                  (67296, 67296, 134592), (67296, 67296, 134208)]),
    }
    for plan_kw, (cfg, expected) in cases.items():
        df = estimate_memory(ParallelPlan(**dict(plan_kw)), cfg, precision="fp32")
        assert list(zip(df.weights, df.grads, df.optimizer)) == expected, plan_kw


def test_reference_and_critic_roles():
    # llama-2-7b, dp=1, fp32: the reference adds weights only; the critic trains a model whose
    # lm_head (V x h) is replaced by a value head (h weights + 1 bias)
    V, h = 32000, 4096
    critic = N7B - V * h + h + 1
    df = estimate_memory(ParallelPlan(), "llama-2-7b", precision="fp32", roles=("actor", "reference", "critic"))
    assert df.weights[0] == 4 * N7B + 4 * N7B + 4 * critic
    assert df.grads[0] == 4 * N7B + 4 * critic
    assert df.optimizer[0] == 8 * N7B + 8 * critic
    # bf16-mixed: the reference is kept in the compute dtype (bf16)
    ref = estimate_memory(ParallelPlan(), "llama-2-7b", roles=("actor", "reference"))
    assert ref.weights[0] == 4 * N7B + 2 * N7B
    # the critic has no logits; the actor's dominate the peak phase
    assert estimate_memory(ParallelPlan(), "llama-2-7b", roles=("critic",)).logits[0] == 0


def test_param_buffers_count_unsharded_grad_accumulation_and_gathered_layers():
    # llama-2-7b dp=8 full_shard bf16-mixed, one micro-batch: the root (embedding, lm_head, norm)
    # and 2 decoder layers unsharded in bf16, plus one layer's unsharded grads in bf16 + fp32
    layer, root = 202_383_360, 2 * 32000 * 4096 + 4096
    one = estimate_memory(ParallelPlan(dp=8), "llama-2-7b").param_buffers[0]
    assert one == (root + 2 * layer) * 2 + layer * (2 + 4)
    # 4 micro-batches: grads are reduced after the last one only, so they accumulate unsharded (fp32)
    four = estimate_memory(ParallelPlan(dp=8, micro_batches=4), "llama-2-7b").param_buffers[0]
    assert four - one == 4 * (N7B - N7B // 8)


# ---- activations and logits ----------------------------------------------------------------------
def test_activations_follow_korthikanti():
    # llama-2-7b, s=2048, b=1, a=32, h=4096, 32 layers, 16-bit activations, eager attention (the
    # default is flash): sbh(34 + 5as/h) per layer (Korthikanti et al. 2022, Eq. 2)
    s, b, h, a, L = 2048, 1, 4096, 32, 32
    eager = dict(flash_attention=False)
    per_layer = s * b * h * 34 + 5 * a * s * s * b
    assert estimate_memory(ParallelPlan(), "llama-2-7b", **eager).activations[0] == L * per_layer
    # tp=8 without SP: sbh(10 + 24/t + 5as/(ht)); with SP: sbh(34/t + 5as/(ht))
    tp = estimate_memory(ParallelPlan(tp=8), "llama-2-7b", **eager).activations[0]
    assert tp == L * (10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // 8)
    sp = estimate_memory(ParallelPlan(tp=8), "llama-2-7b", sequence_parallel=True, **eager).activations[0]
    assert sp == L * ((34 * s * b * h + 5 * a * s * s * b) // 8)
    # flash attention (the default) drops the attention-score term; fp32 doubles everything
    assert estimate_memory(ParallelPlan(), "llama-2-7b").activations[0] == L * 34 * s * b * h
    assert estimate_memory(ParallelPlan(), "llama-2-7b", precision="fp32", **eager).activations[0] == 2 * L * per_layer
    # selective recompute (Korthikanti Sec. 5) drops the same term under eager attention: 34sbh/t with SP
    sel = estimate_memory(ParallelPlan(tp=8), "llama-2-7b", sequence_parallel=True, recompute="selective", **eager)
    assert sel.activations[0] == L * (34 * s * b * h // 8)
    # full recomputation: 2sbh per layer input + one layer's activations while it is recomputed;
    # activation_checkpointing=True is its alias
    ac = estimate_memory(ParallelPlan(), "llama-2-7b", recompute="full", **eager).activations[0]
    assert ac == L * 2 * s * b * h + per_layer
    assert estimate_memory(ParallelPlan(), "llama-2-7b", activation_checkpointing=True, **eager).activations[0] == ac


# ---- padding-free micro-batches: a token budget --------------------------------------------------------
def test_token_budget_sizes_the_micro_batch():
    # llama-2-7b (h=4096, a=32, 32 layers, vocab 32000), 16-bit activations, eager attention: a budget of
    # 8192 + 100 tokens at a row width of 2048 holds 4 rows of 2048, each sbh(34 + 5as/h) per layer
    s, h, a, L, V = 2048, 4096, 32, 32, 32000
    eager = dict(flash_attention=False)
    per_row = 34 * s * h + 5 * a * s * s
    df = estimate_memory(ParallelPlan(), "llama-2-7b", seq_len=s, token_budget=8192 + 100, **eager)
    assert df.activations[0] == L * 4 * per_row
    assert df.logits[0] == 4 * s * V * 4 * 2             # the row tokens, upcast + log-softmax, fp32
    assert df.attrs["token_budget"] == 8292 and df.attrs["micro_batch"] == 4
    # the same budget at a width of 8192 (one row): the same tokens, 4x the attention scores per token
    wide = estimate_memory(ParallelPlan(), "llama-2-7b", seq_len=8192, token_budget=8192, **eager)
    assert wide.activations[0] == L * (34 * 8192 * h + 5 * a * 8192 * 8192)
    assert wide.logits[0] == df.logits[0]
    # flash attention: a budget's activations do not depend on the longest sequence at all
    assert {int(estimate_memory(ParallelPlan(), "llama-2-7b", seq_len=w, token_budget=8192).activations[0])
            for w in (512, 2048, 8192)} == {L * 34 * 8192 * h}
    # tp=8 with SP and a pipeline: the budget stands in for micro_batch everywhere
    plan = ParallelPlan(tp=8, pp=4, micro_batches=8)
    kw = dict(seq_len=s, sequence_parallel=True, **eager)
    assert estimate_memory(plan, "llama-2-7b", token_budget=3 * s, **kw).equals(
        estimate_memory(plan, "llama-2-7b", micro_batch=3, **kw))
    assert ParallelPlan().memory("llama-2-7b", seq_len=s, token_budget=8192).equals(
        estimate_memory(ParallelPlan(), "llama-2-7b", seq_len=s, token_budget=8192))


@pytest.mark.parametrize("kw, needle", [
    (dict(seq_len=4096, token_budget=4095), "token_budget=4095 is smaller than seq_len=4096"),
    (dict(micro_batch=2, token_budget=8192), "leave micro_batch=1"),
    (dict(token_budget=0), "token_budget=0 must be a positive integer"),
    (dict(token_budget=True), "token_budget=True must be a positive integer"),
])
def test_token_budget_errors_name_the_value(kw, needle):
    with pytest.raises(PlanError, match=needle):
        estimate_memory(ParallelPlan(), "llama-2-7b", **kw)


def test_token_budget_in_the_throughput_model_and_the_search():
    from dataclasses import replace

    from rlkit.plan.search import search_plans
    from rlkit.plan.throughput import estimate_throughput

    # dp=2 x 32 sequences of 4096, a budget of 3 sequences: ceil(32 / 3) = 11 micro-batches of
    # ceil(32 / 11) = 3 sequences in one flush; tokens/s counts the 64 x 4096 real tokens
    plan = ParallelPlan(dp=2, tp=8, pp=4, devices_per_node=8)
    r = estimate_throughput(plan, "llama-2-70b", seq_len=4096, global_batch=64, token_budget=3 * 4096 + 5)
    assert (r["micro_batches"], r["micro_batch"], r["tokens_per_step"]) == (11, 3, 64 * 4096)
    same = estimate_throughput(replace(plan, micro_batches=11), "llama-2-70b", seq_len=4096, global_batch=66,
                               micro_batch=3)
    assert r["step_s"] == same["step_s"] and r["bubble"] == same["bubble"] == 3 / (11 + 3)
    assert r["tokens_per_s"] == pytest.approx(64 * 4096 / same["step_s"])
    # the plan's count is a floor; interleaving rounds up to whole rounds of pp
    assert estimate_throughput(replace(plan, micro_batches=16), "llama-2-70b", seq_len=4096, global_batch=64,
                               token_budget=8192)["micro_batches"] == 16
    inter = replace(plan, vpp=2, micro_batches=4)
    assert estimate_throughput(inter, "llama-2-70b", seq_len=4096, global_batch=64,
                               token_budget=3 * 4096)["micro_batches"] == 12
    with pytest.raises(PlanError, match="leave micro_batch=1"):
        estimate_throughput(plan, "llama-2-70b", micro_batch=2, token_budget=8192)
    # the search runs every plan at the packer's count and sizes its memory with the budget
    df = search_plans("qwen2.5-7b", gpus=8, seq_len=4096, global_batch=64, token_budget=8192,
                      include_vpp=False, shardings=("full_shard",), recompute="none", sequence_parallel=False)
    assert df.attrs["token_budget"] == 8192
    for _, row in df[df.valid].iterrows():
        assert row.micro_batches == max(row.pp, 64 // row.dp // 2), row.to_dict()
        peak = estimate_memory(row.plan, "qwen2.5-7b", seq_len=4096, token_budget=8192)["total"].max()
        assert row.memory_gib * 2**30 == pytest.approx(peak), row.to_dict()


# ---- padding-free: the estimate against a measured packed micro-batch ---------------------------------
# Sequence lengths (a 4-token prompt, then the response) chosen by hand so that first-fit decreasing fills
# every row: each row is one sequence as wide as the longest, or two that add up to it. SHORT: 16 rows of
# 16 (24 sequences, responses 1..12 tokens); LONG: 8 rows of 32 (14 sequences, responses 1..28: the
# longest response 2.3x SHORT's). A budget of 128 tokens: 8 rows of 16 or 4 rows of 32 per micro-batch,
# 2 micro-batches each.
PROMPT, BUDGET = 4, 128
SHORT = [16, 16, 16, 16, 11, 5, 10, 6, 9, 7, 8, 8] * 2
LONG = [32, 32, 27, 5, 24, 8, 20, 12, 16, 16, 22, 10, 18, 14]
ACTIVATION_TOL = 0.10  # saved activations: the tolerance notebook 01 holds the padded estimate to


def _ragged_batch(lengths, seed=0):
    """Right-padded rows: ``PROMPT`` prompt tokens, then a response, ``lengths`` real tokens each, shuffled."""
    import torch

    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    width = max(lengths)
    ids = torch.randint(3, 500, (len(lengths), width), generator=g)
    am = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, i in enumerate(order):
        am[row, :lengths[i]] = 1
    return {"input_ids": ids * am, "attention_mask": am}


@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist

    from rlkit.parallel.dist import free_port, init_distributed

    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    init_distributed(timeout_s=30)
    yield
    dist.destroy_process_group()


def test_packed_activations_match_the_token_budget_estimate(world_of_one):
    """One rank trains packed with a token budget: the autograd-saved bytes of a packed micro-batch against
    ``estimate_memory(..., token_budget=)`` with the arguments ``python -m rlkit.parallel`` compares with
    (fp32, eager attention, gathered logits; activations + logits), for two batches whose longest response
    differs 2.3x; and both stay under the budget's bound that holds whatever the longest sequence (one row
    as wide as the budget)."""
    from rlkit.models import tiny_lm
    from rlkit.parallel import ParallelModel

    pm = ParallelModel(tiny_lm("qwen2", size="test"), ParallelPlan())
    pm.set_packing(True, token_budget=BUDGET)

    def estimate(width):
        est = estimate_memory(ParallelPlan(), pm.config, seq_len=width, token_budget=BUDGET, precision="fp32",
                              optimizer="adamw", gathered_logits=True, flash_attention=False)
        return int(est.activations[0] + est.logits[0])

    bound = estimate(BUDGET)
    measured = {}
    for name, lengths in (("short", SHORT), ("long", LONG)):
        width = max(lengths)
        got = pm.measure_activations(_ragged_batch(lengths))
        est = estimate(width)
        cmp = compare_memory(pd_frame(activations=est), pd_frame(activations=got))
        print(f"{name}: width {width}, {BUDGET // width} rows: measured {got} B, estimate {est} B, "
              f"rel err {cmp.activations_rel_err[0]:+.3f}; budget bound {bound} B")
        assert abs(cmp.activations_rel_err[0]) <= ACTIVATION_TOL, (name, got, est)
        assert got <= bound, (name, got, bound)
        measured[name] = got
    # at a fixed budget the tokens stay; only eager attention's scores grow (rows x width^2 = budget x
    # width): the measured growth stays within the estimate's (its s^2 term, 5 x 2 bytes per score in
    # fp32, is an upper bound: without attention dropout torch saves the 4-byte softmax output only)
    assert measured["long"] - measured["short"] <= estimate(max(LONG)) - estimate(max(SHORT))


def pd_frame(**cols):
    import pandas as pd

    return pd.DataFrame({"rank": [0], **{k: [v] for k, v in cols.items()}})


def test_recompute_mode_errors_name_the_value():
    with pytest.raises(PlanError, match="recompute='some'.*none.*selective.*full"):
        estimate_memory(ParallelPlan(), "llama-2-7b", recompute="some")
    with pytest.raises(PlanError, match="contradicts"):
        estimate_memory(ParallelPlan(), "llama-2-7b", recompute="none", activation_checkpointing=True)


def test_peak_memory_is_the_largest_rank_of_the_full_table():
    from rlkit.plan.memory import peak_memory

    # uneven TP (9 heads over 3... vocab), uneven FSDP shards (dp=5), pipeline stages and a rollout
    cases = [(ParallelPlan(dp=5, tp=2), "qwen2.5-7b", {}),
             (ParallelPlan(pp=6, micro_batches=12), "llama-2-7b", {}),   # uneven: 32 layers over 6 stages
             (ParallelPlan(pp=5, vpp=2, micro_batches=10), "qwen2.5-0.5b", dict(flash_attention=False)),
             (ParallelPlan(dp=2, tp=2, pp=3), "qwen2.5-0.5b", dict(rollout=dict(tp=2, max_tokens=4096))),
             (ParallelPlan(dp=6, pp=2, dp_shard="hybrid_shard", dp_shard_size=3), "llama-2-7b",
              dict(recompute="full", roles=("actor", "reference")))]
    for plan, model, kw in cases:
        df = estimate_memory(plan, model, device_memory="80GB", **kw)
        peak = peak_memory(plan, model, device_memory="80GB", **kw)
        assert peak["peak"] == df["total"].max(), plan.describe()
        assert df[df.pp == peak["stage"]]["total"].max() == peak["peak"]
        assert peak["fits"] == bool(df["fits"].all())


def test_pipeline_in_flight_micro_batches():
    s, b, h, a = 2048, 1, 4096, 32
    per_layer = s * b * h * 34 + 5 * a * s * s * b
    # 1F1B, pp=4, m=8: stage r holds pp - r micro-batches of its 8 layers
    df = estimate_memory(ParallelPlan(pp=4, micro_batches=8), "llama-2-7b", flash_attention=False)
    assert df.activations.tolist() == [k * 8 * per_layer for k in (4, 3, 2, 1)]
    # GPipe holds all m
    g = estimate_memory(ParallelPlan(pp=4, micro_batches=8, schedule="gpipe"), "llama-2-7b", flash_attention=False)
    assert g.activations.tolist() == [8 * 8 * per_layer] * 4
    # interleaved 1F1B (vpp=2): the first stage holds pp(1 + (pp-1)/(pp*vpp)) = 5.5 micro-batches
    i = estimate_memory(ParallelPlan(pp=4, vpp=2, micro_batches=8), "llama-2-7b", flash_attention=False)
    assert i.activations[0] == 11 * 8 * per_layer // 2


def test_in_flight_agrees_with_the_simulated_schedule():
    from rlkit.plan.schedule import peak_in_flight, pipeline_timeline

    for plan in (ParallelPlan(pp=4, micro_batches=8), ParallelPlan(pp=4, micro_batches=2, schedule="gpipe"),
                 ParallelPlan(pp=4, vpp=2, micro_batches=8), ParallelPlan(pp=2, vpp=3, micro_batches=4)):
        df = estimate_memory(plan, "llama-2-7b", flash_attention=True)
        per_mb_rank = 34 * 2048 * 4096 * (32 // plan.pp)
        sim = peak_in_flight(pipeline_timeline(plan.pp, plan.n_micro_batches, plan.pipeline_schedule, plan.vpp))
        assert [a / per_mb_rank for a in df.activations] == pytest.approx(sim.tolist()), plan.describe()


def test_logits_buffer_on_last_stage():
    # micro_batch x seq x vocab/tp x 4 bytes, twice: the fp32 upcast and the log-softmax output
    V = 151936
    df = estimate_memory(ParallelPlan(pp=2), "qwen2.5-0.5b", seq_len=1024, micro_batch=2)
    assert df.logits.tolist() == [0, 2 * 1024 * V * 4 * 2]
    tp = estimate_memory(ParallelPlan(tp=2), "qwen2.5-0.5b", seq_len=1024, micro_batch=2)
    assert tp.logits.tolist() == [2 * 1024 * (V // 2) * 4 * 2] * 2
    one = estimate_memory(ParallelPlan(tp=2), "qwen2.5-0.5b", seq_len=1024, micro_batch=2, logits_copies=1,
                          gathered_logits=True)
    assert one.logits.tolist() == [2 * 1024 * V * 4] * 2


# ---- rollout ---------------------------------------------------------------------------------------
def test_rollout_kv_cache_budget():
    # llama-3-8b: 32 layers, 8 KV heads of 128: 2 x 32 x 8 x 128 x 2 bytes / tp=2 = 65536 B/token
    spec = ModelSpec.from_name("llama-3-8b")
    assert spec.kv_bytes_per_token(2, 2) == 65536
    ro = RolloutMemory(tp=2, max_tokens=100_000)
    df = estimate_memory(ParallelPlan(dp=4), spec, rollout=ro)
    assert df.kv_cache.tolist() == [65536 * 100_000] * 4
    # weights over the rollout tp: norms (2 per layer + final) whole, the rest halved, bf16
    norms = 32 * 2 * 4096 + 4096
    assert df.rollout_weights.tolist() == [2 * ((spec.num_params - norms) // 2 + norms)] * 4
    # "fill up to gpu_memory_utilization x device_memory": KV = 0.5 x 80e9 - the weights
    filled = estimate_memory(ParallelPlan(dp=4), spec, rollout=dict(tp=2, gpu_memory_utilization=0.5),
                             device_memory="80GB")
    assert (filled.kv_cache + filled.rollout_weights).tolist() == [40 * GB] * 4
    # train state + rollout add up unless the engine sleeps during training
    awake = filled.iloc[0]
    train = awake[["weights", "grads", "optimizer"]].sum()
    assert awake.total == train + awake[["param_buffers", "activations", "logits"]].sum() + 40 * GB
    asleep = estimate_memory(ParallelPlan(dp=4), spec, rollout=dict(tp=2, gpu_memory_utilization=0.5, sleep=True),
                             device_memory="80GB").iloc[0]
    assert asleep.total == train + max(awake[["param_buffers", "activations", "logits"]].sum(), 40 * GB)
    # KV heads are replicated when the rollout tp exceeds them (vLLM): 8 heads on tp=16 -> 1 each
    qwen = estimate_memory(ParallelPlan(dp=16), "qwen2.5-72b", rollout=RolloutMemory(tp=16, max_tokens=1))
    assert qwen.kv_cache[0] == 2 * 80 * 1 * 128 * 2


def test_rollout_needs_one_budget():
    with pytest.raises(PlanError, match="exactly one of max_tokens"):
        RolloutMemory()
    with pytest.raises(PlanError, match="needs device_memory"):
        estimate_memory(ParallelPlan(), "llama-3-8b", rollout=dict(gpu_memory_utilization=0.9))
    with pytest.raises(PlanError, match="gpu_memory_utilization=1.5"):
        RolloutMemory(gpu_memory_utilization=1.5)
    with pytest.raises(PlanError, match="rollout tp=3"):
        estimate_memory(ParallelPlan(dp=4), "llama-3-8b", rollout=dict(tp=3, max_tokens=1))


# the tiny llama of rlkit.models.tiny_lm("llama", size="test", vocab_size=256): 4 layers of 64, vocab 260
TINY_TEST = dict(model_type="llama", vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def test_rollout_shard_follows_the_generation_layout():
    # tp=4 generating with t_g=2: GenerationLayout gives training tp ranks 0, 1 generation shard 0 and
    # 2, 3 shard 1 (a rank's training chunk lies inside its generation chunk), not rank % 2. An odd
    # vocab (251 = 126 + 125 rows over 2) makes the two shards differ.
    model = dict(TINY_LLAMA, num_key_value_heads=4)
    spec = ModelSpec.from_config(model)
    df = estimate_memory(ParallelPlan(tp=4), model, precision="bf16", rollout=dict(tp=2, max_tokens=1))
    rest = spec.num_params - 2 * spec.vocab_size * spec.hidden_size  # layers and norms: even over 2
    norms = 3 * 2 * 48 + 48
    shard = [2 * ((rest - norms) // 2 + norms + 2 * rows * 48) for rows in (126, 125)]
    assert df.rollout_weights.tolist() == [shard[0], shard[0], shard[1], shard[1]]


def test_hybrid_engine_reuses_the_training_shard():
    plan = ParallelPlan(tp=2, pp=2)
    kw = dict(precision="fp32", seq_len=64)
    for tg in (1, 2):
        plain = estimate_memory(plan, TINY_TEST, rollout=dict(tp=tg, dtype="fp32", max_tokens=1000), **kw)
        hy = estimate_memory(plan, TINY_TEST, rollout=dict(tp=tg, dtype="fp32", max_tokens=1000, hybrid_engine=True),
                             **kw)
        # the generation shard is the same; the rank's training weights (all inside it) are not new
        assert (hy.rollout_weights + hy.weights).tolist() == plain.rollout_weights.tolist()
        assert hy.kv_cache.tolist() == plain.kv_cache.tolist() == [1000 * 1024 // tg] * 4
        persistent = hy.weights + hy.grads + hy.optimizer
        transient = hy.param_buffers + hy.activations + hy.logits
        # the shard lives only while generating, the KV cache throughout
        assert hy.total.tolist() == (persistent + hy.kv_cache + transient.combine(hy.rollout_weights, max)).tolist()
        asleep = estimate_memory(plan, TINY_TEST, rollout=dict(tp=tg, dtype="fp32", max_tokens=1000,
                                                               hybrid_engine=True, sleep=True), **kw)
        assert asleep.total.tolist() == (persistent + transient.combine(hy.rollout_weights + hy.kv_cache, max)).tolist()
    # t_g = 2 on rank 0 (stage 0, tp 0) adds stage 1's half: 2 layers' matrices / 2 + lm_head / 2 + norms
    assert hy.rollout_weights[0] == 4 * ((2 * 36864 + 260 * 64) // 2 + 2 * 128 + 64) == 182_016


def test_hybrid_engine_reuses_nothing_under_fsdp_or_a_cast():
    gen = estimate_memory(ParallelPlan(tp=2, pp=2), TINY_TEST, precision="fp32",
                          rollout=dict(tp=2, dtype="fp32", max_tokens=1)).rollout_weights.tolist()
    # FSDP: the rank keeps its FSDP shard and builds the whole generation shard beside it
    fsdp = estimate_memory(ParallelPlan(dp=2, tp=2, pp=2), TINY_TEST, precision="fp32",
                           rollout=dict(tp=2, dtype="fp32", max_tokens=1, hybrid_engine=True))
    assert fsdp.rollout_weights.tolist() == gen * 2
    # fp32 master weights, bf16 engine: the cast is a new copy
    cast = estimate_memory(ParallelPlan(tp=2, pp=2), TINY_TEST, precision="bf16-mixed",
                           rollout=dict(tp=2, dtype="bf16", max_tokens=1, hybrid_engine=True))
    assert cast.rollout_weights.tolist() == [g // 2 for g in gen]
    # peak_memory agrees with the table, uneven vocab included (ranks then reuse different amounts)
    from rlkit.plan.memory import peak_memory

    for plan, tg in ((ParallelPlan(tp=2, pp=3), 1), (ParallelPlan(dp=3, tp=2, dp_shard="replicate"), 2)):
        kw = dict(precision="bf16", rollout=dict(tp=tg, max_tokens=100, hybrid_engine=True))
        assert peak_memory(plan, TINY_LLAMA, **kw)["peak"] == estimate_memory(plan, TINY_LLAMA, **kw).total.max()


def test_hybrid_engine_needs_a_generation_layout():
    with pytest.raises(PlanError, match=r"Rollout\(tp=2\) divides tp\*pp=2 but not the training tp=1"):
        estimate_memory(ParallelPlan(pp=2), TINY_TEST, rollout=dict(tp=2, max_tokens=1, hybrid_engine=True))
    # the same rollout as a separate engine (consecutive ranks) is fine
    estimate_memory(ParallelPlan(pp=2), TINY_TEST, rollout=dict(tp=2, max_tokens=1))
    with pytest.raises(PlanError, match="hybrid_engine='yes' must be True or False"):
        RolloutMemory(tp=2, max_tokens=1, hybrid_engine="yes")


# ---- fit ---------------------------------------------------------------------------------------------
def test_fits_and_explain():
    ok = estimate_memory(ParallelPlan(dp=8), "llama-2-7b", flash_attention=True, device_memory="80GB")
    assert ok.fits.all() and ok.attrs["device_memory"] == 80 * GB
    assert explain_fit(ok).startswith("All 8 ranks fit in 74.51 GiB")
    state = estimate_memory(ParallelPlan(dp=2, dp_shard="replicate"), "llama-2-13b", device_memory="80GiB",
                            activation_checkpointing=True, flash_attention=True)
    assert not state.fits.any()
    text = explain_fit(state)
    assert "2 of 2 ranks do not fit in 80.00 GiB" in text and "rank 0 (dp=0, tp=0, pp=0)" in text
    assert "optimizer dominates" in text and "dp_shard='full_shard'" in text
    acts = estimate_memory(ParallelPlan(dp=8), "llama-2-13b", seq_len=8192, device_memory="80GiB",
                           flash_attention=False)
    assert "activations dominates" in explain_fit(acts) and "recompute='selective'" in explain_fit(acts)
    assert "Pass device_memory" in explain_fit(estimate_memory(ParallelPlan(), "qwen2.5-0.5b"))


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 TB") == 1_500_000_000_000
    assert parse_bytes("512mib") == 512 * 2**20
    assert parse_bytes(1e9) == 10**9 and parse_bytes(4096) == 4096
    for bad in ("80XB", "lots", "-1GB", 0, -5, True):
        with pytest.raises(PlanError):
            parse_bytes(bad)


def test_compare_memory_side_by_side():
    import pandas as pd

    est = estimate_memory(ParallelPlan(dp=2), TINY_LLAMA, precision="fp32")
    measured = pd.DataFrame({"rank": [0, 1], "weights": [est.weights[0], est.weights[1] * 2],
                             "grads": [0, est.grads[1]], "optimizer": est.optimizer.tolist()})
    cmp = compare_memory(est, measured)
    assert list(cmp.columns[:4]) == ["rank", "weights_estimate", "weights_measured", "weights_rel_err"]
    assert cmp.weights_rel_err.tolist() == [0.0, -0.5]
    assert cmp.grads_rel_err[0] == float("inf") and cmp.grads_rel_err[1] == 0.0
    assert (cmp.optimizer_rel_err == 0).all()
    with pytest.raises(PlanError, match="rank"):
        compare_memory(est, measured.drop(columns="rank"))


# ---- speed and errors ------------------------------------------------------------------------------------
def test_512_ranks_one_row_each():
    # (its speed is measured in bench/bench_search.py, not asserted here)
    plan = ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8)
    df = estimate_memory(plan, "llama-3-70b", roles=("actor", "reference"), device_memory="80GB",
                         rollout=RolloutMemory(tp=8, gpu_memory_utilization=0.4))
    assert len(df) == 512 and df["rank"].tolist() == list(range(512))
    # ranks of one pipeline stage are identical here (every split is even)
    assert df.groupby("pp").total.nunique().eq(1).all()
    # rows follow the plan's coordinates
    assert all(df.loc[r, ["dp", "tp", "pp"]].tolist() == list(plan.coords(r).values()) for r in (0, 9, 77, 511))


@pytest.mark.parametrize("kw, needle", [
    (dict(seq_len=-1), "seq_len=-1"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(precision="fp16"), "precision='fp16'"),
    (dict(optimizer="lion"), "optimizer='lion'"),
    (dict(roles=("actor", "judge")), "judge"),
    (dict(device_memory="80XB"), "80XB"),
    (dict(rollout=dict(tp=2, max_tokens=1, bogus=1)), "bogus"),
])
def test_bad_inputs_name_the_value(kw, needle):
    with pytest.raises(PlanError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        estimate_memory(ParallelPlan(dp=2), "qwen2.5-0.5b", **kw)


def test_plan_that_does_not_fit_the_model_is_rejected():
    with pytest.raises(PlanError, match="tp=3"):
        estimate_memory(ParallelPlan(tp=3), "llama-2-7b")


# ---- the torch check (slow: real processes) ------------------------------------------------------------
TORCH_CASES = [
    dict(plan=dict(dp=3), config=TINY_LLAMA),                                       # FSDP2 padding, 3 ranks
    dict(plan=dict(dp=2, tp=2), config=TINY_QWEN_TIED),                             # FSDP2 x TP, uneven vocab
    dict(plan=dict(dp=2, pp=2), config=TINY_QWEN_TIED),                             # PP, tied copy on last stage
    dict(plan=dict(dp=4, dp_shard="hybrid_shard", dp_shard_size=2), config=TINY_LLAMA),  # HSDP
]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c["plan"].items()))
def test_torch_fsdp2_tp_pp_bytes_match_estimate(case, tmp_path):
    """Spawn one process per rank (gloo), build the stage with real fully_shard / parallelize_module,
    run forward + backward + AdamW.step in fp32, and compare the unique storages per rank."""
    import pandas as pd

    plan = ParallelPlan(**case["plan"])
    env = {**os.environ, "WORLD_SIZE": str(plan.world_size), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(case), str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(plan.world_size)]
    try:
        outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    measured = pd.DataFrame([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(plan.world_size)])
    est = estimate_memory(plan, case["config"], precision="fp32", optimizer="adamw")
    cmp = compare_memory(est, measured)
    for col in ("weights", "grads", "optimizer"):
        assert (cmp[f"{col}_rel_err"] == 0).all(), cmp.to_string()
    # AdamW keeps a 0-dim fp32 step per parameter tensor, not counted in `optimizer`
    assert measured.param_tensors.tolist() == est.param_tensors.tolist() == measured.steps.tolist()


def _torch_worker(case: dict, out_dir: str) -> None:  # pragma: no cover - runs in subprocesses
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    class Stage(nn.Module):
        def __init__(self, hf, layers, first, last):
            super().__init__()
            self.embed = hf.model.embed_tokens if first else None
            self.layers = nn.ModuleList(hf.model.layers[i] for i in layers)
            self.norm = hf.model.norm if last else None
            self.head = hf.lm_head if last else None
            self.rotary = [hf.model.rotary_emb]  # buffers only, kept out of the module tree

        def forward(self, x):
            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1])[None]
            pe = self.rotary[0](h, position_ids=pos)
            mask = torch.full((h.shape[1],) * 2, torch.finfo(h.dtype).min).triu(1)[None, None]
            for layer in self.layers:
                out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h)) if self.head is not None else h

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    plan = ParallelPlan(**case["plan"])
    cfg = dict(case["config"])
    cls = LlamaConfig if cfg.pop("model_type") == "llama" else Qwen2Config
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**cfg), attn_implementation="eager").float()
    S = plan.dp_shard_degree
    mesh = init_device_mesh("cpu", (plan.pp, plan.dp // S, S, plan.tp), mesh_dim_names=("pp", "rep", "shard", "tp"))
    c = plan.coords(rank)
    first, last = c["pp"] == 0, c["pp"] == plan.pp - 1
    stage = Stage(hf, plan.layers_of_rank(rank, hf.config.num_hidden_layers), first, last)
    if plan.tp > 1:
        styles = {}
        for i in range(len(stage.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                styles[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                styles[f"layers.{i}.{name}"] = RowwiseParallel()
        if first:
            styles["embed"] = RowwiseParallel(input_layouts=Replicate())
        if last:
            styles["head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(stage, mesh["tp"], styles)
        if first and last and hf.config.tie_word_embeddings:  # the layout rlkit builds: one tied shard
            stage.head.weight = stage.embed.weight
    dp_mesh = mesh["rep", "shard"] if plan.dp_shard in ("hybrid_shard", "replicate") else mesh["shard"]
    for layer in stage.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=plan.dp_shard != "shard_grad_op")
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(0, hf.config.vocab_size, (2, 8), generator=g) if first
         else torch.randn(2, 8, hf.config.hidden_size, generator=g))
    stage(x).float().pow(2).mean().backward()
    opt.step()

    def nbytes(tensors):
        seen = {}
        for t in tensors:
            st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(v for k, v in seen.items() if v)

    params = list(stage.parameters())
    row = dict(rank=rank, weights=nbytes(params), grads=nbytes(p.grad for p in params if p.grad is not None),
               optimizer=nbytes(v for p in params for k, v in opt.state[p].items() if k != "step"),
               param_tensors=len(params), steps=sum("step" in opt.state[p] for p in params))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _torch_worker(json.loads(sys.argv[1]), sys.argv[2])
