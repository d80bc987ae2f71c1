"""The planner on mixture-of-experts models: parameter counts (total / active) of the bundled MoE configs
against their published numbers and transformers' own models, expert parallelism (``ParallelPlan(ep=...)``)
in the memory, communication and throughput models and in ``search_plans``, and the memory estimate held
against the torch runtime's measured bytes on the tiny Qwen3-MoE."""

from __future__ import annotations

import json

import pytest

from rlkit import PlanError
from rlkit.plan import ModelSpec, ParallelPlan, search_plans
from rlkit.plan.comm import estimate_communication
from rlkit.plan.memory import estimate_memory
from rlkit.plan.spec import CONFIG_DIR
from rlkit.plan.throughput import estimate_throughput

# Published totals / active parameters per token (model cards; DeepSeek-V3's 671B leaves out its 14B
# multi-token-prediction module, and its 37B the 0.9B input embedding, which ``active_params`` counts)
PUBLISHED_MOE = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "deepseek-v3": (671e9, 37e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_moe_counts_match_published(name):
    spec = ModelSpec.from_name(name)
    total, active = PUBLISHED_MOE[name]
    assert spec.is_moe
    assert abs(spec.num_params / total - 1) < 0.01, spec.num_params
    assert abs(spec.active_params / active - 1) < 0.02, spec.active_params
    # FLOPs follow the active parameters: 2 x (active matmul params), far below 2 x total
    assert spec.flops_per_token() < 2 * spec.active_params < spec.num_params


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"])
def test_moe_counts_match_transformers_on_meta_device(name):
    """Exact: the formula (MLA included) equals transformers' model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in json.loads((CONFIG_DIR / f"{name}.json").read_text()).items() if not k.startswith("_")}
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_config(config)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    for i in sorted({0, spec.num_layers - 1}):
        assert spec.layer_params_at(i) == sum(p.numel() for p in model.model.layers[i].parameters()), i


def test_sparse_layers_and_hand_counts():
    ds = ModelSpec.from_name("deepseek-v3")
    assert ds.dense_layers == (0, 1, 2) and len(ds.sparse_layers) == 58 and ds.n_shared_experts == 1
    assert ds.is_mla and ds.kv_bytes_per_token(2) == 61 * (512 + 64) * 2   # the compressed latent
    mix = ModelSpec.from_name("mixtral-8x7b")
    assert mix.moe_intermediate_size == mix.intermediate_size == 14336 and mix.dense_layers == ()
    h, e, i = 4096, 8, 14336
    assert mix.layer_params == (2 * h * h + 2 * h * 1024) + e * h + e * 3 * h * i + 2 * h
    # Qwen-MoE's rules: every decoder_sparse_step-th layer is sparse, except mlp_only_layers
    cfg = json.loads((CONFIG_DIR / "qwen3-30b-a3b.json").read_text())
    q = ModelSpec.from_config({**cfg, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert q.sparse_layers == (1, 5)
    assert q.num_params == (q.embedding_params + q.head_params + q.hidden_size
                            + sum(q.layer_params_at(i) for i in range(6)))
    assert q.layer_params_at(0) - q.layer_params_at(1) == q.mlp_params - q.moe_params
    # a dense model is untouched
    dense = ModelSpec.from_name("qwen2.5-7b")
    assert not dense.is_moe and dense.active_params == dense.num_params and dense.sparse_layers == ()


def test_ep_validation():
    with pytest.raises(PlanError, match="dense"):
        ParallelPlan(dp=2, ep=2).validate(model="qwen2.5-0.5b")
    with pytest.raises(PlanError, match="num_experts=8"):
        ParallelPlan(dp=6, ep=3).validate(model="mixtral-8x7b")
    with pytest.raises(PlanError, match="does not divide dp"):
        ParallelPlan(dp=4, ep=3)


def test_memory_expert_layout():
    """Experts under EP: E/ep whole experts per rank (no FSDP, no TP split), replicated over expert-DP;
    with ep == 1 they are FSDP-sharded over dp like the rest."""
    spec = ModelSpec.from_name("qwen3-30b-a3b")
    kw = dict(seq_len=1024, precision="fp32")
    experts = len(spec.sparse_layers) * spec.num_experts * spec.expert_params   # elements
    rest = spec.num_params - experts
    for dp, ep, tp in [(8, 8, 1), (8, 2, 1), (8, 4, 2), (4, 1, 1)]:
        df = estimate_memory(ParallelPlan(dp=dp, ep=ep, tp=tp), spec, **kw)
        w = int(df.weights.max()) / 4
        expect_experts = experts / ep if ep > 1 else experts / dp
        # the non-expert part: sharded over dp (attention also split over tp); allow FSDP padding
        assert expect_experts < w < expect_experts + rest / dp + 1e6 * spec.num_layers, (dp, ep, tp, w)
        assert int(df.optimizer.max()) == 2 * int(df.grads.max()) or ep == 1
    # more EP, fewer experts per rank; the same for every expert-DP replica
    per_ep = [int(estimate_memory(ParallelPlan(dp=8, ep=ep), spec, **kw).weights.max()) for ep in (1, 2, 4, 8)]
    assert per_ep[1] > per_ep[2] > per_ep[3]
    # the sparse layers' activations hold the dispatch buffers: more than a dense layer of the same model
    act = estimate_memory(ParallelPlan(dp=8, ep=8), spec, seq_len=4096).activations.max()
    dense = estimate_memory(ParallelPlan(dp=8), spec.__class__(**{**spec.to_dict(), "num_experts": 0,
                                                                  "num_experts_per_tok": 0}), seq_len=4096)
    assert act > dense.activations.max()
    # DeepSeek: the first stage holds the 3 dense layers; a peak over ranks is still a rank's total
    ds = estimate_memory(ParallelPlan(dp=16, ep=16, pp=4, tp=2), "deepseek-v3", seq_len=4096)
    assert len(ds) == 128 and ds.total.max() > 0


def test_communication_all_to_all_rows():
    spec = ModelSpec.from_name("qwen3-30b-a3b")
    s, m = 4096, 2
    df = estimate_communication(ParallelPlan(dp=8, ep=4, micro_batches=m), spec, seq_len=s)
    a2a = df[(df.dim == "ep") & (df.collective == "all-to-all")].iloc[0]
    n_sparse, k, h, cb = len(spec.sparse_layers), spec.num_experts_per_tok, spec.hidden_size, 2
    assert a2a.group_size == 4 and a2a.calls_per_step == 4 * n_sparse * m     # dispatch + combine, fwd + bwd
    assert a2a.bytes_per_call == s * k * h * cb
    assert a2a.bytes_per_step == round(4 * n_sparse * m * s * k * h * cb * 3 / 4)   # (ep - 1) / ep leaves
    edp = df[df.collective == "all-reduce (experts)"].iloc[0]
    assert edp.group_size == 2 and edp.bytes_per_call * edp.calls_per_step == n_sparse * (
        spec.num_experts // 4) * spec.expert_params * 4                              # fp32 grads
    # recomputing the forward repeats its two all-to-alls; ep == 1 and dense models have none
    full = estimate_communication(ParallelPlan(dp=8, ep=4, micro_batches=m), spec, seq_len=s, recompute="full")
    assert full[full.dim == "ep"].calls_per_step.iloc[0] == 6 * n_sparse * m
    assert "ep" not in set(estimate_communication(ParallelPlan(dp=8), spec, seq_len=s).dim)
    assert "ep" not in set(estimate_communication(ParallelPlan(dp=8), "qwen2.5-7b", seq_len=s).dim)


def test_throughput_active_flops_and_all_to_all_time():
    spec = ModelSpec.from_name("qwen3-30b-a3b")
    kw = dict(seq_len=4096, global_batch=64, devices_per_node=8)
    r1 = estimate_throughput(ParallelPlan(dp=8), spec, **kw)
    r8 = estimate_throughput(ParallelPlan(dp=8, ep=8), spec, **kw)
    assert r1["ep_comm_s"] == 0 and r8["ep_comm_s"] > 0
    assert r1["flops_per_token"] == 3 * spec.flops_per_token(4096)          # active, not total, params
    assert spec.flops_per_token(0) < 2 * spec.active_params


def test_search_plans_tries_ep_for_moe_only():
    df = search_plans("qwen3-30b-a3b", gpus=16, seq_len=4096, include_vpp=False, recompute="full")
    valid = df[df.valid]
    eps = set(valid.ep)
    assert eps > {1} and all(int(r.dp) % int(r.ep) == 0 and 128 % int(r.ep) == 0 for r in valid.itertuples())
    assert all(r.plan.ep == r.ep for r in valid.itertuples())
    dense = search_plans("qwen2.5-7b", gpus=8, seq_len=4096, include_vpp=False, recompute="full")
    assert set(dense.ep) == {1}


# The estimate against the torch runtime (tiny Qwen3-MoE, fp32, gloo) is asserted on the launches of
# tests/test_moe_parallel.py, which check the same layouts' numerics: weights, grads and AdamW state within 10%
# per rank, activations within 20%.
