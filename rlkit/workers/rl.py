"""RLWorker: one rank of the RL worker group (actor + rollout engine + reference + critic, colocated).

This is the HybridEngine: the actor trains under its ParallelPlan, and rollout runs on the same workers.
Two layouts:

* ``Rollout(tp=None)`` (the default): one engine per DP group, on that group's ``tp=0`` rank of the
  last pipeline stage (the rank ``WorkerGroup.call_dp`` collects results from). After each update the
  new weights stream out of the training layout one tensor at a time, only to the engine ranks, and are
  loaded into the engine in place. On a one-rank plan an HF engine in the actor's dtype needs no model
  of its own: it generates with the actor's tensors (the generation layout below, with ``t_g = 1``).
* ``Rollout(tp=t_g)``: the 3D-HybridEngine's generation layout (``rlkit.workers.hybrid``). Every rank
  generates, in groups of ``t_g``; each generation resharding moves only what a rank lacks, inside its
  micro-DP group, and the generation copy is dropped before training resumes.

Sequences have one fixed layout for the whole run, so pipeline schedules are built once:
``[prompt left-padded to P | response right-padded to R]``; response token ``j`` sits at column
``P + j`` and is predicted from the hidden state at column ``P + j - 1``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlkit.algos import aggregate, kl_loss, masked_mean, policy_loss, value_loss
from rlkit.parallel import ParallelModel
from rlkit.plan.topology import ParallelPlan
from rlkit.rollout import Rollout, make_engine


class RLWorker:
    """Per-rank RL roles. Created by ``WorkerGroup`` inside each actor (the process group exists)."""

    def __init__(self, model_path: str, plan: ParallelPlan, *, rollout: Rollout, prompt_len: int,
                 actor_lr: float, critic_lr: float = 1e-4, max_grad_norm: float | None = 1.0,
                 need_ref: bool = False, need_critic: bool = False, seed: int = 0, colocate_rollout: bool = True,
                 precision: str = "fp32"):
        torch.manual_seed(seed)
        self.plan, self.rank = plan, dist.get_rank()
        self.P, self.R = prompt_len, rollout.max_new_tokens
        common = dict(max_grad_norm=max_grad_norm, seed=seed, eps=1e-6, precision=precision)
        self.actor = ParallelModel(model_path, plan, lr=actor_lr, **common)
        self.ref = ParallelModel(model_path, plan, lr=0.0, **common) if need_ref else None
        self.critic = ParallelModel(model_path, plan, head="value", lr=critic_lr, **common) if need_critic else None
        for model in (self.actor, self.ref):  # every loss and metric here reads the response's columns only
            if model is not None:
                model.set_scoring(first_column=self.P)
        c = plan.coords(self.rank)
        self.dp_rank = c["dp"]
        self.hybrid = None
        gen_tp = rollout.tp
        if gen_tp is None and colocate_rollout and _can_share_actor_weights(rollout, model_path, plan, self.actor):
            gen_tp = 1  # one rank: the engine generates with the actor's own tensors (no second model to sync)
        if gen_tp is not None and colocate_rollout:  # every rank generates, in the generation layout
            from rlkit.plan.hybrid import GenerationLayout
            from rlkit.workers.hybrid import HybridRollout

            self.hybrid = HybridRollout(model_path, self.actor, GenerationLayout(plan, gen_tp), rollout)
        # split placement: the engines live in their own RolloutWorker group instead
        self.engine_ranks = sorted(plan.rank(dp=d, tp=0, pp=plan.pp - 1) for d in range(plan.dp)) \
            if colocate_rollout and self.hybrid is None else []
        self.engine = make_engine(rollout, model_path) if self.rank in self.engine_ranks else None

    # ---- rollout -------------------------------------------------------------------------------
    def generate(self, batch: dict[str, Any], seed: int, **overrides: Any) -> dict[str, Any] | None:
        """n samples per prompt of this DP group's prompts, laid out ``[P | R]``; None off the engine rank
        (in the generation layout: off the replica's collector rank, though every rank generates)."""
        if self.hybrid is not None:
            return self.hybrid.generate(batch, seed + 7919 * self.dp_rank, self.P, self.R, **overrides)
        if self.engine is None:
            return None
        return rollout_to_batch(self.engine, batch, seed + 7919 * self.dp_rank, self.P, self.R, **overrides)

    # ---- forward passes ------------------------------------------------------------------------
    def compute(self, batch: dict[str, Any], what: str) -> dict[str, torch.Tensor]:
        """Per-response-token ``logprobs`` + ``entropy`` (actor), ``ref_logprobs`` or ``values``."""
        ids, attn = batch["input_ids"], batch["attention_mask"]
        P, R = self.P, self.R
        if what == "actor":
            out = self.actor.logprobs(ids, attn)
            return {"logprobs": out["logprobs"][:, P:P + R], "entropy": out["entropy"][:, P:P + R]}
        if what == "ref":
            return {"ref_logprobs": self.ref.logprobs(ids, attn)["logprobs"][:, P:P + R]}
        if what == "values":  # V(state before token j) lives at column P + j - 1
            return {"values": self.critic.values(ids, attn)["values"][:, P - 1:P + R - 1]}
        raise ValueError(f"compute(what={what!r}): choose 'actor', 'ref' or 'values'")

    # ---- updates -------------------------------------------------------------------------------
    def update_actor(self, batch: dict[str, Any], cfg: dict[str, Any]) -> dict[str, float]:
        """PPO-style epochs x mini-batches of clipped policy-gradient steps on this DP rank's chunk."""
        for g in self.actor.optimizer.param_groups:
            g["lr"] = cfg["lr"]
        P, R = self.P, self.R
        stats: list[dict[str, float]] = []
        self.actor.set_scoring(first_column=P, entropy_grad=bool(cfg["entropy_coef"]))  # else entropy is a metric

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            lp, mask = out["logprobs"][:, P:P + R], mb["response_mask"]
            old = mb["old_logprobs"] if "old_logprobs" in mb else lp.detach()
            loss, m = policy_loss(lp, old, mb["advantages"], mask, clip_low=cfg["clip_low"],
                                  clip_high=cfg["clip_high"], dual_clip=cfg["dual_clip"], agg=cfg["loss_agg"])
            m["pg_loss"] = loss.item()
            if cfg["kl_loss_coef"] and "ref_logprobs" in mb:
                kl = kl_loss(lp, mb["ref_logprobs"], mask, kind=cfg["kl_kind"], agg=cfg["loss_agg"])
                loss = loss + cfg["kl_loss_coef"] * kl
                m["kl_loss"] = kl.item()
            ent = out["entropy"][:, P:P + R]
            if cfg["entropy_coef"]:
                loss = loss - cfg["entropy_coef"] * aggregate(ent, mask, cfg["loss_agg"])
            m["entropy"] = masked_mean(ent.detach(), mask).item()
            stats.append(m)
            return loss

        return _epochs(self.actor, batch, cfg, loss_fn, stats, "actor")

    def update_critic(self, batch: dict[str, Any], cfg: dict[str, Any]) -> dict[str, float]:
        P, R = self.P, self.R
        stats: list[dict[str, float]] = []

        def loss_fn(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
            v = out["values"][:, P - 1:P + R - 1]
            loss, m = value_loss(v, mb["values"], mb["returns"], mb["response_mask"], clip=cfg["value_clip"])
            stats.append(m)
            return loss

        return _epochs(self.critic, batch, cfg, loss_fn, stats, "critic")

    # ---- weight sync (HybridEngine) ---------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's full weights into the engines; every rank takes part in the gathers. Returns
        the bytes moved, the seconds and the rank's ``rss_gb``.

        In the generation layout the resharding runs at the start of each ``generate`` (the generation
        copy only exists while it generates): this returns that last resharding's numbers."""
        if self.hybrid is not None:
            return dict(self.hybrid.last_sync, rss_gb=_rss_gb())
        t0 = time.perf_counter()
        stream = self.actor.iter_full_weights(to=self.engine_ranks)
        if self.engine is not None:
            self.engine.load_weights((n, t) for n, t in stream if t is not None)
        for _ in stream:  # drain: the gathers are collectives
            pass
        moved = self.actor.last_transfer.get("bytes", 0.0)
        # the rank's memory rides along: one call a step fewer for the trainer's memory/rss metrics
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0, "rss_gb": _rss_gb()}

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named actor weights on rank 0 (None elsewhere): for a rollout group on its own pool."""
        sd = self.actor.full_state_dict(to=0)
        return sd if self.rank == 0 else None

    # ---- state ---------------------------------------------------------------------------------
    def save(self, path: str) -> str:
        self.actor.save(Path(path) / "actor")
        if self.critic is not None:
            self.critic.save(Path(path) / "critic")
        return path

    def load(self, path: str) -> dict[str, float]:
        self.actor.load(Path(path) / "actor")
        if self.critic is not None:
            self.critic.load(Path(path) / "critic")
        return self.sync_weights()

    def rss_gb(self) -> float:
        return _rss_gb()

    def memory(self) -> list[dict[str, int]]:
        """The actor's bytes per rank (weights, grads of the last backward, optimizer state), measured:
        rows for ``rlkit.plan.compare_memory`` beside ``plan.memory(...)``. A collective: call every rank."""
        return self.actor.memory().to_dict(orient="records")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.hybrid is not None:
            self.hybrid.close()


class RolloutWorker:
    """A rollout engine on its own worker (split placement): no process group, no training state."""

    def __init__(self, model_path: str, *, rollout: Rollout, prompt_len: int, seed: int = 0):
        torch.manual_seed(seed)
        self.P, self.R = prompt_len, rollout.max_new_tokens
        self.dp_rank = int(os.environ.get("RANK", "0"))
        self.engine = make_engine(rollout, model_path)

    def generate(self, batch: dict[str, Any], seed: int, **overrides: Any) -> dict[str, Any]:
        # same seed per DP chunk as a colocated engine: the two placements sample the same responses
        return rollout_to_batch(self.engine, batch, seed + 7919 * self.dp_rank, self.P, self.R, **overrides)

    def load_weights(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.engine.load_weights(state.items())
        return {"bytes": float(sum(t.numel() * t.element_size() for t in state.values())),
                "seconds": time.perf_counter() - t0}

    def rss_gb(self) -> float:
        return _rss_gb()

    def close(self) -> None:
        self.engine.close()


def rollout_to_batch(engine: Any, batch: dict[str, Any], seed: int, P: int, R: int, *, first_index: int = 0,
                     **overrides: Any) -> dict[str, Any]:
    """Generate for ``batch["prompt"]`` and lay the samples out as ``[prompt left-padded to P | response
    right-padded to R]`` with masks, the rollout's log-probs and each sample's prompt ``uid`` / ``row``.
    ``first_index``: where these prompts start in the call they are a slice of (per-prompt seeds).

    >>> from rlkit.models import tiny_lm
    >>> from rlkit.rollout import HFEngine
    >>> engine = HFEngine(tiny_lm("qwen2", size="test"), n=2, max_new_tokens=4, ignore_eos=True)
    >>> b = rollout_to_batch(engine, {"prompt": ["ab", "12+7="], "uid": [0, 1], "row": [5, 9]}, 0, P=8, R=4)
    >>> tuple(b["input_ids"].shape), b["uid"], b["row"], b["response_mask"].sum().item()
    ((4, 12), [0, 0, 1, 1], [5, 5, 9, 9], 16.0)
    """
    out = engine.generate(list(batch["prompt"]), seed=seed, first_index=first_index, **overrides)
    n = out.response_ids.shape[0]
    ids = torch.full((n, P + R), engine.pad_token_id, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    p, r = out.prompt_ids.shape[1], out.response_ids.shape[1]
    if p > P or r > R:
        raise RuntimeError(f"rollout returned prompt length {p} > P={P} or response {r} > R={R}")
    ids[:, P - p:P] = out.prompt_ids
    attn[:, P - p:P] = out.prompt_mask
    ids[:, P:P + r] = out.response_ids
    resp_mask = torch.zeros(n, R)
    resp_mask[:, :r] = out.response_mask.float()
    attn[:, P:] = resp_mask.long()
    lp = torch.zeros(n, R)
    lp[:, :r] = out.response_logprobs
    rows = out.prompt_index.tolist()
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp_mask, "rollout_logprobs": lp,
            "uid": [batch["uid"][i] for i in rows], "row": [batch["row"][i] for i in rows],
            "completion": list(out.texts), "finish_reason": list(out.finish_reason),
            "timing": out.timings.get("generate", 0.0)}


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


def _epochs(model: ParallelModel, batch: dict[str, Any], cfg: dict[str, Any], loss_fn: Any,
            stats: list[dict[str, float]], role: str) -> dict[str, float]:
    """``cfg["epochs"]`` passes over the batch, ``cfg["minibatches"]`` optimizer steps each."""
    results = [model.train_step(mb, loss_fn) for _epoch in range(cfg["epochs"])
               for mb in _split(batch, cfg["minibatches"])]
    return _summarize(results, stats, role)


def _split(batch: dict[str, Any], k: int) -> list[dict[str, Any]]:
    n = next(v.shape[0] for v in batch.values() if torch.is_tensor(v))
    if n % k:
        raise ValueError(f"this DP rank's {n} samples do not split into minibatches={k}")
    s = n // k
    return [{key: v[i * s:(i + 1) * s] if torch.is_tensor(v) else v for key, v in batch.items()} for i in range(k)]


def _summarize(results: list[dict[str, float]], stats: list[dict[str, float]], role: str) -> dict[str, float]:
    out = {f"{role}/loss": sum(r["loss"] for r in results) / len(results),
           f"{role}/grad_norm": sum(r["grad_norm"] for r in results) / len(results)}
    keys = {k for s in stats for k in s}
    for k in sorted(keys):  # stats exist on the last pipeline stage (where the loss runs)
        vals = [float(s[k]) for s in stats if k in s]
        out[f"{role}/{k}"] = sum(vals) / len(vals)
    return out
