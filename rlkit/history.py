"""History: what a Trainer keeps of its steps in memory, beside the run folder (``rlkit.run_dir``).

One metrics row per step (``Trainer.metrics``), the recent samples (``Trainer.samples``: prompt, completion,
reward, and for multi-turn episodes the conversation and its counts) and when each step's generation and
update ran (``Trainer.timeline``).

>>> import torch
>>> from rlkit.batch import Batch
>>> h = History()
>>> samples = Batch(input_ids=torch.tensor([[5, 1, 2], [5, 3, 0]]), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
...                 response_mask=torch.tensor([[1., 1.], [1., 0.]]), uid=[0, 0], completion=["ab", "c"])
>>> h.add_step({"step": 1, "reward/mean": 0.5}, [{"prompt": "p"}], samples, torch.tensor([1.0, 0.0]),
...            step=1, prompt_len=1, keep=512)
>>> h.samples(step=1)[["completion", "reward"]].values.tolist()
[['ab', 1.0], ['c', 0.0]]
>>> h.samples(step=1, ids=True)["completion_ids"].tolist()
[[1, 2], [3]]
>>> h.metrics()["reward/mean"].tolist()
[0.5]
"""

from __future__ import annotations

from typing import Any

import torch

from rlkit.batch import Batch


class History:
    """A trainer's steps as recorded: ``rows`` (the metrics rows, saved with a checkpoint), the last ``keep``
    samples and the phases' times."""

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        self.rows: list[dict[str, Any]] = list(rows or [])
        self._samples: list[dict[str, Any]] = []
        self._timeline: list[dict[str, Any]] = []

    def add_step(self, row: dict[str, Any], prompts: list[dict[str, Any]], samples: Batch,
                 scores: torch.Tensor, *, step: int, prompt_len: int, keep: int) -> None:
        """Step ``step``'s metrics ``row``, and its samples (the ``keep`` newest samples stay)."""
        from rlkit.agent.episodes import conversation_text

        self.rows.append(row)
        s = samples
        for i, u in enumerate(s.uid):
            ids = s.input_ids[i, prompt_len:][s.attention_mask[i, prompt_len:].bool()]
            sample = {"step": step, "prompt": prompts[u]["prompt"], "completion": conversation_text(s.completion[i]),
                      "reward": float(scores[i]), "completion_ids": ids.tolist()}
            if s.episode is not None:  # multi-turn: the conversation (tool messages marked) and the episode's counts
                ep = s.episode[i]
                sample.update(turns=ep["turns"], tool_calls=ep["tool_calls"], tool_errors=ep["tool_errors"],
                              finish_reason=s.finish_reason[i], messages=s.completion[i])
            self._samples.append(sample)
        del self._samples[:max(0, len(self._samples) - keep)]  # [:-0] would keep all

    def add_phases(self, step: int, gen_window: Any, update_start: float, update_end: float) -> None:
        """When step ``step`` (1-based) generated (the rollout workers' earliest start and latest end over
        its samples, ``gen_window``: one ``[start, end]`` row a sample, or None) and updated."""
        if gen_window is not None and len(gen_window):
            self._timeline.append({"step": step, "phase": "generate", "start": float(gen_window[:, 0].min()),
                                   "end": float(gen_window[:, 1].max())})
        self._timeline.append({"step": step, "phase": "update", "start": update_start, "end": update_end})

    def metrics(self):
        """One row per step (a DataFrame)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def samples(self, step: int, last: int | None = None, ids: bool = False):
        """The kept samples of the ``last`` steps up to ``step`` (all with None), a DataFrame; with ``ids``
        each completion's token ids too."""
        import pandas as pd

        df = pd.DataFrame(self._samples)
        if not ids and not df.empty:
            df = df.drop(columns=["completion_ids"] + (["messages"] if "messages" in df else []))
        return df if last is None or df.empty else df[df.step > step - last]

    def timeline(self):
        """``step, phase, start, end`` rows (seconds since the epoch), a DataFrame."""
        import pandas as pd

        return pd.DataFrame(self._timeline, columns=["step", "phase", "start", "end"])


__all__ = ["History"]
