"""Memory per rank of a ParallelPlan: model state, activations, logits and a colocated rollout engine.

Pure Python (no torch import). One row per rank; ranks that hold the same bytes are computed once,
so a 512-rank plan takes milliseconds.

Every count below is in bytes. Parameter tensors are enumerated one by one (q/k/v/o, gate/up/down,
biases, norms, embedding, lm_head) with the shape each rank holds after tensor parallelism and FSDP
sharding (``rlkit.plan.sharding``), so the persistent counts (``weights``, ``grads``, ``optimizer``)
are exact, padding included, for the torch layout described in :func:`estimate_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from rlkit.errors import PlanError
from rlkit.plan.sharding import (
    Shard,
    chunk_len,
    is_expert,
    layer_tensors,
    rank_shard,
    reused_by_generation,
    root_tensors,
    stage_layer_kinds,
    uneven_splits,
    vision_tensors,
)
from rlkit.plan.spec import LORA_TARGETS, LoraSpec
from rlkit.plan.units import (
    OPTIMIZERS,
    PRECISIONS,
    check_common,
    check_vision,
    dtype_bytes,
    parse_bytes,
    positive_int,
    recompute_mode,
)
from rlkit.plan.vision import vision_activation_bytes

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.plan.spec import ModelSpec
    from rlkit.plan.topology import ParallelPlan

ROLES = ("actor", "reference", "critic")
COMPONENTS = ("weights", "grads", "optimizer", "param_buffers", "activations", "logits", "kv_cache",
              "rollout_weights")
_PERSISTENT = ("weights", "grads", "optimizer")
_TRANSIENT = ("param_buffers", "activations", "logits")
_ROLLOUT = ("rollout_weights", "kv_cache")


@dataclass(frozen=True)
class RolloutMemory:
    """A rollout engine (vLLM-style) colocated on the training devices.

    Args:
        tp: the engine's tensor-parallel size t_g. When t_g divides the training tp, ranks form engines
            as ``rlkit.plan.hybrid.GenerationLayout`` groups them (rlkit's ``Rollout(tp=t_g)``) and a rank
            holds generation shard ``gen_tp``; otherwise consecutive ranks form one engine.
        dtype: weight dtype of the engine ("bf16", "fp16", "fp32", "fp8").
        kv_dtype: KV-cache dtype (default: ``dtype``).
        max_tokens: KV cache sized for this many tokens per engine (e.g. max_num_seqs x max_model_len).
        gpu_memory_utilization: or, as vLLM does, fill up to this fraction of ``device_memory`` with
            the engine's weights and KV cache (needs ``device_memory``).
        sleep: the engine frees weights and KV cache while training runs (vLLM sleep mode, verl's
            ``free_cache_engine``): the peak is then the larger of the training and rollout phases.
        hybrid_engine: the 3D-HybridEngine (HybridFlow; ``rlkit.parallel.relayout.Resharder``): the
            engine's weights are the actor's, resharded into the generation layout before each
            generation and dropped after it, so they never coexist with training's transient memory.
            Without FSDP sharding (``plan.dp_shard_degree == 1``) a rank's training shard lies inside
            its generation shard and is reused in place: ``rollout_weights`` counts only what it
            lacks (the generation shard minus its training shard). Needs ``tp`` dividing the training
            tp, and reuses memory only when ``dtype`` has the stored parameters' width (a cast is a
            new copy); under FSDP the rank's shard stays allocated, so nothing is reused.

    >>> RolloutMemory(tp=2, max_tokens=4096, hybrid_engine=True).hybrid_engine
    True
    """

    tp: int = 1
    dtype: str = "bf16"
    gpu_memory_utilization: float | None = None
    max_tokens: int | None = None
    kv_dtype: str | None = None
    sleep: bool = False
    hybrid_engine: bool = False

    def __post_init__(self) -> None:
        positive_int("rollout tp", self.tp)
        dtype_bytes(self.dtype, "rollout dtype")
        if self.kv_dtype is not None:
            dtype_bytes(self.kv_dtype, "rollout kv_dtype")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise PlanError(f"rollout gpu_memory_utilization={u!r} must be a fraction in (0, 1]")
        if self.max_tokens is not None:
            positive_int("rollout max_tokens", self.max_tokens)
        if not isinstance(self.hybrid_engine, bool):
            raise PlanError(f"rollout hybrid_engine={self.hybrid_engine!r} must be True or False")
        if (u is None) == (self.max_tokens is None):
            raise PlanError("a rollout needs exactly one of max_tokens=N (KV cache for N tokens) or "
                            "gpu_memory_utilization=F (fill F x device_memory, as vLLM does)")

    @classmethod
    def coerce(cls, value: Any) -> RolloutMemory | None:
        """``value`` as a RolloutMemory: None and RolloutMemory as they are, a dict as its fields.

        >>> RolloutMemory.coerce({"tp": 2, "max_tokens": 4096}).tp
        2
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise PlanError(f"rollout={value!r}: {e}; fields are tp, dtype, kv_dtype, max_tokens, "
                                f"gpu_memory_utilization, sleep, hybrid_engine") from None
        raise PlanError(f"rollout={value!r} must be None, a dict or a RolloutMemory")


