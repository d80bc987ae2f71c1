"""The RL roles on one rank: ``RLWorker`` (actor + reference + critic + rollout engine, colocated) and
``RolloutWorker`` (an engine on a worker of its own, split placement), and the settings they take.

The controller reaches them through ``rlkit.workers.rl_workers.RLWorkers``, one named method per step
of the dataflow; every sequence column a role reads goes through the run's ``SequenceLayout``.

``RLWorker`` is the HybridEngine: the actor trains under its ParallelPlan, and rollout runs on the same
workers. Two layouts:

* ``Rollout(tp=None)`` (the default): one engine per DP group, on that group's ``tp=0`` rank of the
  last pipeline stage (the rank ``call_dp`` collects results from). ``sync_weights`` streams the actor's
  weights out of the training layout one tensor at a time, only to the engine ranks, into the engine in
  place. On a one-rank plan an HF engine in the actor's dtype needs no model of its own: it generates
  with the actor's tensors (the generation layout below, with ``t_g = 1``).
* ``Rollout(tp=t_g)``: the 3D-HybridEngine's generation layout (``rlkit.workers.hybrid``). Every rank
  generates, in groups of ``t_g``. ``sync_weights`` reshards the actor's weights into the generation
  layout (each rank receives only what it lacks); ``generate`` drops the generation copy when it ends,
  before training resumes.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from rlkit.algos import call_policy_loss, entropy_bonus, kl_loss, masked_mean, value_loss
from rlkit.algos.offpolicy import importance_weights
from rlkit.algos.settings import UpdateSettings
from rlkit.backends import Backend, make_model
from rlkit.batch import Batch, images_of
from rlkit.parallel import ParallelModel
from rlkit.parallel.groups import build_generation_groups, build_groups
from rlkit.parallel.lora import scaling
from rlkit.plan.hybrid import GenerationLayout
from rlkit.plan.topology import ParallelPlan
from rlkit.rollout import Rollout, make_engine
from rlkit.workers.hybrid import HybridRollout
from rlkit.workers.layout import SequenceLayout, generate_batch
from rlkit.workers.weight_channel import Meta, WeightChannel


class SyncReport(TypedDict, total=False):
    """What one rank's part of a weight sync moved: bytes received, seconds, the process's RSS (GiB); in
    the generation layout also the parameter bytes held while generating and their peak."""

    bytes: float
    seconds: float
    rss_gb: float
    param_bytes: float
    peak_param_bytes: float


class Scored(TypedDict):
    """A scoring pass's per-sample result, ``[B, R]`` each (``call_dp`` joins the DP ranks' by rows): the
    ``logprobs`` of the response tokens and the ``entropy`` of their distributions."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


class RefScored(TypedDict):
    """The reference model's log-probs of the response tokens, ``[B, R]``."""

    ref_logprobs: torch.Tensor


class Valued(TypedDict):
    """The critic's values of the states before each response token, ``[B, R]``."""

    values: torch.Tensor


