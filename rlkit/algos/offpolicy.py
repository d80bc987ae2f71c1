"""Off-policy correction: importance weights between the policy that sampled (the rollout engine, the
*behaviour* policy mu) and the policy the update starts from (the trainer's recompute, pi_old).

The two differ when the engine lags the trainer (asynchronous RL: samples a policy version or more old) and
when the engine computes differently (a bf16 engine feeding an fp32 trainer, other kernels). PPO's ratio
pi_theta / pi_old corrects nothing of that; the importance weight ``w = pi_old / mu`` per token does, and
multiplies each token's policy-gradient loss (verl's rollout correction, TRL's
``vllm_importance_sampling_correction``, slime's TIS/MIS):

* **TIS** (truncated importance sampling): ``w = min(pi_old / mu, cap)``: the weight is bounded, so a token
  the engine found unlikely cannot blow up the update.
* **MIS** (masked importance sampling): ``w = pi_old / mu`` where it is at most ``cap``, else 0: tokens whose
  mismatch is too large carry no policy-gradient loss at all.

``level="sequence"`` uses one weight per sample, the product of its tokens' ratios (exp of the summed log
ratio), truncated or masked as a whole. The weights are constants (no gradient). A policy loss that is
positively homogeneous in the advantage (vanilla PG, PPO's clipped surrogate, dual-clip) weighted per token
equals the same loss on ``w * advantages``, which is how the Trainer applies it.

>>> old = torch.log(torch.tensor([[0.5, 0.2, 0.9]])); mu = torch.log(torch.tensor([[0.5, 0.05, 0.3]]))
>>> w, m = importance_weights(old, mu, torch.ones(1, 3), mode="tis", cap=2.0)
>>> [round(x, 4) for x in w[0].tolist()], round(m["offpolicy/truncated_frac"], 4)
([1.0, 2.0, 2.0], 0.6667)
>>> importance_weights(old, mu, torch.ones(1, 3), mode="mis", cap=2.0)[0].tolist()
[[1.0, 0.0, 0.0]]
"""

from __future__ import annotations

import torch

MODES = ("tis", "mis")
LEVELS = ("token", "sequence")


def importance_weights(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "tis", cap: float = 2.0, level: str = "token"
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights ``[B, R]`` (0 off the mask) and the step's mismatch metrics (``mismatch_metrics``
    plus ``offpolicy/truncated_frac``: the share of weighted tokens whose ratio exceeded ``cap``).

    ``old_logprobs``: the trainer's log-probs of the sampled tokens before the update (pi_old);
    ``behaviour_logprobs``: the engine's (mu), both ``[B, R]``; ``mask``: 1 for tokens that carry loss."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {list(MODES)}")
    if level not in LEVELS:
        raise ValueError(f"level={level!r}: choose one of {list(LEVELS)}")
    if not cap > 0:
        raise ValueError(f"cap={cap} must be > 0 (e.g. 2.0)")
    m = mask.float()
    log_ratio = (old_logprobs - behaviour_logprobs).float() * m
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(m)
    ratio = torch.exp(log_ratio.clamp(max=50.0))  # exp(50) is far past any cap: no overflow to inf
    over = (ratio > cap) & m.bool()
    weights = ratio.clamp(max=cap) if mode == "tis" else torch.where(over, torch.zeros_like(ratio), ratio)
    metrics = mismatch_metrics(old_logprobs, behaviour_logprobs, mask)
    n = m.sum().clamp(min=1)
    metrics["offpolicy/truncated_frac"] = float(over.float().sum() / n)
    metrics["offpolicy/weight_mean"] = float((weights * m).sum() / n)
    return (weights * m).detach(), metrics


def mismatch_metrics(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's over the masked tokens: the KL(mu || pi_old)
    estimate ``k3`` (Schulman's low-variance estimator, >= 0), the largest ``|delta log p|``, and the ratio
    ``pi_old / mu``'s mean and max.

    >>> lp = torch.tensor([[-1.0, -2.0]])
    >>> mismatch_metrics(lp, lp, torch.ones(1, 2))["offpolicy/kl"]
    0.0
    """
    m = mask.bool()
    if not m.any():
        return {"offpolicy/kl": 0.0, "offpolicy/max_abs_dlogp": 0.0, "offpolicy/ratio_mean": 1.0,
                "offpolicy/ratio_max": 1.0}
    d = (old_logprobs - behaviour_logprobs).float()[m]
    ratio = torch.exp(d.clamp(max=50.0))
    k3 = ratio - 1 - d  # E_mu[pi/mu - 1 - log(pi/mu)] = KL(mu || pi)
    return {"offpolicy/kl": float(k3.mean()), "offpolicy/max_abs_dlogp": float(d.abs().max()),
            "offpolicy/ratio_mean": float(ratio.mean()), "offpolicy/ratio_max": float(ratio.max())}


__all__ = ["LEVELS", "MODES", "importance_weights", "mismatch_metrics"]
