"""The sequence layout: where each token of a sample sits in the rows the controller and workers exchange.

Every role reads its columns through one ``SequenceLayout``, so no role slices sequences by hand. Today's
layout is fixed for a whole run (pipeline schedules are built once per shape)::

    column:  0 ........ P-1 | P ............ P+R-1
             prompt, left-  | response, right-
             padded to P    | padded to R

* response token ``j`` sits at column ``P + j``; its log-prob (and the entropy of its distribution) is
  read at the same column of a model's per-token output (column ``t`` scores token ``t`` given ``< t``),
  so only columns ``>= P`` are scored;
* the value of the state before response token ``j`` is the critic's output at column ``P + j - 1``;
* the tokens that carry loss (policy loss, KL, entropy) are ``batch.loss_mask`` when a batch has one
  (a multi-turn trajectory masks its tool outputs), else ``batch.response_mask`` (``Batch.loss_tokens``);
* each DP rank samples with its own seed, ``seed + 7919 * dp_rank``: any placement (colocated, split,
  the generation layout) draws the same samples for the same chunk;
* each sample may carry ``policy_version``, the number of updates behind the weights that sampled it.

The engines' samples come out as an ``rlkit.batch.Batch`` (``pack``): ``input_ids``, ``attention_mask``
(P + R wide), ``response_mask``, ``rollout_logprobs`` (R wide), for multi-turn ``loss_mask`` (R wide) and
``episode``; lists ``uid`` (the prompt's index in the step), ``row`` (its dataset row), ``completion``,
``finish_reason``; meta ``timing``.

>>> import torch
>>> layout = SequenceLayout(prompt_len=3, response_len=2)
>>> per_token = torch.arange(5.).expand(2, 5)           # a model's per-token output, 5 = P + R columns
>>> layout.response(per_token)[0].tolist(), layout.values(per_token)[0].tolist()
([3.0, 4.0], [2.0, 3.0])
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rlkit.batch import Batch


@dataclass(frozen=True)
class SequenceLayout:
    """``[prompt left-padded to prompt_len | response right-padded to response_len]``; see the module docstring.

    >>> SequenceLayout(prompt_len=8, response_len=4).width
    12
    """

    prompt_len: int
    response_len: int

    @property
    def width(self) -> int:
        """Columns of a packed sample: ``prompt_len + response_len``."""
        return self.prompt_len + self.response_len

    @property
    def first_scored(self) -> int:
        """The first column whose log-prob any role reads (a model need not score earlier ones)."""
        return self.prompt_len

    def response(self, per_token: torch.Tensor) -> torch.Tensor:
        """The response's columns of a per-token output (log-probs, entropy): ``[batch, response_len]``."""
        return per_token[:, self.prompt_len:self.prompt_len + self.response_len]

    def values(self, per_token: torch.Tensor) -> torch.Tensor:
        """A critic's values of the states before each response token: ``[batch, response_len]``."""
        return per_token[:, self.prompt_len - 1:self.prompt_len + self.response_len - 1]

    @staticmethod
    def loss_mask(batch: Batch | dict[str, Any]) -> torch.Tensor:
        """The response tokens that carry loss (policy loss, KL, entropy, value loss, advantages): the
        ``loss_mask`` of a batch that has one, else its ``response_mask``."""
        mask = batch.get("loss_mask")
        return batch["response_mask"] if mask is None else mask

    def pack(self, out: Any, prompts: dict[str, Any], pad_token_id: int) -> Batch:
        """Lay an engine's ``RolloutBatch`` out as this layout's batch, with each sample's ``uid`` and
        ``row`` from ``prompts`` (the request it answers).

        >>> from rlkit.models import tiny_lm
        >>> from rlkit.rollout import HFEngine
        >>> engine = HFEngine(tiny_lm("qwen2", size="test"), n=2, max_new_tokens=4, ignore_eos=True)
        >>> req = {"prompt": ["ab", "12+7="], "uid": [0, 1], "row": [5, 9]}
        >>> b = SequenceLayout(8, 4).pack(engine.generate(req["prompt"], seed=0), req, engine.pad_token_id)
        >>> tuple(b.input_ids.shape), b.uid, b.row, b.response_mask.sum().item()
        ((4, 12), [0, 0, 1, 1], [5, 5, 9, 9], 16.0)
        """
        P, R = self.prompt_len, self.response_len
        n = out.response_ids.shape[0]
        p, r = out.prompt_ids.shape[1], out.response_ids.shape[1]
        if p > P or r > R:
            raise RuntimeError(f"rollout returned prompt length {p} > P={P} or response {r} > R={R}")
        ids = torch.full((n, P + R), pad_token_id, dtype=torch.long)
        attn = torch.zeros(n, P + R, dtype=torch.long)
        ids[:, P - p:P] = out.prompt_ids
        attn[:, P - p:P] = out.prompt_mask
        ids[:, P:P + r] = out.response_ids
        resp_mask = torch.zeros(n, R)
        resp_mask[:, :r] = out.response_mask.float()
        attn[:, P:] = resp_mask.long()
        lp = torch.zeros(n, R)
        lp[:, :r] = out.response_logprobs
        rows = out.prompt_index.tolist()
        batch = Batch(input_ids=ids, attention_mask=attn, response_mask=resp_mask, rollout_logprobs=lp,
                      uid=[prompts["uid"][i] for i in rows], row=[prompts["row"][i] for i in rows],
                      completion=list(out.texts), finish_reason=list(out.finish_reason),
                      timing=out.timings.get("generate", 0.0))
        if out.routing is not None:  # each sample's recorded experts at its real tokens' columns
            k = out.routing[0].shape[1:] if out.routing else (0, 0)
            batch.routing = torch.full((n, P + R, *k), -1, dtype=torch.int16)
            for i, rt in enumerate(out.routing):
                p_i = int(out.prompt_mask[i].sum())
                batch.routing[i, P - p_i:P - p_i + rt.shape[0]] = rt
        if out.pixel_values is not None:  # a vision-language model's: each sample's prompt images
            batch.pixel_values, batch.image_grid_thw = list(out.pixel_values), list(out.image_grid_thw)
        if out.loss_mask is not None:  # multi-turn: only the sampled tokens carry loss; the completion is a chat
            batch.loss_mask = torch.zeros(n, R)
            batch.loss_mask[:, :r] = out.loss_mask.float()
            batch.completion, batch.episode = list(out.messages), list(out.episodes)
            batch.timing_tools = out.timings.get("tools", 0.0)
        return batch


