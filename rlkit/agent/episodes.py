"""Multi-turn rollouts: many episodes advance together, a turn at a time, on any rollout engine.

Each turn, every running episode's tokens so far (prompt, sampled turns, tool and environment messages)
go to the engine in one batch; each samples one assistant turn, up to the template's end-of-turn token.
The tool calls of all episodes then run concurrently, the environments step, and each episode gets the
template's glue for the new messages (``rlkit.agent.chat``) as tokens. Episodes that finish drop out of
the batch. The trajectory is exactly the tokens the engine sampled plus that glue: ``loss_mask`` marks the
sampled ones, the only tokens that carry loss.

An episode ends when the model answers without a tool call ("stop"), the environment says done
("done"), a turn runs out of ``Rollout.max_new_tokens`` ("length"), the next tokens would pass
``MultiTurn.max_tokens`` ("max_tokens": truncated) or the model calls a tool in its last allowed turn
("max_turns"). Sampling is seeded per episode and turn (from the prompt's seed, its sample and the
turn), so any batching of the episodes, on any layout, draws the same tokens.

Tools run here, on the worker that generates, in threads: a turn's calls cost one round of the slowest
call, with no trip through the driver; a failing or hung tool costs its episode a message, never the
worker (a hung tool's thread is abandoned after its timeout).

>>> from rlkit.models import tiny_lm
>>> from rlkit.rollout import HFEngine
>>> def echo(text: str) -> str:
...     '''Repeat the text.
...
...     Args:
...         text: what to repeat
...     '''
...     return text
>>> agent = Agent.of(tools=[echo], settings=MultiTurn(max_turns=2, max_tokens=24), max_new_tokens=8)
>>> engine = HFEngine(tiny_lm("qwen2", size="test"), n=2, max_new_tokens=8)
>>> out = run_episodes(engine, agent, [agent.format(engine.tokenizer).render_prompt("hi")], seed=0)
>>> out.num_samples, out.loss_mask.shape == out.response_mask.shape
(2, True)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.agent.chat import ChatFormat
from rlkit.agent.environment import EnvStep, check_environment
from rlkit.agent.tools import Tool, as_tools, parse_tool_calls, run_tool_calls
from rlkit.errors import TrainerError
from rlkit.rollout.base import (
    RolloutBatch,
    assemble,
    check_lengths,
    prompt_limit,
    prompt_seeds,
    tokenize_prompts,
)


@dataclass(frozen=True)
class MultiTurn:
    """The bounds of a multi-turn episode.

    Args:
        max_turns: assistant turns at most (a tool call in the last one ends the episode, "max_turns").
        max_tokens: response tokens in all: sampled turns, tool and environment messages and template glue
            (the sequence layout's response width). None: ``max_turns * max_new_tokens`` plus 64 per tool turn.
        tool_timeout_s: a tool call that has not returned by then is an error message ("timeout").
        max_tool_output_chars: a longer tool output is cut to this and marked ("truncated").
        tool_prompt: for chat templates without tool syntax, the system text that teaches the tool-call
            format, with ``{tools}`` where the tools' JSON schemas go (without it, the text alone describes
            the tools: a short prompt for a small model). None: ``rlkit.agent.chat.TOOL_PROMPT``.

    >>> MultiTurn(max_turns=4).response_len(max_new_tokens=32)
    320
    """

    max_turns: int = 4
    max_tokens: int | None = None
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 500
    tool_prompt: str | None = None

    def __post_init__(self) -> None:
        from rlkit.checks import integer, number

        integer("max_turns", self.max_turns, hint="assistant turns per episode, e.g. max_turns=4", error=TrainerError)
        integer("max_tokens", self.max_tokens, none_ok=True, hint="response tokens per episode, e.g. 512",
                error=TrainerError)
        number("tool_timeout_s", self.tool_timeout_s, gt=0, hint="seconds per tool call, e.g. 10", error=TrainerError)
        integer("max_tool_output_chars", self.max_tool_output_chars, hint="e.g. 500", error=TrainerError)
        if self.tool_prompt is not None and not isinstance(self.tool_prompt, str):
            raise TrainerError(f"MultiTurn(tool_prompt={self.tool_prompt!r}) must be text (with {{tools}} where the "
                               f"tools' schemas go), or None for rlkit's TOOL_PROMPT")

    def response_len(self, max_new_tokens: int) -> int:
        """The response width: ``max_tokens``, or its default for ``max_new_tokens`` per turn."""
        if self.max_tokens is not None:
            return self.max_tokens
        return self.max_turns * max_new_tokens + 64 * (self.max_turns - 1)


@dataclass(frozen=True)
class Agent:
    """What the workers get: the checked tools, the environment factory and the bounds, with the response
    width ``response_len``. Build it with ``Agent.of`` (in the driver: bad tools fail there)."""

    tools: tuple[Tool, ...]
    environment: Any
    settings: MultiTurn
    response_len: int

    @classmethod
    def of(cls, tools: Any = None, environment: Any = None, settings: MultiTurn | None = None, *,
           max_new_tokens: int) -> Agent:
        settings = settings or MultiTurn()
        if not isinstance(settings, MultiTurn):
            raise TrainerError(f"multi_turn={settings!r} must be an rlkit.MultiTurn(max_turns=..., max_tokens=...)")
        checked = as_tools(tools)
        check_environment(environment)
        length = settings.response_len(max_new_tokens)
        if length < max_new_tokens:
            raise TrainerError(f"MultiTurn(max_tokens={length}) is below Rollout(max_new_tokens={max_new_tokens}), one "
                               f"turn's tokens; raise max_tokens or lower max_new_tokens")
        return cls(checked, environment, settings, length)

    def format(self, tokenizer: Any) -> ChatFormat:
        """This agent's ``ChatFormat`` for ``tokenizer`` (made once per tokenizer and process)."""
        key = (id(tokenizer), id(self))
        if key not in _FORMATS:
            _FORMATS[key] = ChatFormat(tokenizer, self.tools, self.settings.tool_prompt)
        return _FORMATS[key]


