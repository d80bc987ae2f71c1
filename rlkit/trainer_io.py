"""The save / load half of ``rlkit.Trainer``: a checkpoint to resume from (``save`` / ``Trainer.load``, checked
in the driver by ``rlkit.checkpoint`` before a worker starts), the trained model as a plain Hugging Face
folder (``save_pretrained``) and LoRA adapters in peft's format (``save_adapter``). ``Trainer`` inherits
these methods; they read its workers, config and history.

>>> from rlkit import Trainer
>>> [m for m in ("save", "load", "save_pretrained", "save_adapter") if not hasattr(Trainer, m)]
[]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import torch

from rlkit.ahead import AheadQueue
from rlkit.config import TrainerConfig
from rlkit.errors import TrainerError
from rlkit.history import History
from rlkit.parallel.lora import lora_to_dict
from rlkit.plan.topology import ParallelPlan
from rlkit.rollout import Rollout
from rlkit.workers.placement import Placement


class TrainerIO:
    """Saving and loading a ``Trainer`` (mixed into it; see the module docstring)."""

    def save(self, path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> str:
        """Actor (and critic) sharded state + trainer state; atomic (a temp folder renamed into place).

        ``trainer.json`` records the checkpoint format and rlkit's version, ``model_config.json`` the
        model's config: ``load`` checks both (``rlkit.checkpoint``). ``path`` may be a URL (``s3://bucket/run``,
        any fsspec protocol; ``storage_options`` go to fsspec): staged locally, uploaded as a new version and
        committed by one small ``CURRENT`` object, so a save cut short leaves the last one loadable
        (``rlkit.remote``).

        >>> trainer.save("s3://bucket/run")                                         # doctest: +SKIP
        's3://bucket/run'
        """
        from rlkit import checkpoint, remote

        if remote.is_remote(path):  # the URL checked in the driver, then this save staged and uploaded
            return remote.save_version(path, self.save, step=self.step, storage_options=storage_options)
        path = remote.local_path(path)

        state = {"step": self.step, "rounds": self.rounds, "rows": self.history.rows, "kl_coef": getattr(self.kl_ctl, "value", None),
                 "sampler": {"kind": type(self.sampler).__name__, "state": self.sampler.state_dict(),
                             "chosen": {str(r): rows for r, rows in self._chosen.items() if r >= self.rounds}},
                 **self._state_config()}
        ahead = self._ahead.saved(self.config.timeout_s) if self._ahead else None
        if self._stream is not None:  # streaming: the running samples, the buffer, the chunk in flight (waited for)
            st = self._stream
            st.inflight = [(f.result(self.config.timeout_s) if hasattr(f, "result") else f, *rest)
                           for f, *rest in st.inflight]
            ahead = {"stream": st.saved()}
        return checkpoint.write_trainer(path, self.workers, state, self.model_path, lora=self.config.lora,
                                        ahead=ahead)

    def save_pretrained(self, path: str | os.PathLike, *, dtype: str | torch.dtype | None = None,
                        storage_options: dict[str, Any] | None = None) -> str:
        """The trained actor as a plain Hugging Face checkpoint folder, from any layout: config, safetensors
        weights (a tied lm_head written once), generation config, tokenizer and chat template. It loads with
        ``AutoModelForCausalLM.from_pretrained(path)`` and ``vllm.LLM(path)``. Written atomically; an earlier
        ``save_pretrained`` folder at ``path`` is replaced. ``dtype`` casts the weights (default: the
        actor's, fp32). Returns the path. A critic is not included (``save`` keeps it). With LoRA the
        adapters are merged into the weights (``save_adapter`` writes them alone). ``path`` may be a URL
        (``s3://bucket/final``; ``storage_options`` go to fsspec): the same plain folder, uploaded with
        ``config.json`` last, so a reader that finds it finds every file (``rlkit.remote.save_folder``).

        >>> trainer.fit(steps=20)                                                   # doctest: +SKIP
        >>> path = trainer.save_pretrained("runs/final")                            # doctest: +SKIP
        >>> model = transformers.AutoModelForCausalLM.from_pretrained(path)         # doctest: +SKIP
        """
        from rlkit import checkpoint, remote

        if self.workers is None:
            raise TrainerError("this Trainer was closed (trainer.close(), or a newer Trainer in this notebook took "
                               "its workers); Trainer.load a checkpoint and save_pretrained from it")
        if remote.is_remote(path):  # the URL checked before any gather, then the folder staged and uploaded
            target = remote.folder_target(path, storage_options)
            return remote.save_folder(target, path, lambda local: self.save_pretrained(local, dtype=dtype))
        target = checkpoint.pretrained_target(remote.local_path(path), self.model_path)  # refused before any gather
        return checkpoint.write_pretrained(target, self.workers.full_weights(), self.model_path,
                                           tokenizer=self.tokenizer, dtype=dtype)

    def save_adapter(self, path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> str:
        """The trained LoRA adapters in peft's own format (``adapter_config.json``, ``adapter_model.safetensors``),
        written atomically; ``PeftModel.from_pretrained(base_model, path)`` loads them. ``save_pretrained`` writes
        the merged model instead. Returns the path. A URL (``s3://...``) gets the same folder, uploaded with
        ``adapter_config.json`` last (``rlkit.remote.save_folder``).

        >>> path = trainer.save_adapter("runs/adapter")                             # doctest: +SKIP
        >>> model = peft.PeftModel.from_pretrained(base, path)                      # doctest: +SKIP
        """
        from rlkit import checkpoint, remote

        if self.config.lora is None:
            raise TrainerError("save_adapter needs a LoRA run (Trainer(..., lora=LoraConfig(...))); this run trains "
                               "full weights: use save_pretrained")
        if self.workers is None:
            raise TrainerError("this Trainer was closed; Trainer.load a checkpoint and save_adapter from it")
        if remote.is_remote(path):
            target = remote.folder_target(path, storage_options, marker="adapter_config.json")
            return remote.save_folder(target, path, self.save_adapter, marker="adapter_config.json")
        return checkpoint.write_adapter(remote.local_path(path), self.workers.adapter_weights(), self.config.lora, self.model_path)

    @classmethod
    def load(cls, path: str | os.PathLike, dataset: Any, reward: Any = None, cluster: Any = None,
             callbacks: Sequence[Callable] = (), tools: Sequence[Callable] | None = None, environment: Any = None,
             sampler: Any = None, plan: ParallelPlan | None = None, storage_options: dict[str, Any] | None = None,
             **overrides: Any) -> Self:
        """Resume from ``save``: same model, plan, rollout and config; pass the same dataset and reward (and for
        a multi-turn run the same ``tools`` / ``environment``: functions are not saved, the episode bounds are; and a
        ``sampler`` of the same class, whose state the checkpoint restores).

        ``plan``: go on under another layout than the one that saved (dp=2 -> tp=2, tp=2 x pp=2 -> dp=4, FSDP ->
        one rank). torch.distributed.checkpoint reshards the weights and the optimizer state onto it by their
        HF names; the step, metrics, sampler and rollout state are the run's. Each rank's RNG is restored only
        under the saving layout (another layout's ranks have no saved stream). The torch backend only:
        Megatron-Core's and DeepSpeed's checkpoints load into the plan that wrote them.

        >>> resumed = Trainer.load("runs/ckpt", dataset=data, plan=rlkit.ParallelPlan(tp=2))  # doctest: +SKIP

        The checkpoint is checked in the driver before workers start (``rlkit.checkpoint``): a missing or
        damaged file, another model's checkpoint or a newer rlkit's is a ``CheckpointError`` naming the file
        and the fix. Loading never writes into ``path``. A URL (``s3://bucket/run``; ``storage_options`` go to
        fsspec) is downloaded into a local staging folder first, the version its ``CURRENT`` names.

        >>> trainer = rlkit.Trainer.load("s3://bucket/run", dataset=rlkit.tasks.repeat)  # doctest: +SKIP
        """
        from rlkit import checkpoint, remote

        if remote.is_remote(path):  # checked and downloaded in the driver, then loaded as a local checkpoint
            with remote.downloaded_version(path, storage_options) as local:
                return cls.load(local, dataset, reward, cluster, callbacks, tools, environment, sampler, plan,
                                **overrides)
        path = Path(remote.local_path(path)).expanduser().absolute()
        state, saved_plan = checkpoint.verified_state(path)  # every check the driver can make, before any worker
        plan = checkpoint.load_plan(path, state, saved_plan, plan)
        config = TrainerConfig(**{**state["config"], **overrides})
        saved_sampler = state.get("sampler") or {"kind": "EpochSampler", "state": {}, "chosen": {}}
        given = type(sampler).__name__ if sampler is not None else "EpochSampler"
        if given != saved_sampler["kind"]:
            raise TrainerError(f"{path} was trained with sampler {saved_sampler['kind']}, and this load has {given}: "
                               f"pass sampler={saved_sampler['kind']}(...) (with the run's settings) so the rows it "
                               f"chooses resume where they were")
        placement, rollout_workers = state.get("placement", "colocated"), state.get("rollout_workers") or 1
        if state.get("teacher_plan"):  # the teacher's pool of its own, as the run had it
            teacher = ParallelPlan(**state["teacher_plan"])
            placement = Placement.split(plan, rollout_workers, teacher=teacher) if placement == "split" else \
                Placement.colocated(plan, teacher=teacher)
            rollout_workers = 1
        self = cls(state["model"], dataset, reward, state["algorithm"], plan=plan, tools=tools, environment=environment,
                   multi_turn=checkpoint.multi_turn_of(state, path, tools, environment),
                   rollout=Rollout(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["rollout"].items()}),
                   cluster=cluster, config=config, callbacks=callbacks, placement=placement,
                   rollout_workers=rollout_workers, sampler=sampler)
        self._resume(path, state)
        return self

    def _resume(self, path: Path, state: dict[str, Any]) -> None:
        """Load the checkpoint at ``path`` (``trainer.json``'s ``state``, checked) into this trainer's workers,
        just started, and take its step, history, sampler, KL coefficient and what was in flight: the half of
        ``load`` that a restart after a lost worker repeats (``Trainer.fit``)."""
        from rlkit import checkpoint
        from rlkit.errors import WorkerError

        saved_sampler = state.get("sampler") or {"kind": "EpochSampler", "state": {}, "chosen": {}}
        try:
            self.workers.load(str(path))  # the engines follow at the next step's sync
        except WorkerError as e:  # what the driver could not see: the workers' half-loaded state is dropped
            self.close()
            raise checkpoint.worker_failure(path, e) from None
        self.step, self.history = state["step"], History([r for r in state["rows"] if r.get("step", 0) <= state["step"]])
        self._ahead = AheadQueue()  # a restart: what was in flight went with the old workers
        self._stream = self._new_stream() if self.config.streaming else None
        ahead = checkpoint.read_ahead(path)
        if isinstance(ahead, dict) and "stream" in ahead:  # streaming: running samples and buffer, as they were
            from rlkit.stream import Stream

            self._stream, ahead = Stream.restore(ahead["stream"]), None
            self._stream.engine_version = -1  # the engines start from the model's files: they take the weights first
        elif ahead is not None:  # asynchronous RL: the batches in flight at save, trained next as they were
            self._ahead.restore(ahead)
        # the dataset's prompt batches taken (a checkpoint from before dynamic sampling: one per step and entry)
        self.rounds = state.get("rounds", self.step + len(ahead or []))
        self.sampler.load_state_dict(saved_sampler["state"])
        self._chosen = {int(r): rows for r, rows in saved_sampler["chosen"].items()}
        if state.get("kl_coef") is not None and hasattr(self.kl_ctl, "value"):
            self.kl_ctl.value = state["kl_coef"]
        # One truthful history: metrics.jsonl rolled back to the checkpoint at once (a crash now would leave
        # a truthful file too); rows the earlier run logged after it are kept aside
        self.runs.roll_back(self.step, self.history.rows)

    def _state_config(self) -> dict[str, Any]:
        def fields(plan: Any) -> dict[str, Any] | None:
            return None if plan is None else {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}

        return {"model": self.model_path, "algorithm": self.algorithm, "plan": fields(self.plan),
                "placement": self.placement.kind, "rollout_workers": self.placement.rollout_workers,
                "teacher_plan": fields(self.placement.teacher_plan),
                "rollout": dataclasses.asdict(self.rollout),
                "config": {**dataclasses.asdict(self.config), "lora": lora_to_dict(self.config.lora)},
                "multi_turn": None if self.agent is None else {
                    "settings": dataclasses.asdict(self.agent.settings), "tools": [t.name for t in self.agent.tools],
                    "environment": getattr(self.agent.environment, "__name__", None)}}


__all__ = ["TrainerIO"]
