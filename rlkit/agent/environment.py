"""Environments: a stateful object per episode, for tasks where what the model sees next depends on what
it did (a game, a user simulator, a sandbox).

The interface is OpenEnv's ``reset`` / ``step`` in chat form, made by a factory per episode as TRL's
``environment_factory`` (one instance per rollout, so episodes never share state)::

    class Guess:                                   # Trainer(environment=Guess, ...): Guess() per episode
        def reset(self, row):                      # the dataset row -> the opening messages
            self.secret = int(row["secret"])
            return [{"role": "user", "content": "Guess my number (1-9)."}]
        def step(self, message):                   # the assistant's message -> what comes next
            guess = message["content"].strip()
            if guess == str(self.secret):
                return EnvStep([], done=True, reward=1.0)
            return EnvStep([{"role": "user", "content": "higher" if int(guess) < self.secret else "lower"}])

``reset`` is called once in the driver for each row (its messages are the row's prompt, which fixes the
prompt's length) and again on the worker at the start of each episode: it must give the same messages
for the same row (put randomness in the row). ``step`` may return an ``EnvStep`` or a tuple
``(messages, done, reward)``; a reward (summed over the episode's steps) is added to the reward functions'
score. An assistant message that calls a tool goes to the tools, not to ``step``.

>>> check_environment(Guess)                                 # doctest: +SKIP
>>> EnvStep([{"role": "user", "content": "lower"}]).done
False
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import TrainerError


@dataclass
class EnvStep:
    """What an environment's ``step`` gives back: the next ``messages`` (user or tool turns), whether the
    episode is ``done``, and an optional ``reward`` for this step."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: float | None = None

    @classmethod
    def of(cls, value: Any) -> EnvStep:
        """An ``EnvStep`` from what ``step`` returned (an ``EnvStep`` or ``(messages, done[, reward])``)."""
        if isinstance(value, EnvStep):
            return value
        if isinstance(value, tuple) and len(value) in (2, 3):
            return cls(list(value[0] or []), bool(value[1]), None if len(value) == 2 else value[2])
        raise TypeError(f"an environment's step returned {type(value).__name__}; return EnvStep(messages, done, "
                        f"reward) or a tuple (messages, done, reward)")


def check_environment(environment: Any) -> None:
    """In the driver: ``environment`` is a factory (a class, or a function of no arguments) whose instances
    have ``reset(row)`` and ``step(message)``. Raises ``TrainerError`` naming what is missing."""
    if environment is None:
        return
    if not callable(environment):
        raise TrainerError(f"environment={environment!r} must be a class or factory that makes one environment per "
                           f"episode (Trainer(environment=MyEnv)), not an instance")
    target = environment if inspect.isclass(environment) else None
    if target is None:
        try:
            target = type(environment())
        except Exception as e:
            raise TrainerError(f"environment factory {getattr(environment, '__name__', environment)!r} raised "
                               f"{type(e).__name__}: {e} when called with no arguments; it must make an environment "
                               f"per episode") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(target, m, None))]
    if missing:
        raise TrainerError(f"environment {target.__name__} has no {' and no '.join(f'{m}()' for m in missing)}: an "
                           f"environment defines reset(self, row) -> opening messages and step(self, message) -> "
                           f"EnvStep(messages, done, reward) (rlkit.agent.environment)")
    for m in ("reset", "step"):
        try:
            params = [p for p in inspect.signature(getattr(target, m)).parameters.values() if p.name != "self"]
        except (TypeError, ValueError):
            continue
        if not params:
            arg = "row" if m == "reset" else "message"
            raise TrainerError(f"{target.__name__}.{m} takes no argument; define {m}(self, {arg})")


__all__ = ["EnvStep", "check_environment"]
