"""MegatronModel: ParallelModel's interface over Megatron-Core's GPTModel (TP, 1F1B PP, DDP; for Qwen3-MoE its
MoELayer with expert parallelism, ``ParallelPlan(ep=...)``).

The HF checkpoint is converted into a ``GPTModel`` built with Megatron's local layer spec (no Transformer
Engine), fp32 weights, no dropout and no fused kernels, on the ranks of an already-initialized
``torch.distributed`` world. Megatron's ``parallel_state`` is initialized once per process from the plan
(rank order tp-dp-pp, Megatron's default), and shared by the actor, reference and critic of a rank.

What RL needs is computed exactly as ``ParallelModel`` does (``rlkit.parallel.stage``): position ids
that skip left padding (RoPE is applied at those positions, not at 0..S-1), an explicit causal AND padding
mask, fp32 log-softmax over the TP-gathered vocabulary with column 0 and columns before ``score_from`` 0,
the step objective ``sum(w * loss) / sum(w)`` over the micro-batches of all DP ranks, the global gradient
norm clipped at ``max_grad_norm``, and a torch AdamW.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rlkit import atomic
from rlkit.backends.families import (
    check_experts,
    check_family,
    gpt_model_kwargs,
    head_dim,
    is_moe,
    num_experts,
    rope_theta,
    transformer_config_kwargs,
)
from rlkit.backends.megatron import convert, shim
from rlkit.errors import CheckpointError, PlanError
from rlkit.parallel.kit import (
    LossFn,
    WeightFn,
    clip_grads,
    dp_slice,
    load_hf,
    loss_scales,
    micro_batches,
    restore_rng_state,
    rng_state,
)
from rlkit.parallel.loading import CheckpointReader, can_load_sharded, empty_model
from rlkit.parallel.stage import causal_padding_mask, position_ids_from_mask, token_logprobs
from rlkit.plan.topology import ParallelPlan

_state_world: list[Any] = [None]  # the torch.distributed world Megatron's parallel state was built in


def init_parallel_state(plan: ParallelPlan, seed: int = 0) -> None:
    """Megatron's process groups for ``plan`` in this process, once: a second model of the same layout
    (reference, critic) reuses them; another layout in the same process is refused."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise PlanError("MegatronModel needs an initialized torch.distributed world (rlkit's workers start it; "
                        "by hand: torch.distributed.init_process_group)")
    if dist.get_world_size() != plan.world_size:
        raise PlanError(f"plan {plan.describe()} needs {plan.world_size} ranks; this world has "
                        f"{dist.get_world_size()}")
    world = dist.distributed_c10d._get_default_group()
    if ps.model_parallel_is_initialized() and _state_world[0] is not world:
        # groups of a world that was destroyed since (a Trainer closed in this process, e.g. a notebook cell run
        # again): Megatron's state is stale, build it anew in this world
        ps.destroy_model_parallel()
    _state_world[0] = world
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (plan.tp, plan.pp, plan.dp, plan.ep):
            raise PlanError(f"Megatron's parallel state of this process is tp, pp, dp, ep = {have}; a model of "
                            f"plan {plan.describe()} cannot share it (one layout per process)")
        return
    # ep: Megatron's expert groups are ep consecutive DP ranks (its expert rank order tp-ep-dp-pp; an MoE
    # model runs at tp=1, so the experts are not TP-split)
    ps.initialize_model_parallel(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
                                 expert_model_parallel_size=plan.ep)
    # The tracker Megatron forks for dropout: the inference one is a no-op (dropout is 0 here), and the
    # default one reads CUDA's RNG, which a CPU process has not got.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    mine = plan.coords(dist.get_rank())
    got = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
           "dp": ps.get_data_parallel_rank()}
    if plan.ep > 1:
        got["ep"], mine = ps.get_expert_model_parallel_rank(), dict(mine, ep=mine["dp"] % plan.ep)
    if got != mine:  # rlkit's plan and Megatron must agree on who is who
        raise PlanError(f"Megatron placed rank {dist.get_rank()} at {got}, the plan at {mine}")


