"""The reward step of the dataflow: the Trainer's ``reward=`` argument as weighted functions, and the
score of each sample of a step.

A reward function has TRL's batched signature ``f(prompts, completions, **columns) -> list[float]``
(``columns``: the dataset rows' other fields, one value per completion). ``None`` for a sample means "no
reward": the sample is kept out of the loss and counted as skipped.

>>> rewards = RewardFunctions.of([(lambda prompts, completions, **_: [len(c) for c in completions], 0.5)])
>>> rewards.score({"prompt": ["a", "b"]}, ["xy", "xyz"]).tolist()
[1.0, 1.5]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlkit.errors import RewardError, TrainerError

RewardFn = Callable[..., Any]


class RewardFunctions:
    """Weighted reward functions; ``score`` sums them per sample. Build with ``RewardFunctions.of``."""

    def __init__(self, fns: list[tuple[RewardFn, float]]):
        self.fns = fns

    @classmethod
    def of(cls, reward: Any, task: Any = None) -> RewardFunctions:
        """From the Trainer's ``reward=``: a function, a list of functions and ``(f, weight)`` pairs (a bare
        function weighs 1.0), a dict ``{f: weight}``, or None for the task's own ``reward``. Raises
        ``TrainerError`` naming what is not a reward, and its type.

        >>> len(RewardFunctions.of(lambda prompts, completions, **_: [0.0] * len(prompts)).fns)
        1
        >>> RewardFunctions.of([3])
        Traceback (most recent call last):
        ...
        rlkit.errors.TrainerError: reward entry 3 (an int) is neither a function nor an (f, weight) pair; give functions f(prompts, completions, **columns) -> list[float], e.g. reward=[correct, (short, 0.1)]
        """
        if reward is None:
            if task is None:
                raise TrainerError("no reward: pass reward=f(prompts, completions, **columns) -> list[float]")
            return cls([(task.reward, 1.0)])
        if callable(reward):
            return cls([(reward, 1.0)])
        if not isinstance(reward, (list, tuple, dict)):
            raise TrainerError(f"reward={reward!r} ({_a(reward)}) is not a reward: give f(prompts, completions, "
                               f"**columns) -> list[float], a list of functions or (f, weight) pairs, or a dict "
                               f"{{f: weight}}")
        if isinstance(reward, tuple) and len(reward) == 2 and callable(reward[0]) and not callable(reward[1]):
            reward = [reward]  # one (f, weight) pair
        entries = list(reward.items() if isinstance(reward, dict) else reward)
        if not entries:
            raise TrainerError(f"reward={reward!r} holds no reward function; give at least one f(prompts, "
                               f"completions, **columns) -> list[float]")
        fns = [(e, 1.0) if callable(e) else e for e in entries]
        bad = next((e for e, p in zip(entries, fns) if not (isinstance(p, (list, tuple)) and len(p) == 2)), None)
        if bad is not None:
            raise TrainerError(f"reward entry {bad!r} ({_a(bad)}) is neither a function nor an (f, weight) pair; "
                               f"give functions f(prompts, completions, **columns) -> list[float], e.g. "
                               f"reward=[correct, (short, 0.1)]")
        bad_fn = [f for f, _ in fns if not callable(f)]
        if bad_fn:
            raise TrainerError(f"reward {bad_fn[0]!r} is not callable ({_a(bad_fn[0])}); give f(prompts, "
                               f"completions, **columns)")
        try:
            return cls([(f, float(w)) for f, w in fns])
        except (TypeError, ValueError):
            raise TrainerError(f"reward weights must be numbers; got {[w for _, w in fns]!r}") from None

    def score(self, columns: dict[str, list[Any]], completions: list[str]) -> torch.Tensor:
        """The weighted sum of every function's rewards, one float per completion (NaN: no reward).

        ``columns`` holds ``"prompt"`` and the rows' other fields, one value per completion."""
        cols = dict(columns)
        prompts = cols.pop("prompt")
        total = torch.zeros(len(prompts), dtype=torch.float64)
        for fn, weight in self.fns:
            name = getattr(fn, "__qualname__", repr(fn))
            try:
                values = fn(prompts, completions, **cols)
            except Exception as e:
                raise RewardError(f"reward function {name} raised {type(e).__name__}: {e} (on a batch of "
                                  f"{len(prompts)} completions; first: {completions[0]!r})") from e
            if not isinstance(values, (list, tuple)) and not torch.is_tensor(values):
                raise RewardError(f"reward function {name} returned {type(values).__name__}; it must return a "
                                  f"list of floats, one per completion ({len(prompts)})")
            if len(values) != len(prompts):
                raise RewardError(f"reward function {name} returned {len(values)} values for {len(prompts)} "
                                  f"completions; return one float per completion")
            try:
                vals = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64)
            except (TypeError, ValueError) as e:
                raise RewardError(f"reward function {name} returned a non-number: {e}") from e
            total += weight * vals
        return total.float()


def _a(value: Any) -> str:
    """``value``'s type with its article, for messages: "an int", "a str"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


__all__ = ["RewardFunctions"]
