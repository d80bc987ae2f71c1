"""Agentic RL: multi-turn rollouts with tools and environments, token in and token out.

``Trainer(tools=[...], environment=..., max_turns=...)`` turns each rollout into an episode: the model
samples a turn, its tool calls run (``rlkit.agent.tools``), an environment steps
(``rlkit.agent.environment``), the chat template's glue for their messages is appended as tokens
(``rlkit.agent.chat``), and the next turn samples, many episodes batched a turn at a time
(``rlkit.agent.episodes``). Only the sampled tokens carry loss.

>>> from rlkit.agent import MultiTurn
>>> MultiTurn(max_turns=3, max_tokens=256).max_turns
3
"""

from rlkit.agent.chat import TOOL_PROMPT, ChatFormat
from rlkit.agent.environment import EnvStep, check_environment
from rlkit.agent.episodes import Agent, MultiTurn, conversation_text, episode_metrics, run_episodes
from rlkit.agent.tools import Tool, as_tools, parse_tool_calls, run_tool_calls

__all__ = ["TOOL_PROMPT", "Agent", "ChatFormat", "EnvStep", "MultiTurn", "Tool", "as_tools", "check_environment",
           "conversation_text", "episode_metrics", "parse_tool_calls", "run_episodes", "run_tool_calls"]