class _VocabHead(nn.Module):
    """Hidden (B, c, H) -> full-vocabulary logits (B, c, V): Megatron's vocab-parallel output layer, its
    shards gathered over TP (differentiably), the padding rows dropped."""

    def __init__(self, gpt: nn.Module, vocab: int):
        super().__init__()
        self.gpt, self.vocab = gpt, vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        gpt = self.gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        # Megatron's linear backward views its input as (s*b, h): give it a contiguous [s, b, h]
        logits, _ = gpt.output_layer(h.transpose(0, 1).contiguous(), weight=weight)
        return gather_from_tensor_model_parallel_region(logits).transpose(0, 1)[..., :self.vocab]


class MegatronModel:
    """This rank's share of an HF Llama / Qwen2 / Qwen3-MoE model as a Megatron-Core ``GPTModel`` under ``plan``
    (Qwen3-MoE: its MoE layers' experts split over ``plan.ep`` DP ranks, tp=1).

    Args mirror ``ParallelModel``: ``model`` a local HF checkpoint folder (or module), ``head`` "lm" or
    "value" (critic: a seeded ``nn.Linear(hidden, 1)`` on the final-normed hidden state), AdamW's
    ``lr, weight_decay, betas, eps``, ``max_grad_norm`` (None: no clipping), ``seed``. ``precision``
    "fp32" only and ``lora=None`` only (PlanError otherwise).

    >>> # under torchrun --nproc-per-node 2, after init_process_group("gloo"):
    >>> mm = MegatronModel(tiny_lm("qwen2"), ParallelPlan(tp=2))              # doctest: +SKIP
    >>> mm.logprobs(ids, mask)["logprobs"].shape                               # doctest: +SKIP
    torch.Size([4, 16])
    """

    def __init__(self, model: Any, plan: ParallelPlan, *, head: str = "lm", lr: float = 1e-5,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float | None = 1.0, seed: int = 0, precision: str = "fp32", lora: Any = None,
                 logprob_chunk: int = 1024):
        if lora is not None:
            raise PlanError("LoRA runs on backend='torch' only; backend='megatron' trains full weights")
        if precision != "fp32":
            raise PlanError(f"backend='megatron' runs precision='fp32' here; got precision={precision!r}")
        if head not in ("lm", "value"):
            raise PlanError(f"head={head!r} must be 'lm' (log-probs) or 'value' (critic)")
        if plan.vpp > 1:
            raise PlanError(f"backend='megatron' runs vpp=1 here; got vpp={plan.vpp}")
        if plan.dp > 1 and plan.dp_shard != "replicate":
            raise PlanError(f"Megatron-Core's DP replicates the weights here; use dp_shard='replicate', not "
                            f"{plan.dp_shard!r}")
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        # A local checkpoint folder: the model's shapes on meta, and each rank reads only the tensors its
        # shard is cut from (one at a time); a module or hub id is loaded whole.
        reader = CheckpointReader(model) if can_load_sharded(model) else None
        hf = empty_model(model) if reader is not None else load_hf(model)
        cfg = hf.config
        check_family(cfg)
        check_experts(cfg, plan.ep)
        self.moe = is_moe(cfg)
        if self.moe and plan.tp > 1:
            raise PlanError(f"backend='megatron' runs a mixture-of-experts model at tp=1 here (Megatron's MoE "
                            f"layer under TP needs sequence parallelism, not wired yet); got tp={plan.tp}: use "
                            f"dp (and ep) instead")
        shim.install_moe() if self.moe else shim.install()
        plan.validate(model=cfg)
        if cfg.num_hidden_layers % plan.pp:
            raise PlanError(f"backend='megatron' splits {cfg.num_hidden_layers} layers evenly over pp={plan.pp}; "
                            f"use a pp that divides it")
        init_parallel_state(plan, seed)
        self.plan, self.config, self.head = plan, cfg, head
        self.rank = dist.get_rank()
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), plan.dp
        self.tp_group, self.pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.dp_group, self.mp_group = ps.get_data_parallel_group(), ps.get_model_parallel_group()
        self.ep_rank = ps.get_expert_model_parallel_rank() if plan.ep > 1 else 0
        # the experts' gradient norms add up over the ranks that hold different experts: EP x TP x PP
        self.ep_group = ps.get_expert_model_parallel_group() if plan.ep > 1 else None
        self.expert_mp_group = ps.get_expert_tensor_model_pipeline_parallel_group() if self.moe else None
        self.has_first, self.has_last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False)) and head == "lm"
        self.device = torch.device("cpu") if shim.needed() else torch.device("cuda", torch.cuda.current_device())

        moe_kw = dict(expert_model_parallel_size=plan.ep) if self.moe else {}
        self.mcore_config = TransformerConfig(
            **transformer_config_kwargs(cfg), **moe_kw, activation_func=F.silu,
            tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
            pipeline_dtype=torch.float32 if plan.pp > 1 else None, params_dtype=torch.float32,
            # perform_initialization stays on although every weight is then overwritten from the checkpoint:
            # Megatron marks its TP-sharded weights (``tensor_model_parallel``) only inside its init
            use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
        kw = gpt_model_kwargs(cfg)
        kw["share_embeddings_and_output_weights"] = self.tied
        with shim.cpu_devices():
            spec = get_gpt_layer_local_spec(num_experts=num_experts(cfg), moe_grouped_gemm=False, qk_layernorm=True,
                                            normalization="RMSNorm") if self.moe else \
                get_gpt_layer_local_spec(normalization="RMSNorm")
            gpt = GPTModel(config=self.mcore_config, transformer_layer_spec=spec, vocab_size=convert.padded_vocab(cfg.vocab_size, plan.tp),
                pre_process=self.has_first, post_process=self.has_last, parallel_output=True, **kw)
        pad = getattr(cfg, "pad_token_id", None)
        if self.has_first and pad is not None:
            gpt.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(int(pad)))
        if self.has_last and head == "value":
            gpt.output_layer = None  # the critic's head replaces the vocabulary head
            g = torch.Generator().manual_seed(seed)  # ParallelModel's init: replicated copies start equal
            gpt.value_head = nn.Linear(cfg.hidden_size, 1)
            with torch.no_grad():
                gpt.value_head.weight.normal_(0.0, getattr(cfg, "initializer_range", 0.02), generator=g)
                gpt.value_head.bias.zero_()
        self._value_init = {f"value_head.{k}": v.detach().clone() for k, v in
                            (gpt.value_head.named_parameters() if hasattr(gpt, "value_head") else [])}
        whole = {} if reader is not None else dict(hf.state_dict())

        stacked: dict[str, torch.Tensor] = {}  # the last two stacked expert tensors read (gate_up, down)

        def read(name: str) -> torch.Tensor:
            if name in self._value_init:
                return self._value_init[name]
            if reader is None:
                return whole[name]
            if ".mlp.experts." in name:  # one layer's stacked experts (the reader stacks transformers' one-by-one
                if name not in stacked:  # layout): read once for all of this rank's experts, not once per expert
                    if len(stacked) == 2:
                        stacked.pop(next(iter(stacked)))
                    stacked[name] = reader.get(name)
                return stacked[name]
            return reader.get(name)

        # HF's parameter order (and shapes) for iter_full_weights: a tied lm_head is the embedding
        self._hf_shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
        if head == "value":
            self._hf_shapes.pop("lm_head.weight", None)
            self._hf_shapes |= {"value_head.weight": (1, cfg.hidden_size), "value_head.bias": (1,)}
        del hf
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                p.copy_(convert.to_megatron(name, self._global_layer(gpt, name), read, cfg,
                                            plan.tp, self.tp_rank, plan.ep, self.ep_rank))
        whole.clear()  # the whole model loaded (module or hub id) goes with it
        if self.device.type == "cuda":  # built on the CPU (use_cpu_initialization); trained on the GPU
            gpt.cuda(self.device)
        self.gpt = gpt
        with shim.cpu_devices():
            self.ddp = DistributedDataParallel(
                config=self.mcore_config, module=gpt,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                                         use_distributed_optimizer=False,
                                                         average_in_collective=False))
        self.named = dict(gpt.named_parameters())
        self.params = list(self.named.values())
        # a tied embedding under pp > 1: the last stage's output_layer is a copy of the first stage's table
        self._tied_copy = self.tied and plan.pp > 1 and self.has_last and not self.has_first
        self._tied_embedding = self.tied and plan.pp > 1 and (self.has_first or self.has_last)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                           fused=True)
        self.max_grad_norm = max_grad_norm
        self.logprob_chunk = logprob_chunk
        self.score_from, self.entropy_grad = 1, True
        self.lora = None
        self.step = 0
        self.last_grad_bytes = 0
        self.last_transfer: dict[str, float] = {}
        dim = head_dim(cfg)
        base = rope_theta(cfg)
        # HF's default RoPE frequencies, computed as HF does (int64 arange, then float)
        self._inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self._head = _VocabHead(gpt, cfg.vocab_size) if self.has_last and head == "lm" else None

    @staticmethod
    def _global_layer(gpt: nn.Module, name: str) -> int | None:
        """The global (0-based) layer index of a stage-local ``decoder.layers.<i>.`` parameter."""
        if not name.startswith("decoder.layers."):
            return None
        return gpt.decoder.layers[int(name.split(".")[2])].layer_number - 1  # Megatron counts from 1

    # ---- batches -----------------------------------------------------------------------------------
    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's DP slice of a global batch (tensors split along dim 0; other values kept)."""
        return dp_slice(batch, self.dp_rank, self.dp_size)

    def set_scoring(self, *, first_column: int = 1, entropy_grad: bool = True) -> None:
        """Score only columns ``>= first_column`` (earlier ones come back 0); ``entropy_grad=False`` keeps the
        entropy out of autograd. As ``ParallelModel.set_scoring``."""
        if self.head != "lm":
            raise PlanError(f"set_scoring applies to head='lm' (log-probs), not head={self.head!r}")
        self.score_from, self.entropy_grad = int(first_column), bool(entropy_grad)

    def set_packing(self, padding_free: bool = True, token_budget: int | None = None) -> None:
        """Padding-free packing is the torch backend's: ``padding_free=True`` raises PlanError."""
        if padding_free:
            raise PlanError("padding_free=True runs on backend='torch' only; use padding_free=False with "
                            "backend='megatron'")

    # ---- one stage's forward -----------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor) -> torch.Tensor:
        """Megatron's rotary tensor [S, B, 1, D] at the given (B, S) positions (HF's cos/sin arguments)."""
        freqs = pos[:, :, None].float() * self._inv_freq.to(pos.device)[None, None]
        return torch.cat([freqs, freqs], -1).transpose(0, 1)[:, :, None]

    def _forward(self, mb: dict[str, torch.Tensor]) -> Any:
        """This stage on a micro-batch: hidden [S, B, H] for the next stage, or on the last stage
        ``(logprobs, entropy)`` / ``values`` (B, S) fp32. Later stages read their input from
        ``set_input_tensor`` (Megatron's pipeline schedule sets it)."""
        gpt = self.gpt
        ids, am = mb["input_ids"], mb["attention_mask"]
        pos = position_ids_from_mask(am)
        mask = causal_padding_mask(am, torch.float32) != 0  # Megatron masks where True
        x = gpt.embedding(input_ids=ids, position_ids=pos) if self.has_first else None
        h = gpt.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=self._rope(pos))
        if not self.has_last:
            return h
        h = h.transpose(0, 1)  # [B, S, H], final-normed
        if self.head == "value":
            return gpt.value_head(h).squeeze(-1).float()
        return token_logprobs(self._head, h, ids, self.logprob_chunk, first=self.score_from,
                              entropy_grad=self.entropy_grad)

    def _as_dict(self, out: Any) -> dict[str, torch.Tensor]:
        return {"values": out} if self.head == "value" else {"logprobs": out[0], "entropy": out[1]}

    def _names(self) -> list[str]:
        return ["values"] if self.head == "value" else ["logprobs", "entropy"]

    def _schedule(self, parts: list[dict[str, Any]], loss_func: Callable[[int, Any], Any], forward_only: bool):
        """Megatron's pipeline schedule (1F1B; forward-only for inference) over the micro-batches ``parts``;
        ``loss_func(j, output)`` runs on the last stage for micro-batch ``j``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            j = next(data_iterator)
            return self._forward(parts[j]), (lambda out: loss_func(j, out))

        b, s = parts[0]["input_ids"].shape
        with shim.cpu_devices():
            return get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(range(len(parts))), model=[self.ddp],
                num_microbatches=len(parts), seq_length=s, micro_batch_size=b, forward_only=forward_only)

    # ---- forward only ------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-token ``{"logprobs", "entropy"}`` (B, S) fp32 for this rank's batch (column t scores token t
        given tokens < t; column 0 is 0); ``{"values"}`` with ``head="value"``. Every rank of the DP group
        gets the result (under PP the last stage broadcasts it)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        batch = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        parts = micro_batches(batch, self.plan.n_micro_batches)
        self.gpt.eval()
        try:
            if self.plan.pp == 1:
                outs = [self._as_dict(self._forward(mb)) for mb in parts]
            else:
                got: dict[int, dict[str, torch.Tensor]] = {}

                def keep(j, out):
                    got[j] = {k: v.detach() for k, v in self._as_dict(out).items()}
                    return torch.zeros((), device=self.device), {}

                self._schedule(parts, keep, forward_only=True)
                outs = [got[j] for j in range(len(parts))] if self.has_last else []
        finally:
            self.gpt.train()
        names = self._names()
        if self.has_last:
            out = {k: torch.cat([o[k] for o in outs]).float().contiguous() for k in names}
        else:
            out = {k: torch.empty(input_ids.shape, device=self.device) for k in names}
        if self.plan.pp > 1:
            for k in names:
                dist.broadcast(out[k], src=ps_last_rank(), group=self.pp_group)
        return out

    values = logprobs

    # ---- training ----------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> float:
        """Accumulate the gradients of ``sum(w * loss_fn(out, mb)) / sum(w)`` over the micro-batches of every
        DP rank (``w = weight_fn(mb)``, 1 without it), as ``ParallelModel.forward_backward``. Gradients are
        reduced over DP (Megatron DDP) and, for a tied embedding under PP, summed over its two copies.
        Returns the objective's value (the same on every rank)."""
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        parts = micro_batches(batch, self.plan.n_micro_batches)
        m = len(parts)
        weights = [1.0] * m if weight_fn is None else [float(weight_fn(mb)) for mb in parts]
        scales = loss_scales(weights, self.dp_size, self.dp_group, self.device)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.plan.pp == 1:
            for j, mb in enumerate(parts):
                loss = loss_fn(self._as_dict(self._forward(mb)), mb)
                scaled = loss / m if weight_fn is None else loss * scales[j]
                scaled.backward()
                total += scaled.detach().double()
        else:
            def loss_func(j, out):
                loss = loss_fn(self._as_dict(out), parts[j])
                # the schedule divides by the micro-batch count: a weighted loss is scaled back up
                scaled = loss if weight_fn is None else loss * (scales[j] * m)
                return scaled, {"part": (scaled.detach() / m).double()}

            res = self._schedule(parts, loss_func, forward_only=False)
            if self.has_last:
                total += sum(r["part"] for r in res)
            dist.all_reduce(total, group=self.pp_group)  # only the last stage contributed
        self.ddp.finish_grad_sync()  # DP all-reduce of the grad buffers (averaged)
        if self._tied_embedding:  # the two copies of a tied embedding train on the sum of their gradients
            from megatron.core import parallel_state as ps

            w = self.named["embedding.word_embeddings.weight" if self.has_first else "output_layer.weight"]
            dist.all_reduce(w.main_grad, group=ps.get_embedding_group())
        for p in self.params:  # torch's AdamW reads .grad: point it at the reduced buffer
            p.grad = p.main_grad
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        self.last_grad_bytes = sum(p.main_grad.numel() * p.main_grad.element_size() for p in self.params)
        return float(total.item())

    def grad_norm(self) -> float:
        """L2 norm of the whole model's gradient: TP shards summed over TP, TP-replicated parameters
        counted once, stages summed over PP, a tied embedding's copy once (DP replicas hold the same)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        sq_experts = torch.zeros((), dtype=torch.float64, device=self.device)  # each EP rank's own experts
        for name, p in self.named.items():
            if p.grad is None or (self._tied_copy and name == "output_layer.weight"):
                continue
            if convert.expert_index(name) is not None:
                sq_experts += p.grad.double().norm() ** 2
                continue
            if not getattr(p, "tensor_model_parallel", False) and self.tp_rank != 0:
                continue
            sq += p.grad.double().norm() ** 2
        dist.all_reduce(sq, group=self.mp_group)
        if self.moe:
            dist.all_reduce(sq_experts, group=self.expert_mp_group)
        return float((sq + sq_experts).sqrt().item())

    def optimizer_step(self) -> float:
        """Clip (global grad norm) and step AdamW; returns the pre-clip grad norm."""
        norm = self.grad_norm()
        clip_grads(self.params, norm, self.max_grad_norm)
        self.optimizer.step()
        self.zero_grad()
        self.step += 1
        return norm

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (the grad buffers zeroed, ``.grad`` unset)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.ddp.zero_grad_buffer()

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> dict[str, float]:
        """forward + loss + backward (micro-batched) + clip + AdamW on this rank's batch."""
        t0 = time.perf_counter()
        loss = self.forward_backward(batch, loss_fn, weight_fn)
        norm = self.optimizer_step()
        return {"loss": loss, "grad_norm": norm, "step": self.step, "step_time_s": time.perf_counter() - t0}

    # ---- full weights out --------------------------------------------------------------------------
    def _units(self) -> list[tuple[int, list[str]]]:
        """HF order of the model in units ``(owning pipeline rank, Megatron names with global layers)``:
        the embedding, each layer, the final norm, the head."""
        n, pp = self.config.num_hidden_layers, self.plan.pp
        per = n // pp
        layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        if self.moe:  # the experts as two stacked units (gathered over EP in _iter_full)
            layer[4:] = ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "mlp.router.weight",
                         "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"]
        if getattr(self.mcore_config, "add_qkv_bias", False):
            layer.insert(2, "self_attention.linear_qkv.bias")
        units = [(0, ["embedding.word_embeddings.weight"])]
        units += [(g // per, [f"decoder.layers.{g}.{s}" for s in layer]) for g in range(n)]
        tail = ["decoder.final_layernorm.weight"]
        if self.head == "value":
            tail += ["value_head.weight", "value_head.bias"]
        elif not self.tied:
            tail += ["output_layer.weight"]
        return units + [(pp - 1, tail)]

    def _local_name(self, name: str) -> str:
        if not name.startswith("decoder.layers."):
            return name
        parts = name.split(".")
        parts[2] = str(int(parts[2]) - self.pp_rank * (self.config.num_hidden_layers // self.plan.pp))
        return ".".join(parts)

    def _iter_full(self, tensor_of: Callable[[nn.Parameter], torch.Tensor],
                   to: str | int | Iterable[int]) -> Iterator[tuple[str, torch.Tensor | None]]:
        targets = None if to == "all" else ({to} if isinstance(to, int) else set(to))
        want = targets is None or bool(targets & set(self.plan.group_of(self.rank, "pp")))
        receive = targets is None or self.rank in targets
        order = {n: i for i, n in enumerate(self._hf_shapes)}
        moved = 0
        for owner, names in self._units():
            got: list[tuple[str, torch.Tensor]] = []
            if owner == self.pp_rank:
                for name in names:
                    if ".mlp.experts." in name:
                        t, sent = self._experts(name, tensor_of)
                        moved += sent
                        got += convert.to_hf(name, _layer_of(name), [t], self.config)
                        continue
                    p = self.named[self._local_name(name)]
                    t = tensor_of(p).detach()
                    shards = [t]
                    if self.plan.tp > 1 and getattr(p, "tensor_model_parallel", False):
                        shards = [torch.empty_like(t) for _ in range(self.plan.tp)]
                        dist.all_gather(shards, t.contiguous(), group=self.tp_group)
                        moved += t.numel() * t.element_size() * (self.plan.tp - 1)
                    got += convert.to_hf(name, _layer_of(name), shards, self.config)
                got.sort(key=lambda kv: order[kv[0]])
            else:
                got = [(n, None) for n in self._unit_hf_names(names)]
            for hf_name, t in got:
                if self.plan.pp > 1 and want:
                    if t is None:
                        t = torch.empty(self._hf_shapes[hf_name], device=self.device)
                        moved += t.numel() * t.element_size()
                    t = t.contiguous()
                    dist.broadcast(t, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
                self.last_transfer["bytes"] = float(moved)
                yield hf_name, (t.cpu().clone() if receive and t is not None else None)

    def _experts(self, name: str, tensor_of: Callable[[nn.Parameter], torch.Tensor]) -> tuple[torch.Tensor, int]:
        """All experts of the stacked unit ``decoder.layers.g.mlp.experts.<linear>.weight`` as one (E, ...)
        tensor in global expert order (this rank's gathered with the other EP ranks'), and the bytes received."""
        head, linear = name.rsplit(".mlp.experts.", 1)
        local = self._local_name(head)
        mine = [tensor_of(self.named[f"{local}.mlp.experts.local_experts.{j}.{linear}"]).detach()
                for j in range(num_experts(self.config) // self.plan.ep)]
        t = torch.stack(mine)
        if self.plan.ep == 1:
            return t, 0
        parts = [torch.empty_like(t) for _ in range(self.plan.ep)]
        dist.all_gather(parts, t, group=self.ep_group)  # EP ranks in order hold the experts in order
        return torch.cat(parts), t.numel() * t.element_size() * (self.plan.ep - 1)

    def _unit_hf_names(self, names: list[str]) -> list[str]:
        """The HF names (in HF's order) a unit of Megatron names converts to, without the tensors."""
        order = {n: i for i, n in enumerate(self._hf_shapes)}
        out = [h for name in names for h in convert.hf_names(name, _layer_of(name), self.config)]
        return sorted(out, key=order.__getitem__)

    def iter_full_weights(self, to: str | int | Iterable[int] = "all", *,
                          adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Yield ``(hf_name, full CPU tensor)`` in HF's order (``(hf_name, None)`` on ranks not in ``to``): TP
        shards gathered, stages' layers renumbered to global and broadcast along the pipeline. A collective:
        every rank iterates to the end. No LoRA here, so ``adapters_only=True`` yields nothing."""
        t0 = time.perf_counter()
        self.last_transfer = {"bytes": 0.0}
        if not adapters_only:
            yield from self._iter_full(lambda p: p.data, to)
        self.last_transfer["seconds"] = time.perf_counter() - t0

    def iter_full_grads(self, to: str | int | Iterable[int] = "all") -> Iterator[tuple[str, torch.Tensor | None]]:
        """As ``iter_full_weights``, for the reduced gradients of the last ``forward_backward`` (checks)."""
        yield from self._iter_full(lambda p: p.main_grad, to)

    def full_state_dict(self, to: str | int = 0) -> dict[str, torch.Tensor]:
        """Full HF-named weights (CPU), loadable with ``load_state_dict(strict=True)`` into a fresh HF model
        (plus ``value_head.*`` for a critic). Empty dict on ranks that don't receive."""
        return {k: v for k, v in self.iter_full_weights(to) if v is not None}

    # ---- checkpoint --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> str:
        """Each rank's weights, AdamW state, step and RNG into ``path/rank<r>.pt``, written to a temp folder
        beside ``path`` and moved into place (``rlkit.atomic``) once every rank finished."""
        path = Path(path)
        box = [str(atomic.temp_path(path)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        state = {"model": {n: p.detach().clone() for n, p in self.named.items()},
                 "optim": self.optimizer.state_dict(), "step": self.step, "plan": self.plan.describe(), **rng_state()}
        problem = None
        try:
            torch.save(state, tmp / f"rank{self.rank}.pt")
        except OSError as e:
            problem = f"rank {self.rank} could not write {tmp / f'rank{self.rank}.pt'}: {e}"
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(f"could not write the checkpoint {path} ({next(p for p in problems if p)}); "
                                  f"{path} is untouched")
        if self.rank == 0:
            atomic.move_into_place(tmp, path)
        dist.barrier()
        return str(path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore what ``save`` wrote (same plan) for a bit-exact resume. A missing or damaged file raises
        ``CheckpointError`` naming it on every rank."""
        path = Path(path)
        file = path / f"rank{self.rank}.pt"
        state, problem = None, None
        try:
            state = torch.load(file, weights_only=False)
            if state.get("plan") != self.plan.describe():
                problem = f"{file} was saved with plan {state.get('plan')}, not {self.plan.describe()}"
        except FileNotFoundError:
            problem = f"{file} is missing: {path} is not a complete rlkit checkpoint for rank {self.rank}"
        except Exception as e:  # truncated or foreign: every rank hears of it below (no one left waiting)
            problem = f"{file} is truncated or damaged ({type(e).__name__}: {str(e).strip()[:200]})"
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        with torch.no_grad():
            for n, p in self.named.items():
                p.copy_(state["model"][n])
        self.zero_grad()
        self.optimizer.load_state_dict(state["optim"])
        self.step = state["step"]
        restore_rng_state(state)
        dist.barrier()

    # ---- memory ------------------------------------------------------------------------------------
    def memory(self, batch: dict[str, Any] | None = None):
        """Bytes per rank (a DataFrame gathered on every rank): weights, grads (the DDP grad buffer's share
        of the last backward), optimizer state, activations (not measured here: 0), total."""
        import pandas as pd

        row = {"rank": self.rank,
               "weights": sum(p.numel() * p.element_size() for p in self.params),
               "grads": self.last_grad_bytes,
               "optimizer": sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                                for t in s.values() if torch.is_tensor(t) and t.dim() > 0),
               "activations": 0}
        row["total"] = row["weights"] + row["grads"] + row["optimizer"] + row["activations"]
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return pd.DataFrame(rows)


def _padding_idx_hook(pad: int):
    """HF's ``nn.Embedding(padding_idx=pad)`` in Megatron's embedding: the pad token's lookups give no gradient
    to its row (a pad token the model samples, or the EOS that doubles as pad, trains nothing there). The
    values are unchanged; a tied output layer's gradient for that row still flows, as in HF."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        at_pad = (args[0] == pad).unsqueeze(-1)
        return torch.where(at_pad, output.detach(), output) if bool(at_pad.any()) else output

    return hook


def ps_last_rank() -> int:
    """The global rank of this pipeline's last stage."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_last_rank()


def _layer_of(name: str) -> int | None:
    """The layer index in a ``decoder.layers.<i>.`` name (None for any other)."""
    return int(name.split(".")[2]) if name.startswith("decoder.layers.") else None


def _batch_size(batch: dict[str, Any]) -> int:
    if "input_ids" not in batch:
        raise PlanError(f"batch needs 'input_ids'; got keys {sorted(batch)}")
    return int(batch["input_ids"].shape[0])


__all__ = ["MegatronModel", "init_parallel_state"]
