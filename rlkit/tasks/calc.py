"""Multiplication a small model gets wrong on its own, with a calculator tool to call: the agentic task.

``Calculator(digits=(3, 2))`` asks "What is 347 * 58?" as a chat; the reward is 1 when the episode's last
message ends on the product. ``calculator`` is the tool (a safe evaluator of + - * / and parentheses), and
``demonstrations`` gives the SFT rows of a short warm start: for each problem, the tool call after the
question, and the answer after the tool's result, rendered as the multi-turn episode renders them.

>>> task = Calculator()
>>> row = task.dataset(n=1, seed=0)[0]
>>> row["prompt"][0]["content"], row["answer"] == str(row["a"] * row["b"])
('What is 855 * 61?', True)
>>> calculator("855 * 61"), task.reward(["q"], [[{"role": "assistant", "content": "855 * 61 = 52155"}]], answer=["52155"])
('52155', [1.0])
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass
from typing import Any

from rlkit.tasks.arith import last_number
from rlkit.tasks.base import Rows, aligned_column, check_n, check_split, draw

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. "123 * 47"
    """
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = ev(ast.parse(expression.strip(), mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


@dataclass(frozen=True)
class Calculator:
    """``"What is a * b?"`` with ``a`` of ``digits[0]`` digits and ``b`` of ``digits[1]``; answer ``a * b``.

    Train and test are split by a stable hash of the question (``test_fraction`` to test), so they never
    share a problem. ``tools`` is what ``Trainer(tools=...)`` takes.
    """

    digits: tuple[int, int] = (3, 2)
    test_fraction: float = 0.2
    name: str = "calculator"

    @property
    def tools(self) -> list:
        return [calculator]

    def _make(self, rng) -> dict[str, Any]:
        a = rng.randrange(10 ** (self.digits[0] - 1), 10 ** self.digits[0])
        b = rng.randrange(10 ** (self.digits[1] - 1), 10 ** self.digits[1])
        return {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b), "a": a, "b": b}

    def dataset(self, n: int = 1000, seed: int = 0, split: str = "train") -> Rows:
        """``n`` rows ``{"prompt" (a chat), "answer", "a", "b"}`` from ``split``; same seed, same rows."""
        check_split(split)
        check_n(n)
        return Rows(draw(n, seed, split, self._make, self.test_fraction))

    __call__ = dataset

    def reward(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        """1.0 when a completion's last message ends on the answer (its last number), else 0.0."""
        answers = aligned_column("answer", columns, len(completions), "Calculator.reward", "the rows' answers")
        return [float(last_number(c) == int(a)) for c, a in zip(completions, answers)]

    def demonstrations(self, model_path: str, tool_prompt: str | None = None) -> CalculatorDemos:
        """The SFT warm start's rows for ``model_path``'s chat template (``rlkit.tasks.sft_warmstart`` takes
        them): the tool call after each question, and the answer after the tool's result."""
        return CalculatorDemos(self, str(model_path), tool_prompt)


@dataclass(frozen=True)
class CalculatorDemos:
    """Demonstrations of ``task`` as SFT rows (``prompt`` text, ``target``), rendered for ``model_path``'s
    template with the calculator tool (what ``Trainer(tools=[calculator])`` renders), two per problem."""

    task: Calculator
    model_path: str
    tool_prompt: str | None = None

    def dataset(self, n: int = 64, seed: int = 0, split: str = "train") -> Rows:
        from rlkit.agent.chat import ChatFormat
        from rlkit.agent.tools import as_tools
        from rlkit.rollout.base import load_tokenizer

        fmt = ChatFormat(load_tokenizer(self.model_path), as_tools([calculator]), self.tool_prompt)
        rows = []
        for row in self.task.dataset(n=(n + 1) // 2, seed=seed, split=split):
            call = tool_call_text("calculator", {"expression": f"{row['a']} * {row['b']}"})
            first = fmt.render_prompt(row["prompt"])
            after = fmt.glue_text([{"role": "tool", "name": "calculator", "content": row["answer"]}], ended_turn=False)
            rows.append({"prompt": first, "target": call, "answer": row["answer"]})
            rows.append({"prompt": first + call + after, "target": f"{row['a']} * {row['b']} = {row['answer']}",
                         "answer": row["answer"]})
        return Rows(rows[:n])

    def target(self, row: dict[str, Any]) -> str:
        return row["target"]


# A short tool prompt for tiny models (the default TOOL_PROMPT with the JSON schema is ~400 tokens of theirs)
TINY_TOOL_PROMPT = ('Tool: calculator(expression). Call it as <tool_call>{"name": "calculator", "arguments": '
                    '{"expression": "..."}}</tool_call>')


def tiny_tool_model(steps: int = 200, seed: int = 0, progress: bool = False) -> str:
    """A tiny Qwen2 that calls the calculator: ``tiny_lm("qwen2", size="small")`` after a short SFT (``steps`` x
    16 rows) on ``Calculator(digits=(2, 1))`` demonstrations with ``TINY_TOOL_PROMPT``; built once and cached
    (``rlkit.tasks.sft_warmstart``). For tests and tutorial 08: its episodes call the tool, read the result
    and answer, so every part of a multi-turn episode is exercised on a model that runs in a second.

    >>> path = tiny_tool_model()                                                     # doctest: +SKIP
    >>> rlkit.Trainer(model=path, dataset=Calculator(digits=(2, 1)), tools=[calculator],  # doctest: +SKIP
    ...               multi_turn=rlkit.MultiTurn(tool_prompt=TINY_TOOL_PROMPT), ...)
    """
    from rlkit.models import tiny_lm
    from rlkit.tasks.sft import sft_warmstart

    base = tiny_lm("qwen2", size="small", max_position_embeddings=1024)
    demos = Calculator(digits=(2, 1)).demonstrations(base, TINY_TOOL_PROMPT)
    return sft_warmstart(base, demos, steps=steps, batch_size=16, lr=3e-3, seed=seed, progress=progress)


def calculator_script(answer: bool = False, b: str = r"\d+") -> tuple[tuple[str, str], ...]:
    r"""``Rollout(script=...)`` rules that play a tool-using model on ``Calculator``'s questions, for a ChatML
    template (rlkit's tiny models, Qwen, SmolLM2): the first turn after "What is a * b?" calls the calculator
    on ``a * b``; with ``answer=True`` the turn after the tool's reply answers "It is <reply>.". Only questions
    whose ``b`` matches the pattern ``b`` are scripted (``r"\d*[02468]"``: even ones); other turns are sampled.
    The model scores every scripted token, so an episode's masks, log-probs and update are real
    (``rlkit.rollout.config.check_script``).

    >>> import re
    >>> pattern, call = calculator_script()[0]
    >>> m = re.search(pattern, "<|im_start|>user\nWhat is 12 * 3?<|im_end|>\n<|im_start|>assistant\n")
    >>> m.expand(call)
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 3"}}\n</tool_call><|im_end|>'
    """
    turn = r"<\|im_end\|>\n<\|im_start\|>assistant\n"
    call = tool_call_text("calculator", {"expression": "EXPR"}).replace("EXPR", r"\1 * \2") + "<|im_end|>"
    rules = ((rf"What is (\d+) \* ({b})\?{turn}", call),)
    if answer:
        rules += ((rf"<\|im_start\|>tool\n(-?[\d.]+){turn}", r"It is \1.<|im_end|>"),)
    return rules


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in the Hermes format the agent parses (``rlkit.agent.tools``).

    >>> tool_call_text("calculator", {"expression": "2 * 3"})
    '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\\n</tool_call>'
    """
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


__all__ = ["TINY_TOOL_PROMPT", "Calculator", "CalculatorDemos", "calculator", "calculator_script", "tiny_tool_model",
           "tool_call_text"]
