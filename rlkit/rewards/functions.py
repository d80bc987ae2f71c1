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

import asyncio
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlkit.errors import RewardError, TrainerError

RewardFn = Callable[..., Any]


class RewardFunctions:
    """Weighted reward functions; ``score`` sums them per sample. Build with ``RewardFunctions.of``.

    An ``async def`` reward (one that awaits something external: a sandbox, a service) runs concurrently with
    the step's other async rewards, in an event loop of its own (a notebook's running loop is left alone), each
    bounded by ``timeout_s``: one that runs out gives no reward for that batch (its samples are skipped) and is
    counted in ``reward/timeouts``. Rewards that define ``metrics()`` (``Judge``'s failure counts) report
    through ``take_metrics``, which the trainer logs in each step's row.

    >>> import asyncio
    >>> async def slow(prompts, completions, **_):
    ...     await asyncio.sleep(10)
    ...     return [1.0] * len(completions)
    >>> rewards = RewardFunctions([(slow, 1.0)], timeout_s=0.1)
    >>> rewards.score({"prompt": ["a"]}, ["b"]).tolist(), rewards.take_metrics()
    ([nan], {'reward/timeouts': 1.0})
    """

    def __init__(self, fns: list[tuple[RewardFn, float]], timeout_s: float = 60.0):
        self.fns, self.timeout_s, self.timeouts = fns, float(timeout_s), 0

    @classmethod
    def of(cls, reward: Any, task: Any = None, timeout_s: float = 60.0) -> RewardFunctions:
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
            return cls([(task.reward, 1.0)], timeout_s)
        if callable(reward):
            return cls([(reward, 1.0)], timeout_s)
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
            return cls([(f, float(w)) for f, w in fns], timeout_s)
        except (TypeError, ValueError):
            raise TrainerError(f"reward weights must be numbers; got {[w for _, w in fns]!r}") from None

    def score(self, columns: dict[str, list[Any]], completions: list[str]) -> torch.Tensor:
        """The weighted sum of every function's rewards, one float per completion (NaN: no reward).

        ``columns`` holds ``"prompt"`` and the rows' other fields, one value per completion."""
        cols = dict(columns)
        prompts = cols.pop("prompt")
        total = torch.zeros(len(prompts), dtype=torch.float64)
        awaited = self._run_async(prompts, completions, cols)  # every async reward at once, bounded
        for i, (fn, weight) in enumerate(self.fns):
            name = getattr(fn, "__qualname__", repr(fn))
            if i in awaited:
                values = awaited[i]
                if isinstance(values, BaseException):
                    raise RewardError(f"reward function {name} raised {type(values).__name__}: {values} (on a batch "
                                      f"of {len(prompts)} completions; first: {completions[0]!r})") from values
                if values is _TIMED_OUT:   # no reward for this batch: its samples are skipped, and counted
                    self.timeouts += len(prompts)
                    values = [None] * len(prompts)
            else:
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


    def _run_async(self, prompts: list[Any], completions: list[Any], cols: dict[str, Any]) -> dict[int, Any]:
        """The async rewards' values by index (an exception, or ``_TIMED_OUT``, where they failed), run together
        in a fresh event loop on a thread of their own, each within ``timeout_s``."""
        fns = {i: fn for i, (fn, _) in enumerate(self.fns) if is_async(fn)}
        if not fns:
            return {}

        async def bounded(fn: RewardFn) -> Any:
            try:
                return await asyncio.wait_for(fn(prompts, completions, **cols), self.timeout_s)
            except TimeoutError:
                return _TIMED_OUT

        async def every() -> list[Any]:
            return await asyncio.gather(*(bounded(fn) for fn in fns.values()), return_exceptions=True)

        with ThreadPoolExecutor(1, thread_name_prefix="rlkit-async-rewards") as pool:
            return dict(zip(fns, pool.submit(asyncio.run, every()).result()))

    def take_metrics(self) -> dict[str, float]:
        """What the rewards counted since the last call (async timeouts, a reward's own ``metrics()``), then reset."""
        out = {"reward/timeouts": float(self.timeouts)} if self.timeouts else {}
        self.timeouts = 0
        for fn, _ in self.fns:
            if callable(getattr(fn, "metrics", None)):
                out.update(fn.metrics())
        return out


_TIMED_OUT = object()  # an async reward that ran out of time


def is_async(fn: Any) -> bool:
    """An ``async def`` reward (a coroutine function, or an object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _a(value: Any) -> str:
    """``value``'s type with its article, for messages: "an int", "a str"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


__all__ = ["RewardFunctions"]
