"""The driver's arithmetic in ``Trainer.estimate``: after the workers scored the batch (reference, values,
old log-probs), the advantages and returns by the algorithm's estimator, the KL in the reward, and the
engine-against-trainer mismatch with its optional importance weights. Plain functions on tensors; the
config says which.

>>> import torch
>>> from rlkit.batch import Batch
>>> from rlkit.config import TrainerConfig
>>> mask = torch.ones(4, 2)
>>> b = Batch(input_ids=torch.zeros(4, 3, dtype=torch.long), attention_mask=torch.ones(4, 3, dtype=torch.long),
...           response_mask=mask, rollout_logprobs=torch.zeros(4, 2), uid=[0, 0, 1, 1])
>>> kl = step_advantages(b, torch.tensor([1., 0., 0., 1.]), mask, config=TrainerConfig(), estimator="grpo",
...                      kl_ctl=None, sampling_logprobs=None)
>>> kl is None, b.advantages[:, 0].tolist()
(True, [0.7071..., -0.7071..., -0.7071..., 0.7071...])
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.step_batch import masked_stat


def step_advantages(batch: Batch, scores: torch.Tensor, mask: torch.Tensor, *, config: Any, estimator: str,
                    kl_ctl: Any, sampling_logprobs: torch.Tensor | None) -> float | None:
    """``batch.advantages`` and ``batch.returns`` by ``estimator`` (GRPO's groups: the samples' ``uid``); the KL
    in the reward (``kl_in_reward``, against the policy that sampled: ``sampling_logprobs`` are pi_old's) or
    its measure. ``mask``: the tokens that carry loss (all zero: a sample without reward, a group of its
    own). Returns the mean KL (None when not measured)."""
    from rlkit.algos import (
        ADVANTAGES,
        apply_kl_penalty,
        compute_advantages,
        estimator_options,
        kl_penalty,
        last_token_rewards,
    )

    c = config
    rewards, kl_mean = scores, None
    if c.kl_coef > 0 and c.kl_in_reward:
        rewards, kl_mean = apply_kl_penalty(last_token_rewards(scores, mask), sampling_logprobs,
                                            batch.ref_logprobs, mask, kl_ctl, kind="k1")
        kl_ctl.update(kl_mean, len(scores))
    elif c.kl_coef > 0 and batch.old_logprobs is not None:
        kl_mean = masked_stat(kl_penalty(batch.old_logprobs, batch.ref_logprobs, c.kl_kind), mask, "mean")
    # a sample with no reward (skipped, dropped) is a group of its own: it moves no baseline of the others
    skipped = ~mask.bool().any(1)
    groups = [("skipped", i) if s else u for i, (u, s) in enumerate(zip(batch.uid, skipped.tolist()))]
    logprobs = sampling_logprobs if sampling_logprobs is not None else batch.rollout_logprobs
    adv, returns = compute_advantages(
        estimator, rewards, mask, values=batch.values, group_ids=groups, ref_logprobs=batch.ref_logprobs,
        logprobs=logprobs, **estimator_options(estimator, gamma=c.gamma, lam=c.lam))
    batch.advantages, batch.returns = adv * mask, returns
    if ADVANTAGES.get(estimator) is ADVANTAGES["distill"] and kl_mean is None:  # what distillation drives down: the reverse KL to the teacher
        kl_mean = masked_stat(logprobs - batch.ref_logprobs, mask, "mean")
    return kl_mean


def offpolicy_metrics(batch: Batch, old: torch.Tensor, mask: torch.Tensor, *, config: Any) -> dict[str, float]:
    """The engine/trainer mismatch metrics of pi_old (``old``) against the engine's mu
    (``batch.rollout_logprobs``); with ``config.offpolicy_correction`` also the importance weights pi_old / mu
    (truncated or masked, ``rlkit.algos.offpolicy``), folded into ``batch.advantages``."""
    from rlkit.algos.offpolicy import importance_weights, mismatch_metrics

    c, behaviour = config, batch.rollout_logprobs
    if c.offpolicy_correction is None:
        return mismatch_metrics(old, behaviour, mask)
    weights, metrics = importance_weights(old, behaviour, mask, mode=c.offpolicy_correction,
                                          cap=c.offpolicy_cap, level=c.offpolicy_level)
    batch.advantages = batch.advantages * weights
    return metrics


__all__ = ["offpolicy_metrics", "step_advantages"]
