"""The Megatron-Core backend on transformers' Qwen3-MoE (``tiny_lm("qwen3_moe")``: 4 layers, 8 experts, top-2,
norm_topk_prob, q/k RMSNorm) with Megatron's MoELayer, against the single-process HF model.

``ParallelPlan(dp=2, ep=2, dp_shard="replicate")`` on 2 gloo ranks: each rank holds 4 of each layer's 8
experts, tokens reach them through the alltoall dispatcher (CPU shim: ``shim.install_moe``). The check is the
dense backend's (``python -m rlkit.backends.megatron.check``, ``run_layout`` of test_backend_megatron.py, the
same tolerances): log-probs, entropy, loss, every gradient by HF name, grad norm, weights after 3 clipped AdamW
steps at lr=1e-3, the full-weight gather (experts gathered over EP) strict-loaded into a fresh HF model, and
save -> load -> continue bit-exact.

Measured here (megatron-core 0.16.1, torch 2.13 CPU, transformers 5.25): ep=2: log-probs 4.8e-7, entropy
2.4e-6, grads 1.1e-7, weights 3.5e-6, loss 4.5e-8, grad norm 1.5e-7 relative, resume 0.0; ep=1 (one rank):
4.8e-7, 2.4e-6, 1.9e-7, 3.7e-6; pp=2: 4.8e-7, 2.4e-6, 1.1e-7, 4.4e-7. norm_topk_prob=False (Megatron's pre-softmax routing), one rank: 4.8e-7,
2.9e-6, 2.1e-7, 8.7e-7; with the routing flag flipped the same check measured log-probs 1.4e-2, grads 5.4e-2
(the check sees a routing mismatch).
"""

from __future__ import annotations

import pytest
from _require import need_module

need_module("megatron.core", "RLKIT_REQUIRE_BACKENDS")

from test_backend_megatron import run_layout  # noqa: E402

from rlkit import ParallelPlan  # noqa: E402
from rlkit.backends import CAPABILITIES, check_backend  # noqa: E402
from rlkit.backends.families import check_experts, check_family, transformer_config_kwargs  # noqa: E402
from rlkit.errors import PlanError  # noqa: E402
from rlkit.models import tiny_lm  # noqa: E402


@pytest.fixture(scope="module")
def moe_path():
    return tiny_lm("qwen3_moe", size="test")


def test_ep2_matches_hf_and_resumes_bit_exact(tmp_path, moe_path):
    rep = run_layout(tmp_path, moe_path, 2, "--dp", "2", "--ep", "2", ckpt=True)
    assert rep["experts_per_rank"] == 4, rep  # 8 experts split over ep=2
    assert rep["transfer_bytes"] > 0  # the other rank's experts came over the wire for the full weights
    assert "ep=2" in rep["plan"]


@pytest.mark.slow  # 30 s on 2 cores; ep=2 above covers the same conversion and more
def test_one_rank_matches_hf(tmp_path, moe_path):
    rep = run_layout(tmp_path, moe_path, 1)
    assert rep["experts_per_rank"] == 8, rep


@pytest.mark.slow  # 60 s: the MoE layers split over two pipeline stages (experts whole on each)
def test_pp2_matches_hf(tmp_path, moe_path):
    rep = run_layout(tmp_path, moe_path, 2, "--pp", "2")
    assert rep["experts_per_rank"] == 8, rep


@pytest.mark.slow
def test_unnormalised_top_k_matches_hf(tmp_path):
    # norm_topk_prob=False maps to Megatron's pre-softmax routing (softmax over all experts, top-k, kept as is)
    rep = run_layout(tmp_path, tiny_lm("qwen3_moe", size="test", norm_topk_prob=False), 1)
    assert rep["experts_per_rank"] == 8, rep


def test_moe_config_and_refusals():
    from transformers import LlamaConfig, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64)
    check_family(cfg)
    kw = transformer_config_kwargs(cfg)
    assert (kw["num_moe_experts"], kw["moe_router_topk"], kw["moe_ffn_hidden_size"], kw["qk_layernorm"]) == (8, 2, 64, True)
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_load_balancing_type"] == "none"
    assert transformer_config_kwargs(Qwen3MoeConfig(norm_topk_prob=False))["moe_router_pre_softmax"] is True
    for bad, match in (({"mlp_only_layers": [1]}, "mlp_only_layers"), ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                       ({"attention_bias": True}, "attention_bias"), ({"use_sliding_window": True}, "sliding_window")):
        with pytest.raises(PlanError, match=match):
            check_family(Qwen3MoeConfig(**bad))
    plan = ParallelPlan(dp=2, ep=2, dp_shard="replicate")
    # Megatron splits the experts; the router's losses and routing replay are rlkit's MoE layer's (torch backend)
    assert CAPABILITIES["megatron"].expert_parallel and not CAPABILITIES["megatron"].router_losses
    assert check_backend("megatron", plan, cfg).name == "megatron"
    with pytest.raises(PlanError, match="cannot run ep=2: it has no expert parallelism"):
        check_backend("deepspeed", plan)
    with pytest.raises(PlanError, match="model_type='llama' has none"):
        check_backend("megatron", plan, LlamaConfig())
    with pytest.raises(PlanError, match="does not divide num_experts=8"):
        check_experts(cfg, 3)
    with pytest.raises(PlanError, match="ep=2 does not divide dp=3"):
        ParallelPlan(dp=3, ep=2)


def test_moe_under_tp_is_refused(moe_path):
    from rlkit.backends.megatron import MegatronModel

    with pytest.raises(PlanError, match="mixture-of-experts model at tp=1"):  # before any process group or Megatron state is touched
        MegatronModel(moe_path, ParallelPlan(tp=2))


@pytest.mark.ray
@pytest.mark.slow  # ~40 s (Ray workers): the Trainer's path, beside the equivalence check above
def test_trainer_runs_ep2_on_megatron_and_saves_a_loadable_folder(tmp_path, moe_path):
    """GRPO through the Trainer on Ray workers at dp=2 x ep=2: the HF engine is synced from the gathered experts
    every step, and ``save_pretrained`` writes a folder transformers loads, every weight moved."""
    import torch
    from transformers import AutoModelForCausalLM

    import rlkit

    start = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    with rlkit.Trainer(model=moe_path, dataset=rlkit.tasks.repeat, algorithm="grpo", backend="megatron",
                       plan=ParallelPlan(dp=2, ep=2, dp_shard="replicate"), padding_free=False,
                       rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=6), prompts_per_step=2, lr=1e-2,
                       seed=0, run_dir=str(tmp_path / "run")) as tr:
        df = tr.fit(steps=2, view="none")
        saved = tr.save_pretrained(tmp_path / "hf")
    assert (df["actor/grad_norm"] > 0).all(), df
    after = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, start.get_parameter(n))}
    assert moved == {n for n, _ in start.named_parameters()}, set(dict(start.named_parameters())) - moved
