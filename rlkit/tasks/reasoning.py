"""Procedural reasoning tasks from ``reasoning-gym`` (106 generators: arithmetic, puzzles, logic, ...),
scored by the package's own verifier (``dataset.score_answer(answer, entry)``).

``reasoning_gym(name, **config)`` is a task like ``rlkit.tasks.arithmetic``: ``task.dataset(n, seed,
split)`` gives rows ``{"prompt", "question", "answer", "metadata"}`` and ``task.reward`` is a TRL-style
reward ``f(prompts, completions, **columns) -> list[float]``. Prompts are text (``template``, for base
models and the tiny test models) or, with ``chat=True``, a chat with one user message (the Trainer renders
it with the model's chat template).

Train and test never share a question. reasoning-gym builds item ``i`` of a dataset made with ``seed`` from
``seed + i``, so datasets from nearby seeds share most items. Here each ``(seed, split)`` reads its own
block of item seeds (``2**20`` of them, at ``(2 * seed + k) * 2**20`` with ``k`` 0 for train and 1 for
test, modulo ``2**32``), and each question belongs to one split by a stable hash of its text
(``test_fraction`` of them to test), as in ``rlkit.tasks.arithmetic``: a question that two item seeds
both produce still lands in one split only.

>>> import rlkit
>>> task = rlkit.tasks.reasoning_gym("basic_arithmetic", min_terms=2, max_terms=2, max_digits=2)
>>> row = task.dataset(n=1, seed=0)[0]
>>> sorted(row), row["prompt"] == row["question"] + "\\nAnswer:"
(['answer', 'metadata', 'prompt', 'question'], True)
>>> columns = {c: [row[c]] * 3 for c in ("question", "answer", "metadata")}   # one per completion
>>> task.reward([row["prompt"]] * 3, [row["answer"], " <answer>" + row["answer"] + "</answer>", "no idea"],
...             **columns)
[1.0, 1.0, 0.0]
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import TrainerError
from rlkit.tasks.base import Rows, aligned_column, check_n, check_split, completion_text, split_of

BLOCK = 2**20  # item seeds per (seed, split): the most candidates one dataset() call may read
CHUNK = 1024  # items per reasoning-gym dataset object (generators that precompute per size stay small)
RESERVED = ("seed", "size")  # chosen here, per split


def _gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise TrainerError("reasoning-gym is not installed; pip install reasoning-gym (it works offline)") from None
    return reasoning_gym


def names() -> list[str]:
    """The reasoning-gym generators that ``reasoning_gym(name)`` takes.

    >>> "basic_arithmetic" in names(), len(names()) > 100
    (True, True)
    """
    from reasoning_gym.factory import DATASETS  # the registry create_dataset reads

    _gym()
    return sorted(DATASETS)


@dataclass(frozen=True)
class ReasoningGym:
    """A reasoning-gym generator as an rlkit task, with text prompts ``template.format(question=...)``.

    ``config`` holds the generator's own options (e.g. ``min_terms``, ``max_digits`` for
    ``basic_arithmetic``); ``seed`` and ``size`` are chosen per split here. ``reward`` scores each
    completion (cut at eos; the text inside its last ``<answer>...</answer>`` if it has one, else all of
    it, stripped) with the generator's ``score_answer`` against the row's ``question``, ``answer`` and
    ``metadata`` columns, in [0, 1]; a verifier that raises on a malformed answer scores it 0.0.

    >>> task = ReasoningGym("chain_sum", {"min_terms": 2, "max_terms": 2})
    >>> task.name, task.dataset(n=2, seed=0)[1]["prompt"].endswith("\\nAnswer:")
    ('chain_sum', True)
    >>> ReasoningGym("basic_arithmetc")
    Traceback (most recent call last):
    ...
    rlkit.errors.TrainerError: reasoning-gym has no task 'basic_arithmetc' (did you mean 'basic_arithmetic'?); rlkit.tasks.reasoning.names() lists all 106
    """

    task: str = "basic_arithmetic"
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    template: str = "{question}\nAnswer:"
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        gym = _gym()
        known = names()
        if self.task not in known:
            close = difflib.get_close_matches(str(self.task), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TrainerError(f"reasoning-gym has no task {self.task!r}{hint}; rlkit.tasks.reasoning.names() lists "
                               f"all {len(known)}")
        if not isinstance(self.config, Mapping):
            raise TrainerError(f"config={self.config!r} must be a dict of {self.task}'s options")
        object.__setattr__(self, "config", dict(self.config))
        reserved = [k for k in RESERVED if k in self.config]
        if reserved:
            raise TrainerError(f"{reserved[0]}= is chosen per split by the task (train and test read their own "
                               f"item seeds); drop it and pass seed= to task.dataset(n, seed, split)")
        try:
            gym.create_dataset(self.task, seed=0, size=1, **self.config)
        except Exception as e:  # an unknown option (TypeError) or a value the config's validate() refuses
            from reasoning_gym.factory import DATASETS

            options = [f.name for f in dataclasses.fields(DATASETS[self.task][1]) if f.name not in RESERVED]
            raise TrainerError(f"reasoning-gym task {self.task!r} refuses config {self.config} ({type(e).__name__}: "
                               f"{str(e).strip()[:200]}); its options: {options}") from None
        if isinstance(self.test_fraction, bool) or not isinstance(self.test_fraction, (int, float)) \
                or not 0.0 < self.test_fraction < 1.0:
            raise TrainerError(f"test_fraction={self.test_fraction!r} must be strictly between 0 and 1")
        if not isinstance(self.template, str) or "{question}" not in self.template:
            raise TrainerError(f"template={self.template!r} must contain {{question}}")

    @property
    def name(self) -> str:
        """The reasoning-gym generator's name."""
        return self.task

    # ---- data ------------------------------------------------------------------------------------
    def prompt(self, question: str) -> Any:
        """The prompt a row asks with: here the text ``template.format(question=question)``."""
        return self.template.format(question=question)

    def entries(self, seed: int, split: str):
        """The generator's items for ``(seed, split)``, in order: the split's block of item seeds."""
        gym = _gym()
        base = ((2 * seed + (split == "test")) * BLOCK) % 2**32
        for start in range(0, BLOCK, CHUNK):
            yield from gym.create_dataset(self.task, seed=base + start, size=CHUNK, **self.config)

    def dataset(self, n: int = 1000, seed: int = 0, split: str = "train") -> Rows:
        """``n`` rows ``{"prompt", "question", "answer", "metadata"}`` of ``split``; same seed, same rows."""
        check_split(split)
        check_n(n)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise TrainerError(f"seed={seed!r} must be an integer >= 0")
        rows, misses = Rows(), 0
        if n == 0:
            return rows
        for entry in self.entries(seed, split):
            if split_of(entry["question"], self.test_fraction) != split:
                misses += 1
                if misses > 10_000:
                    raise TrainerError(f"{self.task} gave 10000 questions in a row outside split={split!r} "
                                       f"(test_fraction={self.test_fraction}); widen its config or change "
                                       f"test_fraction")
                continue
            misses = 0
            rows.append({"prompt": self.prompt(entry["question"]), "question": entry["question"],
                         "answer": entry["answer"], "metadata": entry["metadata"]})
            if len(rows) == n:
                return rows
        raise TrainerError(f"{self.task} ran out of item seeds ({BLOCK}) for n={n} rows of split={split!r}; ask "
                           f"for fewer rows")

    __call__ = dataset

    def target(self, row: dict) -> str:
        """The ideal completion for a row (what SFT teaches, before eos): its answer."""
        return str(row["answer"])

    # ---- reward ----------------------------------------------------------------------------------
    @functools.cached_property
    def verifier(self) -> Any:
        """The reasoning-gym dataset whose ``score_answer(answer, entry)`` scores completions."""
        return _gym().create_dataset(self.task, seed=0, size=1, **self.config)

    @staticmethod
    def answer_of(completion: Any) -> str:
        """The answer a completion gives: inside its last ``<answer>...</answer>``, else all of it, stripped.

        >>> ReasoningGym.answer_of("think <answer> 42 </answer><|endoftext|>"), ReasoningGym.answer_of(" 42\\n")
        ('42', '42')
        """
        from reasoning_gym.utils import extract_answer

        text = completion_text(completion)
        tagged = extract_answer(text) if "<answer>" in text else None
        return tagged if tagged is not None else text.strip()

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """The generator's own ``score_answer`` per completion (TRL signature; needs ``question=``,
        ``answer=`` and ``metadata=``, the task's columns)."""
        n = len(completions)
        cols = {c: aligned_column(c, columns, n, "reward", "a column of the task's dataset")
                for c in ("question", "answer", "metadata")}
        out = []
        for i, completion in enumerate(completions):
            entry = {c: cols[c][i] for c in cols}
            try:
                out.append(float(self.verifier.score_answer(self.answer_of(completion), entry)))
            except Exception:  # a verifier that chokes on a malformed answer: that answer is wrong
                out.append(0.0)
        return out


