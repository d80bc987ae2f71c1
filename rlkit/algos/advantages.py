"""Advantage estimators: GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++ as small pure tensor functions.

Conventions (verl / TRL): tensors are [batch, response_len]; ``response_mask`` is 1 on real response
tokens and 0 on padding; rewards come either as one score per sequence ([batch]) or per token
([batch, response_len]; an outcome reward sits on the last real token). ``group_ids`` says which
samples answer the same prompt (n samples per prompt): ints, strings or a tensor.

Every estimator takes the rewards as its first argument, returns ``(advantages, returns)`` as
[batch, response_len] tensors that are 0 on padding, and computes nothing that needs a gradient.
Each is registered by name (``rlkit.algos.registry``), where users add their own:

>>> import torch
>>> from rlkit.algos.registry import compute_advantages
>>> compute_advantages("grpo", torch.tensor([2.0, 0.0]), torch.ones(2, 3), group_ids=[0, 0])[0]
tensor([[ 0.7071,  0.7071,  0.7071],
        [-0.7071, -0.7071, -0.7071]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlkit.algos.masked import (
    as_bool,
    at_least_fp32,
    check_shapes,
    group_index,
    group_stats,
    last_token_rewards,
    masked_whiten,
    sequence_scores,
)
from rlkit.algos.registry import register_advantage


def _token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch] scores go on the last real token; [batch, T] rewards are used as they are."""
    rewards = at_least_fp32(rewards)
    if rewards.dim() == 1:
        return last_token_rewards(rewards, mask)
    check_shapes(mask, token_rewards=rewards)
    return rewards


@register_advantage("gae", "ppo")
@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), as in PPO-RLHF.

    Backwards over tokens: ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``; ``returns = A + V`` (the critic's target, taken before
    whitening). Masked: a padding step neither receives a value nor passes one on, so ``V_{t+1}`` and
    ``A_{t+1}`` are those of the next *real* token (0 after the last one). With ``whiten`` the
    advantages are normalised to mean 0, std 1 over the real tokens of the whole batch (verl does).

    >>> import torch
    >>> adv, ret = gae(torch.tensor([[0., 0., 1.]]), torch.tensor([[.5, .6, .7]]), torch.ones(1, 3),
    ...                gamma=0.9, lam=0.8, whiten=False)
    >>> adv
    tensor([[0.2171, 0.2460, 0.3000]])
    """
    m = as_bool(response_mask)
    check_shapes(m, values=values)
    r, v = _token_rewards(token_rewards, m), at_least_fp32(values)
    v = torch.where(m, v, torch.zeros((), dtype=v.dtype, device=v.device))      # garbage in padding stays out
    r = torch.where(m, r, torch.zeros((), dtype=r.dtype, device=r.device))
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    adv = torch.zeros_like(v)
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        real = m[:, t]
        adv[:, t] = torch.where(real, a, torch.zeros_like(a))
        next_value = torch.where(real, v[:, t], next_value)      # padding passes the later value through
        next_adv = torch.where(real, a, next_adv)
    returns = adv + v
    if whiten:
        adv = masked_whiten(adv, m)
    return adv, returns


@register_advantage("grpo")
@torch.no_grad()
def grpo(scores: torch.Tensor, group_ids: Sequence[Any] | torch.Tensor, response_mask: torch.Tensor,
         eps: float = 1e-6, norm_by_std: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A_i = (r_i - mean_g) / (std_g + eps)`` over the samples ``g`` of the same prompt, broadcast over
    the sequence's tokens. ``std_g`` is the unbiased std (``torch.std``, as verl and TRL). With
    ``norm_by_std=False`` it is ``r_i - mean_g``: Dr.GRPO (see :func:`drgrpo`). A group of size 1 has
    no baseline, so its advantage is 0 (verl instead passes the raw score through). ``scores`` may be
    [batch] or per-token [batch, T] (summed over real tokens). Returns ``(advantages, advantages)``.

    >>> import torch
    >>> grpo(torch.tensor([1., 0., 0., 1.]), [7, 7, 7, 7], torch.ones(4, 1))[0].flatten()
    tensor([ 0.8660, -0.8660, -0.8660,  0.8660])
    """
    m, s, (mean, std, count) = _grouped(scores, group_ids, response_mask)
    a = s - mean
    if norm_by_std:
        a = a / (std + eps)
    return _per_token(torch.where(count > 1, a, torch.zeros_like(a)), m)


@register_advantage("drgrpo")
@torch.no_grad()
def drgrpo(scores: torch.Tensor, group_ids: Sequence[Any] | torch.Tensor,
           response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    ``A_i = r_i - mean_g``: GRPO without the std division, which biases towards easy or hard
    prompts. The paper's other half is the loss without per-sequence length normalisation: use
    ``policy_loss(..., agg="seq-mean-token-sum-norm")``.

    >>> import torch
    >>> drgrpo(torch.tensor([1., 0., 0., 1.]), [0, 0, 0, 0], torch.ones(4, 1))[0].flatten()
    tensor([ 0.5000, -0.5000, -0.5000,  0.5000])
    """
    return grpo(scores, group_ids, response_mask, norm_by_std=False)


@register_advantage("rloo")
@torch.no_grad()
def rloo(scores: torch.Tensor, group_ids: Sequence[Any] | torch.Tensor,
         response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

    ``A_i = r_i - mean_{j != i} r_j`` = ``n / (n - 1) * (r_i - mean_g)`` over the n samples of the
    prompt, broadcast over the tokens. A group of size 1 has no "others", so its advantage is 0.
    Returns ``(advantages, advantages)``.

    >>> import torch
    >>> rloo(torch.tensor([1., 0., 0., 1.]), [0, 0, 0, 0], torch.ones(4, 1))[0].flatten()
    tensor([ 0.6667, -0.6667, -0.6667,  0.6667])
    """
    m, s, (mean, _, n) = _grouped(scores, group_ids, response_mask)
    return _per_token(torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(s)), m)


