"""A generative reward: an LLM judge reads the prompt and the completion and writes a score.

``Judge(model=..., prompt=...)`` is a reward with TRL's batched signature. Each call renders one judge prompt per
completion from ``prompt`` (its ``{completion}`` slot, and ``{prompt}`` or any dataset column such as
``{answer}``), through the judge's chat template when it has one, and has its own rollout engine (``engine="hf"``
or ``"vllm"``) answer all of them in one batch, greedily. The first number in each answer (``pattern``) inside
``scale`` becomes the reward, scaled to [0, 1].

Where it runs: with ``cluster=`` (an ``rlkit.Cluster``), in a worker on a resource pool of its own, beside the
trainer's; without, in this process. The engine starts on the first call (or ``start()``).

Nothing a judge does crashes a step: an answer with no number in the scale, a prompt longer than the judge's
context, or a batch that takes longer than ``timeout_s`` gives ``on_failure`` (None: no reward, the sample is
skipped and counted in the step's ``reward/skipped``) and is counted in ``failures`` and in the step's
``judge/unparseable``, ``judge/too_long``, ``judge/timeout`` metrics. A timed-out batch keeps running in the
background; the next call waits behind it.

>>> Judge.parse("Score: 8/10", r"-?\\d+(?:\\.\\d+)?", (0, 10)), Judge.parse("great!", r"-?\\d+", (0, 10))
(0.8, None)
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rlkit.errors import RlkitError
from rlkit.tasks.base import completion_text


class JudgeError(RlkitError, ValueError):
    """A Judge setting that cannot work; the message names the value and the fix."""


class JudgeWorker:
    """The judge's engine, on whichever process hosts it (a Ray worker, or this one)."""

    def __init__(self, model: str, engine: str, max_new_tokens: int):
        from rlkit.rollout import Rollout, make_engine

        self.engine = make_engine(Rollout(engine=engine, n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                                          on_long_prompt="skip"), model)

    def answer(self, texts: list[str]) -> list[str | None]:
        """One greedy answer per judge prompt (None: too long for the judge's context)."""
        batch = self.engine.generate(texts, seed=0)
        out: list[str | None] = [None] * len(texts)
        for i, text in zip(batch.prompt_index.tolist(), batch.texts):
            out[i] = text
        return out

    def close(self) -> None:
        self.engine.close()


