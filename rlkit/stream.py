"""Streaming RL with partial rollouts (``TrainerConfig(streaming=True)``, split placement).

The rollout workers never generate whole batches. They advance every running sample by a chunk of
``stream_chunk_tokens`` tokens per call, continuing each from its prefix (its prompt and its tokens so far),
and the driver keeps the samples between chunks: their tokens, the engine's log-prob of each, and the policy
version that sampled each. The HF engine keeps each running sample's keys and values between its chunks
(``HFEngine.continue_ids``), so a prefix is prefilled only when new weights have landed since its last
chunk; with ``stream_stale_kv=True`` not even then (the sample goes on over keys and values of older
weights, as PipelineRL's in-flight updates do; the log-probs kept are still the engine's own). So:

- **streaming**: a group (the ``Rollout.n`` samples of a prompt) goes to the buffer when its last sample
  ends; a step trains as soon as the buffer holds ``prompts_per_step`` groups, never waiting for the
  slowest response of a batch. Finished samples free their slots for new prompts at the next chunk
  (admission is by whole rounds of ``prompts_per_step`` rows, the dataset's next ones, while fewer than
  ``stream_groups`` groups are running or buffered: the buffer is bounded);
- **weights in flight (partial rollouts)**: after each update the new weights go to the rollout workers
  at the next chunk boundary, without waiting for the running samples, which go on under them (a token
  boundary). With ``partial_rollouts=False`` the weights wait until no sample is running instead
  (admission pauses), so a sample never crosses an update;
- **a staleness bound**: a group whose oldest token is more than ``max_staleness`` versions behind the
  trainer is dropped and counted, when it is running (it can only get older) and when a step takes it.

The groups take turns in two lanes: while one lane's chunk is merged in the driver, the other's runs, so
the rollout workers always have a chunk queued; both are in flight while the actor trains (launched before
``Trainer.update``), and the weights of that update land right after them. Every decision here (admission, which chunk the weights land before, which
groups a step takes) depends on token counts, never on timing: a run is reproducible, and ``save`` /
``Trainer.load`` resume it exactly (the running samples, the buffer and the chunk in flight are kept; the
engines' kept keys and values are not, and need not be: new weights land right after the chunks in flight,
which empties them in the uninterrupted run too). With ``stream_stale_kv=True`` they would outlive that
update, so a resumed run prefills its running samples under the loaded weights: the same samples and
tokens so far, but not the same next tokens as the uninterrupted run.

>>> s = Stream(n=2, max_new_tokens=4, chunk_tokens=2, capacity=2)
>>> s.admit([{"prompt": "ab", "_row": 0}], [[5, 6]], version=0)
>>> s.request()[0]["prefix"]
[[5, 6], [5, 6]]
>>> done = s.merge([[7, 1], [8, 9]], [[-0.1, -0.2], [-0.3, -0.4]], ["stop", "length"], version=0)
>>> done, s.request()[0]["prefix"]          # sample 1 ended; sample 2 goes on from its prefix
([], [[5, 6, 8, 9]])
>>> [g.row["prompt"] for g in s.merge([[3, 4]], [[-0.5, -0.6]], ["length"], version=1)]
['ab']
>>> s.running, s.buffer[0].samples[1].versions    # a sample that crossed an update: its tokens' versions
([], [0, 0, 1, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.batch import Batch


@dataclass(eq=False)
class Sample:
    """One response being generated: its tokens so far, the engine's log-prob and policy version of each."""

    prompt_ids: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" / "length" once it ended


