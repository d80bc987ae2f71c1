"""Held-out scores of k samples per prompt: avg@k, pass@k and maj@k, as verl, OpenRLHF and TRL report them.

``Trainer.evaluate(k=...)`` and ``TrainerConfig(eval_every=N, eval_k=k)`` (logged as ``eval/*`` every N steps)
sample each held-out prompt k times and reduce the samples here:

- **avg@k**: the mean reward over the k samples, averaged over prompts.
- **pass@j** for j = 1, 2, 4, ... up to k (and k itself): the probability that at least one of j samples drawn
  without replacement from the k solves the prompt, by the unbiased estimator of Chen et al. 2021
  (arXiv:2107.03374, eq. 1), ``1 - C(k - c, j) / C(k, j)`` with ``c`` of the k samples correct, averaged over
  prompts. pass@1 is the share of correct samples.
- **maj@k**: majority voting (Wang et al. 2022, self-consistency): the answer most of the k samples give (ties:
  the one given first) is the prompt's answer; maj@k is the share of prompts whose voted answer is correct.

A sample is correct when its reward is at least ``threshold`` (1.0: a verifier's full marks). Its answer is
what the task reads from it (``task.answer_of``, e.g. reasoning-gym's ``<answer>`` tag), else its text, stripped.

>>> groups = [[(1.0, "4"), (0.0, "5"), (1.0, "4"), (0.0, "3")], [(0.0, "7"), (0.0, "8"), (0.0, "8"), (1.0, "9")]]
>>> scores(groups)
{'avg@4': 0.375, 'pass@1': 0.375, 'pass@2': 0.6666666666666666, 'pass@4': 1.0, 'maj@4': 0.5}
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``,
    computed as a product (no huge binomials).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 1, 4)
    (0.25, 0.5, 0.0, 1.0)
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    if n - c < k:       # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority(answers: Sequence[str]) -> int:
    """The index of the first sample that gives the most common answer (ties: the answer given first).

    >>> majority(["3", "4", "4", "3"]), majority(["a", "b", "b"])
    (0, 1)
    """
    counts = Counter(answers)
    top = max(counts.values())
    return next(i for i, a in enumerate(answers) if counts[a] == top)


def pass_ks(k: int) -> list[int]:
    """The j of the pass@j reported for k samples: the powers of two below k, and k.

    >>> pass_ks(1), pass_ks(5), pass_ks(8)
    ([1], [1, 2, 4, 5], [1, 2, 4, 8])
    """
    out = [2 ** i for i in range(k.bit_length()) if 2 ** i < k]
    return out + [k]


def scores(groups: Sequence[Sequence[tuple[float, str]]], threshold: float = 1.0) -> dict[str, float]:
    """avg@k, pass@j and maj@k over prompts, each prompt a group of ``k`` ``(reward, answer)`` samples (the
    same k for every prompt). See the module docstring.

    >>> scores([[(0.5, "x"), (1.0, "y")]])
    {'avg@2': 0.75, 'pass@1': 0.5, 'pass@2': 1.0, 'maj@2': 0.0}
    """
    if not groups:
        raise ValueError("scores() needs at least one prompt's samples")
    k = len(groups[0])
    if k < 1 or any(len(g) != k for g in groups):
        raise ValueError(f"every prompt needs the same number of samples (>= 1); got {sorted({len(g) for g in groups})}")
    correct = [[reward >= threshold for reward, _ in g] for g in groups]
    out = {f"avg@{k}": sum(sum(r for r, _ in g) / k for g in groups) / len(groups)}
    for j in pass_ks(k):
        out[f"pass@{j}"] = sum(pass_at_k(k, sum(c), j) for c in correct) / len(groups)
    out[f"maj@{k}"] = sum(c[majority([a for _, a in g])] for g, c in zip(groups, correct)) / len(groups)
    return out


__all__ = ["majority", "pass_at_k", "pass_ks", "scores"]
