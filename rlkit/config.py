"""TrainerConfig: how the trainer steps, every field checked on construction, and what each step's
settings are (the learning-rate schedule, the update's settings) as functions of the step alone.

>>> c = TrainerConfig(lr=1e-3, lr_schedule="cosine", total_steps=10)
>>> [round(c.learning_rate(s), 6) for s in (0, 5, 10)]
[0.001, 0.00055, 0.0001]
>>> c.update_settings(step=5).lr == c.learning_rate(5)
True
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkit.errors import TrainerError

if TYPE_CHECKING:
    from rlkit.algos.settings import UpdateSettings


@dataclass
class TrainerConfig:
    """How the trainer steps. Defaults suit a laptop's CPU and a tiny model; see each field.

    >>> TrainerConfig(prompts_per_step=8, lr=1e-3).prompts_per_step
    8
    """

    prompts_per_step: int = 8            # prompts per step (each sampled Rollout.n times)
    lr: float = 1e-5                     # actor learning rate (AdamW)
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"        # "constant" | "cosine" (decays to 10% over total_steps)
    total_steps: int | None = None       # the run's length in steps: what "cosine" decays over
    epochs: int = 1                      # PPO epochs over each batch
    minibatches: int = 1                 # optimizer steps per epoch (split of each DP rank's batch)
    clip_low: float = 0.2
    clip_high: float = 0.2               # > clip_low: DAPO clip-higher
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    loss_options: dict[str, Any] | None = None  # the policy loss's own hyper-parameters, e.g. SAPO's {"tau_neg": 1.05}
    kl_coef: float = 0.0                 # 0: no reference model
    teacher: str | None = None           # on-policy distillation: a checkpoint with the student's tokenizer, in the reference's place
    kl_kind: str = "low_var_kl"
    kl_in_reward: bool = False           # False: KL as a loss term (GRPO); True: penalty in the reward (PPO)
    kl_target: float | None = None       # with kl_in_reward: adaptive controller (Ziegler et al. 2019)
    entropy_coef: float = 0.0
    max_grad_norm: float | None = 1.0
    precision: str = "fp32"              # "bf16-mixed": bf16 autocast on fp32 weights (TRL's bf16=True)
    padding_free: bool = True            # pack sequences, pay for real tokens only (False: the padded layout)
    micro_batch_tokens: int | None = None  # padding-free: tokens per micro-batch (None: the plan's micro-batches)
    router_aux_coef: float = 0.0         # mixture of experts: the router's load-balancing loss weight (0: off, as most RL recipes)
    router_z_coef: float = 0.0           # mixture of experts: the router's z-loss weight (ST-MoE; 0: off)
    routing_replay: bool = False         # mixture of experts: the actor routes by the engine's recorded experts (R3;
    #                                      needs Rollout(record_routing=True))
    freeze_vision: bool = False          # vision-language models: the vision tower keeps its weights (train the LM only)
    lora: Any = None                     # peft LoraConfig (TRL's peft_config) or an int rank: train adapters only
    backend: Any = "torch"               # who trains: "torch" | "megatron" | "deepspeed" or rlkit.Backend(...) (rlkit.backends)
    off_policy_steps: int = 0            # 1: one-step-off async RL (split placement): step k+1's batch samples during step k
    offpolicy_correction: str | None = None  # "tis" | "mis": weight each token by pi_old / mu (engine) (rlkit.algos.offpolicy)
    offpolicy_cap: float = 2.0           # TIS truncates the weight here, MIS drops tokens above it
    offpolicy_level: str = "token"       # "token" | "sequence" (one weight per sample)
    streaming: bool = False              # split placement: chunked generation, groups streamed to the trainer (rlkit.stream)
    max_staleness: int = 1               # streaming: groups whose oldest token is more versions behind are dropped
    partial_rollouts: bool = True        # streaming: new weights land mid-sample (False: once no sample runs)
    stream_chunk_tokens: int = 8         # streaming: tokens each running sample takes per generation call
    stream_groups: int | None = None     # streaming: running + buffered groups at most (None: 2 x prompts_per_step)
    stream_stale_kv: bool = False        # streaming: a running sample keeps its keys/values across weight updates
    dynamic_sampling: bool = False       # DAPO: drop groups whose rewards are all equal, generate more (rlkit.dynamic_sampling)
    max_sampling_rounds: int = 8         # dynamic sampling: generation rounds per step at most (1 = no backfill)
    overlong_buffer: int = 0             # DAPO's soft overlong penalty over the last tokens before max_new_tokens (0: off)
    overlong_penalty: float = 1.0        # the penalty at max_new_tokens (it ramps from 0 over the buffer)
    mask_truncated: bool = False         # responses cut at max_new_tokens carry no loss (TRL's mask_truncated_completions)
    gamma: float = 1.0                   # GAE (ppo)
    lam: float = 1.0
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    train_size: int = 1000               # rows taken from a Task's train split
    prompt_column: str = "prompt"        # the dataset's column that holds the prompts (text or chat)
    seed: int = 0
    run_dir: str | None = None           # metrics.jsonl, config.json, plots; None: ./runs/<time>
    timeout_s: float = 600.0             # bound on each worker call
    checkpoint_every: int = 0            # every N steps, the run's checkpoint (run_dir/checkpoint; 0: off)
    max_restarts: int = 0                # a lost worker: start the groups again and load that checkpoint, up to N times
    restart_timeout_s: float = 300.0     # bound on a restart's wait for the cluster to have room for the plan again
    reward_timeout_s: float = 60.0       # bound on each async reward's call (and a Judge's), per batch
    keep_samples: int = 512              # rows kept for samples()
    eval_every: int = 0                  # every N steps, eval/avg@k, pass@k, maj@k on the held-out split (0: off)
    eval_k: int = 1                      # samples per held-out prompt (1: greedy; more: sampled at the rollout's temperature)
    eval_prompts: int = 64               # held-out prompts per evaluation
    report_to: str | Sequence[str] | None = None  # "tensorboard" | "mlflow" | "wandb" | "trackio" | a list

    def __post_init__(self) -> None:
        from rlkit.algos import AGG_MODES, KL_KINDS
        from rlkit.checks import boolean, choice, integer, number
        from rlkit.parallel.kit import PRECISIONS

        err = {"error": TrainerError}
        integer("prompts_per_step", self.prompts_per_step, hint="e.g. prompts_per_step=8", **err)
        integer("epochs", self.epochs, hint="1 is on-policy; PPO often uses 2-4", **err)
        integer("minibatches", self.minibatches, hint="1: one optimizer step per epoch", **err)
        integer("train_size", self.train_size, hint="rows taken from a Task's train split", **err)
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            raise TrainerError(f"prompt_column={self.prompt_column!r} must be a column name (a non-empty string), "
                               f"e.g. prompt_column='question'")
        integer("lr_warmup_steps", self.lr_warmup_steps, ge=0, hint="0 turns warm-up off", **err)
        integer("seed", self.seed, ge=0, **err)
        integer("keep_samples", self.keep_samples, ge=0, hint="0 keeps no samples", **err)
        number("reward_timeout_s", self.reward_timeout_s, gt=0, hint="seconds an async reward may take per batch, "
               "e.g. 60", **err)
        integer("eval_every", self.eval_every, ge=0, hint="e.g. eval_every=10; 0 turns evaluation inside fit off",
                **err)
        integer("eval_k", self.eval_k, hint="samples per held-out prompt, e.g. eval_k=8 for pass@8", **err)
        integer("eval_prompts", self.eval_prompts, hint="held-out prompts per evaluation, e.g. 64", **err)
        number("lr", self.lr, gt=0, hint="e.g. lr=1e-5 for a pretrained model, 2e-3 for a tiny one", **err)
        number("critic_lr", self.critic_lr, gt=0, hint="e.g. critic_lr=1e-4", **err)
        choice("lr_schedule", self.lr_schedule, ("constant", "cosine"), **err)
        integer("total_steps", self.total_steps, none_ok=True, hint="the run's length in steps, e.g. 200", **err)
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise TrainerError("lr_schedule='cosine' decays the learning rate over the run: set total_steps= to the "
                               "run's length in steps (e.g. total_steps=200), or use lr_schedule='constant'")
        number("clip_low", self.clip_low, ge=0, lt=1, hint="PPO uses 0.2", **err)
        number("clip_high", self.clip_high, ge=0, hint="PPO uses 0.2; DAPO's clip-higher 0.28", **err)
        if self.clip_high < self.clip_low:
            raise TrainerError(f"clip_high={self.clip_high} < clip_low={self.clip_low}: the ratio's upper clip "
                               f"must be at least its lower one (clip-higher widens it); e.g. clip_high="
                               f"{self.clip_low}")
        number("dual_clip", self.dual_clip, gt=1, none_ok=True, hint="e.g. dual_clip=3.0", **err)
        choice("loss_agg", self.loss_agg, AGG_MODES, **err)
        if self.loss_options is not None and not (isinstance(self.loss_options, dict)
                                                  and all(isinstance(k, str) for k in self.loss_options)):
            raise TrainerError(f"loss_options={self.loss_options!r} must be a dict of the policy loss's keyword "
                               f"arguments, e.g. loss_options={{'tau_pos': 1.0, 'tau_neg': 1.05}} for SAPO")
        number("router_aux_coef", self.router_aux_coef, ge=0, hint="e.g. 0.001 (Qwen3-MoE's pretraining value); "
               "0 turns the load-balancing loss off", **err)
        number("router_z_coef", self.router_z_coef, ge=0, hint="e.g. 0.001 (ST-MoE); 0 turns the z-loss off", **err)
        boolean("routing_replay", self.routing_replay, **err)
        boolean("freeze_vision", self.freeze_vision, **err)
        number("kl_coef", self.kl_coef, ge=0, hint="0 turns the KL term (and the reference model) off", **err)
        choice("kl_kind", self.kl_kind, KL_KINDS, **err)
        if self.teacher is not None and not (isinstance(self.teacher, str) and self.teacher):
            raise TrainerError(f"teacher={self.teacher!r} must be a checkpoint: a folder, a hub id or an "
                               f"rlkit.models name (with the student's tokenizer), or None")
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
        boolean("padding_free", self.padding_free, **err)
        integer("micro_batch_tokens", self.micro_batch_tokens, none_ok=True,
                hint="tokens per micro-batch, at least the longest prompt + response, e.g. 4096", **err)
        from rlkit.algos.offpolicy import LEVELS, MODES

        integer("off_policy_steps", self.off_policy_steps, ge=0,
                hint="0: on-policy (generate, then train); 1: one-step-off (generate the next batch while training)",
                **err)
        if self.offpolicy_correction is not None:
            choice("offpolicy_correction", self.offpolicy_correction, MODES, **err)
        number("offpolicy_cap", self.offpolicy_cap, gt=0, hint="TIS/MIS cap on pi_old / mu, e.g. 2.0", **err)
        choice("offpolicy_level", self.offpolicy_level, LEVELS, **err)
        from rlkit.parallel.lora import as_lora_config

        try:
            self.lora = as_lora_config(self.lora)  # a LoraConfig, or None; checked against the model by the Trainer
        except ValueError as e:
            raise TrainerError(str(e)) from None
        from rlkit.backends import Backend
        from rlkit.errors import PlanError

        try:  # a name, a Backend, or the dict a saved trainer.json holds
            self.backend = (Backend(**self.backend) if isinstance(self.backend, dict) else
                            Backend(self.backend) if isinstance(self.backend, str) else self.backend)
        except PlanError as e:
            raise TrainerError(str(e)) from None
        except TypeError:
            self.backend = None  # a dict of other keys: reported below
        if not isinstance(self.backend, Backend):
            raise TrainerError(f"backend={self.backend!r} must be 'torch', 'megatron', 'deepspeed' or an "
                               f"rlkit.Backend(name, zero_stage=...)")
        if self.micro_batch_tokens is not None and not self.padding_free:
            raise TrainerError(f"micro_batch_tokens={self.micro_batch_tokens} sizes padding-free micro-batches; "
                               f"set padding_free=True, or micro_batch_tokens=None for the padded layout")
        boolean("streaming", self.streaming, **err)
        integer("max_staleness", self.max_staleness, ge=0,
                hint="how many updates behind the trainer a sample's oldest token may be, e.g. 1 or 2", **err)
        boolean("partial_rollouts", self.partial_rollouts, **err)
        integer("stream_chunk_tokens", self.stream_chunk_tokens,
                hint="tokens per running sample between weight updates, e.g. 8 or 32", **err)
        boolean("stream_stale_kv", self.stream_stale_kv, **err)
        if self.stream_stale_kv and not (self.streaming and self.partial_rollouts):
            raise TrainerError("stream_stale_kv=True keeps a running sample's keys and values when new weights land "
                               "mid-sample: it needs streaming=True and partial_rollouts=True (now streaming="
                               f"{self.streaming}, partial_rollouts={self.partial_rollouts}); or stream_stale_kv=False")
        integer("stream_groups", self.stream_groups, none_ok=True,
                hint="running + buffered groups, at least prompts_per_step, e.g. 2 x prompts_per_step", **err)
        if self.stream_groups is not None and self.stream_groups < self.prompts_per_step:
            raise TrainerError(f"stream_groups={self.stream_groups} < prompts_per_step={self.prompts_per_step}: a step "
                               f"takes prompts_per_step finished groups, so at least that many must be in the stream; "
                               f"e.g. stream_groups={2 * self.prompts_per_step}")
        if self.streaming and self.off_policy_steps:
            raise TrainerError(f"streaming=True with off_policy_steps={self.off_policy_steps}: streaming is its own "
                               f"asynchronous mode (its staleness is bounded by max_staleness); set off_policy_steps=0")
        boolean("dynamic_sampling", self.dynamic_sampling, **err)
        integer("max_sampling_rounds", self.max_sampling_rounds,
                hint="the generation rounds a step may take to fill its batch with groups that differ, e.g. 8", **err)
        integer("overlong_buffer", self.overlong_buffer, ge=0,
                hint="tokens before max_new_tokens over which the penalty ramps, e.g. a quarter of it; 0 is off", **err)
        number("overlong_penalty", self.overlong_penalty, gt=0, hint="DAPO uses 1.0", **err)
        boolean("mask_truncated", self.mask_truncated, **err)
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
        integer("checkpoint_every", self.checkpoint_every, ge=0,
                hint="steps between the run's checkpoints (run_dir/checkpoint), e.g. 10; 0 is off", **err)
        integer("max_restarts", self.max_restarts, ge=0,
                hint="how often fit may restart lost workers from the last checkpoint, e.g. 3; 0 stops at the first", **err)
        if self.max_restarts and not self.checkpoint_every:
            raise TrainerError(f"max_restarts={self.max_restarts}: a restart goes on from the run's last checkpoint, "
                               f"and checkpoint_every=0 writes none; set checkpoint_every=N (e.g. 10)")
        number("restart_timeout_s", self.restart_timeout_s, gt=0,
               hint="seconds a restart waits for the cluster to have room for the plan again, e.g. 300", **err)
        from rlkit import trackers  # the names, and each one's package installed here (rlkit.trackers)

        self.report_to = trackers.normalize(self.report_to)
        trackers.require_installed(self.report_to)

    # ---- per step ------------------------------------------------------------------------------
    def learning_rate(self, step: int) -> float:
        """The actor's learning rate at ``step`` (0-based): linear warm-up over ``lr_warmup_steps``, then
        constant, or cosine from ``lr`` down to 10% of it at ``total_steps``."""
        if self.lr_warmup_steps and step < self.lr_warmup_steps:
            return self.lr * (step + 1) / self.lr_warmup_steps
        if self.lr_schedule == "cosine":
            total = max(self.total_steps, 1)
            frac = min(1.0, (step - self.lr_warmup_steps) / max(1, total - self.lr_warmup_steps))
            return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        return self.lr

    def kl_controller(self) -> Any:
        """The KL coefficient's controller: adaptive (Ziegler et al. 2019) with ``kl_target``, else fixed."""
        from rlkit.algos import AdaptiveKLController, FixedKLController

        if self.kl_target is not None:
            return AdaptiveKLController(self.kl_coef, self.kl_target, horizon=10_000)
        return FixedKLController(self.kl_coef)

    def update_settings(self, step: int, policy_loss: Any = None) -> UpdateSettings:
        """What the update calls of ``step`` take: the learning rate then, the PPO settings, the KL as a
        loss term (none when the KL is in the reward), and the algorithm's ``policy_loss``."""
        from rlkit.algos.settings import UpdateSettings

        extra = {} if policy_loss is None else {"policy_loss": policy_loss}
        return UpdateSettings(lr=self.learning_rate(step), epochs=self.epochs, minibatches=self.minibatches,
                              clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                              loss_agg=self.loss_agg, loss_options=dict(self.loss_options or {}), kl_loss_coef=0.0 if self.kl_in_reward else self.kl_coef,
                              kl_kind=self.kl_kind, entropy_coef=self.entropy_coef, value_clip=self.value_clip,
                              offpolicy=({"mode": self.offpolicy_correction, "cap": self.offpolicy_cap,
                                          "level": self.offpolicy_level} if self.fused_offpolicy() else None),
                              **extra)

    def passes(self, needs: Any) -> Any:
        """The scoring passes of this config's steps for an estimator's ``rlkit.algos.Needs``
        (``Needs.passes``; the off-policy correction fused into the update when ``fused_offpolicy``).

        >>> from rlkit.algos import Needs
        >>> TrainerConfig(epochs=2).passes(Needs()).old_logprobs
        True
        """
        return needs.passes(kl_coef=self.kl_coef, kl_in_reward=self.kl_in_reward, epochs=self.epochs,
                            minibatches=self.minibatches, offpolicy_correction=self.offpolicy_correction,
                            fused_offpolicy=self.fused_offpolicy())

    def fused_offpolicy(self) -> bool:
        """Whether the off-policy correction runs inside the update, on pi_old from the update's own forward
        (no scoring pass before it): one optimizer step per batch (``epochs = minibatches = 1``, so the
        update's first forward is pi_old) and no KL in the reward (which needs pi_old before the advantages).

        >>> TrainerConfig(offpolicy_correction="tis").fused_offpolicy(), TrainerConfig(offpolicy_correction="tis", epochs=2).fused_offpolicy()
        (True, False)
        """
        return (self.offpolicy_correction is not None and self.epochs == 1 and self.minibatches == 1
                and not (self.kl_coef > 0 and self.kl_in_reward))


__all__ = ["TrainerConfig"]
