"""Rewards: the reward step's weighted functions (``RewardFunctions``), and a learned reward model.

Every reward here has TRL's batched signature ``f(prompts, completions, **columns) -> list[float]``;
``Trainer(reward=[(f, weight), ...])`` sums several.

>>> import rlkit
>>> from rlkit.rewards import RewardModel, tiny_reward_model
>>> reward = [(RewardModel(tiny_reward_model()), 0.5), (rlkit.tasks.repeat.reward, 1.0)]
>>> len(reward[0][0](["aaa"], ["aaaa"]))
1
"""

from rlkit.rewards.functions import RewardFunctions
from rlkit.rewards.judge import Judge, JudgeError
from rlkit.rewards.math_answer import MathAnswer
from rlkit.rewards.model import RewardModel, RewardModelError, tiny_reward_model

__all__ = ["Judge", "JudgeError", "MathAnswer", "RewardFunctions", "RewardModel", "RewardModelError", "tiny_reward_model"]