_FORMATS: dict[tuple, ChatFormat] = {}


@dataclass
class _Episode:
    prompt_index: int
    sample: int
    prompt: list[int]
    seed: int
    env: Any = None
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None
    turns: int = 0
    tool_calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    env_reward: float | None = None
    ended_turn: bool = False

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        self.response += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.action += [1 if logprobs is not None else 0] * len(ids)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": sum(self.errors.values()),
                "errors": dict(self.errors), "truncated": self.reason == "max_tokens", "env_reward": self.env_reward}


def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The sampling seed of one episode's turn: from its prompt's seed, its sample and the turn alone."""
    return ((prompt_seed * 1_000_003 + sample) * 1_009 + turn) % (2**62)


def run_episodes(engine: Any, agent: Agent, prompts: list[str] | list[list[int]], *, seed: int,
                 first_index: int = 0, rows: list[dict[str, Any]] | None = None, **overrides: Any) -> RolloutBatch:
    """``Rollout.n`` episodes of each prompt on ``engine``, batched a turn at a time (see the module
    docstring). ``rows``: each prompt's dataset row, for the environment's ``reset``. Returns a
    ``RolloutBatch`` whose ``loss_mask`` marks the sampled tokens, with each sample's ``messages`` (the
    conversation after the prompt) and ``episodes`` (turns, tool calls, errors by kind, truncated)."""
    cfg = engine.config.with_overrides(**overrides)
    tok, limits = engine.tokenizer, agent.settings
    fmt, R = agent.format(tok), agent.response_len
    t0 = time.perf_counter()
    ids = tokenize_prompts(prompts, tok)
    limit, why = prompt_limit(cfg.with_overrides(max_new_tokens=R), engine.context_len)
    keep, skipped = check_lengths(ids, limit, cfg.on_long_prompt, why)
    seeds = prompt_seeds(seed, first_index, len(ids))
    episodes = []
    for i in keep:
        for j in range(cfg.n):
            env = None
            if agent.environment is not None:
                env = agent.environment()
                env.reset(rows[i] if rows is not None else {})
            episodes.append(_Episode(i, j, ids[i], seeds[i], env))
    if not episodes:
        return RolloutBatch.empty(engine.pad_token_id, skipped)
    stops = tuple(cfg.stop_token_ids) + ((fmt.end_of_turn,) if fmt.end_of_turn is not None else ())
    t_gen = t_tools = 0.0
    run = object()  # an episode's keys and values are kept between its turns under (run, id(episode))
    for turn in range(limits.max_turns):
        active = [e for e in episodes if e.reason is None]
        if not active:
            break
        room = max(R - len(e.response) for e in active)
        turn_cfg = cfg.with_overrides(n=1, max_new_tokens=min(cfg.max_new_tokens, room), stop_token_ids=stops)
        tg = time.perf_counter()
        # each turn prefills only what came since the episode's last one (the tool's reply): a turn's prefix
        # begins with the tokens the last turn fed, so an engine that keeps them (HFEngine) reuses them
        out_ids, out_lp, out_why, _ = engine.continue_ids(
            [e.prompt + e.response for e in active], turn_cfg, [turn_seed(e.seed, e.sample, turn) for e in active],
            [(run, id(e)) for e in active], room=[R - len(e.response) for e in active], keep_ended=True)
        t_gen += time.perf_counter() - tg
        replies: list[tuple[_Episode, list[dict[str, Any]]]] = []  # the messages each episode gets back
        calling: list[tuple[_Episode, list]] = []
        for e, r, lp, finish in zip(active, out_ids, out_lp, out_why):
            left = R - len(e.response)
            cut = len(r) > left or (finish == "length" and len(r) >= left)
            r, lp = r[:left], lp[:left]
            e.add(r, lp)
            e.turns += 1
            e.ended_turn = bool(r) and fmt.end_of_turn is not None and r[-1] == fmt.end_of_turn
            text = tok.decode(r, skip_special_tokens=True)
            calls = parse_tool_calls(text) if agent.tools else []
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in calls if c.error is None]
            e.messages.append(message)
            e.tool_calls += len(calls)
            if cut:
                e.reason = "max_tokens"
            elif finish == "length":
                e.reason = "length"
            elif calls:
                calling.append((e, calls))
            elif e.env is not None:
                replies.append((e, _step(e, message)))
            else:
                e.reason = "stop"
        tt = time.perf_counter()
        flat = [c for _, calls in calling for c in calls]
        results = iter(run_tool_calls(flat, agent.tools, timeout_s=limits.tool_timeout_s,
                                      max_chars=limits.max_tool_output_chars))
        t_tools += time.perf_counter() - tt
        for e, calls in calling:
            msgs = []
            for _ in calls:
                res = next(results)
                if res.error is not None:
                    e.error(res.error)
                msgs.append({"role": "tool", "name": res.name, "content": res.content})
            replies.append((e, msgs))
        for e, msgs in replies:
            if e.reason is not None:  # the environment ended it
                continue
            if turn == limits.max_turns - 1:
                e.reason = "max_turns"
                continue
            glue = fmt.glue_ids(msgs, ended_turn=e.ended_turn)
            if len(e.response) + len(glue) >= R:  # no room left for the model to act on them
                e.reason = "max_tokens"
                continue
            e.add(glue, None)
            e.messages.extend(msgs)
    engine.forget([(run, id(e)) for e in episodes])
    t1 = time.perf_counter()
    batch = assemble([e.prompt for e in episodes], [e.prompt_index for e in episodes], [e.response for e in episodes],
                     [e.logprobs for e in episodes], [e.reason or "max_turns" for e in episodes],
                     [tok.decode(e.response) for e in episodes], engine.pad_token_id, skipped, {}, engine.name)
    action = torch.zeros_like(batch.response_mask)
    for i, e in enumerate(episodes):
        action[i, :len(e.action)] = torch.tensor(e.action, dtype=action.dtype)
    batch.loss_mask = action
    batch.messages = [e.messages for e in episodes]
    batch.episodes = [e.stats() for e in episodes]
    batch.timings = {"prepare": 0.0, "generate": t_gen, "tools": t_tools, "episodes": t1 - t0,
                     "assemble": time.perf_counter() - t1}
    return batch


def episode_metrics(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """A step's episode metrics (each a mean per episode, or a fraction of them): turns, tool calls, tool
    errors (all, and by kind), truncations, and the share of tool calls that were well formed (valid JSON
    naming a known tool with fitting arguments).

    >>> episode_metrics([{"turns": 2, "tool_calls": 1, "tool_errors": 0, "errors": {}, "truncated": False},
    ...                  {"turns": 1, "tool_calls": 1, "tool_errors": 1, "errors": {"bad_json": 1}, "truncated": True}])["episode/well_formed_calls"]
    0.5
    """
    n = max(len(episodes), 1)
    calls = sum(e["tool_calls"] for e in episodes)
    malformed = sum(e["errors"].get(k, 0) for e in episodes for k in ("bad_json", "unknown_tool", "bad_arguments"))
    out = {"episode/turns": sum(e["turns"] for e in episodes) / n,
           "episode/tool_calls": calls / n,
           "episode/tool_errors": sum(e["tool_errors"] for e in episodes) / n,
           "episode/truncated": sum(bool(e["truncated"]) for e in episodes) / n,
           "episode/well_formed_calls": (calls - malformed) / calls if calls else float("nan")}
    for kind in sorted({k for e in episodes for k in e["errors"]}):
        out[f"episode/errors/{kind}"] = sum(e["errors"].get(kind, 0) for e in episodes) / n
    return out


def conversation_text(messages: list[dict[str, Any]] | str) -> str:
    """A conversation (a sample's ``messages`` after the prompt) as text, each message marked by its role and
    a tool's result by the tool's name; a string (a single-turn completion) as it is.

    >>> print(conversation_text([{"role": "assistant", "content": "<tool_call>...</tool_call>"},
    ...                          {"role": "tool", "name": "calculator", "content": "5781"},
    ...                          {"role": "assistant", "content": "5781"}]))
    [assistant] <tool_call>...</tool_call>
    [tool calculator] 5781
    [assistant] 5781
    """
    if isinstance(messages, str):
        return messages
    lines = []
    for m in messages:
        who = f"tool {m['name']}" if m.get("role") == "tool" and m.get("name") else m.get("role", "?")
        lines.append(f"[{who}] {m.get('content', '')}")
    return "\n".join(lines)


def _step(e: _Episode, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Step ``e``'s environment with the assistant's ``message``; its reward is summed into the episode's.
    An environment that raises ends its episode ("env_error", counted)."""
    try:
        out = EnvStep.of(e.env.step(dict(message)))
    except Exception as exc:  # noqa: BLE001 (the episode ends; the run goes on)
        e.error("env_error")
        e.reason = "env_error"
        e.messages.append({"role": "error", "content": f"{type(exc).__name__}: {exc}"})
        return []
    if out.reward is not None:
        e.env_reward = (e.env_reward or 0.0) + float(out.reward)
    if out.done:
        e.reason = "done"
        e.messages.extend(out.messages)
    return list(out.messages)


__all__ = ["Agent", "MultiTurn", "conversation_text", "episode_metrics", "run_episodes", "turn_seed"]
