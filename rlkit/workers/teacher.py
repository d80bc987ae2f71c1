"""A distillation teacher on a pool of its own: ``TeacherWorker``, one rank of the teacher's ``ParallelPlan``.

By default the teacher (``TrainerConfig.teacher``) takes the reference model's place in the actor's workers,
sharded by the actor's plan. A ``Placement`` that maps the ``"teacher"`` role to a pool of its own runs it
here instead: its own ranks, its own process groups, sharded by its own plan (a teacher bigger than the
student can take more ranks), scoring the student's samples while the actor's ranks keep only the student.
The controller calls ``ref_logprobs`` in the reference pass's place (``RLWorkers.ref_logprobs``).

>>> from rlkit.models import tiny_lm
>>> from rlkit.workers.local import LocalWorkerGroup
>>> ids = torch.tensor([[5, 6, 7, 8]])
>>> with LocalWorkerGroup(1, TeacherWorker, tiny_lm("qwen2", size="test"), ParallelPlan(),
...                       layout=SequenceLayout(2, 2)) as g:
...     tuple(g.call_rank0("ref_logprobs", {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
...           ["ref_logprobs"].shape)
(1, 2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlkit.backends import Backend, make_model
from rlkit.batch import Batch, images_of
from rlkit.parallel.groups import build_groups
from rlkit.plan.topology import ParallelPlan
from rlkit.workers.layout import SequenceLayout
from rlkit.workers.rl import RefScored


class TeacherWorker:
    """One rank of the teacher's pool: the teacher model, sharded by ``plan``, forward passes only.

    ``layout`` is the run's ``SequenceLayout`` (the actor's): the teacher reads the same columns.
    """

    def __init__(self, teacher_path: str, plan: ParallelPlan, *, layout: SequenceLayout, precision: str = "fp32",
                 padding_free: bool = False, micro_batch_tokens: int | None = None, seed: int = 0):
        from transformers import AutoConfig

        torch.manual_seed(seed)
        self.plan, self.rank, self.layout = plan, dist.get_rank(), layout
        config = AutoConfig.from_pretrained(str(teacher_path))  # the torch backend (the driver checked)
        groups = build_groups(plan, tied_ends=bool(getattr(config, "tie_word_embeddings", False)) and plan.pp > 1)
        self.model = make_model(Backend(), teacher_path, plan, lr=0.0, max_grad_norm=None, seed=seed, eps=1e-6,
                                precision=precision, groups=groups)
        self.model.set_scoring(first_column=layout.first_scored)
        self.model.set_packing(padding_free, micro_batch_tokens)

    def ref_logprobs(self, batch: Batch) -> RefScored:
        """The teacher's log-probs of this DP rank's samples' response tokens (the reference's column)."""
        batch = Batch.of(batch)
        out = self.model.logprobs(batch.input_ids, batch.attention_mask, **images_of(batch))
        return RefScored(ref_logprobs=self.layout.response(out["logprobs"]))

    def close(self) -> None:
        """Nothing to flush: the teacher never trains."""


__all__ = ["TeacherWorker"]
