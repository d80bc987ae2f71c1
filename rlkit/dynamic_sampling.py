"""Dynamic sampling (DAPO, Yu et al. 2025) and overlong reward shaping: what the driver does with a step's
rewards before the advantages.

**Dynamic sampling.** A group (the ``Rollout.n`` samples of one prompt) whose rewards are all equal has zero
advantage under GRPO's baseline, so it carries no gradient and only dilutes the batch. With
``TrainerConfig(dynamic_sampling=True)`` such groups are filtered out, and more prompts (whole generation
rounds of ``prompts_per_step``, the dataset's next ones) are generated until the step holds
``prompts_per_step`` groups that differ. Kept groups past that are discarded (DAPO's and verl's choice: the
batch keeps its shape). After ``max_sampling_rounds`` rounds short of a full batch the step fails with the
counts (``SamplingError``), never trains on a short batch silently.

**Overlong shaping.** DAPO's soft overlong punishment: with ``L = max_new_tokens`` and a buffer ``B``, a
response of ``l`` tokens gets ``0`` for ``l <= L - B``, ``(L - B - l) / B`` inside the buffer (down to -1 at
``L``), times ``overlong_penalty``. ``mask_truncated`` takes the responses cut at ``L`` out of the loss
(they still count in their group's baseline), as TRL's ``mask_truncated_completions`` does.

>>> import torch
>>> informative_groups([0, 0, 1, 1, 2, 2], torch.tensor([1., 1., 0., 1., 0., 0.]))
[1]
>>> overlong_penalty(torch.tensor([4, 12, 14, 16]), max_tokens=16, buffer=4).tolist()
[0.0, 0.0, -0.5, -1.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.errors import TrainerError


class SamplingError(TrainerError):
    """Dynamic sampling ran out of generation rounds before the step's batch was full."""


def informative_groups(uid: Sequence[int], rewards: torch.Tensor) -> list[int]:
    """The prompts (``uid``, in order of first appearance) whose samples' rewards are not all equal: at least
    two finite rewards (NaN: no reward) that differ. The rest carry no gradient under a group baseline."""
    by_uid: dict[int, list[float]] = {}
    for u, r in zip(uid, rewards.tolist()):
        by_uid.setdefault(int(u), []).append(r)
    return [u for u, rs in by_uid.items() if len(finite := [r for r in rs if math.isfinite(r)]) > 1
            and max(finite) > min(finite)]


def overlong_penalty(lengths: torch.Tensor, *, max_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of responses of ``lengths`` tokens (see the module docstring): 0 up to
    ``max_tokens - buffer``, then falling linearly to ``-factor`` at ``max_tokens``."""
    over = (lengths.float() - (max_tokens - buffer)).clamp(min=0)
    return (over / buffer).clamp(max=1.0) * -factor + 0.0  # + 0.0: no -0.0


class Backfill:
    """One step's batch gathered over generation rounds: ``add`` each round's samples and rewards, ``full``
    says when ``want`` informative groups are in, ``result`` joins them (uids renumbered 0..want-1 in the
    order they came), ``metrics`` says what it cost.

    >>> samples = Batch(input_ids=torch.arange(8).view(4, 2), attention_mask=torch.ones(4, 2), uid=[0, 0, 1, 1])
    >>> fill = Backfill(want=1, max_rounds=2)
    >>> fill.add([{"prompt": "a"}, {"prompt": "b"}], samples, torch.tensor([1., 1., 0., 1.]))
    >>> prompts, batch, rewards = fill.result()
    >>> prompts, batch.uid, batch.input_ids[:, 0].tolist(), rewards.tolist()
    ([{'prompt': 'b'}], [0, 0], [4, 6], [0.0, 1.0])
    >>> fill.metrics()["dynamic/filtered_share"]
    0.5
    """

    def __init__(self, want: int, max_rounds: int):
        self.want, self.max_rounds = want, max_rounds
        self.rounds = self.generated_groups = self.generated_samples = self.filtered = self.surplus = 0
        self._prompts: list[dict[str, Any]] = []
        self._parts: list[tuple[Batch, torch.Tensor, list[int]]] = []  # kept rows of each round, their new uids

    @property
    def full(self) -> bool:
        return len(self._prompts) >= self.want

    def add(self, prompts: list[dict[str, Any]], samples: Batch, rewards: torch.Tensor) -> None:
        """One round: ``samples`` of ``prompts`` (``samples.uid`` indexes them) and their ``rewards``."""
        self.rounds += 1
        self.generated_groups += len(set(samples.uid))
        self.generated_samples += len(samples)
        keep = informative_groups(samples.uid, rewards)
        self.filtered += len(set(samples.uid)) - len(keep)
        room = self.want - len(self._prompts)
        keep, self.surplus = keep[:room], self.surplus + max(0, len(keep) - room)
        if not keep:
            return
        new_uid = {u: len(self._prompts) + i for i, u in enumerate(keep)}
        rows = [i for i, u in enumerate(samples.uid) if u in new_uid]
        self._prompts += [prompts[u] for u in keep]
        self._parts.append((samples.take(rows), rewards[rows], [new_uid[samples.uid[i]] for i in rows]))

    def offer(self, prompts: list[dict[str, Any]], samples: Batch, rewards: torch.Tensor,
              step: int) -> tuple[list[dict[str, Any]], Batch, torch.Tensor] | None:
        """``add`` a round; the step's prompts, samples and rewards once full (``result``), else None (a
        ``SamplingError`` when the rounds are spent: ``check``)."""
        self.add(prompts, samples, rewards)
        if self.full:
            return self.result()
        self.check(step)
        return None

    def check(self, step: int) -> None:
        """A ``SamplingError`` when the rounds are spent and the batch is not full."""
        if not self.full and self.rounds >= self.max_rounds:
            raise SamplingError(
                f"dynamic sampling, step {step + 1}: after {self.rounds} generation round(s) ({self.generated_groups}"
                f" prompts) only {len(self._prompts)} of the {self.want} groups the step needs had rewards that "
                f"differ ({self.filtered} groups had all-equal rewards: every sample right, or every one wrong). "
                f"The task is too easy or too hard for the policy now: raise max_sampling_rounds (now "
                f"{self.max_rounds}), lower prompts_per_step, or set dynamic_sampling=False")

    def result(self) -> tuple[list[dict[str, Any]], Batch, torch.Tensor]:
        """The step's prompts, samples (uids renumbered) and rewards."""
        if not self._parts:
            raise SamplingError(f"dynamic sampling kept no group in {self.rounds} round(s); nothing to train on")
        batch = Batch.cat([b for b, _, _ in self._parts])
        batch.uid = [u for _, _, uids in self._parts for u in uids]
        batch.timing = sum(float(b.timing or 0.0) for b, _, _ in self._parts)
        return self._prompts, batch, torch.cat([r for _, r, _ in self._parts])

    def metrics(self) -> dict[str, float]:
        """The step's filtering: rounds, the share of generated groups filtered out, generated samples per
        trained sample, and the informative groups discarded past a full batch."""
        kept = sum(len(b) for b, _, _ in self._parts)
        return {"dynamic/rounds": float(self.rounds),
                "dynamic/filtered_share": self.filtered / max(1, self.generated_groups),
                "dynamic/samples_per_kept": self.generated_samples / max(1, kept),
                "dynamic/surplus_groups": float(self.surplus)}


__all__ = ["Backfill", "SamplingError", "informative_groups", "overlong_penalty"]
