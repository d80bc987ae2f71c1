"""Mixture-of-experts layers run by rlkit: routing, expert parallelism, the router's losses and its load.

transformers' sparse MoE block (Qwen3-MoE: a top-k ``gate`` router and fused ``experts`` holding
``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``) is swapped for ``MoE``, which keeps the same two
submodules, so every parameter keeps its HF name. ``MoE`` adds what RL training needs:

* **Expert parallelism** (``ParallelPlan(ep=...)``): each rank of an EP group holds ``E / ep`` whole experts
  (a DTensor ``Shard(0)`` on ``mesh["ep"]``). A token's hidden state travels to the ranks of its ``k`` experts
  and back by two ``all_to_all`` collectives (differentiable, so backward runs them in reverse), and the
  expert outputs are summed with the router's weights, in the same order as transformers sums them.
  ``ep=1`` runs transformers' own experts.
* **The router's losses**, as Switch Transformer and Megatron define them, per layer over the micro-batch's
  real tokens, averaged over layers: the load-balancing loss ``E * sum_e f_e P_e`` (``f_e``: the fraction
  of top-k slots routed to expert ``e``, ``P_e``: its mean router probability; transformers'
  ``load_balancing_loss_func`` on one layer) and the z-loss ``mean_t logsumexp(logits_t)^2``. They reach
  the gradients through the layer's output (``_AddLossGrad``: Megatron's aux-loss auto-scaler), so a
  pipeline's middle stages need no loss of their own.
* **The load**: tokens per expert, per layer, summed over the forwards since ``reset_stats``.

>>> from rlkit.models import tiny_lm, load                                   # doctest: +SKIP
>>> hf, _ = load(tiny_lm("qwen3_moe"))                                      # doctest: +SKIP
>>> moes = apply_moe(hf.model, hf.config)                                    # doctest: +SKIP
>>> type(hf.model.layers[0].mlp).__name__, len(moes)                        # doctest: +SKIP
('MoE', 4)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from rlkit.errors import PlanError
from rlkit.parallel.gather import local
from rlkit.plan.spec import as_spec


def is_moe(config: Any) -> bool:
    """Whether ``config`` (an HF config) describes a mixture-of-experts model (``ModelSpec.is_moe``)."""
    return as_spec(config).is_moe


class _AddLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, hands ``loss`` a gradient of 1, so ``loss`` joins the objective
    wherever ``out`` goes (Megatron's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.loss_meta
        return grad, torch.ones((), dtype=dtype, device=device)


class MoE(nn.Module):
    """One sparse MoE layer: transformers' ``gate`` and ``experts`` (same names, same math), routed here.

    Set by the model that owns it: ``tokens`` (bool (T,), the real tokens of the next forward),
    ``loss_scale`` (the weight of this layer's router losses in the step's objective), ``ep_group``.
    """

    def __init__(self, block: nn.Module, config: Any):
        super().__init__()
        self.gate, self.experts = block.gate, block.experts
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        self.aux_coef, self.z_coef, self.loss_scale = 0.0, 0.0, 1.0
        self.tokens: torch.Tensor | None = None
        self.ep_group: Any = None
        self.ep_size, self.ep_rank = 1, 0
        self.skip_stats = 0  # forwards not to count (a pipeline schedule's shape warm-up)
        self.layer = 0  # its decoder layer's index in the whole model
        # routing replay (R3): the engine's choices for the next forward's tokens, (T, k), -1 where none; "replay"
        # routes by them, "observe" only counts how often the router's own choice differs (route flips)
        self.recorded: torch.Tensor | None = None
        self.replay = True
        self.count_flips = True
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"load": torch.zeros(self.num_experts, dtype=torch.float64), "aux": 0.0, "z": 0.0, "n": 0,
                      "flips": 0, "recorded": 0, "a2a_bytes": 0}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits (T, E), probs (T, E) fp32, experts (T, k), weights (T, k))``, as transformers' router; with
        ``recorded`` choices and ``replay``, the recorded experts wherever there are some, weighted by this
        router's own probabilities of them (renormalised as transformers does)."""
        logits = F.linear(x, self.gate.weight)
        probs = logits.float().softmax(-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        rec = self.recorded
        if rec is not None and rec.shape[0] == x.shape[0]:
            rec = rec.to(x.device).long()
            have = (rec >= 0).all(-1) & self._real(x)
            if self.count_flips and self._counting():  # a flip: this router's top-k is not the engine's (as sets)
                differ = (idx.sort(-1).values != rec.sort(-1).values).any(-1)
                self.stats["flips"] += int((differ & have).sum())
                self.stats["recorded"] += int(have.sum())
            if self.replay:
                idx = torch.where(have[:, None], rec.clamp(min=0), idx)
                top = probs.gather(-1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, probs, idx, top.to(logits.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits, probs, idx, w = self.route(x)
        out = self.experts(x, idx, w) if self.ep_size == 1 else self._expert_parallel(x, idx, w)
        real = self._real(x)
        aux, z = router_losses(logits[real], probs[real], idx[real], self.num_experts)
        if self.skip_stats:
            self.skip_stats -= 1
        elif self._counting():
            self.stats["load"] += torch.bincount(idx[real].reshape(-1), minlength=self.num_experts).double().cpu()
            self.stats["aux"] += float(aux.detach())
            self.stats["z"] += float(z.detach())
            self.stats["n"] += 1
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = _AddLossGrad.apply(out, self.loss_scale * (self.aux_coef * aux + self.z_coef * z))
        return out.reshape(shape)

    def _real(self, x: torch.Tensor) -> torch.Tensor:
        """The real tokens of the forward (``tokens``), or all of them."""
        if self.tokens is not None and self.tokens.numel() == x.shape[0]:
            return self.tokens
        return torch.ones(x.shape[0], dtype=torch.bool, device=x.device)

    def _counting(self) -> bool:
        """Whether this forward's statistics count: not a pipeline's warm-up, not a recomputation inside
        backward (activation checkpointing)."""
        return not self.skip_stats and torch._C._current_graph_task_id() == -1

    def _expert_parallel(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The experts' sum for each token, its ``k`` expert computations done on the ranks holding them."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        E, ep, k = self.num_experts, self.ep_size, self.top_k
        n_local = E // ep
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)     # the (token, slot) pairs grouped by expert, tokens in order
        tok = order // k
        counts = torch.bincount(flat, minlength=E)
        # what each rank sends to this rank's experts: (source rank, local expert) counts
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.ep_group)
        got = got.view(ep, n_local)
        send = counts.view(ep, n_local).sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = all_to_all_single_autograd(x[tok], recv, send, self.ep_group)
        if self._counting():  # what leaves this rank: dispatched rows, then their outputs sent back (forward)
            away = sum(send) - send[self.ep_rank] + sum(recv) - recv[self.ep_rank]
            self.stats["a2a_bytes"] += away * x.shape[-1] * x.element_size()
        # arrived grouped by source rank, then expert: regroup by expert, run each, put back
        which = torch.arange(n_local, device=x.device).repeat(ep).repeat_interleave(got.reshape(-1))
        perm = which.argsort(stable=True)
        gate_up, down = local(self.experts.gate_up_proj), local(self.experts.down_proj)
        outs = []
        for j, part in enumerate(rows[perm].split(got.sum(0).tolist())):
            g, u = F.linear(part, gate_up[j].to(part.dtype)).chunk(2, dim=-1)
            outs.append(F.linear(self.experts.act_fn(g) * u, down[j].to(part.dtype)))
        done = torch.cat(outs)[perm.argsort()]
        back = all_to_all_single_autograd(done, send, recv, self.ep_group)
        back = back * w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, tok, back.to(x.dtype))


def router_losses(logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's load-balancing loss ``E * sum_e f_e P_e`` and z-loss ``mean logsumexp(logits)^2`` over the
    given tokens (zeros, still in the graph, when there are none).

    >>> logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]]); probs = logits.softmax(-1)
    >>> aux, z = router_losses(logits, probs, probs.topk(1).indices, 2)
    >>> round(float(aux), 4), round(float(z), 4)   # balanced routing: aux = 1
    (1.0, 4.5238)
    """
    if logits.shape[0] == 0:
        zero = logits.float().sum() * 0.0
        return zero, zero
    f = F.one_hot(idx, num_experts).sum(1).float().mean(0)   # top-k slots per expert, per token
    aux = num_experts * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return aux, z


def apply_moe(body: nn.Module, config: Any, ep_mesh: DeviceMesh | None = None) -> list[MoE]:
    """Swap every sparse MoE block of ``body.layers`` for ``MoE``; with ``ep_mesh``, shard each layer's experts
    over it (``Shard(0)``: whole experts per rank; cut locally, no communication, meta tensors included).
    Returns the layers' ``MoE`` modules in order.

    >>> from rlkit.models import tiny_lm, load                                   # doctest: +SKIP
    >>> hf, _ = load(tiny_lm("qwen3_moe")); [m.num_experts for m in apply_moe(hf.model, hf.config)]  # doctest: +SKIP
    [8, 8, 8, 8]
    """
    moes = []
    layers = body.layers.items() if isinstance(body.layers, nn.ModuleDict) else enumerate(body.layers)
    for index, layer in layers:
        block = getattr(layer, "mlp", None)
        if isinstance(block, MoE):
            moes.append(block)
            continue
        experts = getattr(block, "experts", None)
        if experts is None:  # a dense layer of an MoE model (mlp_only_layers)
            continue
        if not (hasattr(experts, "gate_up_proj") and hasattr(getattr(block, "gate", None), "weight")):
            raise PlanError(f"rlkit runs MoE layers laid out as transformers' Qwen3-MoE (a top-k gate, fused "
                            f"experts); {type(block).__name__} is not: use a Qwen3-MoE model")
        moe = MoE(block, config)
        moe.layer = int(index)
        if ep_mesh is not None and ep_mesh.size() > 1:
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(experts, name)
                sharded = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
            moe.ep_group = ep_mesh.get_group()
            moe.ep_size, moe.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        layer.mlp = moe
        moes.append(moe)
    return moes


def moe_layers(config: Any) -> int:
    """How many of the model's decoder layers are sparse (``ModelSpec.sparse_layers``: Qwen3-MoE's
    ``decoder_sparse_step`` and ``mlp_only_layers``, DeepSeek's ``first_k_dense_replace``).

    >>> from rlkit.models.tiny import tiny_config
    >>> moe_layers(tiny_config("qwen3_moe")), moe_layers(tiny_config("qwen2"))
    (4, 0)
    """
    return len(as_spec(config).sparse_layers)


def expert_params(moes: list[MoE]) -> list[nn.Parameter]:
    """The expert weights of ``moes`` (what EP shards, and what FSDP leaves alone under EP)."""
    return [p for m in moes for p in (m.experts.gate_up_proj, m.experts.down_proj)]


__all__ = ["MoE", "apply_moe", "expert_params", "is_moe", "moe_layers", "router_losses"]
