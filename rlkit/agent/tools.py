"""Tools: plain typed Python functions with docstrings (TRL's convention), their JSON schemas, the tool
calls a model writes, and running them with a bound on time and output.

A tool is ``f(arg: type, ...) -> str`` with a Google-style docstring; its schema comes from
``transformers.utils.get_json_schema``, the helper ``apply_chat_template(tools=...)`` uses. A model calls
tools in the Hermes format (Qwen2.5's, and rlkit's documented one for templates without tool syntax)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 47"}}
    </tool_call>

Every way a call can fail (bad JSON, an unknown tool, wrong arguments, a tool that raises, returns a
non-string, outlives its timeout or returns too much) becomes a message to the model and a counted
``error`` kind: a failure is part of the episode, never a crash.

>>> def add(a: int, b: int) -> str:
...     '''Add two integers.
...
...     Args:
...         a: the first
...         b: the second
...     '''
...     return str(a + b)
>>> tools = as_tools([add])
>>> calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
>>> [r.content for r in run_tool_calls(calls, tools, timeout_s=5, max_chars=100)]
['5']
>>> parse_tool_calls('<tool_call>{"name": add}</tool_call>')[0].error
'bad_json'
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import TrainerError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
# the kinds of failed calls, as the metrics count them
ERRORS = ("bad_json", "unknown_tool", "bad_arguments", "raised", "not_string", "timeout", "truncated")
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,)}


@dataclass(frozen=True, eq=False)
class Tool:
    """A tool: its name, function and JSON schema (``{"type": "function", "function": {...}}``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


@dataclass
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments``, or ``error`` (a kind of ``ERRORS``) and why."""

    name: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    detail: str = ""


@dataclass
class ToolResult:
    """What goes back to the model (``content``), for the call to ``name``; ``error``: the failure's kind."""

    name: str
    content: str
    error: str | None = None


def as_tools(tools: Sequence[Callable[..., Any]] | None) -> tuple[Tool, ...]:
    """Check the Trainer's ``tools=`` in the driver: each a function with type hints and a docstring that
    ``get_json_schema`` reads, names unique. Raises ``TrainerError`` naming the tool and the fix."""
    from transformers.utils import get_json_schema

    if tools is None:
        return ()
    if callable(tools) or isinstance(tools, (str, bytes)):
        raise TrainerError(f"tools={tools!r} must be a list of functions; wrap a single tool: tools=[{getattr(tools, '__name__', 'f')}]")
    out: list[Tool] = []
    for fn in tools:
        if not callable(fn) or not hasattr(fn, "__name__"):
            raise TrainerError(f"tool {fn!r} is not a function; give plain typed functions with docstrings, "
                               f"e.g. def calculator(expression: str) -> str")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise TrainerError(f"tool {fn.__name__!r} cannot be described to the model: {e}. Give it a type hint on "
                               f"every argument and a Google-style docstring with an Args: section, e.g.\n"
                               f"def {fn.__name__}(expression: str) -> str:\n    \"\"\"What it does.\n\n    Args:\n"
                               f"        expression: what to pass\n    \"\"\"") from None
        name = schema["function"]["name"]
        if any(t.name == name for t in out):
            raise TrainerError(f"two tools are named {name!r}; tool names must be unique (rename one function)")
        out.append(Tool(name, fn, schema))
    return tuple(out)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in an assistant message, in order; a malformed one is a ``ToolCall`` with ``error``.
    An opening tag with no closing one is a malformed call."""
    calls, bodies = [], _CALL.findall(text)
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error="bad_json", detail=f"the tool call is not valid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(error="bad_json", detail='a tool call is {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's convention)
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error="bad_json", detail="arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    if text.count(CALL_OPEN) > len(bodies):
        calls.append(ToolCall(error="bad_json", detail=f"{CALL_OPEN} is not closed by {CALL_CLOSE}"))
    return calls


def _check_arguments(tool: Tool, args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit ``tool`` (missing, unknown or mistyped), or None."""
    params = tool.schema["function"].get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    missing = [p for p in required if p not in args]
    unknown = [a for a in args if a not in props]
    if missing or unknown:
        return (f"{tool.name} takes {sorted(props)}" + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else ""))
    for a, v in args.items():
        want = _JSON_TYPES.get(props[a].get("type", ""))
        if want is not None and (not isinstance(v, want) or (isinstance(v, bool) and bool not in want)):
            return f"argument {a!r} of {tool.name} must be a {props[a]['type']}, got {type(v).__name__}"
    try:
        inspect.signature(tool.fn).bind(**args)
    except TypeError as e:
        return f"{tool.name}: {e}"
    return None


def _run_one(tool: Tool, args: dict[str, Any], box: list) -> None:
    try:
        box.append(("ok", tool.fn(**args)))
    except BaseException as e:  # noqa: BLE001 (a tool's failure is the model's to read)
        box.append(("raised", f"{type(e).__name__}: {e}"))


def run_tool_calls(calls: Sequence[ToolCall], tools: Sequence[Tool], *, timeout_s: float,
                   max_chars: int) -> list[ToolResult]:
    """Run ``calls`` concurrently, one daemon thread each (a hung tool is left behind, never waited past
    ``timeout_s``); results in the calls' order. Output longer than ``max_chars`` is cut and marked."""
    by_name = {t.name: t for t in tools}
    results: list[ToolResult | None] = [None] * len(calls)
    running: list[tuple[int, str, threading.Thread, list]] = []
    for i, call in enumerate(calls):
        if call.error is not None:
            results[i] = ToolResult(call.name or "?", f"Error: {call.detail}", call.error)
        elif call.name not in by_name:
            results[i] = ToolResult(call.name, f"Error: unknown tool {call.name!r}; the tools are {sorted(by_name)}",
                                    "unknown_tool")
        elif (why := _check_arguments(by_name[call.name], call.arguments)) is not None:
            results[i] = ToolResult(call.name, f"Error: {why}", "bad_arguments")
        else:
            box: list = []
            thread = threading.Thread(target=_run_one, args=(by_name[call.name], call.arguments, box), daemon=True,
                                      name=f"rlkit-tool-{call.name}")
            thread.start()
            running.append((i, call.name, thread, box))
    if running:
        deadline = time.monotonic() + timeout_s
        for i, name, thread, box in running:
            thread.join(max(0.0, deadline - time.monotonic()))
            if not box:
                results[i] = ToolResult(name, f"Error: {name} did not finish within {timeout_s:g} s", "timeout")
                continue
            status, value = box[0]
            if status == "raised":
                results[i] = ToolResult(name, f"Error: {name} raised {value}", "raised")
            elif not isinstance(value, str):
                results[i] = ToolResult(name, f"Error: {name} returned {type(value).__name__}, not text",
                                        "not_string")
            elif len(value) > max_chars:
                results[i] = ToolResult(name, value[:max_chars] + f"... [truncated: {len(value)} characters]",
                                        "truncated")
            else:
                results[i] = ToolResult(name, value)
    return results  # type: ignore[return-value]


__all__ = ["CALL_CLOSE", "CALL_OPEN", "ERRORS", "Tool", "ToolCall", "ToolResult", "as_tools", "parse_tool_calls",
           "run_tool_calls"]
