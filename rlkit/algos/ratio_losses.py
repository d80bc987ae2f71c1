"""Policy losses that reshape PPO's importance ratio (2025): GSPO and GSPO-token, CISPO, SAPO.

Each is a registered policy loss (``rlkit.algos.registry``) and, with the GRPO advantage, an algorithm of the
same name: ``Trainer(algorithm="gspo")``. Their hyper-parameters beyond the clip range come from
``TrainerConfig(loss_options={...})``, checked in the driver. Per token first, then reduced by
:func:`rlkit.algos.aggregate` (``loss_agg``), as every rlkit loss. With one optimizer step per batch
(``epochs = minibatches = 1``) the ratio is 1 and all four give the plain policy gradient, scaled: they differ
once the policy has moved from the one that sampled (more epochs or minibatches, off-policy steps).

- **GSPO** (Zheng et al. 2025, arXiv:2507.18071): one ratio per sequence, the geometric mean of its tokens'
  ratios ``s_i = exp(mean_t log r_it)``, clipped as PPO clips a token's; the paper clips at 3e-4 / 4e-4
  (``clip_low`` / ``clip_high``). The paper averages over sequences: ``loss_agg="seq-mean-token-mean"`` is
  its formula exactly (TRL's ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``).
- **GSPO-token**: the same value, ``s_it = sg[s_i] * pi_t / sg[pi_t]``, but the gradient reaches each token on
  its own, so per-token advantages (a critic's) work; with one advantage per sequence it equals GSPO.
- **CISPO** (MiniMax-M1, arXiv:2506.13585): REINFORCE on every token, weighted by its ratio truncated above and
  detached, ``-sg(min(r, 1 + clip_high)) * A * log pi``; no token loses its gradient. There is no lower bound
  (``clip_low`` is not used), as in the paper. TRL's ``epsilon_high`` for CISPO is the cap itself (ScaleRL's
  epsilon_max, 5.0 recommended): TRL ``epsilon_high=c`` is rlkit ``clip_high=c - 1``.
- **SAPO** (Gao et al. 2025, arXiv:2511.20347): a soft gate in place of the hard clip,
  ``-A * sigmoid(tau (r - 1)) * 4 / tau``, with ``tau_pos`` for A > 0 and ``tau_neg`` otherwise (1.0 and
  1.05 in the paper). Its gradient is the policy gradient times ``4 s (1 - s) r`` (s the sigmoid): 1 at
  ``r = 1``, fading smoothly as the ratio leaves it. Metrics: ``gate_mean`` and ``gate_min`` of that weight.

>>> import torch
>>> lp = torch.log(torch.tensor([[1.2, 1.2, 1.0], [0.9, 1.0, 1.0]]))   # new - old log-probs
>>> mask, adv = torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([[1.], [-1.]]).expand(2, 3)
>>> loss, m = gspo_loss(lp, torch.zeros(2, 3), adv, mask, clip_low=0.1, clip_high=0.1)
>>> round(loss.item(), 4), m["seq_clipfrac"]   # s = 1.2 clipped to 1.1; 0.9 ** (1/3): (2 * -1.1 + 3 * 0.9655) / 5
(0.1393, 0.5)
"""

from __future__ import annotations

import torch

from rlkit.algos.losses import (
    aggregate,
    check_clip,
    clipped_surrogate,
    masked_advantages,
    masked_log_ratio,
    ratio_metrics,
)
from rlkit.algos.masked import as_bool, at_least_fp32, check_shapes, masked_mean
from rlkit.algos.registry import register_policy_loss


