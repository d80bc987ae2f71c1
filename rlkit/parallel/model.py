"""ParallelModel: one rank's share of an HF causal LM laid out by a ParallelPlan.

Operations RL needs, the same under any plan (dp / tp / pp / 2D / 3D):
  * ``logprobs(input_ids, attention_mask)`` -> per-token log-probs and entropy (actor, reference)
  * ``values(...)`` with ``head="value"`` (critic: a scalar head on the last hidden state)
  * ``train_step(batch, loss_fn)`` = forward + loss + backward over micro-batches + clip + AdamW
  * ``save(path)`` / ``load(path)``: sharded training state via torch.distributed.checkpoint
  * ``iter_full_weights()`` / ``full_state_dict()``: full HF-named weights from any layout
  * ``memory()``: bytes per rank of weights, grads, optimizer state and saved activations

Each rank passes its own data-parallel shard of the batch (``shard_batch`` cuts it). The loss is a
plain function ``loss_fn(out, mb) -> scalar`` of the model outputs ``out`` (``{"logprobs",
"entropy"}`` or ``{"values"}``, each (B, S) aligned with input_ids) and the micro-batch ``mb`` (the
batch's tensors, sliced). Under PP it runs on the last stage, inside the pipeline schedule. The
step's objective is the mean of ``loss_fn`` over micro-batches and DP ranks (as with gradient
accumulation everywhere).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from rlkit import atomic
from rlkit.checks import choice
from rlkit.errors import CheckpointError, PlanError
from rlkit.parallel.apply import apply_ac, apply_fsdp, apply_tp, tp_partial_grads
from rlkit.parallel.gather import full, full_tensors, local, storage_bytes
from rlkit.parallel.groups import ProcessGroups, build_groups, device_type
from rlkit.parallel.kit import (
    PRECISIONS,
    LossFn,
    WeightFn,
    batch_rows,
    clip_grads,
    dp_slice,
    load_hf,
    loss_scales,
    micro_batches,
    restore_rng_state,
    rng_state,
    split_rows,
    take_rows,
)
from rlkit.parallel.loading import CheckpointReader, can_load_sharded, empty_model, materialize
from rlkit.parallel.lora import (
    adapters_disabled,
    check_lora,
    hf_name,
    init_adapters,
    inject,
    is_lora,
    merge,
    module_of,
    scaling,
)
from rlkit.parallel.moe import apply_moe, expert_params, is_moe, moe_layers
from rlkit.parallel.packing import PackedMicroBatch, pack
from rlkit.parallel.stage import split_stages
from rlkit.plan.topology import ParallelPlan

# Not yet: DP ranks pack to different shapes, and a pipeline schedule's first use of a shape runs a warm-up
# forward (FSDP gathers included) on the ranks that meet it, so DP ranks' collectives would not match.
PACKED_DP_PP = ("padding-free training with dp > 1 and pp > 1 together is not supported yet (DP ranks' packed "
                "shapes differ, and a pipeline warms up on each new shape); use padding_free=False for this plan")

class ParallelModel:
    """This rank's stages of ``model`` under ``plan``, with an AdamW optimizer.

    Args:
        model: HF causal LM (module, local path or hub id). A local checkpoint folder loads sharded:
            each rank reads only its own shards (``rlkit.parallel.loading``); a module or hub id is
            loaded whole on every rank, then sliced.
        plan: the layout; ``plan.world_size`` must equal the process group size.
        head: "lm" (per-token log-probs) or "value" (critic; a seeded scalar head replaces lm_head).
        lr, weight_decay, betas, eps, max_grad_norm: AdamW and gradient clipping (None: no clipping).
        activation_checkpointing: recompute decoder layers in backward.
        layer_split: per-stage layer counts for uneven pipelines (default: ``plan.stage_layers``).
        precision: "fp32", or "bf16-mixed": forward and backward under bf16 autocast while weights,
            gradients and AdamW state stay fp32 (TRL's ``bf16=True``; Lightning's "bf16-mixed").
        groups: the rank's process groups (``rlkit.parallel.groups.build_groups``); models of one rank
            share them. Default: built here (a collective: every rank constructs the model).
        router_aux_coef, router_z_coef: mixture-of-experts models: the weights of the router's
            load-balancing loss and z-loss in the objective (``rlkit.parallel.moe``; 0: not trained, still
            measured). ``plan.ep`` shards the experts (expert parallelism).
        freeze_vision: a vision-language model: its vision tower (the merger into the language model included)
            keeps its weights, with no gradients and no AdamW state; the language model trains.

    >>> # under torchrun --nproc-per-node 8 (see python -m rlkit.parallel):
    >>> pm = ParallelModel(tiny_lm("qwen2"), ParallelPlan(dp=2, tp=2, pp=2))   # doctest: +SKIP
    >>> mine = pm.shard_batch(batch)                                          # doctest: +SKIP
    >>> lp = pm.logprobs(mine["input_ids"], mine["attention_mask"])["logprobs"]  # doctest: +SKIP
    >>> pm.train_step(mine, lambda out, mb: -(out["logprobs"] * mb["response_mask"]).mean())  # doctest: +SKIP
    """

    def __init__(self, model: Any, plan: ParallelPlan, *, head: str = "lm", lr: float = 1e-5,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float | None = 1.0, activation_checkpointing: bool = False,
                 layer_split: list[int] | None = None, seed: int = 0, logprob_chunk: int = 1024,
                 groups: ProcessGroups | None = None, mp_policy=None, precision: str = "fp32", lora: Any = None,
                 router_aux_coef: float = 0.0, router_z_coef: float = 0.0, freeze_vision: bool = False):
        choice("precision", precision, tuple(PRECISIONS), error=PlanError)
        # A local checkpoint loads sharded: built on meta, each rank reads only the shards it keeps
        # (loading.py). A module (or a hub id) is loaded whole, then sliced; so is a one-rank plan's
        # checkpoint, which that rank keeps whole anyway (from_pretrained maps the file: 0.06 s against
        # 0.3-0.5 s to fill an empty SmolLM2-135M tensor by tensor).
        sharded = can_load_sharded(model) and plan.world_size > 1
        hf = empty_model(model) if sharded else load_hf(model)
        plan.validate(model=hf.config)
        self.plan, self.config, self.head = plan, hf.config, head
        # a vision-language model (rlkit.models.vision.causal_view): its tower on the first stage; the image
        # token and merge size give each sample's multimodal rotary positions
        self.vision = (hf.image_token_id, hf.merge) if getattr(hf, "visual", None) is not None else None
        # LoRA (rlkit.parallel.lora): peft's layers go in before the split, so every layout applies to them
        self.lora = check_lora(lora, hf, tp=plan.tp, head=head)
        lora_init = {}
        if self.lora is not None:
            inject(hf, self.lora, seed)
            if sharded:  # the adapters' values, full, for materialize (the rest comes from the checkpoint)
                lora_init = init_adapters({n: tuple(p.shape) for n, p in hf.named_parameters() if is_lora(n)}, seed)
        # Tied input/output embeddings: one matrix when pp == 1 (apply_tp keeps TP's shards tied); with
        # pp > 1 the first and last stages each hold a copy and sum their gradients every step (Megatron).
        self.tied = bool(getattr(hf.config, "tie_word_embeddings", False)) and head == "lm"
        self.device = torch.device(device_type())
        # the rank's groups (rlkit.parallel.groups), shared with the other models of the rank when given
        self.groups = groups if groups is not None else build_groups(plan, tied_ends=self.tied and plan.pp > 1)
        self.mesh = self.groups.mesh
        self.rank = dist.get_rank()
        self.coords = plan.coords(self.rank)
        self.pp_rank = self.coords["pp"]
        self.dp_rank, self.dp_size = self.mesh["dp"].get_local_rank(), plan.dp
        self.pp_group = self.mesh["pp"].get_group()
        self.dp_group = self.mesh["dp"].get_group()

        value_head, value_init = None, {}
        if head == "value":
            # Same seed on every rank, so replicated copies start equal.
            g = torch.Generator().manual_seed(seed)
            value_head = nn.Linear(hf.config.hidden_size, 1)
            with torch.no_grad():
                value_head.weight.normal_(0.0, getattr(hf.config, "initializer_range", 0.02), generator=g)
                value_head.bias.zero_()
            if sharded:  # built empty like the rest, filled from these full tensors below
                value_init = {f"value_head.{k}": v.detach().clone() for k, v in value_head.named_parameters()}
                value_head = value_head.to("meta")
        if not sharded:
            hf.to(self.device)
        self.stage_ids, self.stages = split_stages(hf, plan, self.pp_rank, head=head, value_head=value_head,
                                                   split=layer_split, logprob_chunk=logprob_chunk)
        del hf  # layers of other stages are freed with it
        if freeze_vision and self.vision is None:
            raise PlanError("freeze_vision=True applies to a vision-language model; this one has no vision tower")
        self.moes = []
        for st in self.stages:
            st.compute_dtype = PRECISIONS[precision]
            if freeze_vision and st.visual is not None:
                st.visual.requires_grad_(False)
            if is_moe(self.config):  # rlkit routes the experts: EP, the router's losses, its load
                st.moes = apply_moe(st.model, self.config, self.groups.ep_mesh)
                for moe in st.moes:
                    moe.aux_coef, moe.z_coef = float(router_aux_coef), float(router_z_coef)
                self.moes += st.moes
            apply_tp(st, self.mesh["tp"], self.config)
            if activation_checkpointing:
                apply_ac(st)
            if plan.dp > 1:  # EP's experts are sharded over the EP ranks instead, and averaged here
                apply_fsdp(st, self.groups.fsdp_mesh, plan.dp_shard, mp_policy,
                           ignored=set(expert_params(st.moes)) if plan.ep > 1 else None)

        if sharded:
            materialize(self.stages, CheckpointReader(model), self.device, self.config, extra=value_init | lora_init)
        self.has_first = 0 in self.stage_ids
        self.has_last = plan.n_stages - 1 in self.stage_ids
        self._tied_group = None  # on a pipeline's first and last stage: the group summing the copies' grads
        if self.tied and plan.pp > 1:
            if not self.groups.has_tied_ends:
                raise PlanError("a tied embedding under pp > 1 needs its pipeline-ends groups: build the groups "
                                "with rlkit.parallel.groups.build_groups(plan, tied_ends=True)")
            self._tied_group = self.groups.tied_ends
        self.params = [p for st in self.stages for p in st.parameters()]
        # (taken after materialize, which gives meta parameters storage as new objects)
        self.tp_partial = [p for st in self.stages for p in tp_partial_grads(st, self.config)] if plan.tp > 1 else []
        self.expert_params = expert_params(self.moes) if plan.ep > 1 else []
        self._moe_layers = moe_layers(self.config) if self.moes else 0  # the router losses' mean is over these
        # what trains: everything, or with LoRA the adapters only (the base has no grads, no AdamW state)
        self.trainable = [p for p in self.params if p.requires_grad]
        # Plain tensors (no TP, no FSDP): the fused kernel (6x the per-tensor loop at 135M on one CPU
        # thread, bench/README). Otherwise foreach=False: params mix DTensors on different meshes (tp,
        # dp x tp) and plain tensors, which neither fused nor foreach kernels take in one call.
        fused = not any(isinstance(p, DTensor) for p in self.trainable)
        self.optimizer = torch.optim.AdamW(self.trainable, lr=lr, weight_decay=weight_decay, betas=betas,
                                           eps=eps, **({"fused": True} if fused else {"foreach": False}))
        self.max_grad_norm = max_grad_norm
        self.step = 0
        self._schedules: dict[tuple, Any] = {}
        self._loss_ctx: dict[str, Any] = {}
        self.last_grad_bytes = 0
        self.last_transfer: dict[str, float] = {}
        self.padding_free, self.token_budget = False, None  # set_packing

    # ---- batches -----------------------------------------------------------------------------------
    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's DP slice of a global batch (tensors split along dim 0; other values kept)."""
        return dp_slice(batch, self.dp_rank, self.dp_size)

    def _micro_batches(self, batch: dict[str, Any]) -> int:
        return len(micro_batches(batch, self.plan.n_micro_batches))

    def set_scoring(self, *, first_column: int = 1, entropy_grad: bool = True) -> None:
        """Score only columns ``>= first_column`` from now on (earlier columns of ``logprobs`` and
        ``entropy`` come back 0), and with ``entropy_grad=False`` keep the entropy out of autograd.

        RL losses read the response's columns only: skipping the prompt's saves the vocab head and its
        softmax there (TRL's ``logits_to_keep``); an entropy that only feeds a metric needs no backward.

        >>> from rlkit.models import tiny_lm                                       # doctest: +SKIP
        >>> pm = ParallelModel(tiny_lm("qwen2"), ParallelPlan())                   # doctest: +SKIP
        >>> pm.set_scoring(first_column=5, entropy_grad=False)                     # doctest: +SKIP
        """
        if self.head != "lm":
            raise PlanError(f"set_scoring applies to head='lm' (log-probs), not head={self.head!r}")
        for st in self.stages:
            st.score_from, st.entropy_grad = int(first_column), bool(entropy_grad)  # token_logprobs clamps to >= 1

    def set_packing(self, padding_free: bool = True, token_budget: int | None = None) -> None:
        """Run every forward and update on packed rows (``rlkit.parallel.packing``): the real tokens of
        several sequences share a row, with attention that cannot cross them, and a micro-batch holds up
        to ``token_budget`` tokens (None: the plan's ``n_micro_batches``). Outputs and losses see the
        batch's own layout, exactly as padded (the sequences' tokens get the same hidden states).

        >>> pm.set_packing(token_budget=4096)                                       # doctest: +SKIP
        """
        if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                         or token_budget < 1):
            raise PlanError(f"token_budget={token_budget!r} must be a positive int (tokens per micro-batch) or None")
        if padding_free and self.plan.dp > 1 and self.plan.pp > 1:
            raise PlanError(PACKED_DP_PP)
        self.padding_free, self.token_budget = bool(padding_free), token_budget

    def _pack(self, batch: dict[str, Any]) -> list[PackedMicroBatch]:
        """This rank's packed micro-batches. DP ranks hold different sequences, so they may need different
        numbers of micro-batches; every rank takes the largest (FSDP gathers once per forward on each)."""
        score_from = self.stages[0].score_from if self.head == "lm" else 1

        def packed(n_micro: int) -> list[PackedMicroBatch]:
            return pack(batch["input_ids"], batch["attention_mask"], token_budget=self.token_budget, n_micro=n_micro,
                        score_from=score_from, equal_shapes=self.plan.pp > 1, keep_empty=self.dp_size > 1,
                        round_to=16 if self.plan.pp > 1 else 1)

        packs = packed(self.plan.n_micro_batches)
        want = len(packs)
        if self.dp_size > 1:
            most = torch.tensor(want, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
            want = int(most)
        if self.plan.vpp > 1:  # interleaved 1F1B runs micro-batches in rounds of pp
            want = -(-want // self.plan.pp) * self.plan.pp
        return packed(want) if want > len(packs) else packs

    # ---- forward only ------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 routing: torch.Tensor | None = None, pixel_values: list[torch.Tensor] | None = None,
                 image_grid_thw: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Per-token ``{"logprobs", "entropy"}`` (B, S) fp32 for this rank's batch; column t scores
        token t given tokens < t (column 0 is 0). Every rank of the DP group gets the result.
        With ``head="value"`` returns ``{"values"}`` instead. ``routing``: a mixture of experts' recorded
        choices, ``(B, S, layers, k)``, replayed or compared (``set_routing_replay``). ``pixel_values`` /
        ``image_grid_thw``: a vision-language model's images, one tensor per sample (its images' patches and
        grids, ``(0, ...)`` for none), as the processor made them."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        batch = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        if routing is not None:
            batch["routing"] = routing.to(self.device)
        if pixel_values is not None:
            batch["pixel_values"], batch["image_grid_thw"] = list(pixel_values), list(image_grid_thw)
        if self.padding_free:
            return self._packed_forward(batch)
        m = self._micro_batches(batch)
        for st in self.stages:
            st.eval()
        try:
            if self.plan.pp == 1:
                outs = [self._as_dict(self.stages[0](mb["input_ids"], attention_mask=mb["attention_mask"],
                                                     labels=mb["input_ids"], **_routing(mb), **self._images(mb)))
                        for mb in split_rows(batch, m)]
                out = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
            else:
                out = self._pp_forward(batch, m)
        finally:
            for st in self.stages:
                st.train()
        return out

    values = logprobs

    def _pp_forward(self, batch, m) -> dict[str, torch.Tensor]:
        sched = self._schedule(batch, m)
        args = (batch["input_ids"],) if self.has_first else ()
        # Schedules evaluate the loss on the last stage even in eval: hand them a no-op one.
        self._loss_ctx = {"loss_fn": None, "batch": batch}
        extra = {"target": torch.arange(batch_rows(batch), device=self.device)} if self.has_last else {}
        res = sched.eval(*args, attention_mask=batch["attention_mask"], labels=batch["input_ids"], **extra,
                         **_routing(batch), **self._images(batch, per_row=True))
        self._loss_ctx = {}
        return self._share_last_stage(res, batch["input_ids"].shape)

    def _output_names(self) -> list[str]:
        return ["values"] if self.head == "value" else ["logprobs", "entropy"]

    def _share_last_stage(self, res: Any, shape: torch.Size) -> dict[str, torch.Tensor]:
        """A pipeline's per-token outputs (``shape`` each): the last stage has them, the others receive them."""
        names = self._output_names()
        if self.has_last:
            res = (res,) if torch.is_tensor(res) else res
            out = [t.float().contiguous() for t in res]
        else:
            out = [torch.empty(shape, device=self.device) for _ in names]
        src = dist.get_global_rank(self.pp_group, self.plan.pp - 1)
        for t in out:
            dist.broadcast(t, src=src, group=self.pp_group)
        return dict(zip(names, out))

    def _packed_forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        packs = self._pack(batch)
        names = self._output_names()
        for st in self.stages:
            st.eval()
        try:
            if self.plan.pp == 1:
                outs = [self._as_dict(self.stages[0](pk.input_ids, attention_mask=pk.segments, labels=pk.labels,
                                                     **_packed_routing(pk, batch, pk.rows),
                                                     **self._packed_images(pk, batch, pk.rows)))
                        for pk in packs]
            else:
                self._loss_ctx = {"loss_fn": None}
                joined = self._pp_packed_call(packs, None, batch=batch)
                self._loss_ctx = {}
                outs = [dict(zip(joined, parts)) for parts in zip(*(v.chunk(len(packs)) for v in joined.values()))]
        finally:
            for st in self.stages:
                st.train()
        b, s = batch["input_ids"].shape
        full_out = {k: torch.zeros(b, s, device=self.device) for k in names}
        for pk, o in zip(packs, outs):
            for k in names:
                full_out[k][pk.rows] = pk.unpack(o[k])
        return full_out

    def _pp_packed_call(self, packs: list[PackedMicroBatch], loss_fn: LossFn | None,
                        losses: list | None = None, batch: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """One pipeline schedule over packed micro-batches of equal shape: ``eval`` without a loss (the
        last stage's outputs, shared along the pipeline), ``step`` with one. ``batch``: where the packs'
        recorded routing and images come from, if any (each packed row's images padded over every pack)."""
        ids = torch.cat([pk.input_ids for pk in packs])
        seg = torch.cat([pk.segments for pk in packs])
        labels = torch.cat([pk.labels for pk in packs])
        routed = [_packed_routing(pk, batch or {}, pk.rows) for pk in packs]
        if routed[0]:
            extra_kw = {"routing": torch.cat([r["routing"] for r in routed])}
        else:
            extra_kw = {}
        if self.vision is not None and batch is not None:
            parts = [self._packed_images(pk, batch, pk.rows, per_row=True) for pk in packs]
            extra_kw |= {k: torch.cat([p[k] for p in parts]) for k in ("position_ids", "image_mask")
                         if k in parts[0]}
            if "pixel_values" in parts[0]:
                extra_kw |= _image_tensors([x for p in parts for x in p["pixel_values"]],
                                           [x for p in parts for x in p["image_grid_thw"]], True, self.device)
        m = len(packs)
        sched = self._schedule({"input_ids": ids}, m, train=loss_fn is not None)
        args = (ids,) if self.has_first else ()
        extra: dict[str, Any] = {}
        if self.has_last:  # the target is each row's micro-batch number: _pp_loss finds its samples with it
            extra["target"] = torch.arange(m, device=self.device).repeat_interleave(len(packs[0].input_ids))
        if loss_fn is None:
            res = sched.eval(*args, attention_mask=seg, labels=labels, **extra, **extra_kw)
        else:
            sched.step(*args, attention_mask=seg, labels=labels, **extra, **extra_kw,
                       **({"losses": losses} if self.has_last else {}))
            return {}
        return self._share_last_stage(res, ids.shape)

    def _images(self, mb: dict[str, Any], per_row: bool = False) -> dict[str, torch.Tensor]:
        """A vision-language model's stage keywords for micro-batch ``mb``: its samples' images, joined in row
        order, and every sample's multimodal rotary positions (text-only samples too: M-RoPE's positions of
        plain text are the usual ones on all three axes). ``per_row``: the images as per-row tensors a pipeline
        schedule can cut into micro-batches (``_image_tensors``), there whenever ``mb`` carries images at all."""
        if self.vision is None:
            if mb.get("pixel_values") is not None:
                raise PlanError("the batch has images (pixel_values) but the model has no vision tower")
            return {}
        from rlkit.models.vision import image_token_mask, mrope_positions

        grids = mb.get("image_grid_thw")
        out = {"position_ids": mrope_positions(mb["input_ids"], mb["attention_mask"], grids, *self.vision).transpose(0, 1)}
        if grids is not None and (per_row or sum(len(g) for g in grids)):
            out |= _image_tensors(list(mb["pixel_values"]), list(grids), per_row, self.device)
            out["image_mask"] = image_token_mask(mb["input_ids"], grids, *self.vision)
        return out

    def _packed_images(self, pk: PackedMicroBatch, batch: dict[str, Any], rows: Any = None,
                       per_row: bool = False) -> dict[str, Any]:
        """``_images`` laid out as the packed rows of ``pk`` (``rows``: where its rows sit in ``batch``; None: the
        batch is the micro-batch's own rows): each token keeps the positions it has in its own sequence, and the
        images follow the order the sequences sit in the packed rows. ``per_row`` (a pipeline's packs, joined by
        ``_pp_packed_call``): ``pixel_values`` / ``image_grid_thw`` are lists of each packed row's images (None: a
        row without a sequence), there whenever ``batch`` carries images at all."""
        if self.vision is None:
            return self._images(batch)  # (a batch with images for a model without a tower: the error)
        from rlkit.models.vision import image_token_mask, mrope_positions

        sel = list(range(batch_rows(batch))) if rows is None else [int(r) for r in rows]
        mine = take_rows(batch, torch.tensor(sel, dtype=torch.long, device=self.device))
        pixels, grids = mine.get("pixel_values"), mine.get("image_grid_thw")
        positions = mrope_positions(mine["input_ids"], mine["attention_mask"], grids, *self.vision)  # (3, n, S)
        out = {"position_ids": pk.pack(positions.permute(1, 2, 0)).transpose(1, 2)}
        if grids is None or not (per_row or sum(len(g) for g in grids)):
            return out
        # the sequences in packed order: by where their first token landed (per row: each packed row's)
        first = torch.full((len(sel),), pk.input_ids.numel(), dtype=torch.long, device=pk.src.device)
        first = first.scatter_reduce(0, pk.dst // pk.seq_len, pk.src, "amin")
        order = first.argsort().tolist()
        width = pk.input_ids.shape[1]
        groups = [[i for i in order if int(first[i]) // width == r] for r in range(len(pk.input_ids))] \
            if per_row else [order]
        joined = [(torch.cat([pixels[i] for i in g]), torch.cat([grids[i] for i in g])) if g else (None, None)
                  for g in groups]
        out["pixel_values"], out["image_grid_thw"] = (list(x) for x in zip(*joined))
        if not per_row:
            out |= _image_tensors(out["pixel_values"], out["image_grid_thw"], False, self.device)
        out["image_mask"] = pk.pack(image_token_mask(mine["input_ids"], grids, *self.vision), fill=False)
        return out

    def _as_dict(self, out) -> dict[str, torch.Tensor]:
        if self.head == "value":
            return {"values": out}
        return {"logprobs": out[0], "entropy": out[1]}

    # ---- training ----------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> float:
        """Accumulate the gradients of the step's objective on this rank's batch.

        The objective is ``sum(w * loss_fn(out, mb)) / sum(w)`` over the micro-batches of every DP rank,
        ``w = weight_fn(mb)``. A loss that is a mean over a micro-batch's tokens, weighted by its token
        count, is then the mean over the step's tokens however the batch is cut into micro-batches and
        ranks (padding-free micro-batches hold varying numbers of sequences). Without ``weight_fn`` each
        micro-batch weighs the same: the mean over micro-batches and DP ranks.

        Returns the objective's value (the same on every rank)."""
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        packs = self._pack(batch) if self.padding_free else None
        parts = [take_rows(batch, pk.rows) for pk in packs] if packs else list(split_rows(batch, self._micro_batches(batch)))
        m = len(parts)
        weights = [1.0] * m if weight_fn is None else [float(weight_fn(mb)) if batch_rows(mb) else 0.0
                                                     for mb in parts]
        scales = loss_scales(weights, self.dp_size, self.dp_group, self.device)
        # the router's losses: a mean over micro-batches (a pipeline schedule divides by m itself) and layers
        for moe in self.moes:
            moe.loss_scale = (1.0 / m if self.plan.pp == 1 else 1.0) / self._moe_layers
        total = torch.zeros((), device=self.device)
        if self.plan.pp == 1:
            st = self.stages[0]
            for j, mb in enumerate(parts):
                if hasattr(st, "set_requires_gradient_sync"):  # FSDP: reduce grads once, on the last one
                    st.set_requires_gradient_sync(j == m - 1)
                if packs:
                    pk = packs[j]
                    raw = self._as_dict(st(pk.input_ids, attention_mask=pk.segments, labels=pk.labels,
                                           **_packed_routing(pk, mb), **self._packed_images(pk, mb)))
                    out = {k: pk.unpack(v) for k, v in raw.items()}
                else:
                    out = self._as_dict(st(mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["input_ids"],
                                           **_routing(mb), **self._images(mb)))
                # an empty micro-batch (a DP rank with fewer sequences) adds nothing, but FSDP needs its backward
                loss = loss_fn(out, mb) if batch_rows(mb) else sum(v.sum() for v in out.values()) * 0.0
                (loss / m if weight_fn is None else loss * scales[j]).backward()
                total += loss.detach() / m if weight_fn is None else loss.detach() * scales[j]
        else:
            self._loss_ctx = {"batch": batch, "loss_fn": loss_fn, "parts": parts, "packs": packs, "scales": scales,
                              "weighted": weight_fn is not None}
            losses: list[torch.Tensor] = []  # what _pp_loss returned, per micro-batch
            if packs:
                self._pp_packed_call(packs, loss_fn, losses, batch=batch)
            else:
                sched = self._schedule(batch, m, train=True)
                args = (batch["input_ids"],) if self.has_first else ()
                extra = {"target": torch.arange(batch_rows(batch), device=self.device), "losses": losses} \
                    if self.has_last else {}
                sched.step(*args, attention_mask=batch["attention_mask"], labels=batch["input_ids"], **extra,
                           **_routing(batch), **self._images(batch, per_row=True))
            self._loss_ctx = {}
            if self.has_last:  # weighted: each came back times its scale and m (see _pp_loss)
                total += torch.stack([x.detach() for x in losses]).sum() / m
            dist.all_reduce(total, group=self.pp_group)  # only the last stage contributed
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        for p in self.params:
            # DTensor's embedding backward returns a Replicate grad for a vocab-sharded (Rowwise)
            # table; hand the optimizer a grad laid out like its param (a local slice, no comm).
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for p in self.tp_partial:  # each TP rank saw its own heads: the gradient is their sum
            if p.grad is not None:
                dist.all_reduce(local(p.grad), group=self.mesh["tp"].get_group())
        for p in self.expert_params:  # each rank's experts saw its EP group's tokens: average over expert-DP
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = local(p.grad)
            if self.groups.edp_group is not None:
                dist.all_reduce(g, group=self.groups.edp_group)
            g.div_(self.dp_size)  # the step's mean over DP ranks, as FSDP's reduction gives the rest
        if self._tied_group is not None:  # the tied copies get the sum of both stages' gradients
            for p in self._tied_copies():
                if p.grad is not None:
                    dist.all_reduce(local(p.grad), group=self._tied_group)
        self.last_grad_bytes = storage_bytes([p.grad for p in self.params if p.grad is not None])
        return total.item()

    def _pp_loss(self, output, target: torch.Tensor) -> torch.Tensor:
        # The schedule hands the last stage's output and the target's micro-batch slice: row indices of
        # the batch, or (packed) the micro-batch's number on every row. The user's loss sees its samples
        # in the batch's layout; the schedule divides gradients by the micro-batch count, undone here.
        ctx = self._loss_ctx
        if ctx["loss_fn"] is None:
            return torch.zeros((), device=self.device)
        out = self._as_dict(output)
        if ctx.get("warmup"):  # the schedule learning its shapes (on stand-in data): not a micro-batch
            ctx["warmup"] = False
            return sum(v.sum() for v in out.values()) * 0.0
        if ctx["packs"]:
            j = int(target[0])
            out = {k: ctx["packs"][j].unpack(v) for k, v in out.items()}
        else:
            j = int(target[0]) // len(target)
        mb = ctx["parts"][j]
        if not batch_rows(mb):  # an empty row of a packed pipeline: keep the graph, add nothing
            return sum(v.sum() for v in out.values()) * 0.0
        loss = ctx["loss_fn"](out, mb)
        return loss * (ctx["scales"][j] * len(ctx["parts"])) if ctx["weighted"] else loss

    def optimizer_step(self) -> float:
        """Clip (global grad norm over all dims) and step AdamW; returns the pre-clip grad norm."""
        norm = self.grad_norm()
        clip_grads(self.params, norm, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> dict[str, float]:
        """forward + loss + backward (micro-batched) + clip + AdamW step on this rank's batch
        (``weight_fn``: see ``forward_backward``)."""
        t0 = time.perf_counter()
        loss = self.forward_backward(batch, loss_fn, weight_fn)
        norm = self.optimizer_step()
        return {"loss": loss, "grad_norm": norm, "step": self.step, "step_time_s": time.perf_counter() - t0}

    def set_routing_replay(self, replay: bool = True) -> None:
        """Mixture of experts, for forwards given recorded ``routing``: route by it (``True``, rollout routing
        replay) or route by this model's own router and only count where it differs (``False``).

        >>> pm.set_routing_replay(True)                                       # doctest: +SKIP
        """
        for moe in self.moes:
            moe.replay = bool(replay)

    def set_flip_counting(self, on: bool) -> None:
        """Whether forwards given recorded routing count route flips (``router_stats``), e.g. only while the
        weights are still the ones the engine sampled with."""
        for moe in self.moes:
            moe.count_flips = bool(on)

    def reset_router_stats(self) -> None:
        """Start the routers' counts afresh on this rank (``router_stats`` reads and resets them everywhere)."""
        for moe in self.moes:
            moe.reset_stats()

    def router_stats(self) -> dict[str, Any]:
        """The mixture-of-experts routers since the last call, over every rank (a collective on every rank):
        ``load`` (num_layers x E tokens routed to each expert, summed; dense layers' rows 0), the mean
        load-balancing ``aux_loss`` and ``z_loss`` over forwards and MoE layers, and per layer the tokens with
        a recorded choice (``recorded``) and those whose own top-k differed from it (``flips``), and the
        bytes a rank sent to others by the forwards' all-to-alls (``a2a_bytes_per_rank``: dispatch and combine;
        backward sends as much again). Then resets the counts.

        >>> pm.router_stats()["load"].shape                                   # doctest: +SKIP
        torch.Size([4, 8])
        """
        n_layers, experts = self.config.num_hidden_layers, int(getattr(self.config, "num_experts", 0) or 0)
        load = torch.zeros(n_layers, max(experts, 1), dtype=torch.float64)
        flips = torch.zeros(n_layers, 2, dtype=torch.float64)  # route flips, tokens with a recorded choice
        sums = torch.zeros(4, dtype=torch.float64)  # aux, z, forwards (per layer), all-to-all bytes sent
        for moe in self.moes:
            st = moe.stats
            load[moe.layer] += st["load"]
            flips[moe.layer] += torch.tensor([st["flips"], st["recorded"]], dtype=torch.float64)
            sums += torch.tensor([st["aux"], st["z"], st["n"], st["a2a_bytes"]], dtype=torch.float64)
            moe.reset_stats()
        # one copy per TP group (TP ranks route the same tokens): count tp rank 0's
        if self.coords["tp"]:
            load.zero_(), sums.zero_(), flips.zero_()
        for t in (load, sums, flips):
            dist.all_reduce(t)
        n = max(float(sums[2]), 1.0)
        return {"load": load, "aux_loss": float(sums[0]) / n, "z_loss": float(sums[1]) / n,
                "flips": flips[:, 0], "recorded": flips[:, 1],
                "a2a_bytes_per_rank": float(sums[3]) / (dist.get_world_size() // self.plan.tp)}

    def grad_norm(self) -> float:
        """L2 norm of all gradients of the model (DTensor shards reduced over dp/tp, summed over pp)."""
        sq = torch.zeros((), device=self.device, dtype=torch.float64)
        # a tied matrix counts once: its last-stage copy holds the same (summed) gradient as the first's
        skip = {id(st.lm_head.weight) for st in self.stages if self._tied_group is not None and hasattr(st, "lm_head")}
        for p in self.params:
            if p.grad is not None and id(p) not in skip:
                sq += full(p.grad.norm(2)).double() ** 2
        if self.plan.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt().item()

    def _schedule(self, batch: dict[str, Any], m: int, train: bool = False):
        """A pipeline schedule for this micro-batch shape, for training or for eval (stages fix their p2p
        buffer shapes on first use, so a new shape gets new PipelineStage objects over the same modules).

        On its first use a schedule runs one micro-batch through the stages to learn the shapes, loss
        included, and again whenever it switches between eval and training: one schedule per mode keeps
        that to once per shape, and ``_loss_ctx["warmup"]`` keeps the user's loss out of it."""
        import torch.distributed.pipelining as pl

        key = tuple(batch["input_ids"].shape) + (m, train)
        fresh = key not in self._schedules
        if fresh:
            stages = [pl.PipelineStage(mod, s, self.plan.n_stages, self.device, group=self.pp_group)
                      for s, mod in zip(self.stage_ids, self.stages)]
            cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B,
                   "interleaved-1f1b": pl.ScheduleInterleaved1F1B}[self.plan.pipeline_schedule]
            self._schedules[key] = cls(stages if self.plan.vpp > 1 else stages[0], n_microbatches=m,
                                       loss_fn=self._pp_loss)
            for moe in self.moes:  # its first use runs a warm-up forward of each stage: not a micro-batch
                moe.skip_stats = 1
        if train:
            self._loss_ctx["warmup"] = fresh
        return self._schedules[key]

    def _tied_copies(self) -> list[nn.Parameter]:
        """This rank's copy of a tied embedding under pp > 1: the first stage's table, the last's lm_head."""
        out = [st.model.embed_tokens.weight for st in self.stages if st.first]
        return out + [st.lm_head.weight for st in self.stages if st.last and hasattr(st, "lm_head")]

    # ---- named view over this rank's parameters ----------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(HF name, parameter) for this rank's stages; DTensors hold this rank's shard."""
        for st in self.stages:
            yield from st.named_parameters()

    def _root(self) -> nn.Module:
        """One module over all local stages with HF names (interleaved PP holds several stages)."""
        if len(self.stages) == 1:
            return self.stages[0]
        root = nn.Module()
        root.model = nn.Module()
        root.model.layers = nn.ModuleDict({k: v for st in self.stages for k, v in st.model.layers.items()})
        for st in self.stages:
            for name in ("embed_tokens", "norm"):
                if getattr(st.model, name, None) is not None:
                    setattr(root.model, name, getattr(st.model, name))
            for name in ("lm_head", "value_head", "visual"):  # (the vision tower: the first stage's)
                if getattr(st, name, None) is not None:
                    setattr(root, name, getattr(st, name))
        return root

    # ---- full weights out --------------------------------------------------------------------------
    def iter_full_weights(self, to: str | int | Iterable[int] = "all", *,
                          adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Yield ``(hf_name, full tensor)`` one parameter at a time, on CPU, from any layout.

        ``to="all"``: every rank receives every tensor; ``to=0`` (or a set of ranks, e.g. the
        rollout engines' ranks): only those do (others get None). Every rank must iterate to the end (the gathers are collectives).
        FSDP-sharded weights are gathered in buckets (``GATHER_BUCKET_BYTES``), every other layout one
        parameter at a time: beyond what the caller keeps, a rank holds at most one gathered bucket plus
        the tensor being yielded. Stats land in ``self.last_transfer`` (bytes received by this rank, seconds).

        With LoRA the names are HF's and an adapted layer's weight is merged, ``W + scaling * B @ A``;
        ``adapters_only=True`` yields the adapters alone, under their own names (all that an engine holding
        the base needs: ``RolloutEngine.load_lora``).
        """
        t0 = time.perf_counter()
        self.last_transfer = {"bytes": 0.0}
        metas = [m for m in self._param_meta() if not adapters_only or is_lora(m[0])]
        stream = self._gather(metas, to)
        yield from (self._merged(stream) if self.lora is not None and not adapters_only else stream)
        self.last_transfer["seconds"] = time.perf_counter() - t0

    def _gather(self, metas: list, to: str | int | Iterable[int]) -> Iterator[tuple[str, torch.Tensor | None]]:
        moved = 0
        targets = None if to == "all" else ({to} if isinstance(to, int) else set(to))
        # A pipeline column joins the stage broadcasts when it holds a receiving rank.
        want = targets is None or bool(targets & set(self.plan.group_of(self.rank, "pp")))
        mine = dict(self.named_parameters())
        # this stage's parameters, gathered over its dp x tp ranks in metas' order (lazily, bucket by bucket)
        owned = full_tensors([mine[m[0]] for m in metas if m[3] == self.pp_rank])
        for name, shape, dtype, owner in metas:
            if owner == self.pp_rank:
                t, received = next(owned)
                moved += received
            else:
                t = torch.empty(shape, dtype=dtype, device=self.device) if want else None
            if self.plan.pp > 1 and want:
                src = dist.get_global_rank(self.pp_group, owner)
                dist.broadcast(t, src=src, group=self.pp_group)
                if owner != self.pp_rank:
                    moved += t.numel() * t.element_size()
            receive = targets is None or self.rank in targets
            self.last_transfer["bytes"] = float(moved)
            yield name, (t.cpu() if receive else None)

    def _merged(self, stream: Iterator[tuple[str, torch.Tensor | None]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """HF names, and each adapted weight merged with its adapters once the three have streamed by."""
        parts: dict[str, dict[str, torch.Tensor | None]] = {}
        scale = scaling(self.lora)
        for name, t in stream:
            if not is_lora(name) and not name.endswith(".base_layer.weight"):
                yield hf_name(name), t
                continue
            mod = module_of(name)
            key = "A" if ".lora_A." in name else "B" if ".lora_B." in name else "W"
            got = parts.setdefault(mod, {})
            got[key] = t
            if len(got) == 3:
                del parts[mod]
                yield f"{mod}.weight", (None if got["W"] is None else merge(got["W"], got["A"], got["B"], scale))

    def adapters_disabled(self):
        """A context in which this rank's stages run as the base model (LoRA's reference policy).

        >>> with actor.adapters_disabled():                                   # doctest: +SKIP
        ...     ref = actor.logprobs(ids, mask)["logprobs"]
        """
        if self.lora is None:
            raise PlanError("adapters_disabled() needs a model with LoRA adapters (ParallelModel(..., lora=...))")
        return adapters_disabled(self.stages)

    def full_state_dict(self, to: str | int = 0) -> dict[str, torch.Tensor]:
        """Full HF-named weights (CPU), loadable with ``load_state_dict(strict=True)`` into a fresh
        HF model (plus ``value_head.weight`` for a critic). Empty dict on ranks that don't receive."""
        return {k: v for k, v in self.iter_full_weights(to) if v is not None}

    def _param_meta(self) -> list[tuple[str, tuple, torch.dtype, int]]:
        if not hasattr(self, "_meta"):
            # HF's own names, each tensor once: a tied lm_head (its last-stage copy) is the embedding
            mine = [(n, tuple(p.shape), p.dtype, self.pp_rank) for n, p in self.named_parameters()
                    if not (self.tied and n == "lm_head.weight")]
            everyone: list[Any] = [None] * self.plan.pp
            if self.plan.pp > 1:
                dist.all_gather_object(everyone, mine, group=self.pp_group)
            else:
                everyone = [mine]
            order = {n: i for i, n in enumerate(_hf_order(self.config.num_hidden_layers))}
            metas = [m for part in everyone for m in part]
            self._meta = sorted(metas, key=lambda m: (order.get(_layer_key(m[0]), 10**9), m[0]))
        return self._meta

    # ---- checkpoint ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> str:
        """Save model + optimizer (sharded, torch.distributed.checkpoint) + step + RNG of every rank, and the
        layout that wrote them (``layout.json``: the plan's degrees), which ``load`` reads to reshard.

        Written to a temp folder beside ``path`` and renamed into place (``rlkit.atomic``) once every rank
        finished, so a crash never leaves a half-written ``path`` (multi-node: needs a shared filesystem)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Path(path)
        box = [str(atomic.temp_path(path)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        msd, osd = get_state_dict(self._root(), self.optimizer)
        try:
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        except CheckpointException as e:  # a BaseException: never let it leave the rank as one
            raise CheckpointError(f"could not write the checkpoint {path} (every rank stops: {_first_failure(e)}); "
                                  f"{path} is untouched, the write went to a temporary folder beside it. Check "
                                  f"the disk's free space and permissions") from None
        torch.save({"step": self.step, **rng_state()}, tmp / f"extra_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            (tmp / LAYOUT_FILE).write_text(json.dumps(self.plan.layout()))
            atomic.move_into_place(tmp, path)
        dist.barrier()
        return str(path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore what ``save`` wrote, under this plan or another one.

        Under the plan that saved it, the resume is exact: weights, optimizer state, step and every rank's RNG.
        Under another plan (``layout.json`` differs: dp=2 -> tp=2, tp=2 x pp=2 -> dp=4, FSDP -> one rank),
        torch.distributed.checkpoint reshards the weights and the optimizer state by their HF names onto this
        layout; the step comes from the checkpoint, and the RNG is this rank's own (a rank of another layout
        has no saved stream to take; rlkit's sampling is seeded per sample, not per rank).

        A missing, truncated or foreign file raises ``CheckpointError`` naming it on every rank (torch's
        ``CheckpointException``, a ``BaseException``, never leaves the rank). Reads only."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from rlkit.checkpoint import damage_report

        path = Path(path)
        saved = saved_layout(path)
        same = saved is None or saved == self.plan.layout()  # no layout.json: written before it, by this plan
        extra_file = path / f"extra_rank{self.rank if same else 0}.pt"
        try:
            extra, problem = torch.load(extra_file, weights_only=False), None
        except Exception as e:  # missing or cut short; every rank hears of it below (no one left waiting)
            extra = None
            problem = (f"{extra_file} is missing: {path} is not a complete rlkit checkpoint for rank {self.rank}; "
                       f"was it saved with the same plan?") if not extra_file.is_file() else \
                (f"{extra_file} is truncated or damaged ({type(e).__name__}: {_one_line(e)}): rank "
                 f"{self.rank}'s step and RNG state; copy the checkpoint again from where it was saved")
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        root = self._root()
        msd, osd = get_state_dict(root, self.optimizer)
        # Hyper-parameters come from this optimizer, not the file: DCP round-trips the tensors
        # reliably, but drops non-tensor param-group entries of stages other ranks also hold.
        groups = copy.deepcopy(osd["param_groups"])
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as e:  # every rank gets it (DCP gathers the failures)
            raise damage_report(path, e) from None
        state["optim"]["param_groups"] = groups
        set_state_dict(root, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = extra["step"]
        if same:
            restore_rng_state(extra)
        dist.barrier()

    # ---- memory ------------------------------------------------------------------------------------
    def memory(self, batch: dict[str, Any] | None = None):
        """Bytes per rank: weights, grads (from the last backward), optimizer state, activations
        (autograd-saved tensors of one micro-batch forward, times the micro-batches in flight on
        this pipeline rank), total. A DataFrame gathered from every rank (on every rank).

        On CUDA the total is ``torch.cuda.max_memory_allocated`` instead of the sum."""
        import pandas as pd

        row = {"rank": self.rank,
               "weights": storage_bytes([p.data for p in self.params]),
               "grads": self.last_grad_bytes,
               "optimizer": storage_bytes([t for s in self.optimizer.state.values() for t in s.values()
                                    if torch.is_tensor(t) and t.dim() > 0])}
        row["activations"] = self.measure_activations(batch) if batch is not None else 0
        row["total"] = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                        else row["weights"] + row["grads"] + row["optimizer"] + row["activations"])
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return pd.DataFrame(rows)

    def measure_activations(self, batch: dict[str, Any]) -> int:
        """Bytes autograd keeps for backward: one micro-batch forward through this rank's stages
        (hidden-state inputs faked for later stages), times the micro-batches in flight here.
        Runs a throwaway backward and clears gradients: call it between steps.

        Padding-free (``set_packing``): the micro-batch is a packed one as training lays it out (rows of
        packed sequences, the segments' block-diagonal mask, labels on the scored tokens only), the one
        with the most rows (the packer deals rows evenly, so the first may hold one row fewer), and the
        micro-batches in flight are counted among the packed ones."""
        tensors = {k: v.to(self.device) for k, v in batch.items() if torch.is_tensor(v)}
        if self.padding_free:
            tensors.setdefault("attention_mask", torch.ones_like(tensors["input_ids"]))
            packs = self._pack(tensors)
            m = len(packs)
            pk = max(packs, key=lambda p: (p.input_ids.shape[0], int((p.labels >= 0).sum())))
            ids, am, labels = pk.input_ids, pk.segments, pk.labels
        else:
            m = self._micro_batches(batch)
            mb = next(iter(split_rows(tensors, m)))
            ids, am, labels = mb["input_ids"], mb["attention_mask"], mb["input_ids"]
        seen: dict[int, int] = {}
        param_ptrs = {local(p).untyped_storage().data_ptr() for p in self.params}

        def live_param_ptrs():  # FSDP swaps in gathered (unsharded) params during forward
            return {local(p).untyped_storage().data_ptr() for st in self.stages for p in st.parameters()}

        def pack(t):
            try:
                s = local(t).untyped_storage()
                ptr = s.data_ptr()
            except RuntimeError:  # a tensor subclass without storage of its own (its parts are seen)
                return t
            if ptr not in param_ptrs and ptr not in live_param_ptrs():  # weights are not activations
                seen[ptr] = s.nbytes()
            return t

        outs = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for st in self.stages:
                x = ids if st.first else torch.randn(*ids.shape, self.config.hidden_size, device=self.device,
                                                     requires_grad=True)
                out = st(x, attention_mask=am, labels=labels)
                outs += list(out) if isinstance(out, tuple) else [out]
        per_mb = sum(seen.values())
        # Finish the graph (FSDP expects every forward to meet its backward), then drop the grads.
        sum(o.float().sum() for o in outs).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return int(per_mb * self.in_flight(m))

    def in_flight(self, m: int) -> float:
        """Micro-batches of this rank's layers whose activations are held at the peak (the
        schedule's warm-up depth; the same counts ``rlkit.plan.memory`` uses)."""
        pp, r, v = self.plan.pp, self.pp_rank, self.plan.vpp
        if pp == 1:
            return 1  # gradient accumulation: one micro-batch at a time
        if self.plan.pipeline_schedule == "gpipe":
            return m
        if self.plan.pipeline_schedule == "interleaved-1f1b":  # chunks of layers/v (Megatron warm-up)
            return min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) / v
        return min(m, pp - r)


LAYOUT_FILE = "layout.json"  # the saving plan's ParallelPlan.layout()


def saved_layout(path: str | os.PathLike) -> dict[str, Any] | None:
    """The layout a ``ParallelModel.save`` folder was written by (None when it predates ``layout.json``)."""
    file = Path(path) / LAYOUT_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def _routing(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The stage keyword for a batch's recorded routing (mixture of experts), if it has one."""
    r = batch.get("routing")
    return {} if r is None else {"routing": r}


def _packed_routing(pk: PackedMicroBatch, batch: dict[str, Any], rows: Any = None) -> dict[str, torch.Tensor]:
    """``_routing`` laid out as the packed rows of ``pk`` (``rows``: where its rows sit in ``batch``; None: the
    batch is the micro-batch's own rows)."""
    r = batch.get("routing")
    if r is None:
        return {}
    return {"routing": pk.pack(r if rows is None else r[rows], fill=-1)}


def _image_tensors(pixels: list[torch.Tensor | None], grids: list[torch.Tensor | None], per_row: bool,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """The stage's ``pixel_values`` / ``image_grid_thw`` from each row's images (None: a packed row without a
    sequence): joined in row order, or ``per_row`` as a pipeline schedule cuts every keyword, along dim 0: each
    row's patches padded to the most any row has, ``(B, P, D)``, and its grids to the most images, ``(B, K, 3)``,
    with zero rows, which the first stage takes apart again inside its micro-batch (``stage.unpad_images``).

    >>> kw = _image_tensors([torch.ones(4, 2), None], [torch.tensor([[1, 2, 2]]), None], True, torch.device("cpu"))
    >>> tuple(kw["pixel_values"].shape), kw["image_grid_thw"].tolist()
    ((2, 4, 2), [[[1, 2, 2]], [[0, 0, 0]]])
    """
    like = next(p for p in pixels if p is not None)
    pixels = [like[:0] if p is None else p for p in pixels]
    grids = [torch.zeros(0, 3, dtype=torch.long) if g is None else g.reshape(-1, 3) for g in grids]
    if not per_row:
        return {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}
    pad = torch.nn.utils.rnn.pad_sequence
    return {"pixel_values": pad(pixels, batch_first=True).to(device),
            "image_grid_thw": pad(grids, batch_first=True).to(device)}


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _first_failure(e: CheckpointException) -> str:
    """The first rank's failure inside torch's ``CheckpointException``, in one line."""
    for rank, (err, _trace) in e.failures.items():
        return f"rank {rank}: {type(err).__name__}: {_one_line(err)}"
    return "no failure recorded"


def _hf_order(num_layers: int) -> list[str]:
    return ["embed"] + [f"layer{i}" for i in range(num_layers)] + ["norm", "head"]


def _layer_key(name: str) -> str:
    if name.startswith("model.layers."):
        return f"layer{name.split('.')[2]}"
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("model.norm"):
        return "norm"
    return "head"
