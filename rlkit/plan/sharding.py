"""The sharded-tensor model: which piece of each parameter tensor a rank holds under TP, FSDP and PP.

Pure Python (no torch import). A model's parameters are listed tensor by tensor (q/k/v/o, gate/up/down,
biases, norms, embedding, lm_head) as ``(name, dim0, dim1, tp_dim)``: ``tp_dim`` 0 is ColwiseParallel
(Shard(0)), 1 is RowwiseParallel (Shard(1)), None is replicated over TP; 1-D tensors have ``dim1 = 1``.
Splits follow ``torch.chunk`` (pieces of ceil(n/parts), the last ones shorter or empty), as DTensor's
uneven Shard and FSDP2 do. The memory and communication models count bytes from these shapes.

>>> from rlkit.plan.spec import as_spec
>>> tensors = layer_tensors(as_spec("qwen2.5-7b"))
>>> tensors[0]                               # q_proj: (q_dim, hidden), column-parallel
('q_proj', 3584, 3584, 0)
>>> rank_shard(tensors, 28, tp=4, t=0, S=8, j=0).tensors    # 28 layers of tensors on one rank
336
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.plan.spec import ModelSpec
    from rlkit.plan.topology import ParallelPlan

#: one parameter tensor: (name, dim0, dim1, tp_dim); tp_dim None = replicated over TP
Tensor = tuple[str, int, int, int | None]


def chunk_len(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``n`` is split like ``torch.chunk``: pieces of ceil(n/parts),
    the last ones shorter or empty (DTensor's uneven Shard and FSDP2's ``_chunk_with_empty``).

    >>> [chunk_len(10, 4, i) for i in range(4)], [chunk_len(5, 4, i) for i in range(4)]
    ([3, 3, 3, 1], [2, 2, 1, 0])
    """
    c = -(-n // parts)
    return max(0, min(c, n - index * c))


def chunk_overlap(n: int, a: int, i: int, b: int, j: int) -> int:
    """Length of the intersection of ``torch.chunk`` piece ``i`` of ``a`` and piece ``j`` of ``b`` of
    a dim of length ``n`` (a training TP chunk inside a generation TP chunk).

    >>> chunk_overlap(8, 4, 1, 2, 0), chunk_overlap(8, 4, 2, 2, 0)   # quarter 1 lies in half 0
    (2, 0)
    """
    ca, cb = -(-n // a), -(-n // b)
    lo, hi = max(i * ca, j * cb), min(min((i + 1) * ca, n), min((j + 1) * cb, n))
    return max(0, hi - lo)


def split_dims(d0: int, d1: int, tp_dim: int | None) -> tuple[int, int]:
    """(length of the TP-split dim, product of the other dims) of a tensor.

    >>> split_dims(1024, 4096, 0), split_dims(1024, 4096, 1)
    ((1024, 4096), (4096, 1024))
    """
    return (d0, d1) if tp_dim == 0 else (d1, d0)


# ---- the parameter tensors of each part, with their TP split ------------------------------------
def layer_tensors(spec: ModelSpec, sparse: bool | None = None) -> list[Tensor]:
    """The parameter tensors of one decoder layer, biases and norms included.

    ``sparse``: a mixture-of-experts layer (default: the model's, sparse for an MoE model). Its MLP is
    the router ``mlp.gate`` (E, H), the routed experts as transformers fuses them, ``experts.gate_up_proj``
    (E, 2I, H) and ``experts.down_proj`` (E, H, I), listed as (E, rest) since FSDP2 and expert
    parallelism both split dim 0, and DeepSeek's shared experts (a gated MLP ``n_shared x I`` wide).
    The router and the routed experts stay whole on every TP rank (``rlkit.parallel`` splits only the
    attention of an MoE layer); shared experts split like a dense MLP. MLA (DeepSeek) lists its low-rank
    projections: ``q_a_proj`` and ``kv_a_proj_with_mqa`` replicated, ``q_b_proj`` and ``kv_b_proj``
    column-parallel, ``o_proj`` row-parallel (Megatron's and vLLM's split).

    >>> from rlkit.plan.spec import as_spec
    >>> [name for name, *_ in layer_tensors(as_spec("llama-2-7b"))][:4]
    ['q_proj', 'k_proj', 'v_proj', 'o_proj']
    >>> [x for x in layer_tensors(as_spec("mixtral-8x7b")) if x[0].startswith(("mlp.", "experts."))]
    [('mlp.gate', 8, 4096, None), ('experts.gate_up_proj', 8, 117440512, None), ('experts.down_proj', 8, 58720256, None)]
    """
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    if sparse is None:
        sparse = bool(spec.sparse_layers)
    if spec.is_mla:
        a, rope, nope, v = (spec.num_attention_heads, spec.qk_rope_head_dim, spec.qk_nope_head_dim,
                            spec.v_head_dim)
        ql, kl = spec.q_lora_rank, spec.kv_lora_rank
        attn: list[Tensor] = ([("q_a_proj", ql, h, None), ("q_a_layernorm", ql, 1, None),
                               ("q_b_proj", a * (nope + rope), ql, 0)] if ql else [("q_proj", a * (nope + rope), h, 0)])
        attn += [("kv_a_proj_with_mqa", kl + rope, h, None), ("kv_a_layernorm", kl, 1, None),
                 ("kv_b_proj", a * (nope + v), kl, 0), ("o_proj", h, a * v, 1)]
    else:
        attn = [("q_proj", q, h, 0), ("k_proj", kv, h, 0), ("v_proj", kv, h, 0), ("o_proj", h, q, 1)]
        if spec.qk_norm:
            attn += [("q_norm", spec.head_dim, 1, None), ("k_norm", spec.head_dim, 1, None)]
    if sparse and spec.is_moe:
        e, mi = spec.num_experts, spec.moe_intermediate_size
        mlp: list[Tensor] = [("mlp.gate", e, h, None), ("experts.gate_up_proj", e, 2 * mi * h, None),
                             ("experts.down_proj", e, h * mi, None)]
        if spec.n_shared_experts:
            si = spec.n_shared_experts * mi
            mlp += [("shared_experts.gate_proj", si, h, 0), ("shared_experts.up_proj", si, h, 0),
                    ("shared_experts.down_proj", h, si, 1)]
    else:
        mlp = [("gate_proj", i, h, 0), ("up_proj", i, h, 0), ("down_proj", h, i, 1)]
    out: list[Tensor] = attn + mlp + [("input_layernorm", h, 1, None), ("post_attention_layernorm", h, 1, None)]
    if spec.qkv_bias and not spec.is_mla:
        out += [("q_proj.bias", q, 1, 0), ("k_proj.bias", kv, 1, 0), ("v_proj.bias", kv, 1, 0)]
    if spec.o_bias:
        out.append(("o_proj.bias", h, 1, None))  # row-parallel bias: replicated, added after the reduce
    if spec.mlp_bias and not (sparse and spec.is_moe):
        out += [("gate_proj.bias", i, 1, 0), ("up_proj.bias", i, 1, 0), ("down_proj.bias", h, 1, None)]
    return out


def is_expert(tensor: Tensor) -> bool:
    """A routed expert's weights (what expert parallelism shards, and FSDP then leaves alone)."""
    return tensor[0].startswith("experts.")


def stage_layer_kinds(spec: ModelSpec, plan: ParallelPlan) -> list[dict[bool, int]]:
    """Per pipeline rank, how many of its decoder layers are dense (``False``) and sparse (``True``).

    >>> from rlkit.plan import ParallelPlan
    >>> from rlkit.plan.spec import as_spec
    >>> stage_layer_kinds(as_spec("deepseek-v3"), ParallelPlan(pp=4, dp=1))[:2]
    [{False: 3, True: 12}, {True: 16}]
    """
    out: list[dict[bool, int]] = [{} for _ in range(plan.pp)]
    for st, rng in enumerate(plan.stage_layers(spec.num_layers)):
        kinds = out[st % plan.pp]
        for i in rng:
            k = spec.is_sparse(i)
            kinds[k] = kinds.get(k, 0) + 1
    return out


@lru_cache(maxsize=64)
def vision_tensors(spec: ModelSpec) -> tuple[Tensor, ...]:
    """A vision-language model's vision tower, tensor by tensor (``visual.*``, HF's names; none for a text
    model): the Conv3d patch embedding as (hidden, patch_dim), each block's norms, ``attn.qkv``, ``attn.proj``,
    gated MLP and their biases, the merger's ``ln_q`` and two linear layers. All replicated over TP, as
    ``rlkit.parallel`` keeps the tower (its TP plan splits the decoder layers only), and, on the first
    stage's root, sharded by FSDP2 with the embedding.

    >>> from rlkit.plan.spec import as_spec
    >>> t = vision_tensors(as_spec("qwen2.5-vl-7b"))
    >>> len(t), t[0], sum(d0 * d1 for _, d0, d1, _ in t) == as_spec("qwen2.5-vl-7b").vision_params
    (390, ('visual.patch_embed.proj', 1280, 1176, None), True)
    """
    if not spec.is_vision_language:
        return ()
    spec._check_vision()
    h, i = spec.vision_hidden_size, spec.vision_intermediate_size
    w, out = h * spec.vision_merge_size ** 2, spec.vision_out_hidden_size
    tensors: list[Tensor] = [("visual.patch_embed.proj", h, spec.vision_patch_dim, None)]
    for b in range(spec.vision_depth):
        tensors += [(f"visual.blocks.{b}.{name}", d0, d1, None) for name, d0, d1 in (
            ("norm1", h, 1), ("norm2", h, 1), ("attn.qkv", 3 * h, h), ("attn.qkv.bias", 3 * h, 1),
            ("attn.proj", h, h), ("attn.proj.bias", h, 1), ("mlp.gate_proj", i, h), ("mlp.gate_proj.bias", i, 1),
            ("mlp.up_proj", i, h), ("mlp.up_proj.bias", i, 1), ("mlp.down_proj", h, i), ("mlp.down_proj.bias", h, 1))]
    tensors += [("visual.merger.ln_q", h, 1, None), ("visual.merger.mlp.0", w, w, None),
                ("visual.merger.mlp.0.bias", w, 1, None), ("visual.merger.mlp.2", out, w, None),
                ("visual.merger.mlp.2.bias", out, 1, None)]
    return tuple(tensors)


def root_tensors(spec: ModelSpec, pp: int, tp: int, pp_rank: int, role: str,
                 vocab_parallel: bool) -> list[Tensor]:
    """Parameters outside the decoder layers held by pipeline rank ``pp_rank`` of ``pp``: embedding
    (and a vision-language model's vision tower, ``vision_tensors``) on the first stage; final norm and
    lm_head (or the critic's value head) on the last.

    >>> from rlkit.plan.spec import as_spec
    >>> [name for name, *_ in root_tensors(as_spec("llama-2-7b"), 2, 1, 1, "actor", True)]
    ['norm', 'lm_head']
    """
    vdim = 0 if vocab_parallel else None
    h, v = spec.hidden_size, spec.vocab_size
    out: list[Tensor] = []
    if pp_rank == 0:
        out.append(("embed_tokens", v, h, vdim))  # RowwiseParallel on an embedding shards the vocab
        out += vision_tensors(spec)
    if pp_rank == pp - 1:
        out.append(("norm", h, 1, None))
        if role == "critic":
            out += [("value_head", 1, h, None), ("value_head.bias", 1, 1, None)]
        elif not spec.tie_word_embeddings or pp > 1:
            # untied lm_head, or the last stage's own copy of a tied embedding (spec.stage_params);
            # with pp == 1 a tied model holds one matrix, also under TP (apply_tp re-ties the shards)
            out.append(("lm_head", v, h, vdim))
    return out


def owned_tensors(spec: ModelSpec, plan: ParallelPlan) -> list[list[tuple[tuple[Tensor, ...], int]]]:
    """Per pipeline rank: ``(tensors, count)`` of the parameters it owns *once* in HF's naming, as
    ``ParallelModel._param_meta`` lists them for resharding: its decoder layers and its root tensors,
    but not a tied embedding's last-stage copy (pp > 1), which is training-only: the generation
    layout's lm_head is the embedding.

    >>> from rlkit.plan import ParallelPlan
    >>> from rlkit.plan.spec import as_spec
    >>> [[count for _, count in rank] for rank in owned_tensors(as_spec("qwen2.5-7b"), ParallelPlan(pp=2))]
    [[14, 1], [14, 1]]
    """
    pp = plan.pp
    kinds = stage_layer_kinds(spec, plan)
    out = []
    for p in range(pp):
        root = tuple(x for x in root_tensors(spec, pp, plan.tp, p, "actor", True)
                     if not (spec.tie_word_embeddings and x[0] == "lm_head"))
        layers = [(tuple(layer_tensors(spec, sparse)), n) for sparse, n in sorted(kinds[p].items())]
        out.append([*(layers or [(tuple(layer_tensors(spec)), 0)]), (root, 1)])
    return out


def reused_by_generation(spec: ModelSpec, plan: ParallelPlan, rollout_tp: int, pp_rank: int,
                         tp_rank: int) -> int:
    """Elements of a rank's training shard that lie inside its generation shard (3D-HybridEngine):
    all of its stage's TP-local parameters but a tied embedding's last-stage copy (of an unevenly split
    dim, the overlap of the two ``torch.chunk`` pieces). Without FSDP the Resharder keeps them in place
    (aliased, or copied into their slot and the training storage released), so generating adds only
    the rest of the generation shard.

    >>> from rlkit.plan import ParallelPlan
    >>> from rlkit.plan.spec import as_spec
    >>> spec = as_spec("qwen2.5-0.5b")
    >>> reused_by_generation(spec, ParallelPlan(), 1, 0, 0) == spec.num_params    # same layout: all of it
    True
    >>> layers = rank_shard(layer_tensors(spec), 24, tp=2, t=0, S=1, j=0)     # tp=2 training, rank 0
    >>> root = rank_shard(root_tensors(spec, 1, 2, 0, "actor", True), 1, tp=2, t=0, S=1, j=0)
    >>> reused_by_generation(spec, ParallelPlan(tp=2), 1, 0, 0) == layers.local + root.local   # all inside
    True
    """
    k = plan.tp // rollout_tp
    g = tp_rank // k
    n_el = 0
    for tensors, count in owned_tensors(spec, plan)[pp_rank]:
        for _name, d0, d1, td in tensors:
            if td is None:
                n_el += d0 * d1 * count
            else:
                n, other = split_dims(d0, d1, td)
                n_el += chunk_overlap(n, plan.tp, tp_rank, rollout_tp, g) * other * count
    return n_el


# ---- what one rank holds ---------------------------------------------------------------------------
@dataclass
class Shard:
    """Elements one rank holds for a list of tensors.

    >>> Shard(padded=6, actual=5, local=10, tensors=2).actual
    5
    """

    padded: int = 0     # FSDP2 storage: ceil(dim0/S) rows per tensor (params, grads)
    actual: int = 0     # this rank's real rows (optimizer states: zeros_like of the unpadded view)
    local: int = 0      # the TP-local tensor before FSDP (unsharded compute copy)
    tensors: int = 0


def rank_shard(tensors: list[Tensor] | tuple[Tensor, ...], count: int, tp: int, t: int, S: int,
               j: int) -> Shard:
    """What the rank with TP index ``t`` of ``tp`` and FSDP shard index ``j`` of ``S`` holds of
    ``count`` copies of ``tensors`` (e.g. a stage's decoder layers).

    >>> rank_shard([("w", 10, 3, 0)], 2, tp=2, t=1, S=2, j=1)     # rows 5..9 of each, then 3 + 2 rows
    Shard(padded=18, actual=12, local=30, tensors=2)
    """
    one = _shard_one(tuple(tensors), tp, t, S, j)
    return Shard(one.padded * count, one.actual * count, one.local * count, one.tensors * count)


@lru_cache(maxsize=8192)
def _shard_one(tensors: tuple[Tensor, ...], tp: int, t: int, S: int, j: int) -> Shard:
    """One copy of each tensor (counts scale linearly): memoised, since a plan search asks for the
    same layer shapes under the same (tp, shard) split thousands of times."""
    out = Shard()
    for _name, d0, d1, tp_dim in tensors:
        l0 = chunk_len(d0, tp, t) if tp_dim == 0 else d0
        l1 = chunk_len(d1, tp, t) if tp_dim == 1 else d1
        c = -(-l0 // S)
        out.padded += c * l1
        out.actual += chunk_len(l0, S, j) * l1
        out.local += l0 * l1
        out.tensors += 1
    return out


def uneven_splits(tensors: list[Tensor], tp: int, S: int) -> tuple[bool, bool]:
    """(TP split uneven anywhere, FSDP split uneven anywhere): ranks differ only when True.

    >>> uneven_splits([("w", 10, 3, 0)], tp=2, S=2), uneven_splits([("w", 10, 3, 0)], tp=4, S=1)
    ((False, True), (True, False))
    """
    tp_uneven = any((d0 if td == 0 else d1) % tp for _, d0, d1, td in tensors if td is not None)
    fs_uneven = any(chunk_len(d0, tp, t) % S if td == 0 else d0 % S
                    for _, d0, d1, td in tensors for t in range(tp if td == 0 else 1))
    return tp_uneven, fs_uneven
