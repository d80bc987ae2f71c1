"""HF <-> Megatron-Core weights for Llama / Qwen2 / Qwen3-MoE (local layer spec), TP-sharded, both ways.

Megatron's names (``GPTModel`` with ``get_gpt_layer_local_spec``), ``i`` a stage-local layer index:

============================================  ===============================================================
Megatron                                      HF
============================================  ===============================================================
embedding.word_embeddings.weight              model.embed_tokens.weight (rows padded to a multiple of tp)
decoder.layers.i.input_layernorm.weight       model.layers.g.input_layernorm.weight
decoder.layers.i.self_attention.linear_qkv.*  q_proj / k_proj / v_proj (weight, and bias for Qwen2), fused
decoder.layers.i.self_attention.linear_proj   o_proj (split over tp along its input dim)
decoder.layers.i.pre_mlp_layernorm.weight     post_attention_layernorm.weight
decoder.layers.i.mlp.linear_fc1.weight        [gate_proj; up_proj] (each tp rank holds [its gate; its up])
decoder.layers.i.mlp.linear_fc2.weight        down_proj (split over tp along its input dim)
decoder.final_layernorm.weight                model.norm.weight
output_layer.weight                           lm_head.weight (absent when tied on one stage)
============================================  ===============================================================

Qwen3-MoE (Megatron's ``MoELayer``: router + ``SequentialMLP``; TP 1; ``ep`` ranks hold ``E / ep`` experts each,
rank ``r`` the experts ``[r * E/ep, (r+1) * E/ep)``):

=====================================================  =====================================================
Megatron                                               HF
=====================================================  =====================================================
decoder.layers.i.self_attention.q_layernorm.weight     model.layers.g.self_attn.q_norm.weight (head_dim,)
decoder.layers.i.self_attention.k_layernorm.weight     model.layers.g.self_attn.k_norm.weight (head_dim,)
decoder.layers.i.mlp.router.weight                     model.layers.g.mlp.gate.weight (E, H)
decoder.layers.i.mlp.experts.local_experts.j.          model.layers.g.mlp.experts.gate_up_proj[e] (2I, H):
linear_fc1.weight                                      [gate; up], e = ep_rank * E/ep + j
decoder.layers.i.mlp.experts.local_experts.j.          model.layers.g.mlp.experts.down_proj[e] (H, I)
linear_fc2.weight
=====================================================  =====================================================

``to_hf`` takes the experts of a layer whole: ``decoder.layers.g.mlp.experts.linear_fc1.weight`` (a name of
this module's, no Megatron parameter) with the one shard ``(E, 2I, H)``, all experts stacked in global order
(``MegatronModel`` gathers them over EP); likewise ``linear_fc2`` ``(E, H, I)``.

The fused QKV is laid out per query group: for each of the ``num_query_groups`` groups, its
``heads / groups`` query heads, then its key head, then its value head (``head_dim`` rows each). TP splits
it by whole groups, so rank ``r``'s shard is groups ``[r * g/tp, (r+1) * g/tp)``: gathering the shards in
rank order gives the full fused tensor back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlkit.backends.families import head_dim

Getter = Callable[[str], torch.Tensor]


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (VocabParallelEmbedding splits it evenly).

    >>> padded_vocab(49152, 3), padded_vocab(151665, 2)
    (49152, 151666)
    """
    return int(math.ceil(vocab / tp) * tp)


