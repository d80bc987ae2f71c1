"""Policy, value and entropy losses on [batch, response_len] tensors, with one aggregation function.

All losses are per token first (a ``loss_mat``), then reduced by :func:`aggregate`, whose mode is
the choice that distinguishes PPO/GRPO/DAPO/Dr.GRPO loss normalisations. Metrics come back as plain
floats (detached) for the step's metrics dict.
"""

from __future__ import annotations

import torch

from rlkit.algos.masked import as_bool, at_least_fp32, check_shapes, masked_mean
from rlkit.algos.registry import register_policy_loss

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [batch, T] to a scalar over the real tokens; the one place this is done.

    - ``token-mean``: sum over all real tokens / their number: every token weighs the same (DAPO,
      Yu et al. 2025, arXiv:2503.14476; verl's default).
    - ``seq-mean-token-mean``: mean over tokens within each sequence, then mean over sequences: every
      sequence weighs the same, long ones have smaller per-token weight (original GRPO).
    - ``seq-mean-token-sum``: sum over tokens within each sequence, mean over sequences.
    - ``seq-mean-token-sum-norm``: sum over tokens / a constant ``norm`` (default T, the padded
      length; pass the generation budget, e.g. max_new_tokens, to make it independent of padding),
      mean over sequences: Dr.GRPO (Liu et al. 2025, arXiv:2503.20783). verl omits the mean over
      sequences here, so its value is ``batch`` times this one.

    Sequences with no real token count in none of the seq-mean modes, so appending all-padding rows
    changes nothing; an all-padding batch gives 0.

    >>> import torch
    >>> loss, mask = torch.tensor([[1., 2., 3.], [4., 9., 9.]]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    >>> [round(aggregate(loss, mask, m).item(), 4) for m in AGG_MODES]
    [2.5, 3.0, 5.0, 1.6667]
    """
    m = as_bool(mask)
    check_shapes(m, loss_mat=loss_mat)
    if mode == "token-mean":
        return masked_mean(loss_mat, m)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; use one of {', '.join(AGG_MODES)}")
    tokens = m.sum(-1)
    seq = torch.where(m, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / tokens.clamp(min=1).to(seq.dtype)
    elif mode == "seq-mean-token-sum-norm":
        norm = m.shape[-1] if norm is None else norm
        if not norm > 0:
            raise ValueError(f"norm={norm} must be positive (the constant token count, e.g. max_new_tokens)")
        seq = seq / norm
    return masked_mean(seq, tokens > 0)


@register_policy_loss("ppo")
def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, agg: str = "token-mean",
                norm: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (Schulman et al. 2017, arXiv:1707.06347), with DAPO and dual clip.

    Per token, with ``ratio = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20] against
    overflow): ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``.
    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476, e.g. 0.28).
    ``dual_clip=c`` (c > 1, e.g. 3.0; Ye et al. 2020, arXiv:1912.09729) also bounds the loss of
    tokens with A < 0 by ``-A * c``, so a huge ratio on a bad token cannot blow up the update.
    Then reduced with :func:`aggregate` (``agg``, ``norm``).

    Gradients flow to ``logprobs`` only: old log-probs and advantages are detached here.
    Metrics: ``clipfrac`` (tokens where the clipped term is taken), ``clipfrac_lower`` (tokens capped
    by the dual clip), ``approx_kl`` (mean of old - new log-prob: k1 of KL(old || new)), ``ratio_mean``
    and ``ratio_max`` over real tokens.

    >>> import torch
    >>> lp = torch.log(torch.tensor([[0.5, 1.5, 0.5, 1.5]]))
    >>> loss, m = policy_loss(lp, torch.zeros(1, 4), torch.tensor([[1., 1., -1., -1.]]), torch.ones(1, 4))
    >>> round(loss.item(), 4), m["clipfrac"]
    (0.15, 0.5)
    """
    m = as_bool(response_mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_clip(clip_low, clip_high, dual_clip)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, m)
    adv = masked_advantages(advantages, m)
    loss_mat, metrics = clipped_surrogate(torch.exp(log_ratio), adv, m, clip_low, clip_high, dual_clip)
    metrics.update(ratio_metrics(log_ratio, m))
    return aggregate(loss_mat, m, agg, norm), metrics


def check_clip(clip_low: float, clip_high: float, dual_clip: float | None = None) -> None:
    """A ValueError naming a clip range out of bounds (``0 <= clip_low < 1``, ``clip_high >= 0``, ``dual_clip > 1``)."""
    if not (0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(f"clip_low={clip_low}, clip_high={clip_high}: need 0 <= clip_low < 1 and clip_high >= 0 "
                         f"(PPO uses 0.2 / 0.2; DAPO 0.2 / 0.28; GSPO 3e-4 / 4e-4)")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (e.g. 3.0), or None to turn it off")


def masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_old`` per token in fp32, with ``pi_old`` detached, 0 on padding (ratio 1, no NaN
    gradient) and clamped to [-20, 20] against overflow in ``exp``.

    >>> import torch
    >>> masked_log_ratio(torch.tensor([[0.5, 30., 7.]]), torch.zeros(1, 3), torch.tensor([[True, True, False]]))
    tensor([[ 0.5000, 20.0000,  0.0000]])
    """
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    log_ratio = at_least_fp32(logprobs) - at_least_fp32(old_logprobs).detach()
    return torch.where(m, log_ratio, zero).clamp(-20.0, 20.0)


def masked_advantages(advantages: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The advantages in fp32, detached, 0 on padding."""
    zero = torch.zeros((), dtype=torch.float32, device=advantages.device)
    return torch.where(m, at_least_fp32(advantages).detach(), zero)


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, clip_low: float, clip_high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's pessimistic clipped objective per token, ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``,
    with the dual clip's cap ``-A c`` on tokens with A < 0; whatever the ratio ``r`` is (a token's, or a
    sequence's broadcast over its tokens). Returns the per-token loss and ``clipfrac`` / ``clipfrac_lower``
    over the real tokens.

    >>> import torch
    >>> loss_mat, m = clipped_surrogate(torch.tensor([[0.5, 1.5]]), torch.ones(1, 2), torch.ones(1, 2).bool(), 0.2, 0.2)
    >>> loss_mat, m["clipfrac"]
    (tensor([[-0.5000, -1.2000]]), 0.5)
    """
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)                  # pessimistic: the larger loss
    clipfrac = masked_mean((clipped > unclipped).float(), m)
    clipfrac_lower = torch.zeros(())
    if dual_clip is not None:
        cap = -adv * dual_clip
        capped = (adv < 0) & (loss_mat > cap)
        clipfrac_lower = masked_mean(capped.float(), m)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, cap), loss_mat)
    return loss_mat, {"clipfrac": clipfrac.item(), "clipfrac_lower": clipfrac_lower.item()}


@torch.no_grad()
def ratio_metrics(log_ratio: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """``approx_kl`` (mean of old - new log-prob: k1 of KL(old || new)), ``ratio_mean`` and ``ratio_max`` over
    the real tokens, from the per-token log-ratio."""
    ratio = torch.exp(log_ratio)
    return {"approx_kl": masked_mean(-log_ratio, m).item(), "ratio_mean": masked_mean(ratio, m).item(),
            "ratio_max": (ratio.masked_fill(~m, float("-inf")).max().item() if m.any() else 1.0)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = 0.2, agg: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    The 0.5 makes the gradient ``V - R``; the max is the pessimistic choice of PPO's reference
    implementation (OpenAI baselines ppo2; Schulman et al. 2017) and verl. ``clip=None`` gives the plain
    ``0.5 * (V - R)^2``. Gradients flow to ``values`` only. Metrics: ``vf_clipfrac`` (tokens where the
    clipped error is larger), ``vpred_mean``.

    >>> import torch
    >>> loss, m = value_loss(torch.tensor([[1.5]]), torch.tensor([[1.0]]), torch.tensor([[2.0]]), torch.ones(1, 1))
    >>> round(loss.item(), 4), m["vf_clipfrac"]
    (0.32, 1.0)
    """
    m = as_bool(mask)
    check_shapes(m, values=values, old_values=old_values, returns=returns)
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = torch.where(m, at_least_fp32(values), zero)
    old = torch.where(m, at_least_fp32(old_values).detach(), zero)
    ret = torch.where(m, at_least_fp32(returns).detach(), zero)
    err = (v - ret) ** 2
    if clip is None:
        loss_mat, clipfrac = err, torch.zeros(())
    else:
        if not clip > 0:
            raise ValueError(f"clip={clip} must be positive (PPO uses 0.2), or None for no value clipping")
        err_clipped = (torch.clamp(v, old - clip, old + clip) - ret) ** 2
        loss_mat = torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).float(), m)
    loss = 0.5 * aggregate(loss_mat, m, agg)
    return loss, {"vf_clipfrac": clipfrac.item(), "vpred_mean": masked_mean(v.detach(), m).item()}


def entropy_from_logprobs(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = -sum p log p`` over the last dim, from log-probabilities (a ``log_softmax``).

    The one entropy rlkit computes: ``rlkit.parallel.token_logprobs`` calls it on the log-softmax it
    already has for the sampled tokens' log-probs, so autograd keeps nothing more than that and its
    ``exp``. The log-probs must be finite (those of a linear head's logits are; a vocabulary masked to
    ``-inf`` would give ``0 * inf = NaN``: mask with a large negative number instead).

    >>> import torch
    >>> logits = torch.tensor([[0., 0., 0., 0.], [1e4, 0., 0., 0.], [0., 0., -1e30, 0.]])
    >>> entropy_from_logprobs(logits.log_softmax(-1)).abs()   # abs: 0 * -1e4 sums to -0.0
    tensor([1.3863, 0.0000, 1.0986])
    """
    return -(logprobs.exp() * logprobs).sum(-1)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float,
                  agg: str = "token-mean") -> torch.Tensor:
    """The loss term ``-coef * aggregate(entropy)``: add it to the loss to reward exploration (the actor's
    update does, with ``entropy_coef``).

    Negative because the optimiser minimises: lower loss = higher entropy.

    >>> import torch
    >>> entropy_bonus(torch.tensor([[1.0, 3.0, 50.0]]), torch.tensor([[1, 1, 0]]), coef=0.01)
    tensor(-0.0200)
    """
    return -coef * aggregate(entropy, mask, agg)
