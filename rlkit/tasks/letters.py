"""A task a random-init model can learn by RL alone: repeat the prompt's letter.

The reward is graded per character, so even a random policy gets a small, non-zero signal on
most samples and the first RL steps already have something to climb.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlkit.tasks.base import Rows, aligned_column, check_n, check_split, completion_text, rng_for


@dataclass(frozen=True)
class Repeat:
    """Prompts like ``"kkk"``: the completion should be the letter ``k`` repeated ``length`` times.

    ``reward`` = (number of the first ``length`` characters of the completion, cut at eos, that equal
    the prompt's letter) / ``length``, in [0, 1]. Optimum 1.0: at least ``length`` copies of the letter
    (what follows them is ignored). Stopping early costs the missing characters.

    Expected reward of a random policy (measured, 32 new tokens, default ``letters``/``length``): 0.024
    for uniform random tokens of the tiny tokenizers' vocab and 0.025 for a random-init
    ``tiny_lm("qwen2", size="small")`` sampled at temperature 1, with ~30% of samples above zero, so
    group-relative advantages (GRPO/RLOO) are non-zero from step one (``letters="a"``: 0.039, ~50%).
    With one letter every prompt is the same and the policy only has to prefer one token; more
    letters also ask it to copy.

    The prompt space is only ``len(letters)`` prompts, so train and test hold the same prompts
    (``split`` only changes the seed stream): this task measures learning, not generalisation.

    >>> task = Repeat(letters="ab", length=4)
    >>> task(n=2, seed=0)[0]["prompt"] in ("aaa", "bbb")
    True
    >>> task.reward(["aaa"] * 4, ["aaaa", "aab", "a<|endoftext|>aaa", ""], letter=["a"] * 4)
    [1.0, 0.5, 0.25, 0.0]
    """

    letters: str = "abcde"
    length: int = 16
    name: str = "repeat"

    def __post_init__(self):
        if not self.letters or not all(len(c.encode()) == 1 and c.isprintable() and not c.isspace()
                                       for c in self.letters):
            raise ValueError(f"letters={self.letters!r} must be a non-empty string of printable ASCII "
                             "characters (no spaces), e.g. letters='abcde'")
        if not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"length={self.length!r} must be a positive int (target characters)")

    def dataset(self, n: int = 1000, seed: int = 0, split: str = "train") -> Rows:
        """``n`` rows ``{"prompt": "kkk", "letter": "k"}``; same seed, same rows."""
        check_split(split)
        check_n(n)
        rng = rng_for(seed, split)
        letters = [rng.choice(self.letters) for _ in range(n)]
        return Rows({"prompt": c * 3, "letter": c} for c in letters)

    __call__ = dataset

    def target(self, row: dict) -> str:
        """The ideal completion for a row (what SFT would teach, before eos)."""
        return row["letter"] * self.length

    @property
    def max_new_tokens(self) -> int:
        """One token per letter (the tiny tokenizers have no merges of repeated letters) plus eos."""
        return self.length + 1

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """Per-character score in [0, 1] (TRL signature). Uses ``letter=`` if given, else the prompt's
        first character."""
        if columns.get("letter") is not None:
            letters = aligned_column("letter", columns, len(completions), "reward", "the letter column")
        else:
            letters = aligned_column("prompts", {"prompts": prompts}, len(completions), "reward",
                                     "the prompts, whose first character is the letter")
            letters = [completion_text(p)[:1] for p in letters]
        out = []
        for completion, letter in zip(completions, letters):
            head = completion_text(completion)[: self.length]
            letter = str(letter)[:1]
            out.append(sum(ch == letter for ch in head) / self.length if letter else 0.0)
        return out