def _groups(cfg) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    groups = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    return groups, cfg.num_attention_heads // groups, head_dim(cfg)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg) -> torch.Tensor:
    """HF's q/k/v (weights (out, in) or biases (out,)) as Megatron's fused per-group tensor."""
    g, per, d = _groups(cfg)
    rest = q.shape[1:]
    parts = [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, 1).reshape(g * (per + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's full fused QKV back to HF's (q, k, v)."""
    g, per, d = _groups(cfg)
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = x[:, :per * d], x[:, per * d:(per + 1) * d], x[:, (per + 1) * d:]
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _chunk(t: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(tp, dim)[rank].clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


EXPERTS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}  # Megatron expert linear -> HF's stacked tensor
LAYER_MOE = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
             "mlp.router.weight": "mlp.gate.weight"}


def expert_index(name: str) -> tuple[int, str] | None:
    """``(local expert j, "linear_fc1" | "linear_fc2")`` of a ``...mlp.experts.local_experts.j.<linear>.weight``
    name; None for any other.

    >>> expert_index("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight")
    (3, 'linear_fc2')
    """
    parts = name.split(".")
    if len(parts) == 9 and parts[3:5] == ["mlp", "experts"] and parts[5] == "local_experts":
        return int(parts[6]), parts[7]
    return None


def to_megatron(name: str, layer: int | None, get: Getter, cfg, tp: int, tp_rank: int, ep: int = 1,
                ep_rank: int = 0) -> torch.Tensor:
    """This TP rank's shard of the Megatron parameter ``name`` (stage-local name; ``layer`` its global layer
    index, None outside the decoder layers), read from HF tensors through ``get(hf_name)``. An expert's
    weight is the expert ``ep_rank * E/ep + j`` of HF's stacked tensor (experts are not TP-split here)."""
    vocab = padded_vocab(cfg.vocab_size, tp)
    if name == "embedding.word_embeddings.weight":
        return _chunk(_pad_rows(get("model.embed_tokens.weight"), vocab), tp, tp_rank)
    if name == "output_layer.weight":
        key = "model.embed_tokens.weight" if getattr(cfg, "tie_word_embeddings", False) else "lm_head.weight"
        return _chunk(_pad_rows(get(key), vocab), tp, tp_rank)
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight").clone()
    if name.startswith("value_head."):
        return get(name).clone()
    p = f"model.layers.{layer}."
    suffix = name.split(".", 3)[3]  # after decoder.layers.<i>.
    if suffix == "input_layernorm.weight":
        return get(p + "input_layernorm.weight").clone()
    if suffix == "pre_mlp_layernorm.weight":
        return get(p + "post_attention_layernorm.weight").clone()
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        full = fuse_qkv(*(get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"), cfg)
        return _chunk(full, tp, tp_rank)  # whole query groups per rank (the layout keeps each group together)
    if suffix == "self_attention.linear_proj.weight":
        return _chunk(get(p + "self_attn.o_proj.weight"), tp, tp_rank, 1)
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([_chunk(get(p + "mlp.gate_proj.weight"), tp, tp_rank),
                          _chunk(get(p + "mlp.up_proj.weight"), tp, tp_rank)])
    if suffix == "mlp.linear_fc2.weight":
        return _chunk(get(p + "mlp.down_proj.weight"), tp, tp_rank, 1)
    if suffix in LAYER_MOE:
        return get(p + LAYER_MOE[suffix]).clone()
    expert = expert_index(name)
    if expert is not None:
        j, linear = expert
        per = _num_experts(cfg) // ep
        return get(f"{p}mlp.experts.{EXPERTS[linear]}")[ep_rank * per + j].clone()
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


def _num_experts(cfg) -> int:
    from rlkit.backends.families import num_experts

    return num_experts(cfg)


def hf_names(name: str, layer: int | None, cfg) -> list[str]:
    """The HF names (in HF's order) the Megatron parameter ``name`` converts to, without its tensor."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight") \
            or name.startswith("value_head."):
        return [{"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
                 "decoder.final_layernorm.weight": "model.norm.weight"}.get(name, name)]
    p = f"model.layers.{layer}."
    suffix = name.split(".", 3)[3]
    kind = suffix.rsplit(".", 1)[1]
    if suffix in LAYER_MOE:
        return [p + LAYER_MOE[suffix]]
    if suffix in ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"):
        return [f"{p}mlp.experts.{EXPERTS[suffix.split('.')[2]]}"]
    return {"input_layernorm.weight": [p + "input_layernorm.weight"],
            "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
            "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
            "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"]}.get(
        suffix, [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"])


def to_hf(name: str, layer: int | None, shards: list[torch.Tensor], cfg) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, full tensor)`` pairs of the Megatron parameter ``name`` from its TP shards in rank order
    (one shard for a parameter TP replicates)."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(shards)[:cfg.vocab_size])]
    if name == "output_layer.weight":
        return [("lm_head.weight", torch.cat(shards)[:cfg.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    if name.startswith("value_head."):
        return [(name, shards[0])]
    p = f"model.layers.{layer}."
    suffix = name.split(".", 3)[3]
    if suffix == "input_layernorm.weight":
        return [(p + "input_layernorm.weight", shards[0])]
    if suffix == "pre_mlp_layernorm.weight":
        return [(p + "post_attention_layernorm.weight", shards[0])]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(torch.cat(shards), cfg)
        return [(f"{p}self_attn.q_proj.{kind}", q), (f"{p}self_attn.k_proj.{kind}", k),
                (f"{p}self_attn.v_proj.{kind}", v)]
    if suffix == "self_attention.linear_proj.weight":
        return [(p + "self_attn.o_proj.weight", torch.cat(shards, 1))]
    if suffix == "mlp.linear_fc1.weight":
        halves = [s.chunk(2) for s in shards]  # each rank: [its gate rows; its up rows]
        return [(p + "mlp.gate_proj.weight", torch.cat([h[0] for h in halves])),
                (p + "mlp.up_proj.weight", torch.cat([h[1] for h in halves]))]
    if suffix == "mlp.linear_fc2.weight":
        return [(p + "mlp.down_proj.weight", torch.cat(shards, 1))]
    if suffix in LAYER_MOE:
        return [(p + LAYER_MOE[suffix], shards[0])]
    if suffix in ("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"):
        return [(f"{p}mlp.experts.{EXPERTS[suffix.split('.')[2]]}", shards[0])]  # (E, ...) stacked already
    raise KeyError(f"no HF counterpart for Megatron parameter {name!r}")


__all__ = ["EXPERTS", "LAYER_MOE", "expert_index", "fuse_qkv", "hf_names", "padded_vocab", "split_qkv", "to_hf", "to_megatron"]