def _grouped(scores: torch.Tensor, group_ids: Any, response_mask: torch.Tensor):
    """(bool mask, one fp32 score per sequence, (mean, std, count) of each sample's prompt group)."""
    m = as_bool(response_mask)
    s = at_least_fp32(sequence_scores(scores, m))
    return m, s, group_stats(s, group_index(group_ids, s.shape[0], s.device))


def _per_token(a: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-sequence advantage on every real token (0 on padding), as ``(advantages, returns)``."""
    adv = torch.where(m, a[:, None], torch.zeros((), dtype=a.dtype, device=a.device))
    return adv, adv


def _discounted_returns(r: torch.Tensor, m: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over real tokens; padding passes the running return through."""
    ret = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * running
        ret[:, t] = torch.where(m[:, t], g, torch.zeros_like(g))
        running = torch.where(m[:, t], g, running)
    return ret


@register_advantage("reinforce_pp", "reinforce++")
@torch.no_grad()
def reinforce_pp(rewards: torch.Tensor, response_mask: torch.Tensor,
                 gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, whitened over the whole batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over real tokens, then ``A = (G - mean) / std`` over all
    real tokens of the batch (global, not per group: the paper's fix for GRPO's per-prompt
    over-fitting). ``rewards`` are per token [batch, T] (e.g. a score with a per-token KL penalty
    from :func:`rlkit.algos.apply_kl_penalty`) or one score per sequence [batch], placed on the last
    real token. Returns ``(advantages, returns)``.

    >>> import torch
    >>> reinforce_pp(torch.tensor([1., 0.]), torch.tensor([[1, 1], [1, 0]]))[0]
    tensor([[ 0.5774,  0.5774],
            [-1.1547,  0.0000]])
    """
    m = as_bool(response_mask)
    r = _token_rewards(rewards, m)
    ret = _discounted_returns(torch.where(m, r, torch.zeros_like(r)), m, gamma)
    return masked_whiten(ret, m), ret


@register_advantage("reinforce_pp_baseline", "reinforce++_baseline")
@torch.no_grad()
def reinforce_pp_baseline(scores: torch.Tensor, group_ids: Sequence[Any] | torch.Tensor,
                          response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv:2501.03262, "REINFORCE++-baseline").

    ``r_i - mean_g`` (the mean score of the prompt's samples; 0 for a group of size 1) broadcast over
    the sequence's tokens, then whitened over all real tokens of the batch (as verl). Returns
    ``(advantages, advantages)``.

    >>> import torch
    >>> reinforce_pp_baseline(torch.tensor([1., 0., 1., 1.]), [0, 0, 1, 1], torch.ones(4, 1))[0].flatten()
    tensor([ 1.2247, -1.2247,  0.0000,  0.0000])
    """
    m, s, (mean, _, count) = _grouped(scores, group_ids, response_mask)
    a = torch.where(count > 1, s - mean, torch.zeros_like(s))
    adv = masked_whiten(a[:, None].expand(m.shape), m)
    return adv, adv


@register_advantage("distill", "on_policy_distillation")
@torch.no_grad()
def distill(scores: torch.Tensor, response_mask: torch.Tensor, ref_logprobs: torch.Tensor,
            logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines 2025): each token of
    the student's own sample is advised by a teacher, ``A_t = log pi_teacher(y_t) - log pi_student(y_t)``.

    That is minus the per-token reverse KL's one-sample estimate (k1) at the sampled token, with no discount: a
    policy gradient on it lowers ``KL(pi_student || pi_teacher)`` on the student's own distribution. The teacher's
    log-probs arrive as ``ref_logprobs`` (``TrainerConfig(teacher=...)`` puts the teacher in the reference's
    place) and ``logprobs`` are the sampling policy's. The rewards are not used: ``Trainer(algorithm="distill")``
    is pure distillation; for the KL as a loss term beside a reward instead, keep the algorithm and set
    ``teacher=`` with ``kl_coef > 0``. Returns ``(advantages, advantages)``.

    >>> import torch
    >>> distill(torch.zeros(1), torch.tensor([[1, 1, 0]]), torch.tensor([[-1., -2., -9.]]),
    ...         torch.tensor([[-1.5, -1., -3.]]))[0]
    tensor([[ 0.5000, -1.0000,  0.0000]])
    """
    m = as_bool(response_mask)
    adv = torch.where(m, at_least_fp32(ref_logprobs) - at_least_fp32(logprobs), torch.zeros((), dtype=torch.float32))
    return adv, adv
