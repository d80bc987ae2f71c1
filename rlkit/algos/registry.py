"""The names a user picks an algorithm by: advantage estimators, policy losses, and the algorithms made of them.

Everything the trainer needs to know about an algorithm lives here, so an estimator or loss a user
registers in a notebook cell trains through ``rlkit.Trainer(algorithm=...)`` like a built-in one:

* an **advantage estimator** takes the rewards first and ``response_mask`` by name, plus any of
  ``values`` (a critic's), ``group_ids`` (which prompt each sample answers), ``ref_logprobs`` (the
  reference model's) and ``logprobs`` (the sampling policy's); it returns ``(advantages, returns)``.
  What it takes is what it needs: ``values`` without a default needs a critic, ``group_ids`` needs
  ``Rollout(n >= 2)`` (a group baseline), ``ref_logprobs`` a reference model. Override with the
  ``needs_*`` arguments of ``register_advantage``;
* a **policy loss** takes ``(logprobs, old_logprobs, advantages, response_mask)`` and any of the update's
  settings by keyword (``clip_low``, ``clip_high``, ``dual_clip``, ``agg``) and returns
  ``(loss, metrics)``; it runs on the workers (sent by value, so a notebook function works on Ray);
* an **algorithm** is a name for an estimator and a policy loss. An estimator's own name is an algorithm
  too: ``Trainer(algorithm="my-estimator")`` trains it with the PPO clipped loss.

>>> import torch
>>> @register_advantage("sign")
... def sign(scores, response_mask):
...     adv = torch.sign(scores)[:, None] * response_mask
...     return adv, adv
>>> algo = get_algorithm("sign")
>>> algo.advantage, algo.policy_loss, algo.needs_critic, algo.min_samples
('sign', 'ppo', False, 1)
>>> get_algorithm("grpo").min_samples, get_algorithm("ppo").needs_critic
(2, True)
>>> _ = ADVANTAGES.pop("sign"), NEEDS.pop("sign")
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Advantage = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class Needs:
    """What an estimator needs from the dataflow: a critic's values, ``min_samples`` per prompt, a
    reference model's log-probs."""

    critic: bool = False
    min_samples: int = 1
    reference: bool = False

    def passes(self, *, kl_coef: float = 0.0, kl_in_reward: bool = False, epochs: int = 1, minibatches: int = 1,
               offpolicy_correction: str | None = None, fused_offpolicy: bool = False) -> Passes:
        """The scoring passes a step runs between ``generate`` and ``update`` for this estimator under the
        config's knobs (``TrainerConfig.passes``): decided here, once per run, and nowhere else.

        >>> Needs(critic=True).passes(epochs=2)
        Passes(reference=False, values=True, old_logprobs=True, kl_old_logprobs=False, fused_offpolicy=False)
        >>> Needs().passes(kl_coef=0.1, kl_in_reward=True).kl_old_logprobs
        True
        """
        # pi_old: its own pass when the update takes several optimizer steps on the batch (the ratio is no
        # longer 1 after the first), or for an off-policy correction the update cannot take on its first forward
        old = epochs > 1 or minibatches > 1 or (offpolicy_correction is not None and not fused_offpolicy)
        return Passes(reference=kl_coef > 0 or self.reference, values=self.critic, old_logprobs=old,
                      kl_old_logprobs=kl_coef > 0 and kl_in_reward and not old, fused_offpolicy=fused_offpolicy)


@dataclass(frozen=True)
class Passes:
    """What a step computes between ``generate`` and ``update`` (``Needs.passes``)."""

    reference: bool = False        # the reference model's log-probs (a KL, or an estimator that needs them)
    values: bool = False           # the critic's values
    old_logprobs: bool = False     # pi_old, scored before the update (kept in the batch for every minibatch)
    kl_old_logprobs: bool = False  # pi_old for the KL penalty in the reward alone (when old_logprobs is off)
    fused_offpolicy: bool = False  # the off-policy correction inside the update, on its own first forward


