"""DeepSpeedModel: ``ParallelModel``'s interface trained by DeepSpeed (checked on deepspeed 0.19.8).

* ``pp == 1``: ZeRO stage 0-3 over DP on the whole HF model (one ``rlkit.parallel.stage.Stage``, so log-probs,
  entropy and values are computed exactly as the torch backend computes them).
* ``pp > 1``: DeepSpeed's ``PipelineModule`` over rlkit-built layers of the HF model (the embedding, each
  decoder layer, the final norm + head), ZeRO 0 or 1 over DP. A tied embedding is a ``TiedLayerSpec`` on the
  first and last stage (DeepSpeed sums the two copies' gradients). Ranks: pipe outermost, data inside, the
  same as rlkit's ``tp-dp-pp`` order with ``tp == 1`` (checked at construction).

DeepSpeed has no tensor parallelism for training an HF model: ``tp > 1`` is refused (``rlkit.backends``).

The training objective is ``ParallelModel``'s: ``sum(w * loss_fn(out, mb)) / sum(w)`` over the micro-batches of
every DP rank. DeepSpeed divides each micro-batch's loss by its gradient accumulation steps (set to the plan's
micro-batches) and averages gradients over DP; each loss is multiplied by both before its backward, so what
DeepSpeed computes is that objective's gradient. Gradients are clipped by DeepSpeed's own
``"gradient_clipping"`` (0.19.8 clips at 1.0 unless told: it is always set), and AdamW is a
``torch.optim.AdamW`` handed to ``deepspeed.initialize`` (no JIT-built fused Adam).

DeepSpeed's comm layer JIT-builds its ``deepspeed_shm_comm`` op on CPU (g++, ~45 s a machine) for
``inference_all_reduce`` alone, which training never calls: rlkit skips that build (``import_deepspeed``), so no
compiler is needed. Any op DeepSpeed still JIT-builds goes to ``TORCH_EXTENSIONS_DIR``, by default
``rlkit.models.cache_dir() / "torch_extensions"`` (unless set), built once per machine.

Two private parts of DeepSpeed's pipeline engine are used, so that ``forward_backward`` and
``optimizer_step`` stay separate calls as in ``ParallelModel``: the engine's ``_train_schedule`` is
replaced by one without its ``OptimizerStep``, and ``optimizer_step`` calls ``_exec_optimizer_step``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from rlkit import atomic
from rlkit.checks import choice
from rlkit.errors import CheckpointError, PlanError
from rlkit.parallel.kit import (
    PRECISIONS,
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
from rlkit.parallel.stage import (
    Stage,
    causal_padding_mask,
    position_ids_from_mask,
    run_layer,
    token_logprobs,
)
from rlkit.plan.topology import ParallelPlan

TAG = "rlkit"  # the DeepSpeed checkpoint tag save() writes and load() reads (no "latest" lookup)
_ds_world: list[Any] = [None]  # the torch.distributed world DeepSpeed's comm and groups were set up in
# ZeRO-3's deepspeed.initialize replaces torch.nn.functional.linear process-wide (its memory-efficient linear) and
# never puts it back. A one-rank plan trains in the user's own process (a notebook kernel), so the original is
# kept while ZeRO-3 models are open and put back when the last of them closes.
_zero3_open: set[int] = set()  # id() of each open ZeRO-3 DeepSpeedModel of this process
_linear_before_zero3: list[Any] = [None]


def _zero3_opening(key: int) -> None:
    if not _zero3_open:
        _linear_before_zero3[0] = F.linear
    _zero3_open.add(key)


def _zero3_closed(key: int) -> None:
    """Put torch.nn.functional.linear back once no ZeRO-3 model of this process is open (it was DeepSpeed's)."""
    if key not in _zero3_open:
        return
    _zero3_open.discard(key)
    if not _zero3_open and _linear_before_zero3[0] is not None:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        if torch.nn.functional.linear is zero3_linear_wrap:  # not a patch someone made since
            torch.nn.functional.linear = _linear_before_zero3[0]
        _linear_before_zero3[0] = None


def _forget_world() -> None:
    """Drop what DeepSpeed keeps of a destroyed world (its comm backend, its cached world and DP groups), so a
    later model in this process sets them up in the current world."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups

    ds_comm.cdb = None
    groups._WORLD_GROUP = groups._DATA_PARALLEL_GROUP = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP = {}, {}
    groups._EXPERT_PARALLEL_GROUP_RANKS, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS = {}, {}
    groups.mesh_device = None


def _no_shm_op() -> None:
    """DeepSpeed's ``build_shm_op`` where the op is not built (see ``import_deepspeed``)."""
    return None


def import_deepspeed():
    """``deepspeed``, imported for this machine and joined to the running torch.distributed world.

    Without CUDA, DeepSpeed is told to use its CPU accelerator (``DS_ACCELERATOR=cpu``) before it is imported;
    JIT-built ops go to a persistent cache; ``LOCAL_RANK`` (which DeepSpeed insists on) is filled in when the
    launcher did not set it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from rlkit.models.tiny import cache_dir

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))
    import deepspeed

    # its shared-memory all-reduce serves inference_all_reduce only (DeepSpeed inference's TP), never training;
    # without it DeepSpeed takes torch.distributed's collectives, as it does where the op cannot build.
    # (By module name: the package attribute deepspeed.comm.torch is the torch package itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_shm_op
    if not dist.is_initialized():
        raise PlanError("DeepSpeedModel runs inside an initialized torch.distributed world "
                        "(rlkit.parallel.dist.init_distributed)")
    world = dist.distributed_c10d._get_default_group()
    if _ds_world[0] is not None and _ds_world[0] is not world:
        _forget_world()  # DeepSpeed cached the groups of a world destroyed since (a Trainer closed in this process)
    _ds_world[0] = world
    with contextlib.redirect_stdout(io.StringIO()):  # a JIT op build prints "... built successfully"
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    return deepspeed


class _Scoring:
    """What the last stage scores (``set_scoring``) and the autocast dtype, shared by the pipeline layers."""

    def __init__(self, chunk: int, dtype: torch.dtype | None):
        self.first, self.entropy_grad, self.chunk, self.dtype = 1, True, chunk, dtype

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)


class _PipeEmbed(nn.Module):
    """Pipeline layer 0: ``(input_ids, attention_mask) -> (hidden, attention_mask, input_ids)`` (the ids ride
    along: the last stage scores them)."""

    def __init__(self, embed: nn.Module, scoring: _Scoring):
        super().__init__()
        self.embed_tokens, self.scoring = embed, scoring

    def forward(self, inputs):
        ids, am = inputs
        with self.scoring.autocast(ids.device):
            return self.embed_tokens(ids), am, ids


class _PipeLayer(nn.Module):
    """One HF decoder layer with the rotary embedding, positions and mask ``Stage`` gives it."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, scoring: _Scoring):
        super().__init__()
        self.layer, self.scoring = layer, scoring
        self.rotary = [rotary]  # parameter-free, shared by every layer: kept out of the module tree

    def forward(self, inputs):
        h, am, ids = inputs
        with self.scoring.autocast(h.device):
            pos = position_ids_from_mask(am)
            pe = self.rotary[0](h, position_ids=pos)
            h = run_layer(self.layer, h, causal_padding_mask(am, h.dtype), pos, pe)
        return h, am, ids


class _PipeNorm(nn.Module):
    """The final norm alone (a tied embedding's head follows it as its own layer)."""

    def __init__(self, norm: nn.Module, scoring: _Scoring):
        super().__init__()
        self.norm, self.scoring = norm, scoring

    def forward(self, inputs):
        h, am, ids = inputs
        with self.scoring.autocast(h.device):
            return self.norm(h), am, ids


class _PipeHead(nn.Module):
    """The final norm and the head: ``(logprobs, entropy)`` (head "lm") or ``values``, (B, S) fp32 each."""

    def __init__(self, norm: nn.Module, head: nn.Module, kind: str, scoring: _Scoring):
        super().__init__()
        self.norm, self.scoring, self.kind = norm, scoring, kind
        if kind == "value":
            self.value_head = head
        else:
            self.lm_head = head

    def forward(self, inputs):
        h, am, ids = inputs
        with self.scoring.autocast(h.device):
            h = self.norm(h)
            if self.kind == "value":
                return self.value_head(h).squeeze(-1).float()
            sc = self.scoring
            return token_logprobs(self.lm_head, h, ids, sc.chunk, first=sc.first, entropy_grad=sc.entropy_grad)


def _tied_head(module: _PipeEmbed, inputs):
    """The last stage's use of the tied embedding (DeepSpeed's ``forward_fn``): its table as the LM head."""
    h, am, ids = inputs
    sc = module.scoring
    with sc.autocast(h.device):
        def head(x):
            return F.linear(x, module.embed_tokens.weight)
        return token_logprobs(head, h, ids, sc.chunk, first=sc.first, entropy_grad=sc.entropy_grad)


def _no_step_schedule(engine):
    """``engine``'s training schedule without its optimizer step (``optimizer_step`` takes it)."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep, TrainSchedule

    class NoStep(TrainSchedule):
        def steps(self):
            for cmds in super().steps():
                yield [c for c in cmds if not isinstance(c, OptimizerStep)]

    return lambda: NoStep(micro_batches=engine.micro_batches, stages=engine.num_stages, stage_id=engine.stage_id)


class DeepSpeedModel:
    """This rank's share of an HF causal LM trained by DeepSpeed, with ``ParallelModel``'s interface.

    Args:
        model: a local HF checkpoint folder (or an HF module); every rank loads it whole, then DeepSpeed
            partitions it (ZeRO-3) or the pipeline keeps this stage's layers.
        plan: the layout: ``dp`` ZeRO ranks, ``pp`` pipeline stages (``tp`` must be 1).
        zero_stage: DeepSpeed's ZeRO stage, 0-3 (0 or 1 when ``pp > 1``).
        head: "lm" (per-token log-probs) or "value" (critic: the seeded value head ``ParallelModel`` builds).
        lr, weight_decay, betas, eps: ``torch.optim.AdamW``'s; ``max_grad_norm``: DeepSpeed's
            ``"gradient_clipping"`` (None: off). ``lr=0.0`` builds a forward-only model (the reference
            policy): a DeepSpeed engine without an optimizer (``optimizer`` is None; training raises).
        precision: "fp32", or "bf16-mixed" (forward and backward under bf16 autocast, weights, grads and
            AdamW state fp32, as ``ParallelModel``).
        lora: must be None (LoRA runs on the torch backend).
        ds_config: entries merged into the DeepSpeed config (a nested dict, e.g.
            ``{"zero_optimization": {"stage3_param_persistence_threshold": 0}}``).

    A collective: every rank of the world constructs it, and the actor, reference and critic of a rank are
    separate instances.

    >>> # under torchrun --nproc-per-node 2 (rlkit.parallel.dist.init_distributed() first):
    >>> dm = DeepSpeedModel(tiny_lm("qwen2"), ParallelPlan(dp=2), zero_stage=2, lr=1e-3)   # doctest: +SKIP
    >>> mine = dm.shard_batch(batch)                                                      # doctest: +SKIP
    >>> dm.train_step(mine, lambda out, mb: -(out["logprobs"] * mb["response_mask"]).mean())  # doctest: +SKIP
    """

    def __init__(self, model: Any, plan: ParallelPlan, *, zero_stage: int, head: str = "lm", lr: float = 1e-5,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 max_grad_norm: float | None = 1.0, seed: int = 0, precision: str = "fp32", lora: Any = None,
                 logprob_chunk: int = 1024, ds_config: dict | None = None):
        choice("precision", precision, tuple(PRECISIONS), error=PlanError)
        choice("head", head, ("lm", "value"), error=PlanError)
        if lora is not None:
            raise PlanError("LoRA runs on backend='torch' only; backend='deepspeed' trains full weights")
        if plan.tp != 1 or plan.vpp != 1 or plan.ep != 1:
            raise PlanError(f"backend='deepspeed' runs tp=1, vpp=1, ep=1 (got tp={plan.tp}, vpp={plan.vpp}, "
                            f"ep={plan.ep})")
        if zero_stage not in (0, 1, 2, 3) or (plan.pp > 1 and zero_stage > 1):
            raise PlanError(f"zero_stage={zero_stage!r}: DeepSpeed runs ZeRO 0-3, and 0 or 1 with pp > 1")
        deepspeed = import_deepspeed()
        if dist.get_world_size() != plan.world_size:
            raise PlanError(f"the plan has {plan.world_size} ranks, the process group {dist.get_world_size()}")
        from deepspeed.utils import groups as ds_groups

        if plan.pp == 1 and ds_groups.mpu is not None:
            # a pipeline engine sets DeepSpeed's process-global model-parallel grid, which every later engine of
            # the process then reads (its data-parallel group and checkpoint rank): a pp=1 engine would be wrong
            raise PlanError("this process already holds a DeepSpeed pipeline model (pp > 1); DeepSpeed keeps its "
                            "grid process-wide, so a pp=1 DeepSpeedModel cannot join it: use one plan per process")
        hf = load_hf(model)
        plan.validate(model=hf.config)
        self.plan, self.config, self.head, self.zero_stage = plan, hf.config, head, zero_stage
        self.rank = dist.get_rank()
        self.coords = plan.coords(self.rank)
        self.dp_rank, self.dp_size, self.pp_rank = self.coords["dp"], plan.dp, self.coords["pp"]
        self.tied = bool(getattr(hf.config, "tie_word_embeddings", False)) and head == "lm"
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.max_grad_norm, self.step, self.lora = max_grad_norm, 0, None
        self.last_transfer: dict[str, float] = {}
        self.last_grad_bytes = 0
        self.scoring = _Scoring(logprob_chunk, PRECISIONS[precision])
        self._ctx: dict[str, Any] = {}

        value_head = None
        if head == "value":  # ParallelModel's seeded init, so both backends' critics start equal
            g = torch.Generator().manual_seed(seed)
            value_head = nn.Linear(hf.config.hidden_size, 1)
            with torch.no_grad():
                value_head.weight.normal_(0.0, getattr(hf.config, "initializer_range", 0.02), generator=g)
                value_head.bias.zero_()
        hf.to(self.device)
        # HF names by parameter (the HF model's order, each tensor once; a critic trades lm_head for its head)
        names = {id(p): n for n, p in hf.named_parameters() if not (head == "value" and n == "lm_head.weight")}
        if value_head is not None:
            names |= {id(p): f"value_head.{n}" for n, p in value_head.named_parameters()}
        self._hf_order = list(names.values())
        everything = [*hf.parameters(), *(value_head.parameters() if value_head is not None else [])]
        # shapes of every HF tensor: a pipeline stage receives the ones other stages hold
        self._shapes = {names[id(p)]: (tuple(p.shape), p.dtype) for p in everything if id(p) in names}

        m = plan.n_micro_batches
        # DeepSpeed 0.19.8's ZeRO-0 clipping under a pipeline counts only the first stage's gradients in the
        # norm (its clip_grad_norm_ keeps "model-parallel rank 0", which the pipeline grid makes stage 0):
        # there the norm is measured and the gradients clipped here (optimizer_step), with DeepSpeed's formula.
        self._own_clip = zero_stage == 0 and plan.pp > 1
        clip = 0.0 if max_grad_norm is None or self._own_clip else float(max_grad_norm)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                  "train_batch_size": m * plan.dp, "gradient_clipping": clip,
                  "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 2**62, "wall_clock_breakdown": False}
        _merge(config, ds_config or {})
        if plan.pp == 1:
            module: nn.Module = Stage(hf, range(hf.config.num_hidden_layers), first=True, last=True, head=head,
                                      value_head=value_head, logprob_chunk=logprob_chunk)
            module.compute_dtype = self.scoring.dtype
        else:
            module = self._pipeline(deepspeed, hf, value_head)
        del hf
        params = [p for p in module.parameters() if p.requires_grad]
        # lr=0.0 (the reference policy) only runs forward: an engine without an optimizer, so no ZeRO master
        # partition or AdamW state is allocated for it (ZeRO-3 still partitions its weights)
        self.trains = lr != 0.0
        if not self.trains and zero_stage in (1, 2):  # they partition optimizer state only: nothing to partition
            config["zero_optimization"]["stage"] = 0
        # fused: one kernel over the flat partitions ZeRO 1-3 hand it (and every tensor of ZeRO-0)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=True) \
            if self.trains else None
        self._zero3 = config["zero_optimization"]["stage"] == 3
        if self._zero3:
            _zero3_opening(id(self))
        try:
            self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config,
                                                        model_parameters=params if self.trains else None)
        except BaseException:
            self.close()
            raise
        # The workers set param_groups[i]["lr"] on this optimizer: it is the one DeepSpeed steps (its ZeRO
        # optimizers keep the wrapped optimizer's param-group dicts, swapping in their flat partitions).
        self.optimizer = opt
        self.module = self.engine.module
        self.params = list(self.module.parameters())
        self._names = {id(p): names[id(p)] for p in self.params if id(p) in names}
        self.dp_group = self.engine.data_parallel_group if plan.pp == 1 else self.engine.grid.get_data_parallel_group()
        self.pp_group = self.engine.grid.get_pipe_parallel_group() if plan.pp > 1 else None
        if plan.pp > 1:
            self.engine._train_schedule = _no_step_schedule(self.engine)
            grid = self.engine.grid
            if (grid.get_stage_id(), grid.get_data_parallel_rank()) != (self.pp_rank, self.dp_rank):
                raise PlanError(f"DeepSpeed placed rank {self.rank} at stage {grid.get_stage_id()}, data rank "
                                f"{grid.get_data_parallel_rank()}; rlkit's plan at {self.coords}")
            self._owner = self._owners()

    def close(self) -> None:
        """Done with this model: the last ZeRO-3 model of the process to close puts back the
        ``torch.nn.functional.linear`` that ZeRO-3 replaced. Idempotent; the model is not used after it."""
        _zero3_closed(id(self))

    def _pipeline(self, deepspeed, hf: nn.Module, value_head: nn.Module | None) -> nn.Module:
        """The HF model as DeepSpeed pipeline layers, balanced by decoder layers over ``plan.pp`` stages."""
        from deepspeed.pipe import PipelineModule, TiedLayerSpec
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

        body, sc = hf.model, self.scoring
        layers: list[Any] = [_PipeLayer(layer, body.rotary_emb, sc) for layer in body.layers]
        if self.tied:
            spec = dict(tied_weight_attr=["embed_tokens.weight"])
            layers = [TiedLayerSpec("embed", _PipeEmbed, body.embed_tokens, sc, **spec), *layers,
                      _PipeNorm(body.norm, sc),
                      TiedLayerSpec("embed", _PipeEmbed, body.embed_tokens, sc, forward_fn=_tied_head, **spec)]
        else:
            head = value_head if self.head == "value" else hf.lm_head
            layers = [_PipeEmbed(body.embed_tokens, sc), *layers, _PipeHead(body.norm, head, self.head, sc)]
        topo = PipeDataParallelTopology(num_pp=self.plan.pp, num_dp=self.plan.dp)
        # dynamic_shape: RL batches change length from call to call (the p2p buffers follow)
        return PipelineModule(layers=layers, topology=topo, loss_fn=self._pp_loss, partition_method="type:_PipeLayer",
                              dynamic_shape=True)

    def _owners(self) -> dict[str, int]:
        """HF name -> the pipeline stage holding it (a tied embedding: the first stage, its owner)."""
        mine = sorted(set(self._names.values()))
        everyone: list[Any] = [None] * self.plan.pp
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        owner: dict[str, int] = {}
        for stage, part in enumerate(everyone):
            for n in part:
                owner.setdefault(n, stage)
        return owner

    # ---- batches -----------------------------------------------------------------------------------
    def shard_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's DP slice of a global batch (tensors split along dim 0; other values kept)."""
        return dp_slice(batch, self.dp_rank, self.dp_size)

    def set_scoring(self, *, first_column: int = 1, entropy_grad: bool = True) -> None:
        """Score only columns ``>= first_column`` (earlier ones come back 0); ``entropy_grad=False`` keeps the
        entropy out of autograd. As ``ParallelModel.set_scoring``."""
        if self.head != "lm":
            raise PlanError(f"set_scoring applies to head='lm' (log-probs), not head={self.head!r}")
        self.scoring.first, self.scoring.entropy_grad = int(first_column), bool(entropy_grad)
        if self.plan.pp == 1:
            self.module.score_from, self.module.entropy_grad = int(first_column), bool(entropy_grad)

    def set_packing(self, padding_free: bool = True, token_budget: int | None = None) -> None:
        """Padding-free packing runs on the torch backend only: ``padding_free=True`` raises ``PlanError``."""
        if padding_free:
            raise PlanError("padding_free=True runs on backend='torch' only; use padding_free=False with "
                            "backend='deepspeed'")

    def _output_names(self) -> list[str]:
        return ["values"] if self.head == "value" else ["logprobs", "entropy"]

    def _as_dict(self, out) -> dict[str, torch.Tensor]:
        return {"values": out} if self.head == "value" else {"logprobs": out[0], "entropy": out[1]}

    # ---- forward only ------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-token ``{"logprobs", "entropy"}`` (B, S) fp32 for this rank's batch (``{"values"}`` with
        ``head="value"``); column t scores token t given tokens < t. Every rank of the DP group gets it (under
        PP the last stage broadcasts along its pipeline)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        batch = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        parts = micro_batches(batch, self.plan.n_micro_batches)
        if self.plan.pp == 1:
            self.module.eval()
            try:
                outs = [self._as_dict(self.engine(mb["input_ids"], attention_mask=mb["attention_mask"],
                                                  labels=mb["input_ids"])) for mb in parts]
            finally:
                self.module.train()
            return {k: torch.cat([o[k] for o in outs]).float() for k in outs[0]}
        self._ctx = {"loss_fn": None, "outs": {}}
        try:
            self.engine.eval_batch(self._data(batch, parts), compute_loss=True, bcast_loss=False,
                                   num_micro_batches=len(parts))
            outs = self._ctx["outs"]
        finally:
            self._ctx = {}
            self.module.train()
        names = self._output_names()
        if self.engine.is_last_stage():
            res = [torch.cat([outs[j][k] for j in range(len(parts))]).float().contiguous() for k in names]
        else:
            res = [torch.empty(input_ids.shape, device=self.device) for _ in names]
        src = dist.get_global_rank(self.pp_group, self.plan.pp - 1)
        for t in res:
            dist.broadcast(t, src=src, group=self.pp_group)
        return dict(zip(names, res))

    values = logprobs

    def _data(self, batch: dict[str, Any], parts: list[dict[str, Any]]) -> Iterator:
        """The pipeline's micro-batches: inputs ``(input_ids, attention_mask)``, "labels" the rows' indices in
        ``batch`` (the loss finds its micro-batch with them)."""
        rows = torch.arange(_batch_size(batch), device=self.device)
        k = len(rows) // len(parts)
        return iter([((mb["input_ids"], mb["attention_mask"]), rows[j * k:(j + 1) * k]) for j, mb in enumerate(parts)])

    def _pp_loss(self, output, rows: torch.Tensor) -> torch.Tensor:
        # Called by DeepSpeed on the last stage, once per micro-batch: keep the outputs (eval) or evaluate the
        # user's loss on the micro-batch's samples, times what DeepSpeed divides by (see forward_backward).
        ctx = self._ctx
        j = int(rows[0]) // len(rows)
        out = self._as_dict(output)
        if ctx["loss_fn"] is None:
            ctx["outs"][j] = out
            return torch.zeros((), device=self.device)
        loss = ctx["loss_fn"](out, ctx["parts"][j])
        ctx["losses"].append(loss.detach() * ctx["scales"][j])
        return loss * (ctx["scales"][j] * len(ctx["parts"]))

    # ---- training ----------------------------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> float:
        """Accumulate the gradients of ``sum(w * loss_fn(out, mb)) / sum(w)`` over the micro-batches of every
        DP rank (``w = weight_fn(mb)``, 1 without it), as ``ParallelModel.forward_backward``; returns its value.

        DeepSpeed divides each backward by the accumulation steps ``m`` and averages gradients over the
        ``dp`` ranks: micro-batch ``j``'s loss goes in times ``w_j * dp / sum(w) * m``."""
        if not self.trains:
            raise PlanError("this DeepSpeedModel was built with lr=0.0: a forward-only model (the reference "
                            "policy) has no optimizer to train with; build it with lr > 0")
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
        parts = micro_batches(batch, self.plan.n_micro_batches)
        m = len(parts)
        weights = [1.0] * m if weight_fn is None else [float(weight_fn(mb)) for mb in parts]
        scales = loss_scales(weights, self.dp_size, self.dp_group, self.device)
        total = torch.zeros((), device=self.device)
        if self.plan.pp == 1:
            for j, mb in enumerate(parts):
                out = self._as_dict(self.engine(mb["input_ids"], attention_mask=mb["attention_mask"],
                                                labels=mb["input_ids"]))
                loss = loss_fn(out, mb)
                self.engine.backward(loss * (scales[j] * m))
                total += loss.detach() * scales[j]
                if j < m - 1:  # not the accumulation boundary: DeepSpeed only counts the micro-step
                    self.engine.step()
        else:
            self._ctx = {"loss_fn": loss_fn, "parts": parts, "scales": scales, "losses": []}
            try:
                self.engine.train_batch(self._data(batch, parts))
                if self.engine.is_last_stage():
                    total += torch.stack(self._ctx["losses"]).sum()
            finally:
                self._ctx = {}
            dist.all_reduce(total, group=self.pp_group)  # only the last stage contributed
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= self.dp_size
        self.last_grad_bytes = self._grad_bytes()
        return total.item()

    def optimizer_step(self) -> float:
        """Clip (DeepSpeed's ``gradient_clipping``; ZeRO-0 under PP: here, see the constructor) and step AdamW; returns the pre-clip global grad norm
        (DeepSpeed's ``get_global_grad_norm()``; ZeRO-0, whose clipping keeps no norm: measured here first)."""
        own = self.grad_norm() if self.zero_stage == 0 else None
        if self._own_clip:
            clip_grads(self.params, own, self.max_grad_norm)
        if self.plan.pp == 1:
            self.engine.step()
        else:
            self.engine._exec_optimizer_step()
        norm = self.engine.get_global_grad_norm() if own is None else own
        self.step += 1
        return float(norm)

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None) -> dict[str, float]:
        """forward + loss + backward (micro-batched) + clip + AdamW step on this rank's batch."""
        t0 = time.perf_counter()
        loss = self.forward_backward(batch, loss_fn, weight_fn)
        norm = self.optimizer_step()
        return {"loss": loss, "grad_norm": norm, "step": self.step, "step_time_s": time.perf_counter() - t0}

    def full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full gradient)`` of this rank's parameters, between ``forward_backward`` and
        ``optimizer_step`` (``deepspeed.utils.safe_get_full_grad``: a collective over DP under ZeRO)."""
        from deepspeed.utils import safe_get_full_grad

        for p in self.params:
            g = safe_get_full_grad(p)  # every rank calls it for every parameter: it is a collective
            if id(p) in self._names and g is not None:
                yield self._names[id(p)], g

    def grad_norm(self) -> float:
        """L2 norm of the step's full gradient (a tied pipeline copy counted once); a collective."""
        from deepspeed.utils import safe_get_full_grad

        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            g = safe_get_full_grad(p)  # a collective under ZeRO: every parameter, every rank
            if g is None or id(p) not in self._names:
                continue
            if self.plan.pp > 1 and self._owner[self._names[id(p)]] != self.pp_rank:
                continue  # the last stage's copy of a tied embedding
            sq += g.double().norm() ** 2
        if self.plan.pp > 1:
            dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt().item()

    # ---- named view and full weights ---------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(HF name, parameter) of this rank (ZeRO-3: partitioned, gather to read them)."""
        for p in self.params:
            if id(p) in self._names:
                yield self._names[id(p)], p

    def iter_full_weights(self, to: str | int | Iterable[int] = "all", *,
                          adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Yield ``(hf_name, full CPU tensor)`` in HF's order, each tensor once (a tied LM head is the
        embedding); ranks not in ``to`` get ``(hf_name, None)``. A collective: every rank iterates to the end.
        ZeRO-3 gathers each parameter over DP (``deepspeed.zero.GatheredParameters``); under PP a stage's
        owner broadcasts along its pipeline. ``last_transfer``: bytes this rank received, seconds."""
        t0 = time.perf_counter()
        self.last_transfer = {"bytes": 0.0}
        if adapters_only:  # no adapters: full weights only
            self.last_transfer["seconds"] = time.perf_counter() - t0
            return
        targets = None if to == "all" else ({to} if isinstance(to, int) else set(to))
        mine = dict(self.named_parameters())
        moved = 0
        if self.plan.pp > 1:
            column = set(dist.get_process_group_ranks(self.pp_group))
            want = targets is None or bool(targets & column)
        for name in self._hf_order:
            receive = targets is None or self.rank in targets
            if self.plan.pp == 1:
                p = mine[name]
                if self.zero_stage == 3:
                    import deepspeed

                    with deepspeed.zero.GatheredParameters([p]):
                        t = p.data.detach().clone() if receive else None
                    moved += p.ds_numel * p.element_size() - p.ds_tensor.numel() * p.ds_tensor.element_size()
                else:  # a copy: the parameter is a view into DeepSpeed's flat buffer, which the next step changes
                    t = p.data.detach().clone() if receive else None
            else:
                owner = self._owner[name]
                if owner == self.pp_rank:
                    t = mine[name].data.detach().clone()
                else:
                    shape, dtype = self._shapes[name]
                    t = torch.empty(shape, dtype=dtype, device=self.device) if want else None
                if want:
                    dist.broadcast(t, src=dist.get_global_rank(self.pp_group, owner), group=self.pp_group)
                    if owner != self.pp_rank:
                        moved += t.numel() * t.element_size()
                t = t if receive else None
            self.last_transfer["bytes"] = float(moved)
            yield name, (t.cpu() if t is not None else None)
        self.last_transfer["seconds"] = time.perf_counter() - t0

    def full_state_dict(self, to: str | int = 0) -> dict[str, torch.Tensor]:
        """Full HF-named weights (CPU) under HF's ``state_dict`` keys (a tied model's ``lm_head.weight`` is the
        embedding's tensor), loadable with ``load_state_dict(strict=True)`` into a fresh HF model (plus
        ``value_head.*`` for a critic, without ``lm_head``). Empty on ranks that don't receive."""
        sd = {k: v for k, v in self.iter_full_weights(to) if v is not None}
        if self.tied and "model.embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd

    # ---- checkpoint ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> str:
        """DeepSpeed's ``save_checkpoint`` (module, ZeRO partitions, optimizer) plus each rank's step and RNG,
        written to a temp folder beside ``path`` and moved into place (``rlkit.atomic``) once every rank is done."""
        path = Path(path)
        box = [str(atomic.temp_path(path)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        self.engine.save_checkpoint(str(tmp), tag=TAG, client_state={"rlkit_step": self.step}, save_latest=False)
        torch.save({"step": self.step, **rng_state()}, tmp / f"extra_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            atomic.move_into_place(tmp, path)
        dist.barrier()
        return str(path)

    def load(self, path: str | os.PathLike) -> None:
        """Restore what ``save`` wrote (same plan, same ZeRO stage) for a bit-exact resume. A missing or
        damaged checkpoint raises ``CheckpointError`` naming it on every rank."""
        path = Path(path)
        extra_file = path / f"extra_rank{self.rank}.pt"
        problem = None
        try:
            extra = torch.load(extra_file, weights_only=False)
        except Exception as e:  # every rank hears of it below (no one left waiting in a collective)
            extra = None
            problem = (f"{extra_file} is missing: {path} is not a complete rlkit DeepSpeed checkpoint for rank "
                       f"{self.rank}; was it saved with the same plan?") if not extra_file.is_file() else \
                f"{extra_file} is damaged ({type(e).__name__}); copy the checkpoint again from where it was saved"
        if problem is None and not (path / TAG).is_dir():
            problem = f"{path / TAG} is missing: {path} holds no DeepSpeed checkpoint saved by rlkit"
        problems: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in
                  (self.optimizer.param_groups if self.optimizer is not None else [])]
        try:
            loaded, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=self.trains,
                                                    load_lr_scheduler_states=False)
            problem = None if loaded is not None else f"DeepSpeed found no checkpoint under {path / TAG}"
        except Exception as e:  # a damaged file: name it on every rank below
            problem = f"could not read the DeepSpeed checkpoint {path / TAG}: {type(e).__name__}: {str(e)[:300]}"
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise CheckpointError(next(p for p in problems if p))
        for g, kept in zip(self.optimizer.param_groups, groups):  # hyper-parameters are this run's, not the file's
            g.update(kept)
        self.step = extra["step"]
        restore_rng_state(extra)
        dist.barrier()

    # ---- memory ------------------------------------------------------------------------------------
    def memory(self, batch: dict[str, Any] | None = None):
        """Bytes this rank holds, measured (distinct storages, each counted once), gathered from every rank:

        * ``weights``: the module's parameters as this rank holds them: ZeRO 0-2 (and each pipeline stage) the
          full fp32 parameters of its layers; ZeRO-3 its partitions (``ds_tensor``, views of DeepSpeed's flat
          partition buffer) plus any parameter kept whole (under ``stage3_param_persistence_threshold``).
        * ``grads``: what the last ``forward_backward`` left, after DeepSpeed's reduction at the accumulation
          boundary: the parameters' ``.grad`` and ZeRO's gradient partitions and buckets (``averaged_gradients``,
          ZeRO-3's flat gradient buffer, ZeRO-1/2's IPG bucket). In 0.19.8 ZeRO-1 ends, like ZeRO-2, with its
          1/dp partition (plus the bucket), though it holds full ``.grad`` tensors while the micro-batches
          accumulate (the paper's ZeRO-1 keeps full gradients); ZeRO-0 and pipeline stages keep full ``.grad``.
        * ``optimizer``: AdamW's state (exp_avg, exp_avg_sq; ZeRO 1-3: of this rank's 1/dp partition) plus the
          fp32 master partition ZeRO 1-3 keeps beside the module's weights even in fp32 (stage 1/2:
          ``single_partition_of_fp32_groups``, stage 3: ``fp32_partitioned_groups_flat``): 3 x 4 bytes per
          parameter / dp, not the 2 x 4 of fp32 Adam without a master copy.
        * ``activations``: 0 (not measured on this backend); ``total``: the sum (CUDA: the peak allocated)."""
        import pandas as pd

        row = {"rank": self.rank, "weights": self._weight_bytes(), "grads": self.last_grad_bytes,
               "optimizer": self._optimizer_bytes(), "activations": 0}
        row["total"] = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                        else row["weights"] + row["grads"] + row["optimizer"])
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return pd.DataFrame(rows)

    def _weight_bytes(self) -> int:
        tensors = []
        for p in self.params:
            if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition, and the full tensor when it is kept whole
                tensors.append(p.ds_tensor)
            if p.data.numel() > 0:
                tensors.append(p.data)
        return _storage_bytes(tensors)

    def _grad_bytes(self) -> int:
        zo = self.engine.optimizer
        tensors = [p.grad for p in self.params if p.grad is not None]
        tensors += list(_tensors(getattr(zo, "averaged_gradients", None)))
        tensors += list(_tensors(getattr(zo, "ipg_buffer", None)))
        tensors += list(_tensors(getattr(zo, "grad_partitions_flat_buffer", None)))
        tensors += [t.grad for t in _tensors(getattr(zo, "single_partition_of_fp32_groups", None))
                    if t.grad is not None]
        return _storage_bytes(tensors)

    def _optimizer_bytes(self) -> int:
        zo = self.engine.optimizer
        if self.optimizer is None:
            return 0
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        state += list(_tensors(getattr(zo, "single_partition_of_fp32_groups", None)))
        state += list(_tensors(getattr(zo, "fp32_partitioned_groups_flat", None)))
        return _storage_bytes(state)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) list / dict (DeepSpeed's per-group buffers)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view counts its whole storage, once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _merge(base: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def _batch_size(batch: dict[str, Any]) -> int:
    if "input_ids" not in batch:
        raise PlanError(f"batch needs 'input_ids'; got keys {sorted(batch)}")
    return int(batch["input_ids"].shape[0])


__all__ = ["DeepSpeedModel", "import_deepspeed"]