def generate_batch(engine: Any, layout: SequenceLayout, prompts: dict[str, Any], seed: int, *,
                   first_index: int | None = None, agent: Any = None, prompt_len: int | None = None,
                   **overrides: Any) -> Batch:
    """``engine.generate`` for ``prompts["prompt"]`` (seeded per prompt from ``seed`` and its place in the call:
    ``first_index``, by default the first prompt's ``uid``, its index in the step; so a DP rank's or a generation
    replica's slice samples what one engine for the whole call would, under any layout), packed by ``layout``, its prompt part widened to
    ``prompt_len`` where that is longer (held-out prompts longer than any training prompt). With an ``agent``
    (``rlkit.agent.episodes.Agent``): its multi-turn episodes instead, the environment reset from
    ``prompts["env_row"]``.

    >>> from rlkit.models import tiny_lm
    >>> from rlkit.rollout import HFEngine
    >>> engine = HFEngine(tiny_lm("qwen2", size="test"), n=2, max_new_tokens=4, ignore_eos=True)
    >>> b = generate_batch(engine, SequenceLayout(8, 4), {"prompt": ["ab"], "uid": [0], "row": [3]}, seed=0)
    >>> b.row, tuple(b.rollout_logprobs.shape), tuple(b.gen_window.shape)
    ([3, 3], (2, 4), (2, 2))

    Each sample's ``gen_window`` holds when this call ran on the worker: (start, end), seconds since the epoch
    (float64), so a step's generation can be placed against the trainer's other phases (``Trainer.timeline``).
    """
    if prompt_len is not None and prompt_len > layout.prompt_len:
        layout = SequenceLayout(prompt_len, layout.response_len)
    if first_index is None:  # a DP chunk or replica slice is a contiguous run of the call's prompts
        first_index = int(prompts["uid"][0]) if prompts.get("uid") else 0
    start = time.time()
    if agent is not None:
        from rlkit.agent.episodes import run_episodes

        out = run_episodes(engine, agent, list(prompts["prompt"]), seed=seed, first_index=first_index,
                           rows=prompts.get("env_row"), **overrides)
    else:
        out = engine.generate(list(prompts["prompt"]), seed=seed, first_index=first_index, **overrides)
    batch = layout.pack(out, prompts, engine.pad_token_id)
    batch.gen_window = torch.tensor([[start, time.time()]], dtype=torch.float64).expand(len(batch), 2).clone()
    return batch


__all__ = ["SequenceLayout", "generate_batch"]
