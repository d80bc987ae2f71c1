"""Which dataset rows each generation round takes: the epoch order, or a curriculum that follows pass rates.

The trainer asks its sampler for round ``rnd``'s ``k`` row indices (``choose``), tells it each trained sample's
reward (``observe``), logs its ``metrics()`` in the step's row, and saves its ``state_dict()`` in checkpoints,
so a resumed run chooses as the uninterrupted one would. ``Trainer(sampler=...)`` takes one; a sampler of your
own subclasses ``PromptSampler`` and overrides ``choose`` (and ``observe`` / the state, if it keeps any).

- ``EpochSampler`` (the default): every row once per epoch, in a seeded order per epoch.
- ``CurriculumSampler``: online difficulty filtering (as prime-rl's, and DAPO's dynamic sampling before the
  generation rather than after). Each row's pass rate ``p`` over its last ``window`` samples (a sample passes
  when its reward is at least ``threshold``) weighs it by ``4 p (1 - p)``: 1 for a row solved half of the
  time, 0 for one always or never solved, where GRPO's group advantage is 0 and the samples teach nothing.
  Rows not seen yet weigh 1, and every row at least ``explore``, so a row written off is tried again now and
  then. ``k`` distinct rows are drawn by those weights (Efraimidis-Spirakis keys from a seeded RNG per round).
  Its metrics: the share of the chosen rows in each pass-rate bin (``curriculum/unseen``, ``never`` for p = 0,
  ``hard`` for p < 0.5, ``easy`` for p >= 0.5, ``always`` for p = 1) and their mean pass rate.

>>> s = CurriculumSampler(window=4)
>>> s.observe([0, 0, 1, 1, 2, 2], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])    # row 0 always, 1 half, 2 never solved
>>> [round(s.weight(r), 2) for r in range(4)]                          # row 3: not seen yet
[0.05, 1.0, 0.05, 1.0]
>>> sorted(s.choose(rnd=0, k=2, n=4, seed=0))
[1, 3]
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any


class PromptSampler:
    """Which rows round ``rnd`` takes (override ``choose``); the default learns nothing from rewards.

    >>> class Firsts(PromptSampler):
    ...     def choose(self, rnd, k, n, seed):
    ...         return [(rnd * k + i) % n for i in range(k)]
    >>> Firsts().choose(rnd=1, k=2, n=3, seed=0)
    [2, 0]
    """

    def choose(self, rnd: int, k: int, n: int, seed: int) -> list[int]:
        """Round ``rnd``'s ``k`` row indices out of ``n`` rows (the trainer asks once per round, in order)."""
        raise NotImplementedError(f"{type(self).__name__}.choose(rnd, k, n, seed) -> list of k row indices < n")

    def observe(self, rows: Sequence[int], rewards: Sequence[float]) -> None:
        """The rewards of a trained step's samples, each with its row index (NaN: no reward)."""

    def metrics(self) -> dict[str, float]:
        """What the step's metrics row logs about the last choice (prefix it: ``curriculum/...``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything ``choose`` depends on beyond its arguments (JSON-able): saved in checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s state (``Trainer.load``)."""


class EpochSampler(PromptSampler):
    """Every row once per epoch, in a seeded order that changes per epoch (the trainer's default).

    >>> EpochSampler().choose(rnd=0, k=3, n=5, seed=0) == EpochSampler().choose(rnd=0, k=3, n=5, seed=0)
    True
    """

    def choose(self, rnd: int, k: int, n: int, seed: int) -> list[int]:
        from rlkit.inputs import epoch_order

        out = []
        for i in range(rnd * k, rnd * k + k):
            epoch, pos = divmod(i, n)
            out.append(epoch_order(n, seed, epoch)[pos])
        return out


class CurriculumSampler(PromptSampler):
    """Prefer rows solved some of the time (see the module docstring).

    >>> CurriculumSampler(window=0)
    Traceback (most recent call last):
    ...
    ValueError: window=0 must be a whole number of samples >= 1 (each row's pass rate is over its last window samples), e.g. window=8
    """

    def __init__(self, window: int = 8, threshold: float = 1.0, explore: float = 0.05):
        if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
            raise ValueError(f"window={window!r} must be a whole number of samples >= 1 (each row's pass rate is over "
                             f"its last window samples), e.g. window=8")
        if not 0 < explore <= 1:
            raise ValueError(f"explore={explore!r} must be in (0, 1]: the least weight a row keeps (0 would never try "
                             f"a solved or unsolved row again), e.g. explore=0.05")
        self.window, self.threshold, self.explore = window, float(threshold), float(explore)
        self.history: dict[int, deque[bool]] = {}
        self.chosen: dict[str, float] = {}   # the last choice's pass-rate bins, for metrics()

    def pass_rate(self, row: int) -> float | None:
        """The row's share of passing samples over its last ``window`` (None: not seen yet)."""
        seen = self.history.get(row)
        return sum(seen) / len(seen) if seen else None

    def weight(self, row: int) -> float:
        p = self.pass_rate(row)
        return 1.0 if p is None else max(4 * p * (1 - p), self.explore)

    def choose(self, rnd: int, k: int, n: int, seed: int) -> list[int]:
        rng = random.Random(f"curriculum/{seed}/{rnd}")
        keys = sorted(((rng.random() ** (1 / self.weight(r)), r) for r in range(n)), reverse=True)
        rows = [r for _, r in keys[:k]]
        while len(rows) < k:  # fewer rows than a round takes: repeat the preferred ones
            rows.append(rows[len(rows) % n])
        self.chosen = self._bins(rows)
        return rows

    def observe(self, rows: Sequence[int], rewards: Sequence[float]) -> None:
        for row, reward in zip(rows, rewards):
            if reward == reward:  # not NaN
                self.history.setdefault(int(row), deque(maxlen=self.window)).append(reward >= self.threshold)

    def _bins(self, rows: list[int]) -> dict[str, float]:
        """The chosen rows' shares by pass rate when chosen, their mean pass rate, and the rows seen so far."""
        rates = [self.pass_rate(r) for r in rows]
        seen = [p for p in rates if p is not None]
        bins = {"unseen": len(rates) - len(seen), "never": sum(p == 0 for p in seen),
                "hard": sum(0 < p < 0.5 for p in seen), "easy": sum(0.5 <= p < 1 for p in seen),
                "always": sum(p == 1 for p in seen)}
        out = {f"curriculum/{b}": c / max(len(rates), 1) for b, c in bins.items()}
        out["curriculum/pass_rate_mean"] = sum(seen) / len(seen) if seen else float("nan")
        out["curriculum/rows_seen"] = float(len(self.history))
        return out

    def metrics(self) -> dict[str, float]:
        return dict(self.chosen)

    def state_dict(self) -> dict[str, Any]:
        return {"history": {str(r): list(v) for r, v in self.history.items()}, "chosen": dict(self.chosen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {int(r): deque(v, maxlen=self.window) for r, v in state["history"].items()}
        self.chosen = dict(state["chosen"])


__all__ = ["CurriculumSampler", "EpochSampler", "PromptSampler"]