class RLWorker:
    """Per-rank RL roles. Created by a worker group inside each rank (the process group exists).

    ``layout``: the run's ``SequenceLayout`` (its P is the longest prompt, its R the response width). All the models of a rank (actor, reference,
    critic) and the generation layout share one set of process groups, built once here.
    """

    def __init__(self, model_path: str, plan: ParallelPlan, *, rollout: Rollout, layout: SequenceLayout,
                 actor_lr: float, critic_lr: float = 1e-4, max_grad_norm: float | None = 1.0,
                 need_ref: bool = False, need_critic: bool = False, seed: int = 0, colocate_rollout: bool = True,
                 precision: str = "fp32", padding_free: bool = False, micro_batch_tokens: int | None = None,
                 lora: Any = None, agent: Any = None, train_backend: Backend | None = None,
                 ref_path: str | None = None, router: tuple[float, float] = (0.0, 0.0),
                 routing_replay: bool = False, freeze_vision: bool = False):
        from transformers import AutoConfig

        torch.manual_seed(seed)
        self.plan, self.rank = plan, dist.get_rank()
        self.agent = agent  # multi-turn episodes with tools (rlkit.agent), run where the engine generates
        self.layout = layout
        # train_backend, not backend: a worker group's own `backend` is torch.distributed's (gloo / nccl)
        self.backend = backend = train_backend or Backend()
        groups = None
        if backend.caps.rlkit_groups:  # the other backends build their own groups, in the same rank order
            config = AutoConfig.from_pretrained(str(model_path))
            groups = build_groups(plan, tied_ends=bool(getattr(config, "tie_word_embeddings", False)) and plan.pp > 1)
        common = dict(max_grad_norm=max_grad_norm, seed=seed, eps=1e-6, precision=precision, groups=groups)
        # a mixture of experts' router losses (the driver allows them on the torch backend only)
        moe = dict(zip(("router_aux_coef", "router_z_coef"), router)) if any(router) else {}
        frozen = {"freeze_vision": True} if freeze_vision else {}  # a vision-language model's tower kept as it is
        self.actor = make_model(backend, model_path, plan, lr=actor_lr, lora=lora, **common, **moe, **frozen)
        # LoRA: the reference is the actor with its adapters off (no second copy of the model, as TRL and verl);
        # a distillation teacher (ref_path) takes the reference's place, sharded by the same plan
        self.ref = make_model(backend, ref_path or model_path, plan, lr=0.0, **common) \
            if need_ref and (lora is None or ref_path) else None
        self.critic = make_model(backend, model_path, plan, head="value", lr=critic_lr, **common) \
            if need_critic else None
        for model in (self.actor, self.ref):  # every loss and metric here reads the response's columns only
            if model is not None:
                model.set_scoring(first_column=self.layout.first_scored)
        for model in (self.actor, self.ref, self.critic):  # every scoring pass and update packs alike
            if model is not None:
                model.set_packing(padding_free, micro_batch_tokens)
        if getattr(self.actor, "moes", None):  # a batch's recorded routing: replayed, or only compared
            self.actor.set_routing_replay(routing_replay)
            if self.critic is not None:  # replay matches the engine's policy; the critic routes as it learns
                self.critic.set_routing_replay(False)
        self.dp_rank = plan.coords(self.rank)["dp"]
        self.hybrid = None
        gen_tp = rollout.tp
        if gen_tp is None and colocate_rollout and backend.caps.generation_layout and \
                _can_share_actor_weights(rollout, model_path, plan, self.actor):
            gen_tp = 1  # one rank: the engine generates with the actor's own tensors (no second model to sync)
        if gen_tp is not None and colocate_rollout:  # every rank generates, in the generation layout
            gen_layout = GenerationLayout(plan, gen_tp)
            self.hybrid = HybridRollout(model_path, self.actor, build_generation_groups(gen_layout), rollout)
        # split placement: the engines live in their own RolloutWorker group instead
        self.engine_ranks = sorted(plan.rank(dp=d, tp=0, pp=plan.pp - 1) for d in range(plan.dp)) \
            if colocate_rollout and self.hybrid is None else []
        self.engine = make_engine(rollout, model_path) if self.rank in self.engine_ranks else None

    # ---- rollout -------------------------------------------------------------------------------
    def sync_weights(self) -> SyncReport:
        """Put the actor's current weights into the rollout engines; every rank takes part (collectives).

        One engine per DP group: the full weights stream to the engine ranks, one tensor at a time. The
        generation layout: the actor's shards are resharded into it and held until ``generate`` ends."""
        if self.hybrid is not None:
            return SyncReport(**self.hybrid.reshard(), rss_gb=_rss_gb())
        t0 = time.perf_counter()
        lora = self.actor.lora
        # LoRA: only the adapters travel; the engine merges them into the base it loaded (load_lora)
        stream = self.actor.iter_full_weights(to=self.engine_ranks, adapters_only=lora is not None)
        if self.engine is not None:
            named = ((n, t) for n, t in stream if t is not None)
            if lora is None:
                self.engine.load_weights(named)
            else:
                self.engine.load_lora(named, scaling(lora))
        for _ in stream:  # drain: the gathers are collectives
            pass
        moved = self.actor.last_transfer.get("bytes", 0.0)
        # the rank's memory rides along: the trainer's memory metrics need no call of their own
        return SyncReport(bytes=float(moved), seconds=time.perf_counter() - t0, rss_gb=_rss_gb())

    def generate(self, prompts: dict[str, Any], seed: int, **overrides: Any) -> Batch | None:
        """n samples per prompt of this DP group's ``prompts`` (``{"prompt", "uid", "row"}`` lists), as a
        batch of the run's ``SequenceLayout``; None off the engine rank (in the generation layout: off the
        replica's collector rank, though every rank generates)."""
        if self.hybrid is not None:
            return self.hybrid.generate(prompts, seed, self.layout, agent=self.agent, **overrides)
        if self.engine is None:
            return None
        return generate_batch(self.engine, self.layout, prompts, seed, agent=self.agent, **overrides)

    def set_routing_replay(self, replay: bool) -> None:
        """Mixture of experts: the actor routes by the batch's recorded routing (``True``) or by its own router,
        only counting the flips (``False``); what ``TrainerConfig(routing_replay=...)`` set at the start."""
        if not getattr(self.actor, "moes", None):
            raise ValueError("set_routing_replay applies to a mixture-of-experts actor on the torch backend")
        self.actor.set_routing_replay(replay)

    # ---- forward passes ------------------------------------------------------------------------
    def actor_logprobs(self, batch: Batch) -> Scored:
        """The actor's ``logprobs`` and ``entropy`` of the response tokens (pi_old, before an update)."""
        self._training_layout()
        batch = Batch.of(batch)
        out = self.actor.logprobs(batch.input_ids, batch.attention_mask, **_routing_of(batch), **images_of(batch))
        return Scored(logprobs=self.layout.response(out["logprobs"]), entropy=self.layout.response(out["entropy"]))

    def ref_logprobs(self, batch: Batch) -> RefScored:
        """The reference model's ``ref_logprobs`` of the response tokens (with LoRA: the actor, adapters off)."""
        batch = Batch.of(batch)
        if self.ref is None and self.actor.lora is not None:
            self._training_layout()
            with self.actor.adapters_disabled():
                out = self.actor.logprobs(batch.input_ids, batch.attention_mask, **images_of(batch))
        else:
            out = self.ref.logprobs(batch.input_ids, batch.attention_mask, **images_of(batch))
        return RefScored(ref_logprobs=self.layout.response(out["logprobs"]))

    def values(self, batch: Batch) -> Valued:
        """The critic's ``values`` of the states before each response token."""
        batch = Batch.of(batch)
        return Valued(values=self.layout.values(self.critic.values(batch.input_ids, batch.attention_mask, **images_of(batch))["values"]))

    # ---- updates -------------------------------------------------------------------------------
    def update_actor(self, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
        """``settings.epochs`` x ``settings.minibatches`` policy-gradient steps on this DP rank's chunk."""
        self._training_layout()
        for g in self.actor.optimizer.param_groups:
            g["lr"] = settings.lr
        # an entropy that only feeds a metric stays out of autograd
        self.actor.set_scoring(first_column=self.layout.first_scored, entropy_grad=bool(settings.entropy_coef))
        stats: list[dict[str, float]] = []

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, m = actor_loss(self.layout, out, mb, settings)
            stats.append({**m, WEIGHT: loss_weight(mb, settings.loss_agg)})
            return loss

        moe = bool(getattr(self.actor, "moes", None))
        if moe:  # the routers of the update's forwards; route flips in its first step only, whose weights are
            self.actor.reset_router_stats()  # the engine's when on-policy (later steps drift from them)
        out = _epochs(self.actor, Batch.of(batch), settings, loss_fn, stats, "actor", settings.loss_agg,
                      after_first=(lambda: self.actor.set_flip_counting(False)) if moe else None)
        if moe:
            self.actor.set_flip_counting(True)
            out |= router_metrics(self.actor.router_stats())
        return out

    def update_critic(self, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
        """The critic's clipped value regression on this DP rank's chunk (its own learning rate)."""
        stats: list[dict[str, float]] = []

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, m = value_loss(self.layout.values(out["values"]), mb["values"], mb["returns"],
                                 self.layout.loss_mask(mb), clip=settings.value_clip)
            stats.append({**m, WEIGHT: loss_weight(mb, "token-mean")})
            return loss

        return _epochs(self.critic, Batch.of(batch), settings, loss_fn, stats, "critic", "token-mean")

    # ---- weights out ---------------------------------------------------------------------------
    def host_weight_channel(self, receivers: int, timeout_s: float) -> tuple[str, int] | None:
        """Split placement, rank 0: host the store of the weight channel to ``receivers`` rollout workers;
        its address (None on the other ranks). ``join_weight_channel`` follows, beside the receivers'."""
        if self.rank != 0:
            return None
        store, address = WeightChannel.host(receivers, timeout_s)
        self._channel_args = dict(rank=0, size=receivers + 1, timeout_s=timeout_s, store=store)
        return address

    def join_weight_channel(self) -> None:
        """Rank 0's end of the weight channel (a collective with the rollout workers' ``join_weight_channel``)."""
        if self.rank == 0:
            self.channel = WeightChannel.join("", 0, **self._channel_args)

    def send_weights(self) -> tuple[Meta | None, SyncReport]:
        """For a rollout group of its own (split placement): ``full_weights`` (with LoRA ``adapter_weights``)
        gathered to rank 0, which sends them on the weight channel in buckets, from a thread, while the
        caller goes on; rank 0 returns their meta (``RolloutWorker.receive_weights`` takes them), every rank
        its part of the sync. A collective."""
        t0 = time.perf_counter()
        sd = self.full_weights() if self.actor.lora is None else self.adapter_weights()
        meta = None if sd is None else self.channel.send(sd.items())
        return meta, SyncReport(bytes=self.actor.last_transfer.get("bytes", 0.0), seconds=time.perf_counter() - t0,
                                rss_gb=_rss_gb())

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named actor weights on rank 0 (None elsewhere). A collective."""
        self._training_layout()
        sd = self.actor.full_state_dict(to=0)
        return sd if self.rank == 0 else None

    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        """The actor's LoRA adapters, full, on rank 0 (None elsewhere); names ``...q_proj.lora_A.default.weight``.
        A collective."""
        self._training_layout()
        sd = {n: t for n, t in self.actor.iter_full_weights(to=0, adapters_only=True) if t is not None}
        return sd if self.rank == 0 else None

    # ---- state ---------------------------------------------------------------------------------
    def save(self, path: str) -> str:
        self._training_layout()
        self.actor.save(Path(path) / "actor")
        if self.critic is not None:
            self.critic.save(Path(path) / "critic")
        return path

    def load(self, path: str) -> None:
        """Restore ``save``'s state; the engines get the weights at the next ``sync_weights``."""
        self._training_layout()
        self.actor.load(Path(path) / "actor")
        if self.critic is not None:
            self.critic.load(Path(path) / "critic")

    def rss_gb(self) -> float:
        return _rss_gb()

    def memory(self) -> list[dict[str, int]]:
        """The actor's bytes per rank (weights, grads of the last backward, optimizer state), measured:
        rows for ``rlkit.plan.compare_memory`` beside ``plan.memory(...)``. A collective: call every rank."""
        self._training_layout()
        return self.actor.memory().to_dict(orient="records")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.hybrid is not None:
            self.hybrid.close()
        for model in (getattr(self, n, None) for n in ("actor", "ref", "critic")):  # may hold process-wide state
            close = getattr(model, "close", None)
            if callable(close):
                close()

    def _training_layout(self) -> None:
        """The actor's tensors in their training layout: a generation copy that ``sync_weights`` made and
        no ``generate`` used is given back first (hand-written dataflows may call in any order)."""
        if self.hybrid is not None:
            self.hybrid.release()


class RolloutWorker:
    """A rollout engine on its own worker (split placement): no process group, no training state."""

    def __init__(self, model_path: str, *, rollout: Rollout, layout: SequenceLayout, seed: int = 0, lora: Any = None,
                 agent: Any = None):
        torch.manual_seed(seed)
        self.lora_scaling = scaling(lora) if lora is not None else None  # adapters arrive alone (load_weights)
        self.agent, self.layout = agent, layout
        self.dp_rank = int(os.environ.get("RANK", "0"))
        self.engine = make_engine(rollout, model_path)

    def generate(self, prompts: dict[str, Any], seed: int, **overrides: Any) -> Batch:
        # each prompt seeded by its place in the step (its uid), as a colocated engine: every placement and
        # layout samples the same responses
        return generate_batch(self.engine, self.layout, prompts, seed, agent=self.agent, **overrides)

    def continue_samples(self, request: dict[str, list], max_new_tokens: int, stale_kv: bool = False
                         ) -> dict[str, list]:
        """Streaming (``rlkit.stream``): each prefix (a prompt and its response so far, token ids) continued by up
        to ``max_new_tokens`` tokens, one sample each, drawn from its own ``seed`` (``key``: its sample, whose keys
        and values the engine may keep between chunks, ``room``: the tokens it may still take, ``stale_kv``:
        kept across weight loads too; ``RolloutEngine.continue_ids``); per prefix the new tokens,
        the history tokens (all but the last of the prefix) whose keys and values were kept, not prefilled,
        their log-probs and why it stopped ("stop", or "length": the chunk ran out)."""
        cfg = self.engine.config.with_overrides(n=1, max_new_tokens=max_new_tokens)
        t0 = time.perf_counter()
        tokens, logprobs, reasons, reused = self.engine.continue_ids(request["prefix"], cfg, request["seed"],
                                                                     request["key"], request["room"], stale_kv)
        seconds = time.perf_counter() - t0  # per sample, its share of the call: they sum to the engine's time
        return {"tokens": tokens, "logprobs": logprobs, "reason": reasons,
                "seconds": [seconds / len(tokens)] * len(tokens), "reused": reused,
                "history": [len(p) - 1 for p in request["prefix"]]}

    def join_weight_channel(self, ip: str, port: int, size: int, timeout_s: float) -> None:
        """This worker's end of the weight channel from the actor's rank 0 (``RLWorker.host_weight_channel``)."""
        self.channel = WeightChannel.join(ip, port, rank=self.dp_rank + 1, size=size, timeout_s=timeout_s)

    def receive_weights(self, meta: Meta) -> SyncReport:
        """The actor's full weights, or with LoRA its adapters (merged here into the engine's base), off the
        weight channel (``RLWorker.send_weights`` sent them), into the engine."""
        t0 = time.perf_counter()
        named = self.channel.receive(meta)
        if self.lora_scaling is not None:
            self.engine.load_lora(named, self.lora_scaling)
        else:
            self.engine.load_weights(named)
        return SyncReport(bytes=float(sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in meta)),
                          seconds=time.perf_counter() - t0, rss_gb=_rss_gb())

    def rss_gb(self) -> float:
        return _rss_gb()

    def close(self) -> None:
        self.engine.close()


def actor_loss(layout: SequenceLayout, out: dict[str, torch.Tensor], mb: dict[str, Any],
               settings: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's objective on a micro-batch: the algorithm's policy loss, plus the KL to the reference
    and the entropy bonus when their coefficients are set, over the tokens that carry loss.

    ``out``: the actor's per-token ``logprobs`` / ``entropy`` (full width); ``mb``: the micro-batch.
    Without ``old_logprobs`` (one optimizer step per batch) the ratio is 1 and its gradient the policy
    gradient; with ``settings.offpolicy`` and the engine's ``behaviour_logprobs`` the advantages are weighted
    by ``pi_old / mu`` taken from this forward (``rlkit.algos.offpolicy``), its metrics under ``offpolicy/``."""
    lp, mask = layout.response(out["logprobs"]), layout.loss_mask(mb)
    old = mb["old_logprobs"] if "old_logprobs" in mb else lp.detach()
    advantages, m = mb["advantages"], {}
    if settings.offpolicy is not None and "behaviour_logprobs" in mb:
        # one optimizer step per batch: this forward is pi_old, so the weights pi_old / mu need no pass of their own
        weights, m = importance_weights(old, mb["behaviour_logprobs"], mask, **settings.offpolicy)
        advantages = advantages * weights
    loss, pm = call_policy_loss(settings.policy_loss, lp, old, advantages, mask, clip_low=settings.clip_low,
                                clip_high=settings.clip_high, dual_clip=settings.dual_clip, agg=settings.loss_agg,
                                **settings.loss_options)
    m.update(pm)
    m["pg_loss"] = loss.item()
    if settings.kl_loss_coef and "ref_logprobs" in mb:
        kl = kl_loss(lp, mb["ref_logprobs"], mask, kind=settings.kl_kind, agg=settings.loss_agg)
        loss = loss + settings.kl_loss_coef * kl
        m["kl_loss"] = kl.item()
    ent = layout.response(out["entropy"])
    if settings.entropy_coef:
        loss = loss + entropy_bonus(ent, mask, settings.entropy_coef, settings.loss_agg)
    m["entropy"] = masked_mean(ent.detach(), mask).item()
    return loss, m


def _can_share_actor_weights(rollout: Rollout, model_path: str, plan: ParallelPlan, actor: ParallelModel) -> bool:
    """A one-rank plan whose HF engine would hold the actor's weights in the actor's dtype: then the engine
    can run on the actor's own tensors (the generation layout with t_g = 1 aliases them), which saves
    loading the checkpoint twice, a model's worth of memory and the weight copy after every update.

    At dp > 1 the default stays one engine per DP group with a copy of its own, streamed after each update
    (what tutorials 06 and 07 take apart); ``Rollout(tp=1)`` asks for the shared layout there (with
    ``dp_shard="replicate"`` it aliases too; under FSDP it gathers for generation and frees after)."""
    from rlkit.rollout import engine_name

    if plan.world_size != 1 or engine_name(rollout, model_path) != "hf":
        return False
    actor_dtype = next(iter(actor.params)).dtype
    if rollout.dtype != "auto":
        return getattr(torch, rollout.dtype) == actor_dtype
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    return saved == actor_dtype


def _rss_gb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**30


WEIGHT = "_loss_weight"  # a metrics dict's weight in averages over micro-batches and DP ranks


def is_maximum(key: str) -> bool:
    """An off-policy metric that is a largest value (``offpolicy/ratio_max``, ``offpolicy/max_abs_dlogp``):
    combined over micro-batches and DP ranks by ``max``, where the others take a weighted mean.

    >>> is_maximum("actor/offpolicy/ratio_max"), is_maximum("actor/offpolicy/kl"), is_maximum("actor/ratio_max")
    (True, False, False)
    """
    return "offpolicy/" in key and "max" in key.rsplit("/", 1)[-1]


def _routing_of(batch: Batch) -> dict[str, torch.Tensor]:
    """The actor's ``routing=`` for a batch with the engine's recorded routing (mixture of experts)."""
    return {} if batch.routing is None else {"routing": batch.routing}


def router_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """A mixture of experts' routing in an update, as metrics: the router's mean load-balancing and z-loss, and
    per MoE layer the expert load's imbalance, the busiest expert's tokens over the mean (1.0: even;
    ``num_experts / top_k`` at worst), and its maximum over layers.

    With the engine's recorded routing, the route-flip rate too: per layer, the share of tokens whose router
    chose other experts than the engine (whether or not the forward replayed the engine's), and overall.

    >>> load = torch.tensor([[4., 4., 4., 4.], [8., 4., 4., 0.], [0., 0., 0., 0.]])
    >>> router_metrics({"load": load, "aux_loss": 1.5, "z_loss": 2.0})
    {'router/aux_loss': 1.5, 'router/z_loss': 2.0, 'router/load_max/0': 1.0, 'router/load_max/1': 2.0, 'router/load_max': 2.0}
    >>> m = router_metrics({"load": load, "aux_loss": 1.5, "z_loss": 2.0, "flips": torch.tensor([1., 3., 0.]),
    ...                     "recorded": torch.tensor([8., 8., 0.])})
    >>> m["router/flip_rate/0"], m["router/flip_rate/1"], m["router/flip_rate"]
    (0.125, 0.375, 0.25)
    """
    out = {"router/aux_loss": float(stats["aux_loss"]), "router/z_loss": float(stats["z_loss"])}
    load = stats["load"]
    for i, row in enumerate(load):
        if row.sum() > 0:  # a dense layer routes nothing
            out[f"router/load_max/{i}"] = float(row.max() / row.mean())
    out["router/load_max"] = max((v for k, v in out.items() if k.startswith("router/load_max/")), default=1.0)
    recorded = stats.get("recorded")
    if recorded is not None and float(recorded.sum()) > 0:  # the engine's routing came with the batch
        flips = stats["flips"]
        for i, n in enumerate(recorded):
            if n > 0:
                out[f"router/flip_rate/{i}"] = float(flips[i] / n)
        out["router/flip_rate"] = float(flips.sum() / recorded.sum())
    return out


def loss_weight(mb: dict[str, Any], agg: str) -> float:
    """A micro-batch's share of a minibatch's loss aggregated by ``agg`` (``rlkit.algos.aggregate``): its
    loss tokens for ``token-mean``, else its sequences that carry loss. Weighted so, the micro-batches'
    losses add up to the minibatch's whatever the cut (``ParallelModel.forward_backward``).

    >>> mb = {"response_mask": torch.tensor([[1., 1., 0.], [0., 0., 0.]])}
    >>> loss_weight(mb, "token-mean"), loss_weight(mb, "seq-mean-token-mean")
    (2.0, 1.0)
    """
    mask = SequenceLayout.loss_mask(mb) != 0
    return float(mask.sum() if agg == "token-mean" else mask.any(-1).sum())


def _epochs(model: ParallelModel, batch: Batch, settings: UpdateSettings, loss_fn: Any,
            stats: list[dict[str, float]], role: str, agg: str, after_first: Any = None) -> dict[str, float]:
    """``settings.epochs`` passes over the batch, ``settings.minibatches`` optimizer steps each; each step's
    objective is the loss over its whole minibatch (every DP rank's part), however it is micro-batched.
    ``after_first``: called once the first optimizer step is done."""
    results = []
    for _epoch in range(settings.epochs):
        for mb in _minibatches(batch, settings.minibatches):
            results.append(model.train_step(mb, loss_fn, lambda part: loss_weight(part, agg)))
            if after_first is not None and len(results) == 1:
                after_first()
    return _summarize(results, stats, role)


def _minibatches(batch: Batch, k: int) -> list[Batch]:
    """This DP rank's batch in ``k`` PPO minibatches."""
    if len(batch) % k:
        raise ValueError(f"this DP rank's {len(batch)} samples do not split into minibatches={k}")
    return batch.split(k)


def _summarize(results: list[dict[str, float]], stats: list[dict[str, float]], role: str) -> dict[str, float]:
    """One update's metrics on this rank: the losses and grad norms of its optimizer steps averaged, and the
    micro-batches' stats (entropy, clip fraction, ...) averaged by their weight in the loss (``WEIGHT``), so
    they mean the same however the batch was cut; ``WEIGHT`` is the rank's total, for the DP average."""
    out = {f"{role}/loss": sum(r["loss"] for r in results) / len(results),
           f"{role}/grad_norm": sum(r["grad_norm"] for r in results) / len(results)}
    total = sum(s[WEIGHT] for s in stats)
    keys = {k for s in stats for k in s} - {WEIGHT}
    for k in sorted(keys):  # stats exist on the last pipeline stage (where the loss runs)
        part = [s for s in stats if k in s]
        weight = sum(s[WEIGHT] for s in part)
        if is_maximum(k):
            out[f"{role}/{k}"] = max(float(s[k]) for s in part)
            continue
        out[f"{role}/{k}"] = (sum(float(s[k]) * s[WEIGHT] for s in part) / weight if weight > 0
                              else sum(float(s[k]) for s in part) / len(part))
    if stats:
        out[WEIGHT] = total
    return out
