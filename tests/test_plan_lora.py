"""The planner's LoRA model: adapter counts against peft, and weights / grads / optimizer per rank against
hand computations from the tiny Qwen2's shapes (h=64, i=128, 4 heads, 2 KV heads of 16, 4 layers, vocab 512,
q/k/v biases, untied), not from the code under test."""

from __future__ import annotations

import json
import re

import pytest

from rlkit.errors import PlanError
from rlkit.plan import LoraSpec, ParallelPlan, as_spec, lora_params, search_plans
from rlkit.plan.memory import estimate_memory, peak_memory
from rlkit.plan.spec import CONFIG_DIR

# ---- the tiny Qwen2 by hand ---------------------------------------------------------------------------
H, FF, Q, KV, L, V = 64, 128, 64, 32, 4, 512
# (out, in) of each projection; column-parallel q/k/v/gate/up, row-parallel o/down
LINEARS = {"q_proj": (Q, H), "k_proj": (KV, H), "v_proj": (KV, H), "o_proj": (H, Q),
           "gate_proj": (FF, H), "up_proj": (FF, H), "down_proj": (H, FF)}
LAYER = sum(o * i for o, i in LINEARS.values()) + 2 * H + (Q + 2 * KV)  # + 2 norms + q/k/v biases
EMBED = V * H
BASE = EMBED + L * LAYER + H + V * H  # embedding, layers, final norm, lm_head
FP32 = 4


@pytest.fixture(scope="module")
def tiny_config():
    from rlkit.models import load, tiny_lm

    hf, _ = load(tiny_lm("qwen2"))
    assert sum(p.numel() for p in hf.parameters()) == BASE  # the hand numbers are the model's
    return hf.config


def _peft_trainable(hf, cfg) -> int:
    from peft import inject_adapter_in_model

    inject_adapter_in_model(cfg, hf, low_cpu_mem_usage=next(hf.parameters()).is_meta)
    return sum(p.numel() for p in hf.parameters() if p.requires_grad)


