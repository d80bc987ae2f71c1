"""Which HF model families the Megatron-Core backend builds, and how an HF config maps to Megatron's.

No Megatron import here: the driver checks a config (``check_family``) before any worker starts, on a
machine that may not have Megatron installed. ``transformer_config_kwargs`` and ``gpt_model_kwargs`` are
plain dicts the rank side hands to ``TransformerConfig`` and ``GPTModel``.

>>> from transformers import GPT2Config
>>> check_family(GPT2Config())
Traceback (most recent call last):
...
rlkit.errors.PlanError: backend='megatron' does not build model_type='gpt2'; it covers ('llama', 'qwen2') (use backend='torch' for other families)
"""

from __future__ import annotations

from typing import Any

from rlkit.errors import PlanError

SUPPORTED = ("llama", "qwen2")


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


def check_family(config: Any) -> None:
    """Raise ``PlanError`` unless ``config`` (an HF config or its dict) is a family and feature set the
    Megatron backend converts exactly: Llama or Qwen2, SiLU-gated MLP, plain RoPE, no sliding window, no
    biases beyond Qwen2's q/k/v."""
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
    if model_type == "qwen2" and _get(config, "use_sliding_window", False):
        problems.append("use_sliding_window=True")
    if problems:
        raise PlanError(f"backend='megatron' cannot build this {model_type!r} model: {'; '.join(problems)}; "
                        f"use backend='torch'")


def transformer_config_kwargs(config: Any) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of an HF config's architecture (the layout and numerics
    options are the caller's). ``activation_func`` is left to the caller (a torch function)."""
    check_family(config)
    return {
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


def gpt_model_kwargs(config: Any) -> dict[str, Any]:
    """``GPTModel`` arguments of an HF config besides the config and layer spec (vocab padding is the
    caller's: it depends on tp)."""
    return {
        "max_sequence_length": int(_get(config, "max_position_embeddings")),
        "position_embedding_type": "rope",
        "rotary_base": int(rope_theta(config)),
        "share_embeddings_and_output_weights": bool(_get(config, "tie_word_embeddings", False)),
    }


__all__ = ["SUPPORTED", "check_family", "gpt_model_kwargs", "head_dim", "rope_theta", "transformer_config_kwargs"]