@dataclass(frozen=True)
class ChatReasoningGym(ReasoningGym):
    """A reasoning-gym generator asked in a chat, for instruction-tuned models: each row's ``prompt`` is
    ``[{"role": "user", "content": question}]`` (a ``system`` message first if given, e.g. one of
    ``reasoning_gym.utils.SYSTEM_PROMPTS``, which ask for ``<answer>`` tags). The Trainer renders it with
    the model's chat template.

    >>> task = ChatReasoningGym("chain_sum", system="Answer with just the number.")
    >>> [m["role"] for m in task.dataset(n=1, seed=0)[0]["prompt"]]
    ['system', 'user']
    """

    system: str | None = None

    def prompt(self, question: str) -> Any:
        """The chat a row asks with: an optional system message, then the question as the user's."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": question}]


def reasoning_gym(task: str, *, chat: bool = False, system: str | None = None, template: str = "{question}\nAnswer:",
                  test_fraction: float = 0.1, **config: Any) -> ReasoningGym:
    """A reasoning-gym generator as an rlkit task: ``config`` holds its own options; ``chat=True`` asks in a
    chat (``ChatReasoningGym``, with an optional ``system`` message), else in text (``template``).

    >>> import rlkit
    >>> task = rlkit.tasks.reasoning_gym("basic_arithmetic", max_digits=2)
    >>> train, test = task.dataset(n=200, seed=0), task.dataset(n=50, seed=1, split="test")
    >>> set(train.column("question")) & set(test.column("question"))
    set()
    >>> type(rlkit.tasks.reasoning_gym("chain_sum", chat=True)).__name__
    'ChatReasoningGym'
    """
    if not isinstance(chat, bool):
        raise TrainerError(f"chat={chat!r} must be True (a chat prompt) or False (text from template=)")
    if chat:
        return ChatReasoningGym(task, config, template, test_fraction, system=system)
    if system is not None:
        raise TrainerError("system= is the system message of a chat prompt; pass chat=True with it, or put the "
                           "instruction in template=")
    return ReasoningGym(task, config, template, test_fraction)


__all__ = ["ChatReasoningGym", "ReasoningGym", "names", "reasoning_gym"]
