"""One small function per parallelism (TorchTitan style), applied to a ``Stage`` in this order:
TP (DTensor ``parallelize_module``), activation checkpointing, then FSDP2 (``fully_shard``).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rlkit.errors import PlanError
from rlkit.parallel.lora import tp_styles

# transformers' own TP vocabulary (config.base_model_tp_plan) -> torch's parallel styles.
_HF_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Llama / Qwen2 / Mistral layout, used when a config carries no plan.
DEFAULT_LAYER_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def tp_plan(module: nn.Module, config=None) -> dict:
    """The ``parallelize_module`` plan of a Stage: the decoder layers from the model's own
    ``base_model_tp_plan`` (q/k/v/gate/up colwise, o/down rowwise), plus a vocab-sharded embedding
    (rowwise, replicated ids in) and lm_head (colwise, logits gathered so the log-softmax sees the
    whole vocabulary). Colwise also shards q/k/v biases (Qwen2); GQA works as long as tp divides
    num_key_value_heads, since each rank then owns whole KV heads and HF attention reshapes with
    ``view(..., -1, head_dim)``, i.e. it infers the local head count from the sharded projection.
    """
    hf_plan = dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_LAYER_PLAN)
    plan = {}
    names = [n for n, _ in module.named_modules()]
    for pattern, style in hf_plan.items():
        if not pattern.startswith("layers."):
            continue
        if not fnmatch.filter(names, "model." + pattern):  # e.g. a dense MLP's projections in an MoE model
            continue
        if style == "replicated_with_grad_allreduce":  # a full copy per rank; see tp_partial_grads
            continue
        if style not in _HF_STYLES:
            raise PlanError(f"the model's tp plan uses style {style!r} for {pattern}, which rlkit does not "
                            f"map yet (supported: {sorted(_HF_STYLES)}); use tp=1 for this model")
        plan["model." + pattern] = _HF_STYLES[style]()
    if getattr(module.model, "embed_tokens", None) is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if getattr(module, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def tp_partial_grads(module: nn.Module, config=None) -> list[nn.Parameter]:
    """The parameters each TP rank holds whole but whose gradient it sees only in part, which the ranks sum
    after backward (transformers' "replicated_with_grad_allreduce": Qwen3's q_norm / k_norm, applied to
    each rank's own heads).

    >>> from rlkit.models import tiny_lm, load                                      # doctest: +SKIP
    >>> hf, _ = load(tiny_lm("qwen3_moe")); len(tp_partial_grads(hf, hf.config))   # doctest: +SKIP
    8
    """
    hf_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    patterns = ["model." + k for k, v in hf_plan.items() if v == "replicated_with_grad_allreduce"]
    return [p for name, mod in module.named_modules() if any(fnmatch.fnmatch(name, pat) for pat in patterns)
            for p in mod.parameters(recurse=False)]


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh, config=None) -> nn.Module:
    """Shard a Stage's Linear layers over ``tp_mesh`` (Megatron-style, see ``tp_plan``).

    >>> apply_tp(stage, mesh["tp"], hf_model.config)  # doctest: +SKIP
    """
    if tp_mesh.size() > 1:
        tied = (getattr(module, "lm_head", None) is not None and getattr(module.model, "embed_tokens", None)
                is not None and module.lm_head.weight is module.model.embed_tokens.weight)
        # LoRA layers: the base is split as planned, the adapters with it (rlkit.parallel.lora.tp_styles)
        parallelize_module(module, tp_mesh, tp_styles(module, tp_plan(module, config)))
        if tied:
            # parallelize_module gives each module a new DTensor Parameter, which unties them. Both are
            # vocab-sharded (Shard(0)) the same way, so the lm_head can use the embedding's shard: one
            # weight, and autograd sums both uses into its gradient, as one process does.
            emb = module.model.embed_tokens.weight
            assert emb.placements == module.lm_head.weight.placements, (emb.placements, module.lm_head.weight)
            module.lm_head.weight = emb
    return module


def apply_ac(module: nn.Module) -> nn.Module:
    """Recompute each decoder layer in backward instead of keeping its activations.

    A flag read by ``Stage.forward`` (which wraps each layer call in ``torch.utils.checkpoint``)
    rather than ``checkpoint_wrapper``: wrapping would add ``_checkpoint_wrapped_module`` to every
    parameter name and break the HF names that state dicts rely on.

    >>> apply_ac(stage).ac                                    # doctest: +SKIP
    True
    """
    module.ac = True
    return module


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, dp_shard: str = "full_shard",
               mp_policy=None, ignored: set | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` per decoder layer, then the stage root (embedding, norm, head).

    ``dp_shard`` picks the ZeRO flavour with FSDP2 alone (torch 2.13's composable ``replicate``
    is still private API, while HSDP is the supported path to replication):
      * "full_shard": 1D mesh, reshard after forward (ZeRO-3);
      * "shard_grad_op": 1D mesh, keep params unsharded from forward to backward (ZeRO-2-like;
        params are still sharded between steps);
      * "hybrid_shard": 2D (dp_replicate, dp_shard) mesh = HSDP;
      * "replicate": HSDP with shard groups of size 1 = DDP (grads all-reduced, full params).
    ``mp_policy``: an FSDP ``MixedPrecisionPolicy`` (bf16 params / fp32 reduce on GPU; default:
    ``default_mp_policy()``). ``ignored``: parameters FSDP leaves alone (experts sharded by expert
    parallelism, whose gradients ``ParallelModel`` averages over the expert-DP ranks itself).

    >>> apply_fsdp(stage, build_groups(plan).fsdp_mesh, "full_shard")     # doctest: +SKIP
    """
    from torch.distributed.fsdp import fully_shard

    if dp_mesh.size() == 1:
        return module
    if mp_policy is None:
        mp_policy = default_mp_policy()
    reshard = dp_shard in ("full_shard", "hybrid_shard")
    kw = {"ignored_params": ignored} if ignored else {}
    for layer in module.model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy, **kw)
    # The root's params (embedding, norm, head) are needed right after forward: keep them gathered.
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy, **kw)
    return module


def default_mp_policy():
    """bf16 compute with fp32 gradient reduction on CUDA; plain fp32 on CPU (bf16 is slower there)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if torch.cuda.is_available():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
