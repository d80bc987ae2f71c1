"""Which HF model families the Megatron-Core backend builds, and how an HF config maps to Megatron's.

No Megatron import here: the driver checks a config (``check_family``) before any worker starts, on a
machine that may not have Megatron installed. ``transformer_config_kwargs`` and ``gpt_model_kwargs`` are
plain dicts the rank side hands to ``TransformerConfig`` and ``GPTModel``.

>>> from transformers import GPT2Config
>>> check_family(GPT2Config())
Traceback (most recent call last):
...
rlkit.errors.PlanError: backend='megatron' does not build model_type='gpt2'; it covers ('llama', 'qwen2', 'qwen3_moe') (use backend='torch' for other families)
"""

from __future__ import annotations

from typing import Any

from rlkit.errors import PlanError

SUPPORTED = ("llama", "qwen2", "qwen3_moe")
MOE = ("qwen3_moe",)  # mixture-of-experts families: Megatron's MoELayer (router + SequentialMLP experts)


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def rope_theta(config: Any) -> float:
    """The rotary base: transformers >= 5 keeps it in ``rope_parameters``, older ones in ``rope_theta``."""
    params = _get(config, "rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(_get(config, "rope_theta", 10000.0))


def head_dim(config: Any) -> int:
    """Per-head width (``head_dim`` when the config sets it, else hidden / heads)."""
    return int(_get(config, "head_dim", None) or _get(config, "hidden_size") // _get(config, "num_attention_heads"))


def is_moe(config: Any) -> bool:
    """Whether ``config`` is one of the mixture-of-experts families (``MOE``)."""
    return _get(config, "model_type") in MOE


def num_experts(config: Any) -> int:
    """Experts per MoE layer, as the planner reads them (``ModelSpec.num_experts``)."""
    from rlkit.plan.spec import as_spec

    return as_spec(config).num_experts


def check_family(config: Any) -> None:
    """Raise ``PlanError`` unless ``config`` (an HF config or its dict) is a family and feature set the
    Megatron backend converts exactly: Llama, Qwen2 or Qwen3-MoE, SiLU-gated MLP, plain RoPE, no sliding
    window, no biases beyond Qwen2's q/k/v. Qwen3-MoE: every layer an MoE layer (``decoder_sparse_step=1``,
    no ``mlp_only_layers``), softmax top-k routing (renormalised or not: ``norm_topk_prob``), no shared
    experts; its q/k RMSNorm is Megatron's ``qk_layernorm``.

    >>> from transformers import Qwen3MoeConfig
    >>> check_family(Qwen3MoeConfig(mlp_only_layers=[0]))
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: backend='megatron' cannot build this 'qwen3_moe' model: mlp_only_layers=[0] (dense layers between MoE layers are not mapped; every layer must be an MoE layer); use backend='torch'
    """
    model_type = _get(config, "model_type")
    if model_type not in SUPPORTED:
        raise PlanError(f"backend='megatron' does not build model_type={model_type!r}; it covers {SUPPORTED} "
                        f"(use backend='torch' for other families)")
    problems = []
    params = _get(config, "rope_parameters")
    # transformers >= 5: rope_parameters (rope_scaling is an alias of it); older: rope_scaling or None
    scaling = params if isinstance(params, dict) else _get(config, "rope_scaling")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in (None, "default"):
        # RoPE scaling (llama3, yarn, linear, dynamic) changes the frequencies: not mapped yet
        problems.append(f"rope scaling {scaling!r} (only plain RoPE is mapped)")
    if _get(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={_get(config, 'hidden_act')!r} (SwiGLU with silu only)")
    if model_type == "llama":
        if _get(config, "attention_bias", False):
            problems.append("attention_bias=True")
        if _get(config, "mlp_bias", False):
            problems.append("mlp_bias=True")
    if model_type in ("qwen2", "qwen3_moe") and _get(config, "use_sliding_window", False):
        problems.append("use_sliding_window=True")
    if model_type == "qwen3_moe":
        if _get(config, "attention_bias", False):
            problems.append("attention_bias=True")
        if list(_get(config, "mlp_only_layers", None) or []):
            problems.append(f"mlp_only_layers={list(_get(config, 'mlp_only_layers'))} (dense layers between MoE "
                            f"layers are not mapped; every layer must be an MoE layer)")
        if int(_get(config, "decoder_sparse_step", 1) or 1) != 1:
            problems.append(f"decoder_sparse_step={_get(config, 'decoder_sparse_step')} (only every layer MoE, "
                            f"decoder_sparse_step=1, is mapped)")
        if num_experts(config) < 1:
            problems.append("num_experts=0 (no experts)")
        if int(_get(config, "num_experts_per_tok", 1)) > num_experts(config):
            problems.append(f"num_experts_per_tok={_get(config, 'num_experts_per_tok')} > num_experts="
                            f"{num_experts(config)}")
    if problems:
        raise PlanError(f"backend='megatron' cannot build this {model_type!r} model: {'; '.join(problems)}; "
                        f"use backend='torch'")


def check_experts(config: Any, ep: int) -> None:
    """Raise ``PlanError`` unless ``ParallelPlan(ep=ep)`` can split this model's experts: ep > 1 needs a
    mixture-of-experts model whose expert count ep divides.

    >>> from transformers import LlamaConfig
    >>> check_experts(LlamaConfig(), 2)
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: ep=2 splits the experts of a mixture-of-experts model; model_type='llama' has none: use ep=1
    """
    if ep == 1:
        return
    if not is_moe(config):
        raise PlanError(f"ep={ep} splits the experts of a mixture-of-experts model; model_type="
                        f"{_get(config, 'model_type')!r} has none: use ep=1")
    n = num_experts(config)
    if n % ep:
        raise PlanError(f"ep={ep} does not divide num_experts={n}: each expert-parallel rank holds an equal share "
                        f"of the experts; choose ep among the divisors of {n} that divide dp")


def transformer_config_kwargs(config: Any) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of an HF config's architecture (the layout and numerics
    options are the caller's). ``activation_func`` is left to the caller (a torch function)."""
    check_family(config)
    moe = is_moe(config)
    kw = {
        "num_layers": int(_get(config, "num_hidden_layers")),
        "hidden_size": int(_get(config, "hidden_size")),
        "ffn_hidden_size": int(_get(config, "intermediate_size")),
        "num_attention_heads": int(_get(config, "num_attention_heads")),
        "num_query_groups": int(_get(config, "num_key_value_heads", None) or _get(config, "num_attention_heads")),
        "kv_channels": head_dim(config),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(_get(config, "rms_norm_eps")),
        "gated_linear_unit": True,  # SwiGLU: fc1 = [gate; up], silu(gate) * up
        "add_bias_linear": False,
        "add_qkv_bias": _get(config, "model_type") == "qwen2",  # Qwen2: q/k/v carry a bias, o_proj none
    }
    if moe:
        kw |= {
            "qk_layernorm": True,  # Qwen3: RMSNorm over each head's q and k before RoPE (q_norm, k_norm)
            "num_moe_experts": num_experts(config),
            "moe_ffn_hidden_size": int(_get(config, "moe_intermediate_size")),
            "moe_router_topk": int(_get(config, "num_experts_per_tok")),
            "moe_router_score_function": "softmax",
            # HF: softmax over all experts, top-k, then (norm_topk_prob) divided by the top-k's sum. Megatron
            # without pre-softmax takes the top-k logits and softmaxes over them: the same renormalised
            # probabilities (softmax is monotonic, so the same experts). pre-softmax: softmax over all, top-k,
            # not renormalised, which is HF's norm_topk_prob=False.
            "moe_router_pre_softmax": not bool(_get(config, "norm_topk_prob", True)),
            # HF adds its load-balancing loss only to the loss it computes from labels; rlkit's loss is its own,
            # so no auxiliary loss trains the router on either side
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_grouped_gemm": False,  # SequentialMLP: one MLP per local expert, the local spec's
            "moe_permute_fusion": False,
            "moe_token_dispatcher_type": "alltoall",
        }
    return kw


def gpt_model_kwargs(config: Any) -> dict[str, Any]:
    """``GPTModel`` arguments of an HF config besides the config and layer spec (vocab padding is the
    caller's: it depends on tp)."""
    return {
        "max_sequence_length": int(_get(config, "max_position_embeddings")),
        "position_embedding_type": "rope",
        "rotary_base": int(rope_theta(config)),
        "share_embeddings_and_output_weights": bool(_get(config, "tie_word_embeddings", False)),
    }


__all__ = ["MOE", "SUPPORTED", "check_experts", "check_family", "is_moe", "num_experts", "gpt_model_kwargs", "head_dim", "rope_theta", "transformer_config_kwargs"]