# ---- adapter counts vs peft -----------------------------------------------------------------------------
PEFT_CASES = [
    dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    dict(r=3, target_modules="all-linear"),
    dict(r=2, target_modules=r".*\.mlp\.(up|down)_proj"),
    dict(r=5, target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
    dict(r=2, target_modules=["q_proj", "o_proj"], exclude_modules=["model.layers.1.self_attn.o_proj"]),
    dict(r=1, target_modules=["self_attn.k_proj", "model.layers.3.mlp.gate_proj"]),
]


@pytest.mark.parametrize("kw", PEFT_CASES, ids=lambda kw: f"r{kw['r']}-{kw['target_modules']}")
def test_lora_params_match_peft_on_the_tiny_model(kw, tiny_config):
    from peft import LoraConfig

    from rlkit.models import load, tiny_lm

    hf, _ = load(tiny_lm("qwen2"))
    cfg = LoraConfig(**kw)
    assert lora_params(tiny_config, cfg) == _peft_trainable(hf, cfg)


def test_int_rank_is_the_seven_projections_and_matches_peft(tiny_config):
    from peft import LoraConfig

    from rlkit.models import load, tiny_lm

    hf, _ = load(tiny_lm("qwen2"))
    n = _peft_trainable(hf, LoraConfig(r=4, target_modules=list(LINEARS)))
    assert lora_params(tiny_config, 4) == n == L * sum(4 * (o + i) for o, i in LINEARS.values())


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3-8b"])
def test_lora_params_match_peft_on_a_bundled_model_on_meta(name):
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    assert lora_params(name, cfg) == _peft_trainable(hf, cfg)
    assert lora_params(name, 16) == lora_params(name, cfg)  # the shorthand's projections are all of them


# ---- weights / grads / optimizer per rank, by hand -----------------------------------------------------
def _state(df) -> list[tuple[int, int, int, int]]:
    return [tuple(int(x) for x in row) for row in df[["weights", "grads", "optimizer", "param_tensors"]].values]


def test_dp2_full_shard_shards_adapters_with_fsdp_padding(tiny_config):
    from peft import LoraConfig

    # r=3: lora_A (3, in) splits 2 + 1 rows over 2 ranks, stored padded to 2 on both
    cfg = LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"])
    df = estimate_memory(ParallelPlan(dp=2, dp_shard="full_shard"), tiny_config, precision="fp32", lora=cfg,
                         seq_len=16)
    base = BASE // 2  # every base dim is even: half of each tensor
    padded = L * (2 * H + (Q // 2) * 3 + 2 * H + (KV // 2) * 3)  # A q, B q, A v, B v
    actual = [L * (rows * H + (Q // 2) * 3 + rows * H + (KV // 2) * 3) for rows in (2, 1)]
    assert _state(df) == [((base + padded) * FP32, padded * FP32, 2 * actual[j] * FP32, 4 * L) for j in (0, 1)]
    peak = peak_memory(ParallelPlan(dp=2), tiny_config, precision="fp32", lora=cfg, seq_len=16)["peak"]
    assert peak == int(df.total.max())


def test_tp2_splits_each_adapter_like_its_base(tiny_config):
    df = estimate_memory(ParallelPlan(tp=2), tiny_config, precision="fp32", lora=4, seq_len=16)
    r = 4
    replicated = L * 2 * H + H  # norms
    base = (BASE - replicated) // 2 + replicated  # vocab-parallel embedding and lm_head, split layers
    col = sum(r * i + (o // 2) * r for n, (o, i) in LINEARS.items() if n not in ("o_proj", "down_proj"))
    row = sum(r * (i // 2) + o * r for n, (o, i) in LINEARS.items() if n in ("o_proj", "down_proj"))
    adapters = L * (col + row)
    assert adapters == L * 2944
    assert _state(df) == [((base + adapters) * FP32, adapters * FP32, 2 * adapters * FP32, 14 * L)] * 2


@pytest.mark.parametrize("layers", [None, [0]])
def test_pp2_keeps_adapters_on_their_layers_stage(layers, tiny_config):
    from peft import LoraConfig

    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=layers)
    df = estimate_memory(ParallelPlan(pp=2), tiny_config, precision="fp32", lora=cfg, seq_len=16)
    one = 4 * (Q + H) + 4 * (KV + H)  # q and v adapters of one layer
    held = [2 * one, 2 * one] if layers is None else [one, 0]
    stage_base = [EMBED + 2 * LAYER, 2 * LAYER + H + V * H]
    tensors = [4 * n // one for n in held]
    assert _state(df) == [((stage_base[p] + held[p]) * FP32, held[p] * FP32, 2 * held[p] * FP32, tensors[p])
                          for p in (0, 1)]


def test_peak_memory_finds_the_rank_with_most_adapters():
    from peft import LoraConfig

    # 32 layers over pp=4, 8 each: adapters on rank 2's layers only (a middle rank with as many layers as
    # rank 1, so not one the layer counts single out), large enough to make it the peak under GPipe
    spec = as_spec("llama-2-7b")
    cfg = LoraConfig(r=512, target_modules=list(LINEARS), layers_to_transform=list(range(16, 24)))
    plan = ParallelPlan(pp=4, micro_batches=4, schedule="gpipe")
    df = estimate_memory(plan, spec, lora=cfg, precision="fp32")
    assert int(df.grads.idxmax()) == 2 and df.grads[[0, 1, 3]].eq(0).all() and int(df.total.idxmax()) == 2
    assert peak_memory(plan, spec, lora=cfg, precision="fp32")["peak"] == int(df.total.max())


def test_full_finetune_columns_are_unchanged_without_lora(tiny_config):
    plain = estimate_memory(ParallelPlan(dp=2, pp=2), tiny_config, precision="fp32", seq_len=16)
    assert _state(plain)[0][1] == _state(plain)[0][0]  # fp32: grads as large as weights
    assert plain.attrs["lora"] is None


def test_activations_keep_the_share_of_saved_tensors_a_frozen_base_needs(tiny_config):
    from peft import LoraConfig

    s, b, A = 32, 2, 4  # 4 heads; eager attention keeps the A x s probabilities per token
    kw = dict(seq_len=s, micro_batch=b, precision="fp32", flash_attention=False)

    def acts(**more):
        return int(estimate_memory(ParallelPlan(), tiny_config, **kw, **more).activations[0])

    per_layer = acts() // L
    # elements per token one layer saves, by hand. Full fine-tuning: two norms (input, normed, output:
    # 3H, + rsqrt), rotated q, k and v (repeat_kv copies the 2 KV heads to 4: Q each), probabilities,
    # attention output, gate / up outputs, SiLU, product
    full = 2 * (3 * H + 1) + 3 * Q + A * s + Q + 4 * FF
    # q and v adapted (r=4): no norm keeps normed, o_proj / gate+up / down_proj lose their inputs, two lora_B
    # keep lora_A(x); layer 0 (after the frozen embedding): no input norm, only q and v need grad so QK^T
    # keeps k but not the rotated q, and everything after the attention needs grad again
    qv = full - 2 * H - Q - H - FF + 2 * 4
    qv0 = (H + 2 * 4) + 2 * Q + A * s + (H + 1) + 3 * FF
    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    assert acts(lora=cfg) == 3 * (per_layer * qv // full) + per_layer * qv0 // full
    ckpt = dict(activation_checkpointing=True)
    assert acts(lora=cfg, **ckpt) - acts(**ckpt) == per_layer * qv // full - per_layer  # the recomputed layer's
    # lora_dropout: each adapter keeps its own dropped copy of the input and (while it needs grad) a 1-byte mask
    dropped = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    in_bytes = [(qv0 + H) * FP32, (qv + H) * FP32 + 2 * H]
    assert acts(lora=dropped) == sum(per_layer * n // (full * FP32) for n in in_bytes[:1] + in_bytes[1:] * 3)
    # adapters on layers 2 and 3 only: layers 0 and 1 save nothing
    late = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[2, 3])
    assert acts(lora=late) == per_layer * qv0 // full + per_layer * qv // full
    assert acts(lora=4) < acts()  # frozen weights keep fewer inputs


# the one-process stage's saved tensors (unique storages autograd keeps, parameters aside), as the runtime's
# ParallelModel.measure_activations counts them: the measurement is the expected value
MEASURED_TARGETS = {
    "full fine-tuning": None,
    "all seven": list(LINEARS),
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "q and v": ["q_proj", "v_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "k only": ["k_proj"],
    "q and v, layers 2-3": (["q_proj", "v_proj"], [2, 3]),
}


def _saved_bytes(lora_cfg, seq_len: int, batch: int) -> int:
    import torch

    from rlkit.models import load, tiny_lm
    from rlkit.parallel.lora import inject
    from rlkit.parallel.stage import Stage

    hf, _ = load(tiny_lm("qwen2"))
    if lora_cfg is not None:
        inject(hf, lora_cfg, 0)
    st = Stage(hf, range(hf.config.num_hidden_layers), first=True, last=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (batch, seq_len), generator=gen)
    params = {p.untyped_storage().data_ptr() for p in st.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = st(ids, attention_mask=torch.ones_like(ids), labels=ids)
    (lp.sum() + ent.sum()).backward()
    return sum(seen.values())


@pytest.mark.parametrize("targets", list(MEASURED_TARGETS), ids=list(MEASURED_TARGETS))
def test_lora_activations_match_the_measured_saved_tensors(targets, tiny_config):
    from peft import LoraConfig

    chosen = MEASURED_TARGETS[targets]
    cfg = None
    if chosen is not None:
        names, layers = chosen if isinstance(chosen, tuple) else (chosen, None)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=names, layers_to_transform=layers)
    s, b = 16, 2
    measured = _saved_bytes(cfg, s, b)
    # as rlkit.parallel.check.compare_with_estimate reads it: fp32, eager attention, gathered logits
    est = estimate_memory(ParallelPlan(), tiny_config, seq_len=s, micro_batch=b, precision="fp32",
                          flash_attention=False, gathered_logits=True, lora=cfg)
    estimate = int(est.activations[0] + est.logits[0])
    assert abs(estimate - measured) <= 0.02 * measured, (targets, estimate, measured)


def test_reference_shares_the_actors_weights_and_hybrid_engine_merges(tiny_config):
    from rlkit.plan.memory import RolloutMemory

    actor = estimate_memory(ParallelPlan(), tiny_config, precision="fp32", lora=4, seq_len=16)
    both = estimate_memory(ParallelPlan(), tiny_config, precision="fp32", lora=4, seq_len=16,
                           roles=("actor", "reference"))
    assert int(both.weights[0]) == int(actor.weights[0])

    from peft import LoraConfig

    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    ro = RolloutMemory(max_tokens=64, dtype="fp32", hybrid_engine=True)
    plain = estimate_memory(ParallelPlan(), tiny_config, precision="fp32", rollout=ro, seq_len=16)
    merged = estimate_memory(ParallelPlan(), tiny_config, precision="fp32", rollout=ro, seq_len=16, lora=cfg)
    assert int(plain.rollout_weights[0]) == 0  # the training shard is the generation shard
    assert int(merged.rollout_weights[0]) == L * (Q * H + KV * H) * FP32  # a merged copy of q and v


def test_attrs_record_lora(tiny_config):
    df = ParallelPlan(dp=2).memory(tiny_config, lora=8, precision="fp32", seq_len=16)
    assert df.attrs["lora"].r == 8 and df.attrs["lora_params"] == lora_params(tiny_config, 8)
    assert df.attrs["lora_targets"] == tuple(LINEARS)


# ---- the search ----------------------------------------------------------------------------------------
def test_search_plans_with_lora_returns_plans_that_need_less_memory():
    kw = dict(gpus=4, gpu_memory="40GB", seq_len=2048, include_vpp=False, variants="all", recompute="none",
              sequence_parallel=False)
    full = search_plans("qwen2.5-7b", **kw)
    lora = search_plans("qwen2.5-7b", **kw, lora=16)
    assert lora.attrs["lora"].r == 16 and len(lora[lora.valid])
    assert lora.fits.sum() > full.fits.sum()
    keys = ["dp", "tp", "pp", "dp_shard", "micro_batches"]
    both = full[full.valid].merge(lora[lora.valid], on=keys, suffixes=("_full", "_lora"))
    assert len(both) == int(full.valid.sum())
    assert (both.memory_gib_lora < both.memory_gib_full).all()


def test_search_refuses_tp_with_lora_dropout():
    from peft import LoraConfig

    df = search_plans("qwen2.5-0.5b", gpus=2, include_vpp=False,
                      lora=LoraConfig(r=8, target_modules=["q_proj"], lora_dropout=0.05))
    tp2 = df[df.tp == 2]
    assert len(tp2) and not tp2.valid.any() and tp2.why_not.str.contains("lora_dropout").all()
    assert df[df.tp == 1].valid.any()


# ---- bad values ----------------------------------------------------------------------------------------
BAD = [
    (0, "r=0"),
    (-2, "r=-2"),
    (dict(r=0, target_modules=["q_proj"]), "r=0"),
    (dict(r=8, target_modules=["nope_proj"]), "['nope_proj']"),
    (dict(r=8, target_modules=["q_proj"], layers_to_transform=[99]), "[99]"),
    (dict(r=8, target_modules=["lm_head"]), "['lm_head']"),
    (dict(r=8, target_modules=["q_proj"], use_dora=True), "use_dora=True"),
    ({"r": 8, "target_modules": []}, "target_modules=[]"),
    ("sixteen", "'sixteen'"),
]


@pytest.mark.parametrize("where", ["lora_params", "estimate_memory", "search_plans"])
@pytest.mark.parametrize("bad,named", BAD, ids=[named for _, named in BAD])
def test_bad_lora_raises_plan_error_naming_the_value(bad, named, where):
    from peft import LoraConfig

    # a LoraConfig as users pass it (peft accepts r=0 until injection); the plain dict case as it is
    lora = LoraConfig(**bad) if isinstance(bad, dict) and bad.get("target_modules") else bad
    call = {"lora_params": lambda: lora_params("qwen2.5-0.5b", lora),
            "estimate_memory": lambda: estimate_memory(ParallelPlan(), "qwen2.5-0.5b", lora=lora),
            "search_plans": lambda: search_plans("qwen2.5-0.5b", gpus=2, lora=lora)}[where]
    with pytest.raises(PlanError, match=re.escape(named)):
        call()


def test_lora_needs_an_actor_and_no_dropout_under_tp():
    with pytest.raises(PlanError, match="roles"):
        estimate_memory(ParallelPlan(), "qwen2.5-0.5b", lora=8, roles=("critic",))
    with pytest.raises(PlanError, match="lora_dropout=0.1 with tp=2"):
        estimate_memory(ParallelPlan(tp=2), "qwen2.5-0.5b", lora={"r": 8, "target_modules": ["q_proj"],
                                                                   "lora_dropout": 0.1})


def test_lora_spec_coerce_is_stable():
    lo = LoraSpec.coerce({"r": 8, "target_modules": {"v_proj", "q_proj"}})
    assert lo.target_modules == ("q_proj", "v_proj") and LoraSpec.coerce(lo) is lo
    assert lo.layer_targets(as_spec("qwen2.5-0.5b"))[5] == ("q_proj", "v_proj")
