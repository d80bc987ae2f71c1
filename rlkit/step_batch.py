"""StepBatch: one RL step's samples as the controller holds them between cells.

``trainer.generate()`` returns one (the actor's weights synced into the engines, the prompts sampled,
the rewards scored); ``trainer.estimate(batch)`` adds what the update needs (reference and old
log-probs, values, advantages); ``trainer.update(batch)`` trains on it and logs the step. In between, a
notebook can look at it as a DataFrame and change it: ``drop`` samples (they stay in the tensors, with
no loss: every layout keeps its shapes) or ``set_rewards``. ``trainer.train_step()`` is exactly
``update(estimate(generate()))``.

>>> import torch
>>> from rlkit.batch import Batch
>>> samples = Batch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
...                 response_mask=torch.tensor([[1., 1.], [1., 0.]]), rollout_logprobs=torch.tensor([[-0.5, -1.0], [-2.0, 0.0]]),
...                 uid=[0, 0], completion=["ab", "cd"], finish_reason=["stop", "length"], columns={"prompt": ["p", "p"]})
>>> b = StepBatch(step=0, prompts=[{"prompt": "p", "_row": 3}], samples=samples, rewards=torch.tensor([1.0, 0.0]))
>>> b.table()[["uid", "row", "completion", "reward", "tokens"]].values.tolist()
[[0, 3, 'ab', 1.0, 2], [0, 3, 'cd', 0.0, 1]]
>>> b.drop([1]).rewards.tolist()          # NaN: no reward, no loss
[1.0, nan]
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.batch import Batch


@dataclass
class StepBatch:
    """The samples of one step: ``samples`` (an ``rlkit.batch.Batch``: the engines' samples with their prompt
    rows' ``columns``; ``trainer.estimate`` adds ``ref_logprobs``, ``values``, ``old_logprobs``,
    ``advantages``, ``returns`` and says so in ``estimated``), ``rewards`` (one per sample; NaN: no
    reward, the sample carries no loss), the prompts they answer, the step (policy version) that sampled
    them and the phases' seconds.
    """

    step: int
    prompts: list[dict[str, Any]]
    samples: Batch
    rewards: torch.Tensor
    timings: dict[str, float] = field(default_factory=dict)
    sync: list[dict[str, float]] = field(default_factory=list)
    started: float = 0.0
    estimated: bool = False
    kl_mean: float | None = None
    offpolicy: dict[str, float] = field(default_factory=dict)  # engine vs trainer (rlkit.algos.offpolicy)
    sampling: dict[str, float] = field(default_factory=dict)  # dynamic sampling, overlong (rlkit.dynamic_sampling)
    next_round: int | None = None  # the dataset's next round once this batch trains (synchronous: Trainer.rounds)

    def __len__(self) -> int:
        return len(self.samples)

    # ---- changing it ----------------------------------------------------------------------------
    def drop(self, samples: Sequence[int] | torch.Tensor) -> StepBatch:
        """Leave ``samples`` (indices, or a bool mask of those to drop) out of the update: their reward
        becomes NaN, so they carry no loss (counted as skipped). In place; returns the batch.

        Before ``estimate``: the advantages are computed without them. After: the other samples keep the
        advantages they got, the dropped ones lose theirs."""
        idx = self._indices(samples)
        rewards = self.rewards.clone()
        rewards[idx] = math.nan
        self.rewards = rewards
        if self.estimated:
            keep = torch.ones(len(self), dtype=torch.bool)
            keep[idx] = False
            s = self.samples
            s.response_mask *= keep[:, None].float()
            if s.loss_mask is not None:
                s.loss_mask *= keep[:, None].float()
            s.advantages = s.advantages * keep[:, None]
        return self

    def set_rewards(self, rewards: Sequence[float | None] | torch.Tensor) -> StepBatch:
        """Replace every sample's reward (None or NaN: no reward); before ``estimate`` (the advantages
        are computed from them). In place; returns the batch."""
        if self.estimated:
            raise ValueError("set_rewards after trainer.estimate(batch) would leave advantages from the old "
                             "rewards: set them on the batch trainer.generate() returned, then estimate")
        if len(rewards) != len(self):
            raise ValueError(f"set_rewards got {len(rewards)} rewards for {len(self)} samples; give one per sample")
        self.rewards = torch.tensor([math.nan if r is None else float(r) for r in rewards], dtype=torch.float32)
        return self

    def _indices(self, samples: Sequence[int] | torch.Tensor) -> torch.Tensor:
        s = torch.as_tensor(samples)
        if s.dtype == torch.bool:
            if s.numel() != len(self):
                raise ValueError(f"a mask of {s.numel()} for {len(self)} samples; give one bool per sample")
            return s.nonzero().flatten()
        s = s.long().flatten()
        if s.numel() and (s.min() < -len(self) or s.max() >= len(self)):
            raise IndexError(f"sample indices {s.tolist()} are outside 0..{len(self) - 1}")
        return s

    # ---- its metrics ------------------------------------------------------------------------------
    def metrics_row(self, step: int, settings: Any, actor: dict[str, float],
                    critic: dict[str, float]) -> dict[str, float]:
        """The metrics row of the step that trained on this batch (``step``: its number, 1-based): rewards,
        lengths, advantages, the updates' metrics, phase seconds, the sync's bytes and every process's memory."""
        t, s = self.timings, self.samples
        valid = torch.isfinite(self.rewards)
        scores = torch.nan_to_num(self.rewards, nan=0.0)
        mask = s.loss_tokens
        lengths = mask.sum(1)
        row = {"step": step, "reward/mean": scores[valid].mean().item() if valid.any() else math.nan,
               "reward/std": scores[valid].std().item() if valid.sum() > 1 else 0.0,
               "reward/skipped": int((~valid).sum()), "response_length/mean": lengths.mean().item(),
               "advantages/mean": masked_stat(s.advantages, mask, "mean"),
               "advantages/std": masked_stat(s.advantages, mask, "std"),
               "entropy": actor.get("actor/entropy", math.nan), "actor/lr": settings.lr, **actor, **critic}
        row.update(self.offpolicy)
        row.update(self.sampling)
        if s.episode is not None:  # multi-turn: turns, tool calls and errors, truncations (rlkit.agent)
            from rlkit.agent.episodes import episode_metrics

            row.update(episode_metrics(s.episode))
            row["timing/tools"] = float(s.timing_tools or 0.0)
        if s.policy_version is not None:  # how many updates behind the actor the sampling policy was (async RL)
            lag = (step - 1) - s.policy_version.float()
            row["offpolicy/staleness_mean"], row["offpolicy/staleness_max"] = lag.mean().item(), lag.max().item()
            if s.token_version is not None:  # streaming: the samples' share by versions behind (their oldest token)
                for k, count in zip(*lag.long().unique(return_counts=True)):
                    row[f"stream/staleness/{int(k)}"] = count.item() / len(lag)
        if self.kl_mean is not None:
            row["kl"] = self.kl_mean
        elif "actor/kl_loss" in actor:
            row["kl"] = actor["actor/kl_loss"]
        row.update({f"timing/{k}": v for k, v in t.items()})
        row["timing/step"] = time.perf_counter() - self.started
        row["tokens_per_s"] = float(s.attention_mask.sum()) / row["timing/step"]
        sync = self.sync
        row["sync/bytes"] = max(s["bytes"] for s in sync)
        row["sync/seconds"] = max(s["seconds"] for s in sync)
        if "param_bytes" in sync[0]:  # the generation layout: parameter memory while generating
            row["sync/param_bytes"] = max(s["param_bytes"] for s in sync)
            row["sync/peak_param_bytes"] = max(s["peak_param_bytes"] for s in sync)
        rss = [s["rss_gb"] for s in sync]  # every process's memory rides along with its part of the sync
        row["memory/rss_max_gb"] = max(rss)
        row.update({f"memory/rss_gb/rank{r}": v for r, v in enumerate(rss)})
        return row

    # ---- looking at it --------------------------------------------------------------------------
    def table(self, logprobs: bool = False):
        """One row per sample: prompt uid, dataset row, prompt, completion, reward, tokens, finish
        reason, and (after ``estimate``) the advantage (mean over its tokens); with ``logprobs`` the
        engine's per-token log-probs (and the old / reference ones when estimated) as lists.

        Samples of rows with images (a vision-language run) get an ``image`` column after the prompt, shown
        as thumbnails in Jupyter and as the images' sizes ("56x56") in text (``rlkit.widgets.samples``);
        their prompt is the rendered text."""
        import pandas as pd

        from rlkit.agent.episodes import conversation_text
        from rlkit.widgets.samples import with_images

        s = self.samples
        tokens = s.response_mask.sum(1)
        cols = s.columns or {}
        row_of = {i: p.get("_row") for i, p in enumerate(self.prompts)}
        df = pd.DataFrame({
            "uid": list(s.uid), "row": [row_of.get(u) for u in s.uid],
            "prompt": list(cols.get("prompt", [None] * len(self))),
            "completion": [conversation_text(c) for c in s.completion],
            "reward": self.rewards.tolist(), "tokens": tokens.long().tolist(),
            "finish_reason": list(s.finish_reason or [None] * len(self))})
        if s.policy_version is not None:  # the policy version (actor step) that sampled it
            df["version"] = s.policy_version.tolist()
        if self.estimated:
            df["advantage"] = (s.advantages.sum(1) / tokens.clamp(min=1)).tolist()
        if logprobs:
            for name, t in (("logprobs", s.rollout_logprobs), ("old_logprobs", s.old_logprobs),
                            ("ref_logprobs", s.ref_logprobs)):
                if t is not None:
                    df[name] = [t[i, :int(n)].tolist() for i, n in enumerate(tokens)]
        return with_images(df, self._sample_rows())

    def _sample_rows(self) -> list[dict[str, Any] | None]:
        """Each sample's dataset row (its prompt's), for its images; else its own image columns."""
        cols, n = self.samples.columns or {}, len(self.prompts)
        return [self.prompts[int(u)] if u is not None and 0 <= int(u) < n
                else {k: cols[k][i] for k in ("image", "images") if k in cols}
                for i, u in enumerate(self.samples.uid if self.samples.uid is not None else [None] * len(self))]

    def _repr_html_(self) -> str:
        from rlkit.widgets.samples import table_html

        state = "estimated" if self.estimated else "not estimated"
        return f"<b>StepBatch</b> of step {self.step + 1}: {len(self)} samples, {state}" + table_html(self.table())

    def __repr__(self) -> str:
        return (f"StepBatch(step={self.step + 1}, samples={len(self)}, prompts={len(self.prompts)}, "
                f"estimated={self.estimated})")


def masked_stat(x: torch.Tensor, mask: torch.Tensor, what: str) -> float:
    """The mean (or, with ``what="std"``, the unbiased std) of ``x`` over the tokens of ``mask``; 0 for none.

    >>> masked_stat(torch.tensor([[1., 3., 9.]]), torch.tensor([[1, 1, 0]]), "std")
    1.4142135381698608
    """
    vals = x[mask.bool()]
    if vals.numel() == 0:
        return 0.0
    return (vals.mean() if what == "mean" else vals.std() if vals.numel() > 1 else torch.tensor(0.0)).item()


__all__ = ["StepBatch", "masked_stat"]