ADVANTAGES: dict[str, Advantage] = {}     # name -> estimator; add yours with @register_advantage("name")
NEEDS: dict[str, Needs] = {}              # name -> what the estimator needs
POLICY_LOSSES: dict[str, PolicyLoss] = {}  # name -> loss; add yours with @register_policy_loss("name")
ALGORITHMS: dict[str, Algorithm] = {}     # name -> (estimator, loss); add with register_algorithm


def _register(table: dict[str, Any], kind: str, names: tuple[str, ...], fn: Any, override: bool) -> None:
    """Put ``fn`` under ``names``; a name taken by another function is an error unless ``override``
    (the same function defined again, a re-run notebook cell, replaces the old one quietly)."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"register_{kind} needs one or more non-empty names, got {names!r}")
    for name in names:
        old = table.get(name)
        same = old is not None and (getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == (
            getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
        if old is not None and not same and not override:
            raise ValueError(f"{kind.replace('_', ' ')} {name!r} is already registered "
                             f"({getattr(old, '__qualname__', old)!s}); pick another name or pass override=True")
    for name in names:
        table[name] = fn


def _needs_of(fn: Advantage) -> Needs:
    params = inspect.signature(fn).parameters
    values = params.get("values")
    return Needs(critic=values is not None and values.default is inspect.Parameter.empty,
                 min_samples=2 if "group_ids" in params else 1,
                 reference="ref_logprobs" in params)


def register_advantage(*names: str, override: bool = False, needs_critic: bool | None = None,
                       min_samples: int | None = None,
                       needs_reference: bool | None = None) -> Callable[[Advantage], Advantage]:
    """Decorator: make an estimator available under one or more names (see the module docstring).

    What it needs is read from its parameters; ``needs_critic``, ``min_samples`` (samples per prompt)
    and ``needs_reference`` override that.

    >>> import torch
    >>> @register_advantage("centered", min_samples=1)
    ... def centered(scores, response_mask, group_ids=None):
    ...     return (scores - scores.mean())[:, None] * response_mask, scores[:, None] * response_mask
    >>> NEEDS["centered"]
    Needs(critic=False, min_samples=1, reference=False)
    >>> _ = ADVANTAGES.pop("centered"), NEEDS.pop("centered")
    """
    def decorate(fn: Advantage) -> Advantage:
        _register(ADVANTAGES, "advantage_estimator", names, fn, override)
        found = _needs_of(fn)
        needs = Needs(critic=found.critic if needs_critic is None else bool(needs_critic),
                      min_samples=found.min_samples if min_samples is None else int(min_samples),
                      reference=found.reference if needs_reference is None else bool(needs_reference))
        for name in names:
            NEEDS[name] = needs
        return fn

    return decorate


def _lookup(table: dict[str, Any], name: str, what: str, register: str) -> Any:
    """``table[name]``, or a ValueError listing the known names and how to add one."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}. Add your own with "
                         f"@rlkit.algos.{register}({name!r})") from None


def get_advantage(name: str) -> Advantage:
    """The estimator registered under ``name``.

    >>> get_advantage("grpo").__name__
    'grpo'
    """
    return _lookup(ADVANTAGES, name, "advantage estimator", "register_advantage")


