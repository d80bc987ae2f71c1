"""Toy tasks with verifiable rewards, plus an SFT warm-start and an evaluator.

Each task is a small dataclass: calling it returns its dataset (a ``list[dict]`` with ``prompt`` and
answer columns, ``.to_pandas()`` for a DataFrame) and ``task.reward`` is a TRL-style reward function
``f(prompts, completions, **columns) -> list[float]``. Ready-made instances: ``arithmetic``
(2-digit addition), ``chat_arithmetic`` (the same asked in a chat, for instruction-tuned models), ``repeat`` (repeat the
prompt's letter, learnable by RL from a random init) and ``shapes`` (count the shapes in a picture: a
vision-language task).
``reasoning_gym(name, **config)`` makes a task of any of reasoning-gym's procedural generators, scored by
its own verifier.

>>> import rlkit
>>> rows = rlkit.tasks.arithmetic(n=2, seed=0)
>>> rewards = rlkit.tasks.arithmetic.reward([r["prompt"] for r in rows], [r["answer"] for r in rows],
...                                         answer=rows.column("answer"))
>>> rewards
[1.0, 1.0]
"""

from rlkit.tasks.arith import Arithmetic, ChatArithmetic, first_number, last_number
from rlkit.tasks.base import Rows, completion_text
from rlkit.tasks.calc import Calculator, calculator
from rlkit.tasks.letters import Repeat
from rlkit.tasks.pictures import Shapes
from rlkit.tasks.reasoning import ChatReasoningGym, ReasoningGym, reasoning_gym
from rlkit.tasks.sft import evaluate, sft_log, sft_warmstart

arithmetic = Arithmetic()
repeat = Repeat()

chat_arithmetic = ChatArithmetic()
shapes = Shapes()

__all__ = ["Arithmetic", "Calculator", "calculator", "ChatArithmetic", "ChatReasoningGym", "ReasoningGym", "Repeat", "chat_arithmetic", "last_number",
           "Rows", "arithmetic", "completion_text", "evaluate", "first_number", "reasoning_gym", "repeat", "sft_log",
           "sft_warmstart", "Shapes", "shapes"]