class Judge:
    """An LLM judge as a reward (see the module docstring).

    Args:
        model: the judge's checkpoint (folder, hub id or ``rlkit.models`` name).
        prompt: the judge's instructions, with ``{completion}`` and optionally ``{prompt}`` / dataset columns.
        engine: ``"hf"`` or ``"vllm"``. cluster: an ``rlkit.Cluster`` to run it on a pool of its own.
        max_new_tokens: the judge's answer length. pattern, scale: what a score looks like and its range.
        timeout_s: the bound on one batch. on_failure: the reward where the judge fails (None: no reward).
    """

    __name__ = "judge"

    def __init__(self, model: str, prompt: str, *, engine: str = "hf", cluster: Any = None, max_new_tokens: int = 16,
                 pattern: str = r"-?\d+(?:\.\d+)?", scale: tuple[float, float] = (0.0, 10.0), timeout_s: float = 120.0,
                 on_failure: float | None = None, chat: bool = True):
        from rlkit.checks import integer, number

        fields = [f for _, f, _, _ in string.Formatter().parse(prompt)] if isinstance(prompt, str) else []
        if "completion" not in fields:
            raise JudgeError(f"prompt={prompt!r} has no {{completion}} slot: the judge would not see what it scores; "
                             f"write e.g. 'Question: {{prompt}}\\nAnswer: {{completion}}\\nScore 0-10:'")
        if engine not in ("hf", "vllm"):
            raise JudgeError(f"engine={engine!r}: the judge runs on 'hf' or 'vllm'")
        integer("max_new_tokens", max_new_tokens, hint="the judge's answer length, e.g. 16", error=JudgeError)
        number("timeout_s", timeout_s, gt=0, hint="seconds one batch may take, e.g. 120", error=JudgeError)
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise JudgeError(f"pattern={pattern!r} is not a regular expression ({e})") from None
        if not (isinstance(scale, (tuple, list)) and len(scale) == 2 and float(scale[0]) < float(scale[1])):
            raise JudgeError(f"scale={scale!r} must be (lowest, highest) with lowest < highest, e.g. (0, 10)")
        from rlkit.hub import resolve_checkpoint

        self.model, self.prompt, self.engine_name, self.cluster = resolve_checkpoint(model), prompt, engine, cluster
        self.fields = {f for f in fields if f}
        self.max_new_tokens, self.pattern, self.scale = max_new_tokens, pattern, (float(scale[0]), float(scale[1]))
        self.timeout_s, self.on_failure, self.chat = float(timeout_s), on_failure, chat
        self.failures: Counter[str] = Counter()
        self._since: Counter[str] = Counter()
        self._group: Any = None
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="rlkit-judge")
        self._tokenizer: Any = None

    # ---- the engine --------------------------------------------------------------------------------
    def start(self) -> Judge:
        """Start the judge's engine now (else on the first call). Returns the judge."""
        if self._group is None:
            if self.cluster is not None:
                from rlkit.workers.group import WorkerGroup

                self._group = WorkerGroup(self.cluster, 1, JudgeWorker, self.model, self.engine_name,
                                          self.max_new_tokens, name="judge", init_process_group=False, owner=self,
                                          timeout_s=self.timeout_s)
            else:
                from rlkit.workers.local import LocalWorkerGroup

                # built on the thread that runs every call: an engine may be tied to its thread (vLLM's CPU
                # attention checks the OpenMP thread count it was set up with)
                self._group = self._calls.submit(LocalWorkerGroup, 1, JudgeWorker, self.model, self.engine_name,
                                                 self.max_new_tokens, name="judge",
                                                 init_process_group=False).result()
        return self

    def close(self) -> None:
        """Stop the judge's engine (and its worker)."""
        group, self._group = self._group, None
        if group is None:
            return
        if self.cluster is None:  # on the engine's own thread, behind a call still running (bounded)
            try:
                self._calls.submit(group.shutdown).result(timeout=self.timeout_s)
                return
            except FutureTimeout:
                pass  # that call ran past its bound: shut the engine down from here
        group.shutdown()

    # ---- scoring -----------------------------------------------------------------------------------
    def render(self, prompt: Any, completion: Any, columns: dict[str, Any]) -> str:
        """One judge prompt: the template filled, through the judge's chat template when it has one."""
        text = self.prompt.format(**{"prompt": completion_text(prompt), **columns,
                                     "completion": completion_text(completion)})
        if self.chat:
            if self._tokenizer is None:
                from rlkit.rollout.base import load_tokenizer

                self._tokenizer = load_tokenizer(self.model)
            if getattr(self._tokenizer, "chat_template", None):
                return self._tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                           add_generation_prompt=True)
        return text

    @staticmethod
    def parse(answer: str | None, pattern: str, scale: tuple[float, float]) -> float | None:
        """The first number ``pattern`` finds in ``answer``, scaled from ``scale`` to [0, 1]; None if there is
        none, or it lies outside the scale."""
        found = re.search(pattern, answer or "")
        if found is None:
            return None
        try:
            value = float(found.group(0))
        except ValueError:
            return None
        lo, hi = scale
        return (value - lo) / (hi - lo) if lo <= value <= hi else None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float | None]:
        missing = sorted(self.fields - {"prompt", "completion"} - set(columns))
        if missing:
            raise JudgeError(f"the judge's prompt reads {{{missing[0]}}}, which the dataset's rows do not have "
                             f"(columns: {sorted(columns)}); use {{prompt}}, {{completion}} or one of those")
        texts = [self.render(p, c, {k: columns[k][i] for k in self.fields if k in columns})
                 for i, (p, c) in enumerate(zip(prompts, completions))]
        self.start()
        job = self._calls.submit(self._group.call_rank0, "answer", texts)
        try:
            answers = job.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._count("timeout", len(texts))
            return [self.on_failure] * len(texts)
        out = []
        for answer in answers:
            score = self.parse(answer, self.pattern, self.scale)
            if score is None:
                self._count("too_long" if answer is None else "unparseable", 1)
                score = self.on_failure
            out.append(score)
        return out

    def _count(self, why: str, n: int) -> None:
        self.failures[why] += n
        self._since[why] += n

    def metrics(self) -> dict[str, float]:
        """The failures since the last call, by kind (the trainer logs them per step as ``judge/*``)."""
        out = {f"judge/{why}": float(n) for why, n in self._since.items()}
        self._since.clear()
        return out


__all__ = ["Judge", "JudgeError", "JudgeWorker"]
