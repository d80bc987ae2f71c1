"""RL algorithms as small pure tensor functions: advantage estimators, losses, KL estimators.

Tensors are [batch, response_len] with a ``response_mask`` (1 = real response token), as in verl and
TRL. Nothing here knows about models, processes or Ray, so every piece is testable on tiny tensors.

>>> import torch
>>> from rlkit import algos
>>> mask = torch.ones(4, 3)
>>> adv, _ = algos.compute_advantages("grpo", torch.tensor([1., 0., 0., 1.]), mask, group_ids=[0, 0, 0, 0])
>>> logprobs = torch.zeros(4, 3, requires_grad=True)
>>> loss, metrics = algos.policy_loss(logprobs, torch.zeros(4, 3), adv, mask)
>>> loss.backward(); logprobs.grad.shape
torch.Size([4, 3])
"""

from rlkit.algos.advantages import drgrpo, gae, grpo, reinforce_pp, reinforce_pp_baseline, rloo
from rlkit.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_loss,
    kl_penalty,
)
from rlkit.algos.losses import (
    AGG_MODES,
    aggregate,
    entropy_bonus,
    entropy_from_logprobs,
    policy_loss,
    value_loss,
)
from rlkit.algos.masked import last_token_rewards, masked_mean, masked_sum, masked_whiten
from rlkit.algos.ratio_losses import cispo_loss, gspo_loss, gspo_token_loss, sapo_loss
from rlkit.algos.registry import (
    ADVANTAGES,
    ALGORITHMS,
    NEEDS,
    POLICY_LOSSES,
    Algorithm,
    Needs,
    Passes,
    call_policy_loss,
    check_loss_options,
    compute_advantages,
    estimator_options,
    get_advantage,
    get_algorithm,
    get_policy_loss,
    known_algorithms,
    register_advantage,
    register_algorithm,
    register_policy_loss,
)
from rlkit.algos.settings import UpdateSettings

# The built-in algorithms, by the names papers and peers use: each an estimator with the PPO clipped loss.
for _name, _estimator in (("grpo", "grpo"), ("drgrpo", "drgrpo"), ("rloo", "rloo"), ("reinforce++", "reinforce_pp"),
                          ("reinforce++-baseline", "reinforce_pp_baseline"), ("ppo", "gae")):
    register_algorithm(_name, advantage=_estimator)
# ... and the 2025 losses that reshape the ratio (rlkit.algos.ratio_losses), with the GRPO advantage.
for _name in ("gspo", "gspo-token", "cispo", "sapo"):
    register_algorithm(_name, advantage="grpo", policy_loss=_name)

__all__ = [
    "ADVANTAGES", "AGG_MODES", "ALGORITHMS", "KL_KINDS", "NEEDS", "POLICY_LOSSES", "Algorithm", "Needs", "Passes",
    "UpdateSettings",
    "register_advantage", "get_advantage", "compute_advantages", "register_policy_loss", "get_policy_loss",
    "call_policy_loss", "check_loss_options", "estimator_options", "register_algorithm", "get_algorithm", "known_algorithms",
    "gae", "grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
    "aggregate", "policy_loss", "gspo_loss", "gspo_token_loss", "cispo_loss", "sapo_loss", "value_loss", "entropy_from_logprobs", "entropy_bonus",
    "kl_penalty", "kl_loss", "apply_kl_penalty", "FixedKLController", "AdaptiveKLController",
    "masked_mean", "masked_sum", "masked_whiten", "last_token_rewards",
]
