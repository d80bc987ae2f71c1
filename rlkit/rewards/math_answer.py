"""A math answer checked by ``math-verify`` (Hugging Face's verifier): equal as mathematics, not as text.

``MathAnswer`` is a reward with TRL's batched signature. It reads each completion's final answer (inside its last
``<answer>...</answer>`` when it has one, else the whole text, where math-verify finds a ``\\boxed{}`` or the last
expression), parses the row's gold answer the same way, and scores 1.0 when math-verify finds them equal
(``1/2``, ``0.5`` and ``\\frac{2}{4}`` are), else 0.0. A completion or gold answer it cannot parse scores 0.0
and is counted in ``failures``; nothing raises out of a reward call. math-verify bounds its own parsing with a
``SIGALRM`` timer, which only the main thread may set: elsewhere (a reward called from a thread) the bound is
off.

>>> reward = MathAnswer()
>>> reward(["2/4 = ?"] * 3, ["\\\\boxed{0.5}", "<answer>1/2</answer>", "it is 2"], answer=["\\\\frac{1}{2}"] * 3)
[1.0, 1.0, 0.0]
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from rlkit.tasks.base import aligned_column, completion_text

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class MathAnswer:
    """1.0 where a completion's final answer equals the row's ``answer_column`` by math-verify, else 0.0.

    ``timeout_s`` bounds parsing and comparing each answer (main thread only; see the module docstring).
    ``failures`` counts the answers math-verify could not read or compare.

    >>> MathAnswer.answer_of("so <answer> 7 </answer> or <answer>8</answer><|endoftext|>")
    '8'
    >>> MathAnswer.answer_of("4 + 3 makes 7."), MathAnswer.answer_of("half: \\\\boxed{\\\\frac{2}{4}}")
    ('7', '1/2')
    """

    __name__ = "math_answer"

    def __init__(self, answer_column: str = "answer", timeout_s: int = 5):
        if not isinstance(answer_column, str) or not answer_column:
            raise ValueError(f"answer_column={answer_column!r} must name the dataset column with the gold answers, "
                             f"e.g. answer_column='solution'")
        if not (isinstance(timeout_s, int) and timeout_s >= 1):
            raise ValueError(f"timeout_s={timeout_s!r} must be a whole number of seconds >= 1 (math-verify's "
                             f"timer counts seconds), e.g. timeout_s=5")
        self.answer_column, self.timeout_s, self.failures = answer_column, timeout_s, 0

    @staticmethod
    def final_text(completion: Any) -> str:
        """The text holding the completion's final answer: inside its last ``<answer>`` tags, else all of it."""
        text = completion_text(completion)
        tagged = _ANSWER_TAG.findall(text)
        return (tagged[-1] if tagged else text).strip()

    @classmethod
    def answer_of(cls, completion: Any) -> str:
        """The completion's final answer as math-verify reads it (what maj@k votes on, so "= 7." and "is 7"
        agree), as text; the ``final_text`` itself where math-verify reads no answer."""
        text = completion_text(completion)
        final = cls.final_text(text)
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        try:
            found = cls._parse(final, bool(_ANSWER_TAG.search(text)), timeout)
        except Exception:  # math-verify's own timeout or a parser error: vote on the text
            found = None
        return str(found[0]) if found else final

    @staticmethod
    def _parse(text: str, bare: bool, timeout: int | None) -> list[Any]:
        """math-verify's reading of ``text``; a ``bare`` answer (the gold one, or one inside ``<answer>`` tags)
        is read as LaTeX math first, so ``x^2 + 2x + 1`` is one expression rather than its last number."""
        from math_verify import parse

        if bare and "$" not in text and "\\boxed" not in text:
            found = parse(f"${text}$", parsing_timeout=timeout)
            if found:
                return found
        return parse(text, parsing_timeout=timeout)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        from math_verify import verify

        gold = aligned_column(self.answer_column, columns, len(completions), "MathAnswer",
                              "the gold answers; set MathAnswer(answer_column=...) to the dataset's column")
        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        out = []
        for completion, answer in zip(completions, gold):
            try:
                text = completion_text(completion)
                target = self._parse(str(answer), True, timeout)
                pred = self._parse(self.final_text(text), bool(_ANSWER_TAG.search(text)), timeout)
                ok = bool(target and pred and verify(target, pred, timeout_seconds=timeout))
            except Exception:  # math-verify's own timeout or a parser error: this answer is not verified
                self.failures += 1
                ok = False
            else:
                self.failures += not (target and pred)
            out.append(1.0 if ok else 0.0)
        return out


__all__ = ["MathAnswer"]