def sequence_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``mean_t log r_it`` over each row's real tokens, [batch, 1]
    (0 for a row without one).

    >>> import torch
    >>> sequence_log_ratio(torch.tensor([[0.2, 0.4, 9.0]]), torch.tensor([[True, True, False]]))
    tensor([[0.3000]])
    """
    return masked_mean(log_ratio, m, dim=-1)[:, None]


def _gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
          clip_low: float, clip_high: float, dual_clip: float | None, agg: str, norm: float | None,
          token_gradient: bool) -> tuple[torch.Tensor, dict[str, float]]:
    m = as_bool(response_mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    check_clip(clip_low, clip_high, dual_clip)
    log_ratio = masked_log_ratio(logprobs, old_logprobs, m)
    seq = sequence_log_ratio(log_ratio, m)                          # [B, 1]
    if token_gradient:   # value s_i, gradient through each token's own log-prob
        lp = at_least_fp32(logprobs)
        seq = seq.detach() + torch.where(m, lp - lp.detach(), torch.zeros((), dtype=lp.dtype, device=lp.device))
    ratio = torch.exp(seq.expand_as(log_ratio))
    loss_mat, metrics = clipped_surrogate(ratio, masked_advantages(advantages, m), m, clip_low, clip_high, dual_clip)
    rows = m.any(-1)
    with torch.no_grad():
        s = torch.exp(seq.detach()[:, :1].squeeze(-1))[rows]
        clipped = ((s < 1 - clip_low) | (s > 1 + clip_high)).float()
        metrics.update({
            "seq_clipfrac": clipped.mean().item() if rows.any() else 0.0,   # sequences whose ratio left the range
            "seq_ratio_mean": s.mean().item() if rows.any() else 1.0,
            "seq_ratio_max": s.max().item() if rows.any() else 1.0,
        })
    metrics.update(ratio_metrics(log_ratio, m))
    return aggregate(loss_mat, m, agg, norm), metrics


@register_policy_loss("gspo")
def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
              dual_clip: float | None = None, agg: str = "token-mean",
              norm: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO's clipped objective on the sequence ratio ``s_i = exp(mean_t (log pi - log pi_old))``.

    Every token of sequence ``i`` carries ``max(-A s_i, -A clip(s_i, 1 - clip_low, 1 + clip_high))``; the
    gradient reaches the sequence's tokens through ``s_i`` (each ``A s_i / |y_i|``, none once clipped).
    Metrics: ``seq_clipfrac`` (sequences clipped), ``seq_ratio_mean`` / ``seq_ratio_max``, ``clipfrac`` (tokens in
    clipped sequences), and the token-level ``approx_kl`` / ``ratio_*`` as PPO's loss reports them.

    >>> import torch
    >>> lp = torch.zeros(2, 2, requires_grad=True)
    >>> loss, m = gspo_loss(lp, torch.zeros(2, 2), torch.tensor([[1., 1.], [-1., -1.]]), torch.ones(2, 2))
    >>> loss.backward(); lp.grad                      # -A s_i / |y_i| / 2 sequences
    tensor([[-0.2500, -0.2500],
            [ 0.2500,  0.2500]])
    """
    return _gspo(logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg, norm,
                 token_gradient=False)


