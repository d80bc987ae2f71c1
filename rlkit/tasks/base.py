"""What every toy task shares: rows, seeded splits, and completions cleaned before scoring.

A task is a small dataclass. Calling it returns its dataset (so ``rlkit.tasks.arithmetic()`` reads as
"the arithmetic data") and its bound ``reward`` method is a TRL-style reward function
(``f(prompts, completions, **columns) -> list[float]``). Pure Python: no torch, no pandas until asked.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

SPLITS = ("train", "test")
# Generation stops here; anything after an end marker is not part of the answer.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "</s>", "<pad>")
_END_RE = re.compile("|".join(re.escape(m) for m in END_MARKERS))


class Rows(list):
    """A task's dataset: a plain ``list[dict]`` (one dict per example) with ``.to_pandas()``.

    >>> rows = Rows([{"prompt": "1+1=", "answer": "2"}])
    >>> rows.columns(), rows.column("answer")
    (['prompt', 'answer'], ['2'])
    """

    def columns(self) -> list[str]:
        """Column names, from the first row."""
        return list(self[0]) if self else []

    def column(self, name: str) -> list[Any]:
        """One column as a list (e.g. the ``answer=`` argument of a reward function)."""
        return [row[name] for row in self]

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (pandas is imported only here)."""
        import pandas as pd

        return pd.DataFrame(list(self), columns=self.columns() or None)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a split; use one of {list(SPLITS)}")


def check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative int (the number of rows to draw)")


def prompt_key(prompt: Any) -> str:
    """The text a prompt is identified by: the string itself, or a chat's message contents joined.

    >>> prompt_key("1+1="), prompt_key([{"role": "user", "content": "What is 1 + 1?"}])
    ('1+1=', 'user: What is 1 + 1?')
    """
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def split_of(key: str, test_fraction: float) -> str:
    """The split a problem belongs to, fixed by a stable hash of its text (not by the seed).

    So train and test never share a problem, whatever seeds the two datasets were drawn with.
    """
    bucket = zlib.crc32(key.encode()) % 10_000
    return "test" if bucket < round(test_fraction * 10_000) else "train"


def rng_for(seed: int, split: str) -> random.Random:
    """A private RNG per (seed, split): the global ``random`` state is never touched."""
    return random.Random(f"{seed}/{split}")


def completion_text(completion: Any) -> str:
    """The text of one completion, whatever shape it came in; never raises.

    Accepts a string, ``None``, or a TRL conversational completion (a list of ``{"role", "content"}``
    messages: the last message's content is used). Cuts at the first end-of-sequence marker.

    >>> completion_text("42<|endoftext|>17"), completion_text([{"role": "assistant", "content": "7"}])
    ('42', '7')
    """
    if completion is None:
        return ""
    if isinstance(completion, (list, tuple)):  # conversational: [{"role": ..., "content": ...}, ...]
        completion = completion[-1] if completion else ""
    if isinstance(completion, dict):
        completion = completion.get("content", "")
    if isinstance(completion, bytes):
        completion = completion.decode("utf-8", errors="replace")
    if not isinstance(completion, str):
        completion = str(completion)
    return _END_RE.split(completion, maxsplit=1)[0]


def aligned_column(name: str, columns: dict[str, Sequence[Any] | None], n: int, reward_name: str,
                   hint: str) -> Sequence[Any]:
    """Column ``name`` from a reward call, checked to have one entry per completion."""
    values = columns.get(name)
    if values is None:
        raise TypeError(f"{reward_name}() needs the {name!r} column: call it as "
                        f"{reward_name}(prompts, completions, {name}=[...]) ({hint})")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        values = [values] * n  # one value for every completion
    if len(values) != n:
        raise ValueError(f"{reward_name}(): {name}= has {len(values)} entries but there are {n} "
                         f"completions; pass one {name} per completion (aligned with prompts)")
    return values


def draw(n: int, seed: int, split: str, make: Any, test_fraction: float) -> Iterator[dict]:
    """Rows for ``split`` by rejection sampling: ``make(rng)`` proposes a row, its prompt's hash decides
    the split. Uniform over the split's problems; repeats only once ``n`` nears the split's size."""
    rng = rng_for(seed, split)
    tries = 0
    produced = 0
    while produced < n:
        row = make(rng)
        tries += 1
        if split_of(prompt_key(row["prompt"]), test_fraction) == split:
            produced += 1
            tries = 0
            yield row
        elif tries > 10_000:  # this split is empty (e.g. test_fraction=0 and split="test")
            raise ValueError(f"split={split!r} holds no problems with test_fraction={test_fraction}; "
                             "use a test_fraction strictly between 0 and 1")
