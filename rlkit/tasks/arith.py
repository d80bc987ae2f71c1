"""Arithmetic with a verifiable answer: "17+25=" -> "42".

The tiny models' tokenizer splits digits into single tokens, so a ~1M-parameter model can learn
1- and 2-digit addition on a CPU in about a minute of SFT (see ``rlkit.tasks.sft_warmstart``) and RL
then has a reward it can push up.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlkit.tasks.base import Rows, aligned_column, check_n, check_split, completion_text, draw

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# At most 64 digits per number: Python refuses int() of >4300-digit strings, garbage must not raise.
_NUMBER = re.compile(r"-?\d{1,64}")


def first_number(text: Any) -> int | None:
    """The first integer in a completion (cut at eos), or ``None``; never raises.

    >>> first_number(" 42 is it"), first_number("x-7y"), first_number("<|endoftext|>5"), first_number("??")
    (42, -7, None, None)
    """
    match = _NUMBER.search(completion_text(text))
    return int(match.group()) if match else None


def last_number(text: Any) -> int | None:
    """The last integer in a completion (cut at eos), or ``None``; never raises.

    Chat models answer in sentences ("17 + 25 = 42."), so their answer is the last number, not the first.

    >>> last_number("17 + 25 = 42."), last_number("42<|im_end|>7"), last_number("none")
    (42, 42, None)
    """
    matches = _NUMBER.findall(completion_text(text))
    return int(matches[-1]) if matches else None


def _digit_match(pred: int, answer: int) -> float:
    """Fraction of digit positions (right-aligned, over the longer number) that agree."""
    p, a = str(abs(pred)), str(abs(answer))
    width = max(len(p), len(a))
    p, a = p.rjust(width, " "), a.rjust(width, " ")
    return sum(x == y for x, y in zip(p, a)) / width


@dataclass(frozen=True)
class Arithmetic:
    """Integer arithmetic prompts like ``"17+25="`` with the answer ``"42"``.

    Operands are uniform in ``[0, 10**digits)``; ``ops`` is any mix of ``"+-*"`` (for ``-`` the larger
    operand comes first, so answers are never negative). Each problem belongs to train or test by a
    stable hash of its prompt (``test_fraction`` of them to test), so the splits are disjoint for any
    seeds. Once ``n`` nears a split's size (100 problems per op for ``digits=1``) rows repeat.

    Rewards, both in [0, 1]:

    - ``reward``: 1.0 if the first integer in the completion (cut at eos) equals the answer, else 0.0.
      With ``strict=True`` the whole completion (stripped, cut at eos) must be exactly the answer.
    - ``partial_reward``: 1.0 exact; 0.0 if no number; else ``0.1`` (a number) ``+ 0.4 *`` the fraction
      of right-aligned digits that match ``+ 0.4 * max(0, 1 - |pred - answer| / (|answer| + 1))``,
      so any wrong answer scores below 0.9 and closer ones score more.

    >>> task = Arithmetic(digits=2)
    >>> rows = task(n=3, seed=0)                 # same as task.dataset(n=3, seed=0, split="train")
    >>> sorted(rows[0])
    ['a', 'answer', 'b', 'op', 'prompt']
    >>> task.reward(["17+25="] * 4, ["42", " 42<|endoftext|>", "41", "no"], answer=["42"] * 4)
    [1.0, 1.0, 0.0, 0.0]
    >>> [round(r, 3) for r in task.partial_reward(["17+25="] * 3, ["42", "41", ""], answer=[42] * 3)]
    [1.0, 0.691, 0.0]
    """

    digits: int = 2
    ops: str = "+"
    test_fraction: float = 0.1
    strict: bool = False
    template: str = "{a}{op}{b}="
    name: str = "arithmetic"

    def __post_init__(self):
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 18:
            raise ValueError(f"digits={self.digits!r} must be an int in 1..18 (digits per operand)")
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"ops={self.ops!r} has unsupported operators {bad}; use a mix of {''.join(OPS)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction={self.test_fraction!r} must be strictly between 0 and 1")
        if "{a}" not in self.template or "{b}" not in self.template:
            raise ValueError(f"template={self.template!r} must contain {{a}} and {{b}} (and may use {{op}})")

    # ---- data ------------------------------------------------------------------------------------
    def _make(self, rng) -> dict:
        high = 10**self.digits - 1
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(self.ops)
        if op == "-" and b > a:  # keep answers non-negative: fewer tokens for a tiny model to learn
            a, b = b, a
        return {"prompt": self.template.format(a=a, b=b, op=op), "answer": str(OPS[op](a, b)),
                "a": a, "b": b, "op": op}

    def dataset(self, n: int = 1000, seed: int = 0, split: str = "train") -> Rows:
        """``n`` rows ``{"prompt", "answer", "a", "b", "op"}`` from ``split``; same seed, same rows."""
        check_split(split)
        check_n(n)
        return Rows(draw(n, seed, split, self._make, self.test_fraction))

    __call__ = dataset

    def target(self, row: dict) -> str:
        """The ideal completion for a row (what SFT teaches, before eos)."""
        return str(row["answer"])

    @property
    def max_new_tokens(self) -> int:
        """Enough new tokens for the longest answer (one token per digit) plus eos and a spare."""
        longest = {"+": self.digits + 1, "-": self.digits, "*": 2 * self.digits}
        return max(longest[op] for op in self.ops) + 2

    # ---- rewards ---------------------------------------------------------------------------------
    def predicted(self, completion: Any) -> int | None:
        """The number a completion answers with (the first integer in it)."""
        return first_number(completion)

    def _pairs(self, completions: Sequence[Any], columns: dict, fn: str):
        answers = aligned_column("answer", columns, len(completions), fn,
                                 "the answer column of the task's dataset")
        for completion, answer in zip(completions, answers):
            yield completion, int(str(answer).strip())

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """Exact match, 1.0 or 0.0 per completion (TRL signature; needs ``answer=``)."""
        out = []
        for completion, answer in self._pairs(completions, columns, "reward"):
            if self.strict:
                text = completion_text(completion).strip()
                out.append(float(text == str(answer)))
            else:
                out.append(float(self.predicted(completion) == answer))
        return out

    def partial_reward(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """Partial credit in [0, 1]: exact 1.0, else number + digit-match + closeness (see class doc)."""
        out = []
        for completion, answer in self._pairs(completions, columns, "partial_reward"):
            pred = self.predicted(completion)
            if pred is None:
                out.append(0.0)
            elif pred == answer:
                out.append(1.0)
            else:
                closeness = max(0.0, 1.0 - abs(pred - answer) / (abs(answer) + 1))
                out.append(0.1 + 0.4 * _digit_match(pred, answer) + 0.4 * closeness)
        return out


@dataclass(frozen=True)
class ChatArithmetic(Arithmetic):
    """Arithmetic asked in a chat, for instruction-tuned models: the prompt is a list of messages.

    Each row's ``prompt`` is ``[{"role": "user", "content": "What is 17 + 25? Answer with just the
    number."}]`` (a ``system`` message first if given), the TRL conversational format: the Trainer renders
    it with the model's chat template (``add_generation_prompt=True``). ``question`` holds the user text.
    Splits are by the question's hash, as for ``Arithmetic``.

    ``reward`` checks the answer and its format, in [0, 1]: 0.6 if the answer is right (the last integer
    in the completion is the answer) plus 0.4 if the completion (stripped, cut at eos) is a bare integer.
    So ``"42"`` scores 1.0, ``"17 + 25 = 42"`` 0.6, ``"41"`` 0.4 and ``"The answer is 41"`` 0.0, and each
    half can be learnt alone: a small chat model rarely gets both at first. ``exact`` (reward == 1, as
    ``Trainer.evaluate`` reports it) is right *and* well-formatted. ``partial_reward`` is
    ``Arithmetic``'s, on the last integer.

    >>> task = ChatArithmetic(digits=2)
    >>> row = task(n=1, seed=0)[0]
    >>> row["prompt"] == [{"role": "user", "content": row["question"]}], row["question"].endswith("number.")
    (True, True)
    >>> task.reward(None, ["42", " 42<|im_end|>", "17 + 25 = 42.", "41", "The answer"], answer=[42] * 5)
    [1.0, 1.0, 0.6, 0.4, 0.0]
    """

    template: str = "What is {a} {op} {b}? Answer with just the number."
    system: str | None = None
    name: str = "chat-arithmetic"

    def _make(self, rng) -> dict:
        row = super()._make(rng)
        question = row["prompt"]
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {**row, "prompt": system + [{"role": "user", "content": question}], "question": question}

    def predicted(self, completion: Any) -> int | None:
        """The number a completion answers with: the last integer in it (chat models answer in sentences)."""
        return last_number(completion)

    @property
    def max_new_tokens(self) -> int:
        """Room for a one-sentence answer ("17 + 25 = 42") and eos: the whole question echoed back."""
        return 4 * self.digits + 10

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """0.6 for the right answer + 0.4 for a bare-integer reply (needs ``answer=``); see the class doc."""
        out = []
        for completion, answer in self._pairs(completions, columns, "reward"):
            right = last_number(completion) == answer
            bare = _NUMBER.fullmatch(completion_text(completion).strip()) is not None
            out.append(0.6 * right + 0.4 * bare)
        return out
