"""How a conversation with tools becomes tokens, for one tokenizer and its chat template.

Token in, token out: the model's own tokens are never decoded and encoded again. What the template adds
between two assistant turns (the end of the assistant's message, the tool or environment messages, the
next assistant header) is rendered as text and tokenized on its own: the *glue*. It is found by rendering
a fixed conversation with and without the new messages and keeping the difference, so it is exactly what
``apply_chat_template`` would put there.

Templates with tool syntax (e.g. Qwen2.5's, which mention ``tools``) get the tools through
``apply_chat_template(tools=...)``. A template without it (SmolLM2-135M-Instruct's plain ChatML, the tiny
models') gets rlkit's documented prompt, ``TOOL_PROMPT``, as (the start of) the system message, in the same
Hermes ``<tool_call>`` format; tool results are then ``tool`` messages, which ChatML renders as
``<|im_start|>tool ... <|im_end|>``.

>>> from rlkit.models import tiny_lm
>>> from rlkit.rollout.base import load_tokenizer
>>> fmt = ChatFormat(load_tokenizer(tiny_lm("qwen2", size="test")))
>>> fmt.tokenizer.decode([fmt.end_of_turn])
'<|im_end|>'
>>> fmt.glue_text([{"role": "tool", "content": "42"}], ended_turn=True)
'\\n<|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rlkit.agent.tools import Tool
from rlkit.rollout.base import template_bos

TOOL_PROMPT = """You can use tools. To call one, reply with a tool call and nothing after it:
<tool_call>
{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}
</tool_call>
The result comes back in a message from "tool". When you know the answer, reply without a tool call.

Tools:
{tools}"""

_SENTINEL = "\u2063rlkit-sentinel\u2063"  # an assistant message's content, to find what the template puts around it


class ChatFormat:
    """Renders prompts with the tools and the glue between turns; knows the end-of-turn token.

    ``native``: the template renders the tools itself (it mentions ``tools``); else ``TOOL_PROMPT`` goes in
    the system message. ``end_of_turn``: the token the template ends an assistant message with (the
    engines stop there), or None when the template has none.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[Tool] = (), tool_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a chat template; this tokenizer has none: set "
                             "tokenizer.chat_template and save it with the model, or use an instruction-tuned one")
        self.tokenizer, self.tools = tokenizer, tuple(tools)
        self.tool_prompt = TOOL_PROMPT if tool_prompt is None else tool_prompt
        self.native = bool(tools) and "tools" in tokenizer.chat_template
        base = self._render(self._base(), generation=False)
        self.tail = base[base.rindex(_SENTINEL) + len(_SENTINEL):]  # what follows an assistant message's content
        ids = tokenizer(self.tail, add_special_tokens=False)["input_ids"] if self.tail else []
        first = tokenizer.decode(ids[:1]) if ids else ""
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.end_of_turn: int | None = ids[0] if ids and ids[0] in special and self.tail.startswith(first) else None
        self._eot_text = first if self.end_of_turn is not None else ""
        self._base_text = base
        self._bos = template_bos(tokenizer)

    # ---- prompts ---------------------------------------------------------------------------------
    def with_tools(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with ``TOOL_PROMPT`` in the system message, for templates without tool syntax."""
        messages = [dict(m) for m in messages]
        if not self.tools or self.native:
            return messages
        schemas = "\n".join(json.dumps(t.schema) for t in self.tools)
        text = self.tool_prompt.replace("{tools}", schemas) if self.tool_prompt is not TOOL_PROMPT else \
            TOOL_PROMPT.format(tools=schemas)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{text}\n\n{messages[0]['content']}"
            return messages
        return [{"role": "system", "content": text}, *messages]

    def render_prompt(self, messages: Sequence[dict[str, Any]] | str) -> str:
        """The prompt text of an episode: its opening ``messages`` (a text prompt is one user message) with
        the tools, the assistant's turn opened. A BOS the tokenizer adds itself is not repeated."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self._render(self.with_tools(messages), generation=True)
        return text[len(self._bos):] if self._bos and text.startswith(self._bos) else text

    # ---- between turns ---------------------------------------------------------------------------
    def glue_text(self, messages: Sequence[dict[str, Any]], ended_turn: bool) -> str:
        """What the template puts after an assistant message's sampled tokens, then ``messages`` (tool or
        environment turns), then the next assistant header. ``ended_turn``: the sample ended with
        ``end_of_turn`` (so it is not repeated)."""
        full = self._render(self._base() + list(messages), generation=True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template renders earlier messages differently once more follow; "
                             "multi-turn rollouts need a template that only appends")
        tail = self.tail[len(self._eot_text):] if ended_turn and self.end_of_turn is not None else self.tail
        return tail + full[len(self._base_text):]

    def glue_ids(self, messages: Sequence[dict[str, Any]], ended_turn: bool) -> list[int]:
        """``glue_text`` as token ids, tokenized on its own (the sampled tokens before it stay as sampled)."""
        return self.tokenizer(self.glue_text(messages, ended_turn), add_special_tokens=False)["input_ids"]

    def _base(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]

    def _render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        kwargs = {"tools": [t.schema for t in self.tools]} if self.native else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)


__all__ = ["TOOL_PROMPT", "ChatFormat"]
