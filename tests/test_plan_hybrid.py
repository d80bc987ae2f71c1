"""rlkit.plan.comm.estimate_resharding: the 3D-HybridEngine's resharding bytes per rank, counted from the
tensor shapes, against hand counts, against HybridFlow's closed form, and against what
``rlkit.parallel.relayout.Resharder`` measured on real gloo process groups (recorded below)."""

from __future__ import annotations

import pytest

from rlkit.errors import PlanError
from rlkit.plan import ModelSpec, ParallelPlan, RolloutMemory, estimate_memory, estimate_resharding
from rlkit.plan.comm import estimate_communication

# rlkit.models.tiny_lm("llama", size="test", vocab_size=256, tie_word_embeddings=False): the tokenizer's
# byte alphabet and 4 specials make the vocabulary 260
TINY = dict(model_type="llama", vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
TINY_TIED = dict(TINY, tie_word_embeddings=True)
# its parts, in elements: a decoder layer's matrices (q 64x64, k and v 32x64, o 64x64, gate/up/down
# 128x64) and its two norms, one vocab matrix, the final norm
LAYER, NORMS, VOCAB, FINAL = 4096 + 2 * 2048 + 4096 + 3 * 8192, 2 * 64, 260 * 64, 64
M = 4 * (4 * (LAYER + NORMS) + 2 * VOCAB + FINAL)  # fp32 bytes
FORMULA_TOLERANCE = 0.01  # exact vs HybridFlow's closed form, for models whose stages are alike


def received(plan, tg, model=TINY, **kw):
    return estimate_resharding(plan, model, tg, **kw).received_bytes.tolist()


def test_tiny_model_bytes_and_layout_columns():
    assert M == 4 * ModelSpec.from_config(TINY).num_params == 725_248
    df = estimate_resharding(ParallelPlan(tp=2, pp=2), TINY, rollout_tp=2)
    assert df.attrs["model_bytes"] == M and df.attrs["micro_dp"] == 2 and df.attrs["engines"] == 2
    # HybridFlow's strided grouping: ranks 0, 1 (tp 0, 1 of stage 0) form engine 0
    assert df[["rank", "dp", "tp", "pp", "gen_group", "gen_tp"]].values.tolist() == [
        [0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 1], [2, 0, 0, 1, 1, 0], [3, 0, 1, 1, 1, 1]]


def test_tp2_pp2_to_one_engine_per_rank_hand_counted():
    # t_g = 1, k = 2: every rank gathers the whole model inside its micro-DP group of 4. Per stage
    # (2 layers each): stage 0 also has the embedding, stage 1 the final norm and lm_head.
    sharded = [2 * LAYER + VOCAB, 2 * LAYER + VOCAB]        # TP-split elements per stage
    replicated = [2 * NORMS, 2 * NORMS + FINAL]             # norms, whole on every TP rank
    other_stage = [sharded[1] + replicated[1], sharded[0] + replicated[0]]
    want = []
    for p in (0, 1):
        for t in (0, 1):
            # all of the other stage, the other TP rank's half of its own stage's matrices, and its own
            # stage's norms again unless it is their source (the first owner-stage member, t = 0)
            want.append(4 * (other_stage[p] + sharded[p] // 2 + (replicated[p] if t else 0)))
    assert want == [543_488, 544_512, 543_232, 544_512]
    df = estimate_resharding(ParallelPlan(tp=2, pp=2), TINY, 1)
    assert df.received_bytes.tolist() == want
    assert df.broadcast_bytes.tolist() == want and df.fsdp_gather_bytes.tolist() == [0] * 4
    assert df.generation_param_bytes.tolist() == [M] * 4  # the training shard was released into it


def test_tp2_pp2_to_tp2_engines_hand_counted():
    # t_g = 2, k = 1: a rank's training shard is its generation shard's own-stage part; it receives
    # the other stage's half (its TP index) and that stage's norms
    sharded = [2 * LAYER + VOCAB, 2 * LAYER + VOCAB]
    replicated = [2 * NORMS, 2 * NORMS + FINAL]
    want = [4 * (sharded[1 - p] // 2 + replicated[1 - p]) for p in (0, 1) for _t in (0, 1)]
    assert want == [182_016, 182_016, 181_760, 181_760]
    df = estimate_resharding(ParallelPlan(tp=2, pp=2), TINY, 2)
    assert df.received_bytes.tolist() == want
    gen_shard = 4 * (sum(sharded) // 2 + sum(replicated))
    assert df.generation_param_bytes.tolist() == [gen_shard] * 4 == [363_776] * 4


def test_fsdp_first_gathers_the_tp_shard_inside_the_dp_group():
    # dp=2 full_shard: the owner stage's TP-local piece is all-gathered over S = 2 first (half of it
    # arrives), then resharded as without FSDP; the FSDP shard stays allocated while generating
    plan = ParallelPlan(dp=2, tp=2, pp=2, dp_shard="full_shard")
    tp_local = [2 * (LAYER // 2 + NORMS) + VOCAB // 2, 2 * (LAYER // 2 + NORMS) + FINAL + VOCAB // 2]
    for tg in (1, 2):
        df = estimate_resharding(plan, TINY, tg)
        flat = estimate_resharding(ParallelPlan(tp=2, pp=2), TINY, tg)
        for r in range(8):
            c = plan.coords(r)
            twin = flat.iloc[ParallelPlan(tp=2, pp=2).rank(tp=c["tp"], pp=c["pp"])]
            assert df.fsdp_gather_bytes[r] == 4 * tp_local[c["pp"]] // 2
            assert df.received_bytes[r] == twin.received_bytes + 4 * tp_local[c["pp"]] // 2
            assert df.generation_param_bytes[r] == twin.generation_param_bytes + 4 * tp_local[c["pp"]] // 2
    # Megatron's layout (DDP over dp): nothing to gather, the DP replicas reshard alike
    rep = estimate_resharding(ParallelPlan(dp=2, tp=2, pp=2, dp_shard="replicate"), TINY, 2)
    assert rep.received_bytes.tolist() == [182_016] * 4 + [181_760] * 4


# What rlkit.parallel.relayout.Resharder measured (stats["bytes"], stats["param_bytes"]) on every rank of
# the tiny model above, fp32 on gloo, one reshard per (plan, t_g): the estimate is exact.
MEASURED = {
    ("1x2x2", 1): ([543488, 544512, 543232, 544512], [725248] * 4),
    ("1x2x2", 2): ([182016, 182016, 181760, 181760], [363776] * 4),
    ("2x2x2:replicate", 1): ([543488, 544512] * 2 + [543232, 544512] * 2, [725248] * 8),
    ("2x2x2:replicate", 2): ([182016] * 4 + [181760] * 4, [363776] * 8),
    ("2x2x2:full_shard", 1): ([634368, 635392] * 2 + [634240, 635520] * 2, [816128] * 4 + [816256] * 4),
    ("2x2x2:full_shard", 2): ([272896] * 4 + [272768] * 4, [454656] * 4 + [454784] * 4),
}
# tied embeddings, pp=2: one vocab matrix resharded, the last stage's copy training-only (kept allocated)
MEASURED_TIED = {
    ("1x2x2", 1): ([476928, 477952, 509952, 511232], [658688, 658688, 691968, 691968]),
    ("1x2x2", 2): ([148736, 148736, 181760, 181760], [330496, 330496, 363776, 363776]),
    ("2x1x2:full_shard", 1): ([477440, 477440, 510592, 510592], [839936, 839936, 840064, 840064]),
}


def _plan(name: str) -> ParallelPlan:
    dims, _, shard = name.partition(":")
    dp, tp, pp = (int(x) for x in dims.split("x"))
    return ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=shard or "full_shard")


@pytest.mark.parametrize("model, table", [(TINY, MEASURED), (TINY_TIED, MEASURED_TIED)], ids=["untied", "tied"])
def test_matches_the_resharder_measured_on_gloo(model, table):
    for (name, tg), (got_bytes, got_params) in table.items():
        df = estimate_resharding(_plan(name), model, tg)
        assert df.received_bytes.tolist() == got_bytes, (name, tg)
        assert df.generation_param_bytes.tolist() == got_params, (name, tg)


@pytest.mark.parametrize("model", [TINY, "llama-2-7b", "qwen2.5-7b"])
@pytest.mark.parametrize("plan", [ParallelPlan(tp=2, pp=2), ParallelPlan(dp=2, tp=2, pp=2),
                                  ParallelPlan(dp=2, tp=2, pp=2, dp_shard="replicate"),
                                  ParallelPlan(dp=4, tp=2, pp=2, dp_shard="hybrid_shard", dp_shard_size=2)])
def test_close_to_hybridflow_closed_form(model, plan):
    # untied, pp=2: the two stages differ only by embedding vs final norm + lm_head, so the exact counts
    # differ from (tp*pp - t_g)/(t_g*tp*pp) M (- M/(tp*pp*S) with FSDP) by the replicated norms alone
    for tg in (1, 2):
        df = estimate_resharding(plan, model, tg)
        for col, formula in (("received_bytes", "received_formula"), ("generation_param_bytes", "param_formula")):
            err = ((df[col] - df[formula]).abs() / df[formula]).max()
            assert err <= FORMULA_TOLERANCE, (plan.describe(), tg, col, err)


def test_large_plan_exact_counts_are_cheap_and_consistent():
    # 512 ranks: a row each; ranks of one (pp, tp) receive alike, and the busiest stage's rows in
    # plan.communication(rollout_tp=) are the largest of estimate_resharding's
    plan = ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8, micro_batches=16)
    df = estimate_resharding(plan, "llama-3-70b", 2, dtype="bf16", devices_per_node=8)
    assert len(df) == 512 and df.groupby(["pp", "tp"]).received_bytes.nunique().max() == 1
    assert df.link.unique().tolist() == ["inter"]  # a micro-DP group spans every stage: all nodes
    assert df.seconds.max() == pytest.approx(df.received_bytes.max() / 50e9)  # the IB preset
    comm = estimate_communication(plan, "llama-3-70b", precision="bf16", rollout_tp=2, global_batch=64)
    stage = comm.attrs["stage"]
    sync = comm[comm.dim == "reshard"]
    assert sync.bytes_per_step.sum() == df[df.pp == stage].received_bytes.max()


def test_plan_communication_adds_one_weight_sync():
    plan = ParallelPlan(dp=2, tp=2, pp=2)
    base = plan.communication(TINY, precision="fp32", stage=0)
    assert "reshard" not in base.dim.tolist()
    df = plan.communication(TINY, precision="fp32", stage=0, rollout_tp=1)
    sync = df[df.dim == "reshard"].set_index("collective")
    exact = estimate_resharding(plan, TINY, 1)
    worst = exact[exact.pp == 0].loc[exact[exact.pp == 0].received_bytes.idxmax()]
    assert sync.loc["all-gather (dp)"].bytes_per_step == worst.fsdp_gather_bytes
    assert sync.loc["broadcast (micro-dp)"].bytes_per_step == worst.broadcast_bytes
    assert sync.loc["broadcast (micro-dp)"].group_size == 4
    # a broadcast per replicated tensor, k = 2 per sharded one, over the whole model's 4 x 9 + 3 tensors
    assert sync.loc["broadcast (micro-dp)"].calls_per_step == 4 * (7 * 2 + 2) + 2 * 2 + 1
    assert sync.loc["all-gather (dp)"].calls_per_step == 2 * 9 + 1  # stage 0's own tensors
    assert df.attrs["total_time_s"] == pytest.approx(df.time_s.sum())


def test_memory_hybrid_engine_adds_only_what_the_rank_lacks():
    # without FSDP, in the training dtype, the rank's rollout weights = its generation shard minus its
    # training shard: what estimate_resharding says it holds while generating, minus its weights
    plan = ParallelPlan(tp=2, pp=2)
    for tg in (1, 2):
        ro = RolloutMemory(tp=tg, dtype="fp32", max_tokens=1000, hybrid_engine=True)
        mem = estimate_memory(plan, TINY, precision="fp32", rollout=ro, seq_len=64)
        gen = estimate_resharding(plan, TINY, tg)
        assert (mem.rollout_weights + mem.weights).tolist() == gen.generation_param_bytes.tolist()
        # KV cache of a t_g-way engine: 2 x 4 layers x 32 (2 KV heads of 16) x 4 bytes / t_g per token
        assert mem.kv_cache.tolist() == [1000 * 2 * 4 * 32 * 4 // tg] * 4


def test_bad_rollout_tp_is_a_clear_error():
    with pytest.raises(PlanError, match=r"Rollout\(tp=3\) does not divide tp\*pp=4"):
        estimate_resharding(ParallelPlan(tp=2, pp=2), TINY, 3)
    with pytest.raises(PlanError, match=r"Rollout\(tp=0\) must be a positive integer; choose tp in \{1, 2\}"):
        estimate_resharding(ParallelPlan(tp=2), TINY, 0)
    with pytest.raises(PlanError, match=r"tp=4 does not divide num_key_value_heads=2"):
        estimate_resharding(ParallelPlan(tp=4), TINY, 2)  # the training plan itself is checked first
    odd = dict(TINY, vocab_size=259)  # an uneven vocab split: fine when t_g is 1 or the training tp
    assert len(estimate_resharding(ParallelPlan(tp=2), odd, 1)) == 2
    wide = dict(odd, num_attention_heads=8, num_key_value_heads=4)  # ... but not in between
    with pytest.raises(PlanError, match=r"vocab_size=259 does not divide by 4.*choose tp in \{1, 4\}"):
        estimate_resharding(ParallelPlan(tp=4), wide, 2)
    with pytest.raises(PlanError, match="dtype='fp31'"):
        estimate_resharding(ParallelPlan(tp=2), TINY, 1, dtype="fp31")
    with pytest.raises(PlanError, match="plan="):
        estimate_resharding("tp=2", TINY, 1)