@register_policy_loss("gspo-token", "gspo_token")
def gspo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None, agg: str = "token-mean",
                    norm: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: ``s_it = sg[s_i] * pi_t / sg[pi_t]``, the value of GSPO's sequence ratio with a gradient per
    token, so each token's own advantage ``A_it`` weighs its own log-prob (``A_it s_i``, none once the sequence
    is clipped). With one advantage per sequence its value and gradient are GSPO's. Metrics as :func:`gspo_loss`.

    >>> import torch
    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = gspo_token_loss(lp, torch.zeros(1, 2), torch.tensor([[1., 3.]]), torch.ones(1, 2))
    >>> loss.backward(); lp.grad                      # -A_it s_i / |y_i|
    tensor([[-0.5000, -1.5000]])
    """
    return _gspo(logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg, norm,
                 token_gradient=True)


@register_policy_loss("cispo")
def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, clip_high: float = 0.2, agg: str = "token-mean",
               norm: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: ``-sg(min(r, 1 + clip_high)) * A * log pi`` per token (``r = pi / pi_old``).

    The truncated ratio is a detached weight on REINFORCE's ``A log pi``: a token whose ratio is large still
    gets a gradient, capped at ``(1 + clip_high) A``, rather than none as under PPO's clip. ScaleRL's
    epsilon_max = 5 is ``clip_high=4.0``. Metrics: ``clipfrac`` (tokens whose weight was
    truncated), ``weight_mean``, and the ``approx_kl`` / ``ratio_*`` of PPO's loss.

    >>> import torch
    >>> lp = torch.log(torch.tensor([[0.5, 3.0]])).requires_grad_()
    >>> loss, m = cispo_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_high=1.0)
    >>> loss.backward(); lp.grad, m["clipfrac"]       # -min(r, 2) A / 2 tokens
    (tensor([[-0.2500, -1.0000]]), 0.5)
    """
    m = as_bool(response_mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if not clip_high > 0:
        raise ValueError(f"clip_high={clip_high}: CISPO truncates the ratio at 1 + clip_high, so it must be > 0 "
                         f"(ScaleRL's epsilon_max = 5 is clip_high=4.0)")
    log_ratio = masked_log_ratio(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1 + clip_high).detach()
    lp = torch.where(m, at_least_fp32(logprobs), torch.zeros((), dtype=torch.float32, device=logprobs.device))
    loss_mat = -weight * masked_advantages(advantages, m) * lp
    with torch.no_grad():
        metrics = {"clipfrac": masked_mean((ratio > 1 + clip_high).float(), m).item(),
                   "weight_mean": masked_mean(weight, m).item(), **ratio_metrics(log_ratio, m)}
    return aggregate(loss_mat, m, agg, norm), metrics


@register_policy_loss("sapo")
def sapo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05, agg: str = "token-mean",
              norm: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: ``-A * sigmoid(tau (r - 1)) * 4 / tau`` per token, ``tau = tau_pos`` where A > 0 else ``tau_neg``.

    A smooth trust region: the gradient is the policy gradient times ``4 s (1 - s) r`` with
    ``s = sigmoid(tau (r - 1))``, which is 1 on-policy and decays as the ratio moves either way, faster for a
    larger ``tau`` (the paper's ``tau_neg > tau_pos`` damps negative-advantage tokens more). Metrics:
    ``gate_mean`` / ``gate_min`` of that weight over the real tokens, and PPO's ``approx_kl`` / ``ratio_*``.

    >>> import torch
    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = sapo_loss(lp, torch.zeros(1, 2), torch.tensor([[1., -1.]]), torch.ones(1, 2))
    >>> loss.backward(); lp.grad, m["gate_mean"]      # on-policy: the plain policy gradient, gate 1
    (tensor([[-0.5000,  0.5000]]), 1.0)
    """
    m = as_bool(response_mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not tau > 0:
            raise ValueError(f"{name}={tau}: SAPO's gate temperature must be > 0 (the paper uses tau_pos=1.0, "
                             f"tau_neg=1.05)")
    log_ratio = masked_log_ratio(logprobs, old_logprobs, m)
    ratio = torch.exp(log_ratio)
    adv = masked_advantages(advantages, m)
    tau = torch.where(adv > 0, torch.tensor(float(tau_pos)), torch.tensor(float(tau_neg)))
    gate = torch.sigmoid(tau * (ratio - 1))
    loss_mat = -adv * gate * 4 / tau
    with torch.no_grad():
        weight = 4 * gate * (1 - gate) * ratio
        metrics = {"gate_mean": masked_mean(weight, m).item(),
                   "gate_min": (weight.masked_fill(~m, float("inf")).min().item() if m.any() else 1.0),
                   **ratio_metrics(log_ratio, m)}
    return aggregate(loss_mat, m, agg, norm), metrics


__all__ = ["cispo_loss", "gspo_loss", "gspo_token_loss", "sapo_loss", "sequence_log_ratio"]