@dataclass(eq=False)
class Group:
    """The ``n`` samples of one prompt row, admitted at ``version``."""

    key: int  # admission order over the run
    row: dict[str, Any]
    samples: list[Sample]
    version: int
    rewards: torch.Tensor | None = None  # once finished and scored

    @property
    def done(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    @property
    def oldest(self) -> int:
        """The policy version of its oldest token (the admission's, before any token)."""
        return min((v for s in self.samples for v in s.versions[:1]), default=self.version)


class Stream:
    """The driver's side of streaming: running groups, the buffer of finished ones, the chunk requests and
    their merge (see the module docstring). ``capacity``: running plus buffered groups at most."""

    def __init__(self, n: int, max_new_tokens: int, chunk_tokens: int, capacity: int, lanes: int = 2):
        self.n, self.max_new_tokens, self.chunk_tokens, self.capacity = n, max_new_tokens, chunk_tokens, capacity
        self.lanes = lanes  # groups take turns by lane (key % lanes): one lane's chunk runs while another's merges
        self.running: list[Group] = []
        self.buffer: list[Group] = []
        self.admitted = 0        # groups admitted over the run (their keys)
        self.chunks = 0          # chunk calls launched over the run (their seeds)
        self.dropped_stale = 0   # groups dropped by the staleness bound (over the run)
        self.inflight: list[tuple] = []  # chunks in flight, oldest first: (future or result, samples, version, lane)
        self.engine_version = -1  # the actor step whose weights the rollout engines hold (or are loading)
        self.filtered = 0         # dynamic sampling: finished groups filtered out since the last step
        self.taken: list[Group] = []  # the last step's groups (back to the buffer if that step is given up)

    # ---- admission and chunks --------------------------------------------------------------------
    def room(self) -> int:
        """Groups that may be admitted now."""
        return self.capacity - len(self.running) - len(self.buffer)

    def admit(self, rows: list[dict[str, Any]], prompt_ids: list[list[int]], version: int) -> None:
        """New prompt rows (tokenized: ``prompt_ids``), ``n`` samples each, admitted under ``version``."""
        for row, ids in zip(rows, prompt_ids):
            key = self.admitted
            self.admitted += 1
            samples = [Sample(list(ids), seed=(key * 1_000_003 + j) % 2**31) for j in range(self.n)]
            self.running.append(Group(key, row, samples, version))

    def idle_lanes(self) -> list[int]:
        """The lanes with no chunk in flight."""
        busy = {entry[3] for entry in self.inflight}
        return [lane for lane in range(self.lanes) if lane not in busy]

    def request(self, lane: int | None = None) -> tuple[dict[str, list], list[Sample]]:
        """The next chunk of ``lane`` (None: all): the request for its running samples (``RolloutWorker.
        continue_samples``: each one's ``prefix``, prompt + tokens so far, its ``seed`` for this chunk, its
        ``key`` across chunks and the ``room`` it has left before ``max_new_tokens``), and those samples."""
        live = [s for g in self.running if lane is None or g.key % self.lanes == lane for s in g.samples
                if s.finish is None]
        return {"prefix": [s.prompt_ids + s.tokens for s in live],
                "seed": [(s.seed * 7919 + len(s.tokens)) % 2**31 for s in live],
                "key": [s.seed for s in live],
                "room": [self.max_new_tokens - len(s.tokens) for s in live]}, live

    def merge(self, tokens: list[list[int]], logprobs: list[list[float]], reasons: list[str],
              version: int, samples: list[Sample] | None = None) -> list[Group]:
        """A chunk's result for ``samples`` (default: the running ones, as ``request`` listed them), sampled
        under ``version``; returns the groups it finished (also appended to the buffer), in admission order.
        A sample ends at a stop ("stop") or at ``max_new_tokens`` ("length"; tokens past it are dropped)."""
        samples = self.request()[1] if samples is None else samples
        for s, toks, lps, why in zip(samples, tokens, logprobs, reasons, strict=True):
            room = self.max_new_tokens - len(s.tokens)
            cut = len(toks) > room
            s.tokens += list(toks)[:room]
            s.logprobs += list(lps)[:room]
            s.versions += [version] * min(len(toks), room)
            if why == "stop" and not cut:
                s.finish = "stop"
            elif len(s.tokens) >= self.max_new_tokens:
                s.finish = "length"
        done = [g for g in self.running if g.done]
        self.running = [g for g in self.running if not g.done]
        self.buffer += done
        return done

    def drop_stale(self, step: int, max_staleness: int) -> int:
        """Drop the running and buffered groups whose oldest token is more than ``max_staleness`` versions
        behind the trainer at ``step``; returns how many."""
        keep = lambda g: step - g.oldest <= max_staleness  # noqa: E731
        before = len(self.running) + len(self.buffer)
        self.running = [g for g in self.running if keep(g)]
        self.buffer = [g for g in self.buffer if keep(g)]
        dropped = before - len(self.running) - len(self.buffer)
        self.dropped_stale += dropped
        return dropped

    def take(self, count: int) -> list[Group]:
        """The ``count`` oldest finished groups, out of the buffer."""
        out, self.buffer = self.buffer[:count], self.buffer[count:]
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def saved(self) -> dict[str, Any]:
        """Everything as plain data, to pickle in one piece (the chunks in flight, their results waited for by
        the caller and kept unmerged, with the very samples they continue)."""
        if any(hasattr(entry[0], "result") for entry in self.inflight):
            raise RuntimeError("wait for the chunks in flight before saving the stream")
        return dict(vars(self))

    @classmethod
    def restore(cls, state: dict[str, Any]) -> Stream:
        """The stream ``saved`` gave (its chunks in flight ready, to merge next)."""
        out = cls.__new__(cls)
        vars(out).update(state)
        return out


def group_batch(groups: list[Group], layout: Any, pad_token_id: int, tokenizer: Any) -> Batch:
    """Finished groups as one batch of ``layout`` (uids 0.. in their order): the samples, the engine's
    log-probs, ``policy_version`` (the oldest token's) and ``token_version`` (each token's)."""
    from rlkit.rollout.base import assemble

    samples = [s for g in groups for s in g.samples]
    index = [i for i, g in enumerate(groups) for _ in g.samples]
    out = assemble([s.prompt_ids for s in samples], index, [s.tokens for s in samples], [s.logprobs for s in samples],
                   [s.finish for s in samples], tokenizer.batch_decode([s.tokens for s in samples],
                                                                       skip_special_tokens=True),
                   pad_token_id, [], {}, "stream")
    request = {"uid": list(range(len(groups))), "row": [g.row.get("_row") for g in groups]}
    batch = layout.pack(out, request, pad_token_id)
    batch.columns = {k: [groups[u].row[k] for u in batch.uid] for k in groups[0].row if k not in ("_row", "_env_row")}
    batch.token_version = torch.zeros_like(batch.response_mask, dtype=torch.long)
    for i, s in enumerate(samples):
        batch.token_version[i, :len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
    batch.policy_version = torch.tensor([min(s.versions, default=g.version) for g in groups for s in g.samples],
                                        dtype=torch.long)
    return batch


__all__ = ["Group", "Sample", "Stream", "group_batch"]