# ---- activations --------------------------------------------------------------------------------
def _layer_activation_bytes(spec: ModelSpec, s: int, b: int, tp: int, act_bytes: int,
                            sequence_parallel: bool, flash_attention: bool, recompute: str = "none") -> int:
    """Bytes one decoder layer saves for backward, for one micro-batch (Korthikanti et al. 2022).
    Flash attention and selective recompute both drop the attention core's s^2 terms."""
    h, a = spec.hidden_size, spec.num_attention_heads
    scores = 0 if flash_attention or recompute == "selective" else 5 * a * s * s * b
    if sequence_parallel or tp == 1:
        n = (34 * s * b * h + scores) // tp
    else:
        n = 10 * s * b * h + (24 * s * b * h + scores) // tp
    qk_norm = 0
    if spec.qk_norm:
        # Qwen3's per-head RMSNorm on q and k (transformers' RMSNorm): the fp32 input, its rsqrt per head and
        # the normed output in the compute dtype, on each rank's heads
        heads = -(-spec.num_attention_heads // tp) + -(-spec.num_key_value_heads // tp)
        qk_norm = s * b * ((4 + act_bytes) * heads * spec.head_dim + 4 * heads)
    return n * act_bytes // 2 + qk_norm


def _moe_layer_activation_bytes(spec: ModelSpec, s: int, b: int, tp: int, act_bytes: int, sequence_parallel: bool,
                                flash_attention: bool, recompute: str = "none", ep: int = 1) -> int:
    """Bytes one sparse (mixture-of-experts) decoder layer saves for backward, for one micro-batch: the dense
    layer's (Korthikanti) less its MLP's share (input 2, the two 4h outputs 8 + 8, dropout mask 1, in sbh
    units of 16-bit activations; TP splits the 16), plus what the MoE MLP saves per token (``rlkit.parallel.moe``
    and transformers' experts, counted tensor by tensor; the router and experts run on every token on each TP
    rank):

    * its input, ``h`` (read by the router and gathered for dispatch);
    * the router: softmax probabilities (fp32) and the router losses' copies of the real tokens' logits and
      probabilities: ``E x (8 + compute bytes)``, + 4 more with 16-bit logits (their fp32 upcast);
    * the **dispatch buffers**: the ``k`` rows of ``h`` each token sends to its experts, as the experts receive
      them, and the ``k`` rows the combine returns (kept for the routing-weight product): ``2 k h``, the
      all-to-all's payloads under expert parallelism;
    * each routed row through its expert: the gate/up output ``2 I``, the SiLU and the product ``I`` each:
      ``4 k I``; its routing weight ``k``; the top-k weights and indices (fp32 / int64) and the permutation
      indices of the dispatch (int64: 5 per slot under EP, 3 in transformers' loop);
    * shared experts (DeepSeek): a dense gated MLP ``n_shared x I`` wide, split by TP: ``4 n_shared I / tp``.

    >>> from rlkit.plan.spec import as_spec
    >>> spec = as_spec("qwen3-30b-a3b")
    >>> moe = _moe_layer_activation_bytes(spec, 4096, 1, 1, 2, False, True)
    >>> moe > _layer_activation_bytes(spec, 4096, 1, 1, 2, False, True)   # 8 experts x 768 > one 6144 MLP
    True
    """
    dense = _layer_activation_bytes(spec, s, b, tp, act_bytes, sequence_parallel, flash_attention, recompute)
    h, cb = spec.hidden_size, act_bytes
    mlp = (19 * s * b * h // tp if sequence_parallel or tp == 1 else 3 * s * b * h + 16 * s * b * h // tp) * cb // 2
    k, e, i = spec.num_experts_per_tok, spec.num_experts, spec.moe_intermediate_size
    per_token = (h * cb + e * (8 + cb + (4 if cb < 4 else 0)) + 24
                 + k * (2 * h * cb + 4 * i * cb + cb + 4 + 8 * (5 if ep > 1 else 3))
                 + 4 * spec.n_shared_experts * i * cb // tp)
    return dense - mlp + s * b * per_token


def _layer_saved(spec: ModelSpec, s: int, b: int, tp: int, cb: int, sequence_parallel: bool, eager: bool,
                 lora: tuple[tuple[str, ...], int, bool] | None = None, rg: bool = True) -> tuple[int, bool]:
    """The tensors one decoder layer (HF Llama / Qwen2: RMSNorm, q/k/v/o, gated MLP) saves for backward,
    one by one, in bytes for ``b x s`` tokens on one TP rank, and whether its output requires grad.

    ``lora=None``: full fine-tuning, where every weight trains. ``lora=(targets, r, dropout)``: the base is
    frozen and ``targets`` carry adapters; ``rg`` says whether the layer's input requires grad (not on
    the first stage before the first adapter: the embedding is frozen). Autograd saves an op's input
    only for a gradient that is needed, so with a frozen base:

    * a linear layer's input is saved only by its adapters' ``lora_A`` (one tensor, however many of
      q/k/v or gate/up read it; with ``lora_dropout`` each adapter saves its own dropped copy and, while
      the input requires grad, its 1-byte mask instead), plus the r-wide ``lora_A(x)`` each ``lora_B``
      saves;
    * an RMSNorm keeps its input and ``rsqrt`` while its input requires grad, never ``normed`` (the
      input of ``weight * normed``, needed only for the frozen weight's gradient);
    * the attention core and the gated MLP keep what their inputs' gradients need: QK^T keeps the
      rotated q for k's gradient and k for q's, the softmax its output while q or k require grad, PV the
      probabilities for v's gradient and v for theirs; SiLU its input and ``act * up`` each factor
      for the other's gradient. A fused attention kernel keeps q, k, v and its output while any of
      them requires grad.

    Full fine-tuning keeps, per token: ``6h + 2`` replicated (two norms' input, ``normed``, output and
    ``rsqrt``), ``2q + 2k + a s`` (rotated q, k, v, the probabilities; k and v at ``kv_dim`` where a rank
    holds one KV head or none are shared, ``q_dim`` where ``repeat_kv`` copies them) and ``q + 4i`` split
    by TP (the attention output, gate and up outputs, SiLU, their product).

    >>> from rlkit.plan.spec import as_spec
    >>> spec = as_spec("llama-2-7b")    # h = q = 4096, i = 11008, 32 heads; one token, fp32, eager
    >>> saved = lambda **kw: _layer_saved(spec, 1, 1, 1, 4, False, True, **kw)
    >>> saved()[0] // 4                                                # 6h + 2 + 4q + a s + 4i
    85026
    >>> saved(lora=(("q_proj", "v_proj"), 8, False))[0] // 4           # - 2h - q - h - i + 2r
    57650
    >>> saved(lora=(("o_proj",), 8, False), rg=False)[0] // 4   # frozen up to o_proj: q + r + h + 1 + 3i
    41225
    """
    a = spec.num_attention_heads
    h = -(-spec.hidden_size // tp) if sequence_parallel else spec.hidden_size  # replicated (sequence-split)
    q, inter = -(-spec.q_dim // tp), -(-spec.intermediate_size // tp)          # TP-split
    kv_local = spec.num_key_value_heads // tp
    # repeat_kv: a view of k / v where a rank holds one KV head (or each head is its own), else a copy
    kv = -(-spec.kv_dim // tp) if kv_local <= 1 or spec.num_key_value_heads == a else q
    probs = -(-a // tp) * s
    full = lora is None
    targets, r, dropout = ((), 0, False) if lora is None else lora
    mask = 0

    def trains(name: str) -> bool:
        return full or name in targets

    def inputs(n: int, readers: tuple[str, ...], input_rg: bool) -> int:
        nonlocal mask
        if full:
            return n
        adapted = sum(name in targets for name in readers)
        if dropout:
            mask += adapted * n * input_rg
            return adapted * n + adapted * r
        return (n if adapted else 0) + adapted * r

    def norm(input_rg: bool) -> int:
        return 2 * h + 1 if full else (h + 1) * input_rg

    rg = rg or full
    el = norm(rg) + inputs(h, ("q_proj", "k_proj", "v_proj"), rg)
    rq, rk, rv = (rg or trains(n) for n in ("q_proj", "k_proj", "v_proj"))
    if eager:
        el += q * rk + kv * rq + kv * (rq or rk) + probs * (rq or rk or rv)
    else:
        el += (2 * q + 2 * kv) * (rq or rk or rv)
    attn_rg = rq or rk or rv
    el += inputs(q, ("o_proj",), attn_rg)
    rg = rg or attn_rg or trains("o_proj")
    el += norm(rg) + inputs(h, ("gate_proj", "up_proj"), rg)
    r_gate, r_up = rg or trains("gate_proj"), rg or trains("up_proj")
    el += 2 * inter * r_gate + inter * r_up
    el += inputs(inter, ("down_proj",), r_gate or r_up)
    return s * b * (el * cb + mask), rg or r_gate or r_up or trains("down_proj")


def _in_flight(plan: ParallelPlan, pp_rank: int) -> int:
    """Micro-batch chunks whose activations pipeline rank ``pp_rank`` holds at its peak, in units of
    one virtual stage (``layers_on_rank / vpp`` layers)."""
    m, pp, v = plan.n_micro_batches, plan.pp, plan.vpp
    if pp == 1:
        return 1  # gradient accumulation runs micro-batches one after another
    sched = plan.pipeline_schedule
    if sched == "gpipe":
        return m * v
    if sched == "1f1b":
        return min(pp - pp_rank, m)
    # interleaved 1F1B: Megatron's warm-up (pp - r - 1) * 2 + (v - 1) * pp, plus one in steady state
    return min((pp - pp_rank - 1) * 2 + (v - 1) * pp + 1, m * v)


# ---- the estimate ---------------------------------------------------------------------------------
def estimate_memory(plan: ParallelPlan, model: Any, *, seq_len: int = 2048, micro_batch: int = 1,
                    precision: str = "bf16-mixed", optimizer: str = "adamw",
                    recompute: str | None = None, activation_checkpointing: bool | None = None,
                    roles: tuple[str, ...] | list[str] = ("actor",),
                    rollout: Any = None, device_memory: Any = None, sequence_parallel: bool = False,
                    flash_attention: bool = True, vocab_parallel: bool = True,
                    gathered_logits: bool = False, logits_copies: int = 2, token_budget: int | None = None,
                    image_tokens: int = 0, freeze_vision_tower: bool = False,
                    lora: Any = None, _peak_only: bool = False) -> pd.DataFrame:
    """Bytes each rank of ``plan`` holds to train ``model``: one row per rank.

    **Defaults describe a GPU training stack**: bf16-mixed AdamW, SDPA/flash attention (no s^2
    attention scores kept), no recompute, no sequence parallelism. ``rlkit.parallel`` on CPU builds
    HF models with eager attention: pass ``flash_attention=False`` to compare with it.

    Columns (ints, bytes unless said): ``rank, dp, tp, pp, layers`` (decoder layers on the rank),
    ``param_tensors`` (trained parameter tensors of the trained roles), ``weights, grads, optimizer,
    param_buffers, activations, logits, kv_cache, rollout_weights, total``; with ``device_memory``
    also ``fits`` (bool). ``df.attrs`` holds the settings (and ``device_memory``).

    **Layout assumed** (what rlkit.parallel builds; torch-native): TP with DTensor
    ``ColwiseParallel`` on q/k/v/gate/up (weight and bias Shard(0)), ``RowwiseParallel`` on o/down
    (weight Shard(1), bias replicated), norms replicated; with ``vocab_parallel`` the embedding
    (RowwiseParallel = vocab rows) and lm_head (ColwiseParallel) are split over the vocab, else
    replicated. Uneven TP splits follow ``torch.chunk`` (pieces of ceil(n/tp)). DP with FSDP2
    ``fully_shard`` on each decoder layer and on the stage root, over ``plan.dp_shard_degree``
    ranks (HSDP: shard index = dp % dp_shard_size, as a (replicate, shard) mesh). PP: pipeline rank
    r holds virtual stages r, r+pp, ...; the first stage also the embedding, the last the final
    norm and lm_head; tied embeddings are one tensor when pp == 1 (TP shares one vocab-sharded
    matrix) and a copy on the last stage when pp > 1, its gradient summed with the first stage's
    (``ModelSpec.stage_params``).

    **Persistent state** (Rajbhandari et al. 2019, "ZeRO", Sec. 3.1: mixed-precision Adam holds
    2 + 2 + 12 = 16 bytes/param: fp16 params and grads, fp32 master, momentum, variance). Here, in
    FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` form, per element:

    ============  ======  =====  =========================  ==============
    precision     weights grads  optimizer (adamw / sgd)    compute copy
    ============  ======  =====  =========================  ==============
    "fp32"        4       4      8 / 0                      (fp32)
    "bf16-mixed"  4       4      8 / 0  -> 16 B/param total  2 (transient)
    "bf16"        2       2      4 / 0                      (bf16)
    ============  ======  =====  =========================  ==============

    Sharding over ``S = plan.dp_shard_degree`` with torch's padding: for a tensor whose TP-local
    shape is (d0, d1), a rank's parameter storage and its gradient (a view into the padded
    reduce-scatter output) hold ``ceil(d0/S) * d1`` elements on *every* shard rank, while optimizer
    states (``zeros_like`` of the unpadded view) hold that rank's real rows
    ``min(ceil(d0/S), max(0, d0 - j*ceil(d0/S))) * d1`` (j = shard index). "replicate" is S = 1;
    "shard_grad_op" (ZeRO-2 = FSDP2 ``reshard_after_forward=False``) persists the same shards as
    "full_shard" and keeps the unsharded compute copy in ``param_buffers``.

    ``param_buffers`` (transient, approximate): unsharded compute-dtype parameters alive at the
    peak plus one layer's gradient reduce buffers. full/hybrid_shard: the stage root (embedding,
    norm, lm_head; FSDP2 does not reshard the root after forward) + 2 decoder layers (current and
    prefetched), plus one layer's unsharded grads in compute and reduce dtype. shard_grad_op: the
    whole stage unsharded, plus one layer's grads. replicate: a compute copy of the stage only when
    the compute dtype differs from the stored one (bf16-mixed). With several micro-batches grads are
    reduced only after the last one (``set_requires_gradient_sync(False)`` before: rlkit.parallel
    does so, and so does ``torch.distributed.pipelining``), so they accumulate unsharded: add
    (unsharded - sharded) x grad bytes. With pp > 1 the pipelining schedule also calls
    ``set_reshard_after_backward(False)``, so a stage keeps its whole unsharded compute copy (the
    stage's TP-local params x compute bytes; for replicate only when bf16-mixed).

    **Activations** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", Eq. 1-5), per decoder layer and micro-batch, for 16-bit activations
    (scaled by compute bytes / 2), s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp:
    no TP ``sbh(34 + 5as/h)``; TP ``sbh(10 + 24/t + 5as/(ht))``; TP + sequence parallel
    ``sbh(34/t + 5as/(ht))``. ``flash_attention=True`` drops the ``5as/h`` attention-score term
    (same saving as the paper's selective recomputation). ``recompute="selective"`` (Korthikanti
    Sec. 5: recompute only the attention core, QK^T, softmax, dropout, attention over V) drops the
    same term: ``34sbh/t`` with SP. ``recompute="full"`` (``activation_checkpointing=True`` is its
    alias) keeps only each layer's input, ``2sbh`` (``/t`` with SP), plus one layer's full
    activations during its recomputation. The 34 is the paper's GPT accounting (4h MLP, dropout
    masks); for gated-MLP models it is an approximation.

    **Pipeline in-flight micro-batches** (held at the peak by pipeline rank r of pp, m micro-batches):
    GPipe: all m (Huang et al. 2019); 1F1B: ``min(pp - r, m)`` (Narayanan et al. 2021 PipeDream-
    Flush, Megatron's warm-up ``pp - r - 1`` + 1); interleaved 1F1B with v virtual stages:
    ``min(2(pp - r - 1) + (v - 1)pp + 1, m*v)`` chunks of ``layers/v`` layers (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters", Sec. 2.2; Megatron's
    ``get_forward_backward_func`` warm-up), i.e. ``pp(1 + (pp-1)/(pp v))`` micro-batches of a stage's
    layers on the first rank (Korthikanti Sec. 4.2.3). pp = 1: one micro-batch at a time.

    **Padding-free micro-batches** (``token_budget``: ``TrainerConfig.micro_batch_tokens``,
    ``ParallelModel.set_packing(token_budget=...)``): sequences are packed several to a row, rows as
    wide as the longest sequence, and a micro-batch holds up to ``token_budget`` tokens, padding in
    its rows included (``rlkit.parallel.packing``). ``seq_len`` is then that row width (the longest
    sequence; ``ParallelModel`` rounds it up to a multiple of 16 under a pipeline) and one micro-batch
    is ``token_budget // seq_len`` rows of ``seq_len``, which replaces ``micro_batch`` (leave it 1):
    everything that scales with tokens (hidden states, MLP) follows the budget's tokens, whatever the
    responses' lengths; only the eager attention scores grow with the width (each row's
    ``seq_len^2``, block-diagonal over its sequences). The logits follow the scored tokens, the
    budget's at most: the row tokens are counted. A budget below ``seq_len`` cannot hold the longest
    sequence (a PlanError, as the packer raises). The plan's ``n_micro_batches`` stays the
    micro-batch count (give the plan the packer's count, ``ParallelPlan(micro_batches=m)``): with GPipe
    all of them are in flight, and with more than one the gradients accumulate unsharded.

    >>> from rlkit.plan import ParallelPlan
    >>> acts = lambda **kw: int(estimate_memory(ParallelPlan(), "llama-2-7b", **kw).activations[0])
    >>> acts(seq_len=2048, token_budget=8192) == acts(seq_len=2048, micro_batch=4)
    True
    >>> len({acts(seq_len=s, token_budget=8192) for s in (1024, 2048, 4096, 8192)})   # flash: no s^2 term
    1

    **Logits** (last stage, actor and reference): ``micro_batch x seq_len x vocab/tp x 4 bytes x
    logits_copies``. The log-prob computation upcasts logits to fp32 and applies log-softmax,
    whose output autograd saves; both fp32 buffers are alive at its peak, so ``logits_copies=2``
    counts the upcast *and* the log-softmax copy (the 16-bit logits themselves are not counted).
    GPipe keeps all m micro-batches' copies on the last stage. ``gathered_logits=True``: the lm_head
    gathers the full vocabulary on every TP rank (``ColwiseParallel(output_layouts=Replicate())``,
    as ``rlkit.parallel.apply.tp_plan`` does), so count ``vocab`` instead of ``vocab/tp``.

    **RL roles** (``roles``, colocated): "actor" trains; "critic" trains too with a value head
    (hidden -> 1, with bias, replicated) instead of lm_head and no logits; "reference" holds
    weights only, in the compute dtype, sharded like the actor. Persistent state adds up over
    roles; transient memory (param_buffers, activations, logits) is that of the role whose phase
    peaks highest (roles run one after another).

    **Rollout** (``rollout``: a :class:`RolloutMemory` or its dict): weights split over the
    engine's tp (same tensor split, no DP sharding); KV cache per device, vLLM-style:
    ``2 x layers x kv_heads x head_dim x kv_dtype_bytes / tp`` bytes per token
    (``ModelSpec.kv_bytes_per_token``; KV heads are replicated when tp > kv_heads, as vLLM does)
    times ``max_tokens``, or ``gpu_memory_utilization x device_memory`` - the engine's weights.
    ``total`` adds both to the training peak, or with ``sleep=True`` takes the larger phase. When the
    rollout tp t_g divides the training tp, a rank holds the generation shard its
    ``GenerationLayout`` coordinates name (``gen_tp = tp_rank // (tp / t_g)``), and ``max_tokens``
    is per t_g-way engine (every rank holds 1/t_g of its engine's KV cache).

    **3D-HybridEngine** (``RolloutMemory(hybrid_engine=True)``): the generation shard is the actor's
    weights resharded (``rlkit.parallel.relayout.Resharder``) and released after generation. Without
    FSDP sharding and with ``dtype`` as wide as the stored parameters, the rank's training shard is
    reused in place, so ``rollout_weights`` = generation shard - training shard inside it (exact,
    from the tensor shapes); otherwise the whole generation shard. ``total`` = persistent +
    kv_cache + max(transient, rollout_weights), or with ``sleep=True`` persistent + max(transient,
    rollout_weights + kv_cache): the peak of the training and generation phases.

    **Mixture of experts** (``ModelSpec.sparse_layers``; ``plan.ep``), as ``rlkit.parallel.moe`` lays a sparse
    layer out: the router ``mlp.gate`` (E, H) is an ordinary parameter (FSDP-sharded, whole on every TP rank);
    the routed experts ``experts.gate_up_proj`` (E, 2I, H) and ``experts.down_proj`` (E, H, I) are, with
    ``ep == 1``, FSDP-sharded over dim 0 like any parameter (whole on every TP rank), and with ``ep > 1``
    DTensors ``Shard(0)`` over the ``ep`` ranks of an EP group that FSDP ignores: each rank holds ``E/ep``
    whole experts, replicated over the ``dp/ep`` expert-DP ranks, with grads and AdamW states of the same
    local size and no gathered compute copy (``param_buffers`` leaves them out). Dense layers of an MoE model
    (DeepSeek's first three) keep the dense layout. A sparse layer's ``activations`` replace the dense MLP's
    share by what the MoE MLP saves, dispatch buffers included (``_moe_layer_activation_bytes``), per layer
    and micro-batch in flight. Measured against the runtime (``python -m rlkit.parallel --ep 2``, tiny
    Qwen3-MoE, fp32 eager; ``tests/test_plan_moe.py``): weights, grads and optimizer exact on every rank for
    ep=2, dp=4 x ep=2 and dp=2 x ep=2 x pp=2; activations assume a balanced router (every rank receives
    ``k`` rows per token), so a rank whose experts draw more tokens holds more and one that draws fewer less:
    within 12% per rank (-11% to +10%) on the tiny model's random router.

    **Torch comparison hook**: with ``precision="fp32", optimizer="adamw"`` the columns
    ``weights``, ``grads``, ``optimizer`` equal the bytes of the unique storages a real FSDP2 +
    DTensor TP + PP model with ``torch.optim.AdamW`` holds per rank after ``step()`` (grads not
    yet zeroed), padding included as described above. AdamW's 0-dim ``step`` tensors (4 bytes per
    parameter tensor, ``param_tensors`` of them) are *not* in ``optimizer``. Compare with
    :func:`rlkit.plan.memory_report.compare_memory`.

    **LoRA** (``lora``: a peft ``LoraConfig``, read by its attributes ``r``, ``target_modules``...; an int
    ``r``, rlkit's shorthand for the seven projections q/k/v/o/gate/up/down; or a
    :class:`~rlkit.plan.spec.LoraSpec`), as ``rlkit.parallel`` trains it (peft adapters injected before
    the split; ``ParallelModel(..., lora=...)``): each adapted linear layer (in -> out) gets ``lora_A``
    (r x in) and ``lora_B`` (out x r) in the parameter dtype, split under TP like its base (column-parallel
    q/k/v/gate/up: ``lora_B`` Shard(0), ``lora_A`` replicated; row-parallel o/down: ``lora_A`` Shard(1),
    ``lora_B`` replicated), sharded by FSDP2 as every other parameter (padding included), on its decoder
    layer's pipeline stage. The base stays, frozen. So for the actor: ``weights`` = base + adapters,
    ``grads`` and ``optimizer`` = the adapters only (the base has no gradient and no AdamW state) and
    ``param_tensors`` counts the adapter tensors (AdamW's ``step`` tensors). ``param_buffers``: the
    all-gathered compute copies are of base + adapters (FSDP2 gathers frozen parameters too), the gradient
    buffers and the unsharded gradients of accumulation are the adapters'. ``activations``: autograd saves an
    op's input only for a gradient that is needed, and a frozen weight needs none, so LoRA saves *less* than
    full fine-tuning. Each decoder layer's tensors are counted one by one for both (``_layer_saved``; HF
    Llama / Qwen2 layers) and the per-layer term above is scaled by the share LoRA keeps. Under LoRA a
    frozen linear layer no longer keeps its input: only its adapter's ``lora_A`` does (one tensor for
    q/k/v or gate/up together), so the attention input goes when none of q/k/v is adapted, the attention
    output without an o_proj adapter, the MLP input without gate/up, the SiLU product without down_proj;
    each ``lora_B`` adds its r-wide input ``lora_A(x)`` (``micro_batch x seq_len x r``, whole on every TP
    rank); an RMSNorm keeps its input and ``rsqrt`` but not ``normed`` (the input of its frozen weight's
    product). On the first pipeline stage the frozen embedding's output needs no gradient, so until the
    first adapter nothing is saved, and in the first adapted layer only what the adapted projections'
    gradients need (e.g. with q and v adapted, QK^T keeps k for q's gradient but not the rotated q).
    With ``lora_dropout > 0`` each adapter saves its own dropped copy of its input instead
    (``in_features x compute bytes``) and, where that input requires grad, its 1-byte mask (CUDA's
    ``native_dropout``; CPU's dropout keeps the mask in the input's dtype); rlkit allows dropout only with
    tp=1. The logits and the head's other tensors are left as full fine-tuning counts them (the frozen
    lm_head no longer keeps its input, which the head term does not count either). Under
    ``recompute="full"`` only the recomputed layer's share applies. Measured against the runtime
    (``python -m rlkit.parallel --lora 4``, tiny Qwen2, fp32 eager) the activations are within about 1.5%
    for the seven projections, attention or MLP only, q/v only, on one rank, dp=2, tp=2 and pp=2. The
    critic trains its full weights (LoRA is the actor's), and a ``"reference"`` next to the actor is the
    same model with its adapters switched off: it adds no weights. With the 3D-HybridEngine the generation
    layout reads merged weights ``W + s B A``: a new tensor per adapted weight on top of the generation
    shard (``rollout_weights``; the adapters it gathers on the way, small and dropped after the merge, are
    not counted). ``df.attrs`` records
    ``lora`` (the LoraSpec), ``lora_params`` (adapter parameters of the whole model,
    :func:`~rlkit.plan.spec.lora_params`) and ``lora_targets`` (the adapted layers' short names).

    **Vision-language models** (``ModelSpec.is_vision_language``: Qwen2.5-VL), as ``rlkit.parallel`` lays them
    out: the vision tower sits on the first pipeline stage beside the embedding, whole on every TP rank (the
    TP plan splits the decoder layers only), its tensors (``rlkit.plan.sharding.vision_tensors``) sharded by
    FSDP2 in the stage root's unit, so it counts in ``weights``, ``grads``, ``optimizer``, ``param_buffers``
    (the root stays gathered) and ``param_tensors`` like the embedding, with their padding.
    ``freeze_vision_tower=True`` (the actor's and the critic's tower; a LoRA actor's is frozen anyway): its
    weights stay, with no gradient, no optimizer state and no activations. ``image_tokens``: image tokens per
    sequence (:func:`rlkit.plan.vision.image_tokens` of each image, summed), which are part of ``seq_len``:
    the language model runs them as it runs text, and the trained tower keeps, on the first stage, what
    :func:`rlkit.plan.vision.vision_activation_bytes` counts for their ``merge^2`` patches each, for every
    micro-batch in flight there (the tower is not recomputed: ``recompute`` is the decoder layers'). A
    ``rollout`` engine holds the tower whole on each rank (vLLM splits its blocks over its TP: an upper
    bound there). ``df.attrs`` records ``image_tokens``, ``freeze_vision_tower`` and ``vision_params``.

    >>> full = estimate_memory(ParallelPlan(dp=2), "qwen2.5-vl-7b", seq_len=1024, image_tokens=256)
    >>> frozen = estimate_memory(ParallelPlan(dp=2), "qwen2.5-vl-7b", seq_len=1024, image_tokens=256,
    ...                          freeze_vision_tower=True)
    >>> int((full.grads + full.optimizer - frozen.grads - frozen.optimizer)[0]) == 12 * 676550144 // 2
    True
    >>> f"{(full.activations - frozen.activations)[0] / 2**30:.2f} GiB"   # the tower's, one 448 x 448 image
    '2.03 GiB'

    >>> full = estimate_memory(ParallelPlan(dp=8), "llama-3-8b", precision="fp32")
    >>> adapted = estimate_memory(ParallelPlan(dp=8), "llama-3-8b", precision="fp32", lora=16)
    >>> from rlkit.plan.spec import lora_params
    >>> int(adapted.grads[0]) == 4 * lora_params("llama-3-8b", 16) // 8     # fp32 grads of the adapters
    True
    >>> int(adapted.weights[0] - full.weights[0]) == int(adapted.grads[0])  # base + adapters
    True
    >>> adapted.attrs["lora_targets"]
    ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')
    >>> f"{adapted.activations[0] / full.activations[0]:.2f}"   # frozen weights keep fewer inputs
    '0.92'
    """
    spec, s, b = check_common(plan, model, seq_len, micro_batch, precision)
    if token_budget is not None:
        b = budget_rows(token_budget, s, b)
    recompute = recompute_mode(recompute, activation_checkpointing)
    positive_int("logits_copies", logits_copies)
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer={optimizer!r} is unknown; choose one of {list(OPTIMIZERS)}")
    roles = (roles,) if isinstance(roles, str) else tuple(roles)
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles or len(set(roles)) != len(roles):
        raise PlanError(f"roles={roles!r}: each must be one of {list(ROLES)}, once; e.g. roles=('actor', 'reference')")
    ro = RolloutMemory.coerce(rollout)
    mem = parse_bytes(device_memory) if device_memory is not None else None
    check_vision(spec, s, image_tokens, freeze_vision_tower)
    lo = LoraSpec.coerce(lora)
    lora_layers: tuple[tuple[str, ...], ...] = ()
    if lo is not None:
        if "actor" not in roles:
            raise PlanError(f"lora={lora!r} trains the actor's adapters, and roles={roles!r} has no 'actor' (a "
                            f"critic trains its full weights); add 'actor' to roles or drop lora")
        if lo.lora_dropout and plan.tp > 1:
            raise PlanError(f"LoRA lora_dropout={lo.lora_dropout} with tp={plan.tp}: the TP ranks would draw "
                            f"different dropout masks for the same replicated input (rlkit refuses it); use "
                            f"lora_dropout=0.0 or tp=1")
        lora_layers = lo.layer_targets(spec)  # validates the targets against the model
    if ro is not None:
        if plan.world_size % ro.tp:
            raise PlanError(f"rollout tp={ro.tp} does not divide world_size={plan.world_size}; choose a "
                            f"rollout tp that divides it")
        if spec.num_attention_heads % ro.tp:
            raise PlanError(f"rollout tp={ro.tp} does not divide num_attention_heads={spec.num_attention_heads}")
        if ro.gpu_memory_utilization is not None and mem is None:
            raise PlanError("rollout gpu_memory_utilization needs device_memory (e.g. device_memory='80GB'), "
                            "or give the rollout max_tokens instead")
    # which generation shard a rank holds: GenerationLayout's gen_tp when the rollout tp divides the
    # training tp (rlkit's Rollout(tp=t_g)); consecutive ranks per engine otherwise
    layout = None
    if ro is not None and (ro.hybrid_engine or plan.tp % ro.tp == 0):
        from rlkit.plan.hybrid import GenerationLayout

        layout = GenerationLayout(plan, tp=ro.tp)
        if ro.hybrid_engine:
            layout.validate(spec)  # the Resharder needs whole attention and KV heads per rank

    prec = PRECISIONS[precision]
    n_states = OPTIMIZERS[optimizer]
    tp, pp, S = plan.tp, plan.pp, plan.dp_shard_degree
    layer_t = layer_tensors(spec)
    layers_per_rank = [0] * pp
    for st, rng in enumerate(plan.stage_layers(spec.num_layers)):
        layers_per_rank[st % pp] += len(rng)
    per_layer_act = _layer_activation_bytes(spec, s, b, tp, prec["compute"], sequence_parallel, flash_attention,
                                            recompute)
    # mixture of experts: each pipeline rank's dense and sparse layers; the tensors FSDP manages in each kind
    # (under expert parallelism the routed experts leave FSDP: E/ep whole experts per rank, replicated over
    # the expert-DP ranks), and what a sparse layer saves for backward
    ep = plan.ep
    kinds = stage_layer_kinds(spec, plan)
    kind_t = {k: tuple(x for x in (layer_t if k == bool(spec.sparse_layers) else layer_tensors(spec, k))
                       if not (ep > 1 and is_expert(x)))
              for k in {k for kk in kinds for k in kk} | {bool(spec.sparse_layers)}}
    expert_t = tuple(x for x in layer_tensors(spec, True) if is_expert(x)) if spec.is_moe and ep > 1 else ()
    layer_act = {False: per_layer_act,
                 True: _moe_layer_activation_bytes(spec, s, b, tp, prec["compute"], sequence_parallel, flash_attention,
                                                   recompute, ep) if spec.is_moe else per_layer_act}
    ckpt_layer = 2 * s * b * spec.hidden_size * prec["compute"] // 2 // (tp if sequence_parallel else 1)
    # a vision-language model's tower (first stage): its tensors, and what it saves for one micro-batch's images
    vis_t = vision_tensors(spec)
    vis_act = 0 if freeze_vision_tower else vision_activation_bytes(spec, image_tokens, b, prec["compute"],
                                                                    flash_attention)

    # LoRA: per pipeline rank, how many of its layers carry each set of adapted linear layers, and how the
    # activations its layers save differ from full fine-tuning's (all its layers; the largest one layer's)
    lora_groups: list[dict[tuple[str, ...], int]] = [{} for _ in range(pp)]
    lora_act = [0] * pp
    lora_act_max: list[int | None] = [None] * pp
    if lo is not None:
        # a layer keeps the share of full fine-tuning's saved bytes that its tensors, counted one by one,
        # still need with a frozen base (_layer_saved): the per-layer term scaled by it
        saved = partial(_layer_saved, spec, s, b, tp, prec["compute"], sequence_parallel,
                        not flash_attention and recompute != "selective")
        full_layer = saved()[0]
        for st, rng in enumerate(plan.stage_layers(spec.num_layers)):
            p = st % pp
            rg = st > 0  # the frozen embedding's output needs no grad; a later stage's input does
            for i in rng:
                targets = lora_layers[i]
                if targets:
                    lora_groups[p][targets] = lora_groups[p].get(targets, 0) + 1
                kept, rg = saved((targets, lo.r, bool(lo.lora_dropout)), rg)
                act = per_layer_act * kept // full_layer - per_layer_act
                lora_act[p] += act
                lora_act_max[p] = act if lora_act_max[p] is None else max(lora_act_max[p], act)

    def adapter_shard(p: int, t: int, j: int) -> tuple[Shard, int]:
        """What rank (p, t, j) holds of its stage's adapters, and one layer's TP-local adapters (the largest)."""
        out, one = Shard(), 0
        for targets, count in lora_groups[p].items():
            tensors = lo.tensors(spec, targets)
            sh = rank_shard(tensors, count, tp, t, S, j)
            out.padded, out.actual, out.local = out.padded + sh.padded, out.actual + sh.actual, out.local + sh.local
            out.tensors += sh.tensors
            one = max(one, rank_shard(tensors, 1, tp, t, S, j).local)
        return out, one

    def role_bytes(role: str, p: int, t: int, j: int) -> dict[str, int]:
        root_t = root_tensors(spec, pp, tp, p, role, vocab_parallel)
        L = layers_per_rank[p]
        lay, one_layer = Shard(), Shard()
        for k, n in kinds[p].items():
            sh = rank_shard(kind_t[k], n, tp, t, S, j)
            lay.padded, lay.actual, lay.local, lay.tensors = (lay.padded + sh.padded, lay.actual + sh.actual,
                                                              lay.local + sh.local, lay.tensors + sh.tensors)
            one = rank_shard(kind_t[k], 1, tp, t, S, j)
            if one.local > one_layer.local:
                one_layer = one
        # expert parallelism: this rank's E/ep experts of each sparse layer, whole (no FSDP, no TP split)
        experts = rank_shard(expert_t, kinds[p].get(True, 0), 1, 0, ep, 0) if expert_t else Shard()
        root = rank_shard(root_t, 1, tp, t, S, j)
        padded, actual, local = lay.padded + root.padded, lay.actual + root.actual, lay.local + root.local
        out = dict(weights=0, grads=0, optimizer=0, param_buffers=0, activations=0, logits=0, tensors=0)
        cb = prec["compute"]
        if role == "reference":
            # with LoRA the reference is the actor's model with its adapters off: no weights of its own
            out["weights"] = 0 if lo is not None else (padded + experts.padded) * cb
            out["param_buffers"] = (root.local + min(2, L) * one_layer.local) * cb if plan.dp_shard != "replicate" else 0
        else:
            # what trains (grads, optimizer state) and what is stored: everything, or with LoRA (the
            # actor's) the adapters, next to the frozen base
            trained, trained_one = Shard(padded, actual, local, lay.tensors + root.tensors), one_layer.local
            if p == 0 and vis_t and freeze_vision_tower:  # a frozen tower: stored and gathered, never trained
                vis = rank_shard(vis_t, 1, tp, t, S, j)
                trained = Shard(padded - vis.padded, actual - vis.actual, local - vis.local,
                                trained.tensors - vis.tensors)
            stored_padded, stored_local, stored_one = padded, local, one_layer.local
            lora_act_all = lora_act_one = 0
            if lo is not None and role == "actor":
                trained, trained_one = adapter_shard(p, t, j)
                stored_padded, stored_local, stored_one = (padded + trained.padded, local + trained.local,
                                                           one_layer.local + trained_one)
                lora_act_all, lora_act_one = lora_act[p], lora_act_max[p] or 0
            out["weights"] = (stored_padded + experts.padded) * prec["param"]
            # (the experts train unless the actor trains LoRA adapters only)
            trains_experts = not (lo is not None and role == "actor")
            out["grads"] = (trained.padded + experts.padded * trains_experts) * prec["grad"]
            out["optimizer"] = n_states * (trained.actual + experts.actual * trains_experts) * prec["state"]
            out["tensors"] = trained.tensors + experts.tensors * trains_experts
            grad_buf = trained_one * (cb + prec["grad"])
            # no grad sync until the last micro-batch: grads accumulate unsharded (beyond the
            # sharded grads counted in ``grads``)
            accum = (trained.local - trained.padded) * prec["grad"] if plan.n_micro_batches > 1 else 0
            if pp > 1:
                # torch.distributed.pipelining also skips the reshard after backward: the stage's
                # params stay unsharded through the step
                copy = cb != prec["param"] or plan.dp_shard != "replicate"
                out["param_buffers"] = stored_local * cb * copy + accum
            elif plan.dp_shard == "replicate":
                out["param_buffers"] = stored_local * cb if cb != prec["param"] else 0
            elif plan.dp_shard == "shard_grad_op":
                out["param_buffers"] = stored_local * cb + grad_buf + accum
            else:
                out["param_buffers"] = (root.local + min(2, L) * stored_one) * cb + grad_buf + accum
            chunks = _in_flight(plan, p)
            if recompute == "full":
                biggest = max((layer_act[k] for k in kinds[p]), default=0)
                out["activations"] = chunks * L * ckpt_layer // plan.vpp + ((biggest + lora_act_one) if L else 0)
            else:
                stage_act = sum(n * layer_act[k] for k, n in kinds[p].items())
                out["activations"] = chunks * (stage_act + lora_act_all) // plan.vpp
            if p == 0 and vis_act and not (lo is not None and role == "actor"):
                # the tower runs before virtual stage 0: one copy per micro-batch in flight there
                out["activations"] += -(-chunks // plan.vpp) * vis_act
        if role != "critic" and p == pp - 1:
            split = vocab_parallel and not gathered_logits
            vocab_local = chunk_len(spec.vocab_size, tp, t) if split else spec.vocab_size
            held = plan.n_micro_batches if (pp > 1 and plan.pipeline_schedule == "gpipe" and role == "actor") else 1
            out["logits"] = b * s * vocab_local * 4 * logits_copies * held
        return out

    def rollout_bytes(p: int, t: int, rt: int) -> dict[str, int]:
        if ro is None:
            return dict(rollout_weights=0, kv_cache=0)
        n_sparse = len(spec.sparse_layers)
        wt = sum(rank_shard(layer_tensors(spec, k), n, ro.tp, rt, 1, 0).local
                 for k, n in ((False, spec.num_layers - n_sparse), (True, n_sparse)) if n)
        wt += rank_shard(root_tensors(spec, 1, 1, 0, "actor", True), 1, ro.tp, rt, 1, 0).local
        wb = dtype_bytes(ro.dtype, "rollout dtype")
        weights = engine = wt * wb
        if ro.hybrid_engine and S == 1 and wb == prec["param"] and "actor" in roles:
            # the actor's training shard sits inside the generation shard: only the rest is new
            weights -= reused_by_generation(spec, plan, ro.tp, p, t) * wb
        if ro.hybrid_engine and lo is not None:
            # LoRA: each adapted weight's generation shard is merged, W + s B A, into a new tensor
            adapted: dict[tuple[str, ...], int] = {}
            for targets in lora_layers:
                adapted[targets] = adapted.get(targets, 0) + 1
            weights += sum(rank_shard(tuple(x for x in layer_t if x[0] in targets), n, ro.tp, rt, 1, 0).local
                           for targets, n in adapted.items() if targets) * wb
        kvb = dtype_bytes(ro.kv_dtype or ro.dtype, "rollout kv_dtype")
        kvh = spec.num_key_value_heads
        per_tok = (spec.kv_bytes_per_token(kvb, ro.tp) if kvh % ro.tp == 0
                   else 2 * spec.num_layers * -(-kvh // ro.tp) * spec.head_dim * kvb)
        if ro.max_tokens is not None:
            kv = ro.max_tokens * per_tok
        else:
            kv = max(0, int(ro.gpu_memory_utilization * mem) - engine)
        return dict(rollout_weights=weights, kv_cache=kv)

    # ranks differ only by pp rank, by tp index where a TP split is uneven, by shard index where an
    # FSDP split is uneven, and by rollout-tp index where the rollout split is uneven
    all_t = [x for tensors in kind_t.values() for x in tensors] + [x for p in {0, pp - 1} for r in roles
                       for x in root_tensors(spec, pp, tp, p, r, vocab_parallel)]
    all_t += [x for groups in lora_groups for targets in groups for x in lo.tensors(spec, targets)]
    tp_uneven, fs_uneven = uneven_splits(all_t, tp, S)
    ro_uneven = ro is not None and uneven_splits(all_t, ro.tp, 1)[0]

    cache: dict[tuple, dict[str, int]] = {}

    def rank_bytes(p: int, t: int, j: int, rt: int) -> dict[str, int]:
        key = (p, t, j, rt)
        if key in cache:
            return cache[key]
        per_role = {r: role_bytes(r, p, t, j) for r in roles}
        row = {c: sum(v[c] for v in per_role.values()) for c in (*_PERSISTENT, "tensors")}
        peak_role = max(roles, key=lambda r: sum(per_role[r][c] for c in _TRANSIENT))
        row.update({c: per_role[peak_role][c] for c in _TRANSIENT})
        row.update(rollout_bytes(p, t, rt))
        persistent = sum(row[c] for c in _PERSISTENT)
        transient = sum(row[c] for c in _TRANSIENT)
        rolled = sum(row[c] for c in _ROLLOUT)
        if ro is not None and ro.hybrid_engine and not ro.sleep:
            # the generation shard lives only while generating; the KV cache stays through training
            row["total"] = persistent + row["kv_cache"] + max(transient, row["rollout_weights"])
        else:
            row["total"] = persistent + (max(transient, rolled) if ro is not None and ro.sleep else transient + rolled)
        cache[key] = row
        return row

    if _peak_only:
        # every byte count is largest at tp index 0 and shard index 0 (torch.chunk's full pieces); over
        # pipeline ranks it grows with the layers held and falls with the rank (fewer micro-batches in
        # flight), the ends add embedding / lm_head / logits: so the first rank of each layer count and
        # the two ends are the only candidates
        first_of: dict[int, int] = {}
        # (LoRA on some layers only, layers_to_transform: ranks with as many layers hold different adapters)
        pp_lora = set(range(pp)) if len(set(lora_layers)) > 1 else set()
        for p, n in enumerate(layers_per_rank):
            first_of.setdefault((n, tuple(sorted(kinds[p].items()))), p)
        # (with the hybrid engine a rank's rollout weights grow as its training shard shrinks: with an
        # uneven TP split every tp index is a candidate)
        ts = range(tp) if ro is not None and ro.hybrid_engine and tp_uneven else (0,)
        keys = [(p, t, 0, t // layout.k if ro_uneven and layout is not None else 0)
                for p in sorted({0, pp - 1, *first_of.values()} | pp_lora) for t in ts]
        best = max(keys, key=lambda key: rank_bytes(*key)["total"])
        peak = rank_bytes(*best)["total"]
        return {"peak": peak, "stage": best[0], "fits": None if mem is None else peak <= mem}
    stride = _strides(plan)
    rows = []
    for rank in range(plan.world_size):
        d, t, p = ((rank // stride[k]) % getattr(plan, k) for k in ("dp", "tp", "pp"))
        rt = (layout.coords(rank)["gen_tp"] if layout is not None else rank % ro.tp) if ro_uneven else 0
        r = rank_bytes(p, t if tp_uneven else 0, (d % S) if fs_uneven else 0, rt)
        rows.append((rank, d, t, p, layers_per_rank[p], r["tensors"], *(r[c] for c in COMPONENTS[:3]),
                     *(r[c] for c in COMPONENTS[3:]), r["total"]))
    import pandas as pd

    df = pd.DataFrame(rows, columns=["rank", "dp", "tp", "pp", "layers", "param_tensors", *COMPONENTS, "total"])
    if mem is not None:
        df["fits"] = df["total"] <= mem
        df.attrs["device_memory"] = mem
    df.attrs.update(model=spec.name, plan=plan.describe(), seq_len=s, micro_batch=b, token_budget=token_budget,
                    precision=precision,
                    optimizer=optimizer, roles=roles, recompute=recompute,
                    activation_checkpointing=recompute == "full",
                    rollout=ro, sequence_parallel=sequence_parallel, flash_attention=flash_attention,
                    vocab_parallel=vocab_parallel, gathered_logits=gathered_logits,
                    logits_copies=logits_copies, lora=lo, image_tokens=image_tokens,
                    freeze_vision_tower=freeze_vision_tower, vision_params=spec.vision_params,
                    lora_params=None if lo is None else lo.params(spec),
                    lora_targets=None if lo is None else tuple(n for n in LORA_TARGETS
                                                               if any(n in x for x in lora_layers)))
    return df


def budget_rows(token_budget: Any, seq_len: int, micro_batch: int = 1) -> int:
    """Rows of ``seq_len`` in a padding-free micro-batch of ``token_budget`` tokens (the rows of the
    longest sequence's width that ``rlkit.parallel.packing`` fits in one); the budget replaces
    ``micro_batch``, which must be left at 1.

    >>> budget_rows(8192, 2048), budget_rows(8191, 2048)
    (4, 3)
    """
    positive_int("token_budget", token_budget)
    if micro_batch != 1:
        raise PlanError(f"micro_batch={micro_batch} and token_budget={token_budget}: a token budget sizes the "
                        f"micro-batch itself (token_budget // seq_len rows); leave micro_batch=1")
    if token_budget < seq_len:
        raise PlanError(f"token_budget={token_budget} is smaller than seq_len={seq_len} (the longest sequence, "
                        f"one packed row); use token_budget >= {seq_len}")
    return token_budget // seq_len


def peak_memory(plan: ParallelPlan, model: Any, **kw: Any) -> dict[str, Any]:
    """The largest ``total`` over ranks of :func:`estimate_memory` (same arguments), without building
    a row per rank: ``{"peak": bytes, "stage": the pipeline rank that holds it, "fits": bool or None}``.
    A plan search calls this for thousands of plans of up to 16k ranks.

    >>> from rlkit.plan import ParallelPlan
    >>> plan = ParallelPlan(dp=4, tp=8, pp=16)
    >>> peak_memory(plan, "llama-3-70b")["peak"] == int(estimate_memory(plan, "llama-3-70b")["total"].max())
    True
    """
    return estimate_memory(plan, model, _peak_only=True, **kw)  # type: ignore[return-value]


def _strides(plan: ParallelPlan) -> dict[str, int]:
    """Rank stride of each dim in the plan's order (fastest first)."""
    out, stride = {}, 1
    for dim in plan.order.split("-"):
        dim = dim.strip()
        out[dim] = stride
        stride *= getattr(plan, dim)
    return out