def compute_advantages(name: str, rewards: torch.Tensor, response_mask: torch.Tensor, *,
                       values: torch.Tensor | None = None, group_ids: Sequence[Any] | torch.Tensor | None = None,
                       ref_logprobs: torch.Tensor | None = None, logprobs: torch.Tensor | None = None,
                       **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Call estimator ``name`` with what it takes, from one uniform call (what a trainer uses).

    ``values``, ``group_ids``, ``ref_logprobs`` and ``logprobs`` are passed only to estimators that take
    them; an estimator that needs one that is missing gets a clear error instead of a TypeError.

    >>> import torch
    >>> adv, ret = compute_advantages("rloo", torch.tensor([1., 0.]), torch.ones(2, 2), group_ids=[0, 0])
    >>> adv
    tensor([[ 1.,  1.],
            [-1., -1.]])
    """
    fn = get_advantage(name)
    params = inspect.signature(fn).parameters
    kwargs = dict(options)
    hints = {"values": "a critic's values", "group_ids": "which prompt each sample answers",
             "ref_logprobs": "a reference model's log-probs", "logprobs": "the sampling policy's log-probs"}
    for key, val in (("values", values), ("group_ids", group_ids), ("ref_logprobs", ref_logprobs),
                     ("logprobs", logprobs)):
        if key in params:
            if val is None and params[key].default is inspect.Parameter.empty:
                raise ValueError(f"advantage estimator {name!r} needs {key}= ({hints[key]}); "
                                 f"critic-free choices: grpo, drgrpo, rloo, reinforce_pp")
            if val is not None:
                kwargs[key] = val
    return fn(rewards, response_mask=response_mask, **kwargs)


def estimator_options(name: str, **candidates: Any) -> dict[str, Any]:
    """The ``candidates`` (e.g. ``gamma=``, ``lam=`` from a trainer's config) that estimator ``name`` takes.

    >>> estimator_options("gae", gamma=0.9, lam=0.95), estimator_options("grpo", gamma=0.9)
    ({'gamma': 0.9, 'lam': 0.95}, {})
    """
    params = inspect.signature(get_advantage(name)).parameters
    return {k: v for k, v in candidates.items() if k in params}


def register_policy_loss(*names: str, override: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make a policy loss available under one or more names (see the module docstring).

    >>> import torch
    >>> @register_policy_loss("vanilla-pg")
    ... def vanilla_pg(logprobs, old_logprobs, advantages, response_mask):
    ...     m = response_mask.bool()
    ...     return -(logprobs * advantages)[m].mean(), {}
    >>> get_policy_loss("vanilla-pg") is vanilla_pg
    True
    >>> _ = POLICY_LOSSES.pop("vanilla-pg")
    """
    def decorate(fn: PolicyLoss) -> PolicyLoss:
        _register(POLICY_LOSSES, "policy_loss", names, fn, override)
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under ``name``.

    >>> get_policy_loss("ppo").__name__
    'policy_loss'
    """
    return _lookup(POLICY_LOSSES, name, "policy loss", "register_policy_loss")


def call_policy_loss(fn: PolicyLoss, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     advantages: torch.Tensor, response_mask: torch.Tensor,
                     **settings: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """``fn(logprobs, old_logprobs, advantages, response_mask, ...)`` with the ``settings`` it takes.

    >>> import torch
    >>> loss, m = call_policy_loss(get_policy_loss("ppo"), torch.zeros(1, 2), torch.zeros(1, 2),
    ...                            torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, not_taken=1)
    >>> loss.item(), m["clipfrac"]
    (-1.0, 0.0)
    """
    takes = _keywords(fn)
    kwargs = {k: v for k, v in settings.items() if takes is None or k in takes}
    return fn(logprobs, old_logprobs, advantages, response_mask, **kwargs)


# The update's settings every policy loss is offered by keyword (UpdateSettings): loss_options cannot set them.
SETTINGS = ("clip_low", "clip_high", "dual_clip", "agg")


def check_loss_options(fn: PolicyLoss, name: str, options: dict[str, Any], **settings: Any) -> None:
    """A ValueError, raised before any worker starts, for ``loss_options`` the policy loss ``name`` cannot take:
    a keyword it has no parameter for, one of the update's own ``SETTINGS``, or a value it rejects (it is called
    once on a 1 x 2 batch of zeros with ``options`` and ``settings``).

    >>> check_loss_options(get_policy_loss("ppo"), "ppo", {"tau": 1.0})
    Traceback (most recent call last):
    ...
    ValueError: loss_options: the policy loss 'ppo' takes no 'tau'; it takes: norm
    """
    takes = _keywords(fn)
    own = sorted(set(takes or ()) - {*SETTINGS, *list(inspect.signature(fn).parameters)[:4]})
    for key in options:
        if key in SETTINGS:
            field = "loss_agg" if key == "agg" else key
            raise ValueError(f"loss_options sets {key!r}, which is the trainer's own setting: pass {field}=... "
                             f"to the Trainer (or TrainerConfig) instead")
        if takes is not None and key not in takes:
            raise ValueError(f"loss_options: the policy loss {name!r} takes no {key!r}; it takes: "
                             f"{', '.join(own) or 'no options'}")
    if options:
        zeros = torch.zeros(1, 2)
        call_policy_loss(fn, zeros, zeros, zeros, torch.ones(1, 2), **settings, **options)


@functools.lru_cache(maxsize=64)
def _keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The parameter names ``fn`` takes (None: it takes any keyword); read once per function, since a
    loss is called for every micro-batch."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


@dataclass(frozen=True)
class Algorithm:
    """An RL algorithm as the trainer runs it: an advantage estimator and a policy loss, by name.

    >>> Algorithm("grpo", advantage="grpo").needs
    Needs(critic=False, min_samples=2, reference=False)
    """

    name: str
    advantage: str
    policy_loss: str = "ppo"

    @property
    def needs(self) -> Needs:
        get_advantage(self.advantage)  # a clear error for an estimator that is not registered
        return NEEDS.get(self.advantage, Needs())

    @property
    def needs_critic(self) -> bool:
        return self.needs.critic

    @property
    def min_samples(self) -> int:
        return self.needs.min_samples

    @property
    def needs_reference(self) -> bool:
        return self.needs.reference


def register_algorithm(name: str, *, advantage: str, policy_loss: str = "ppo",
                       override: bool = False) -> Algorithm:
    """Name an (estimator, policy loss) pair; ``Trainer(algorithm=name)`` then trains it.

    >>> algo = register_algorithm("grpo-again", advantage="grpo")
    >>> get_algorithm("grpo-again") is algo
    True
    >>> _ = ALGORITHMS.pop("grpo-again")
    """
    get_advantage(advantage)
    get_policy_loss(policy_loss)
    algo = Algorithm(name, advantage, policy_loss)
    if name in ALGORITHMS and ALGORITHMS[name] != algo and not override:
        raise ValueError(f"algorithm {name!r} is already registered ({ALGORITHMS[name]}); pick another name or "
                         f"pass override=True")
    ALGORITHMS[name] = algo
    return algo


def get_algorithm(name: str) -> Algorithm:
    """The algorithm ``name``: a registered algorithm, or an estimator's name (with the PPO loss).

    >>> get_algorithm("reinforce++").advantage
    'reinforce_pp'
    """
    if isinstance(name, str) and name in ALGORITHMS:
        return ALGORITHMS[name]
    if isinstance(name, str) and name in ADVANTAGES:
        return Algorithm(name, advantage=name)
    raise ValueError(f"algorithm={name!r} is not known; choose one of {sorted(ALGORITHMS)}, or an advantage "
                     f"estimator ({', '.join(sorted(ADVANTAGES))}); add your own with "
                     f"@rlkit.algos.register_advantage(...) or rlkit.algos.register_algorithm(...)")


def known_algorithms() -> list[str]:
    """Every name ``get_algorithm`` takes: the algorithms, then the estimators.

    >>> "grpo" in known_algorithms() and "gae" in known_algorithms()
    True
    """
    return sorted(ALGORITHMS) + sorted(set(ADVANTAGES) - set(ALGORITHMS))


__all__ = ["ADVANTAGES", "ALGORITHMS", "Algorithm", "NEEDS", "Needs", "POLICY_LOSSES", "Passes", "call_policy_loss",
           "check_loss_options",
           "compute_advantages", "estimator_options", "get_advantage", "get_algorithm", "get_policy_loss", "known_algorithms",
           "register_advantage", "register_algorithm", "register_policy_loss"]
