"""KL divergence to the reference policy: per-token estimators, coefficient controllers, and the two
ways to use them (as a reward penalty, or as a loss term).

Tokens are sampled from the policy p, so ``KL(p || p_ref)`` is estimated per token from
``log r`` with ``r = p_ref / p`` (Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html):

- ``k1 = -log r = logp - logp_ref``: unbiased, high variance, can be negative (alias ``"kl"``);
- ``abs = |k1|``;
- ``k2 = 0.5 (log r)^2`` (alias ``"mse"``): biased, low variance, >= 0; its gradient is that of the KL;
- ``k3 = (r - 1) - log r``: unbiased and >= 0, low variance;
- ``low_var_kl``: k3 with log r clamped to [-20, 20] and the result to [-10, 10], as verl does.
"""

from __future__ import annotations

import torch

from rlkit.algos.losses import aggregate
from rlkit.algos.masked import as_bool, at_least_fp32, check_shapes, last_token_rewards, masked_mean

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference); see the module docstring for each ``kind``.

    >>> import torch
    >>> lp, ref = torch.log(torch.tensor([0.5, 0.5])), torch.log(torch.tensor([0.25, 0.75]))
    >>> kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "k3")
    (tensor([ 0.6931, -0.4055]), tensor([0.1931, 0.0945]))
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
                         f"must have the same shape")
    log_r = at_least_fp32(ref_logprobs) - at_least_fp32(logprobs)       # log(p_ref / p)
    if kind in ("k1", "kl"):
        return -log_r
    if kind == "abs":
        return log_r.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.expm1(log_r) - log_r                                 # expm1: exact near r = 1
    if kind == "low_var_kl":
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.expm1(log_r) - log_r).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator kind={kind!r}; use one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing (same interface as the adaptive one).

    >>> FixedKLController(0.05).value
    0.05
    """

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"coef={coef} must be >= 0 (0 turns the KL penalty off)")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

    After each batch: ``e = clip(KL / target - 1, -0.2, 0.2)``, ``coef *= 1 + e * n_steps / horizon``:
    the coefficient grows while the policy drifts further than ``target`` nats and shrinks when it
    stays closer, by at most 20% per ``horizon`` samples.

    >>> ctl = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    >>> ctl.update(current_kl=9.0, n_steps=256); round(ctl.value, 6)
    0.201024
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController(init_coef={init_coef}, target={target}, horizon={horizon}): "
                             f"need init_coef >= 0, target > 0, horizon > 0 (e.g. 0.2, 6.0, 10000)")
        self.value, self.target, self.horizon = float(init_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


@torch.no_grad()
def apply_kl_penalty(token_rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     mask: torch.Tensor, coef: float | FixedKLController | AdaptiveKLController,
                     kind: str = "k1") -> tuple[torch.Tensor, float]:
    """KL in the reward (Ziegler et al. 2019; InstructGPT): ``r_t - coef * kl_t`` on every real token.

    ``token_rewards`` is [batch, T], or one score per sequence [batch] placed on its last real token.
    ``coef`` is a number or a controller (its ``.value`` is used; call ``ctl.update(kl_mean, batch)``
    afterwards, this function stays pure). Returns the new rewards (0 on padding) and ``kl_mean``:
    the per-sequence token-mean KL averaged over sequences (verl's ``actor/reward_kl_penalty``).

    >>> import torch
    >>> r, kl = apply_kl_penalty(torch.tensor([1.0]), torch.tensor([[-1.0, -2.0]]),
    ...                          torch.tensor([[-1.5, -2.0]]), torch.ones(1, 2), coef=0.1)
    >>> r, kl
    (tensor([[-0.0500,  1.0000]]), 0.25)
    """
    m = as_bool(mask)
    check_shapes(m, logprobs=logprobs, ref_logprobs=ref_logprobs)
    beta = coef.value if hasattr(coef, "value") else float(coef)
    rewards = at_least_fp32(token_rewards)
    rewards = last_token_rewards(rewards, m) if rewards.dim() == 1 else rewards
    check_shapes(m, token_rewards=rewards)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    kl = torch.where(m, kl_penalty(logprobs, ref_logprobs, kind).to(rewards.dtype), zero)
    new = torch.where(m, rewards - beta * kl, zero)
    per_seq = masked_mean(kl, m, dim=-1)
    kl_mean = masked_mean(per_seq, m.any(-1)).item()
    return new, kl_mean


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "low_var_kl",
            agg: str = "token-mean") -> torch.Tensor:
    """KL as a loss term (GRPO, Shao et al. 2024): ``aggregate(kl_penalty(logprobs, ref), mask, agg)``.

    Multiply by a coefficient (e.g. 0.001) and add to the policy loss; the gradient reaches
    ``logprobs`` only. GRPO uses k3 (``"low_var_kl"`` is k3 with verl's safety clamps).

    >>> import torch
    >>> round(kl_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)).item(), 6)
    0.0
    """
    m = as_bool(mask)
    check_shapes(m, logprobs=logprobs, ref_logprobs=ref_logprobs)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = torch.where(m, at_least_fp32(logprobs), zero)                 # padding: no NaN into the gradient
    ref = torch.where(m, at_least_fp32(ref_logprobs).detach(), zero)
    return aggregate(kl_penalty(lp, ref, kind), m, agg)
