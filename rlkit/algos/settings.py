"""What one update call trains with: the settings the driver's config makes for each step and the workers'
``update_actor`` / ``update_critic`` take. They live here, beside the losses they parameterise, so the
driver's config and the workers both import them from below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlkit.algos.losses import policy_loss


@dataclass(frozen=True)
class UpdateSettings:
    """How one update call trains (the actor's; the critic reads ``epochs``, ``minibatches``,
    ``value_clip``). Made by the trainer for each step (``TrainerConfig.update_settings(step)``) and
    taken by the workers' ``update_actor`` / ``update_critic`` (``rlkit.workers.rl``).

    ``policy_loss`` is the algorithm's loss function (``rlkit.algos.registry``); it travels with the
    settings, so a loss defined in a notebook cell runs on Ray workers too.

    >>> UpdateSettings(lr=1e-5, epochs=2).minibatches
    1
    """

    lr: float
    epochs: int = 1
    minibatches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    loss_options: dict[str, Any] = field(default_factory=dict)  # the policy loss's own keywords (SAPO's tau_pos, ...)
    kl_loss_coef: float = 0.0       # KL to the reference as a loss term (0: none, e.g. KL in the reward)
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    value_clip: float | None = 0.2
    policy_loss: Callable[..., Any] = policy_loss
    # the off-policy correction taken inside the update (pi_old from its own forward): None, or
    # {"mode": "tis" | "mis", "cap": float, "level": "token" | "sequence"} (rlkit.algos.offpolicy)
    offpolicy: dict[str, Any] | None = None


__all__ = ["UpdateSettings"]
