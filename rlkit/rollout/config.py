"""``Rollout``: what the Trainer is told about generation (engine, sampling, limits, engine memory).

Plain data, no torch import: the config is checked when it is built, so a typo fails in the
notebook cell that made it, not minutes later inside an engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlkit.errors import RlkitError

ENGINES = ("auto", "vllm", "hf")
ON_LONG_PROMPT = ("error", "skip")
DTYPES = ("auto", "float32", "bfloat16", "float16")
HF_DECODE = ("auto", "generate")
# The fields a single generate() call may override; the rest are fixed when the engine starts.
# Rollout.script on vLLM: refused in the config (engine="vllm") and by the engine (engine="auto" resolved to it)
SCRIPT_HF_ONLY = ("Rollout(script=...) runs on the HF engine (it picks the scripted tokens inside rlkit's decode "
                  "loop); use engine='hf'")
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "seed")


class RolloutError(RlkitError, ValueError):
    """A rollout setting or prompt that cannot work; the message names the value and the fix."""


class PromptTooLongError(RolloutError):
    """A prompt longer than ``max_prompt_len`` (or the model context); carries ``index`` and ``length``."""

    def __init__(self, message: str, *, index: int, length: int, limit: int):
        self.index, self.length, self.limit = index, length, limit
        super().__init__(message)


def check_script(script: Any) -> None:
    r"""``Rollout.script``: a tuple of ``(pattern, response)`` rules of text, each pattern a regular expression.

    A rule applies to a sample when its pattern matches the end of the sample's context: the prompt and the
    turns so far, decoded with their special tokens (``...What is 12 * 3?<|im_end|>\n<|im_start|>assistant\n``).
    The first rule that applies gives the response, with ``\1`` or ``\g<name>`` filled in from the match
    (``re.Match.expand``). The HF engine then emits the response's tokens instead of drawing them, and
    samples on after them unless they end the turn. The model still scores every token, so the recorded
    log-probs are its own, as for drawn tokens, and whatever the scripted tokens meet downstream (tools,
    template glue, masks, the update) runs for real: a way to check an agent's plumbing on turns you chose,
    whatever a model would sample.

    >>> check_script(((r"What is (\d+)\?<\|im_end\|>\n<\|im_start\|>assistant\n", r"It is \1."),))
    >>> check_script((("(", "x"),))
    Traceback (most recent call last):
    ...
    rlkit.rollout.config.RolloutError: script rule 0: pattern '(' is not a regular expression (missing ), unterminated subpattern at position 0)
    """
    import re

    if not isinstance(script, tuple):
        raise RolloutError(f"script={script!r} must be a tuple of (pattern, response) rules, e.g. "
                           f"script=((r'What is (\\d+)\\?', r'It is \\1.'),)")
    for i, rule in enumerate(script):
        if not (isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise RolloutError(f"script rule {i}: {rule!r} must be a (pattern, response) pair of strings")
        try:
            re.compile(rule[0])
        except re.error as e:
            raise RolloutError(f"script rule {i}: pattern {rule[0]!r} is not a regular expression ({e})") from None


@dataclass(frozen=True)
class Rollout:
    """How to sample responses: engine, sampling parameters, prompt limits and engine options.

    Log-prob convention (both engines): ``response_logprobs`` are log-probs of the sampled tokens under
    ``softmax(logits / temperature)`` of the raw model logits -- the same number the actor recomputes with
    a forward pass at the same temperature. top-k / top-p change which tokens can be drawn but are not
    folded into the log-probs (HF exactly; vLLM reports its own processed log-probs, equal to this when
    top_k/top_p are off). ``temperature=0`` means greedy decoding with log-probs at temperature 1.

    >>> Rollout(engine="hf", n=4, max_new_tokens=32).n
    4
    >>> Rollout(temperature=-1)
    Traceback (most recent call last):
    ...
    rlkit.rollout.config.RolloutError: temperature=-1 must be a finite number >= 0; 0 means greedy; e.g. temperature=1.0
    """

    engine: str = "auto"                 # "auto": vllm when importable, else hf
    n: int = 1                           # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0                   # 1.0 = off
    top_k: int = 0                       # 0 (or -1) = off
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()           # stop strings, matched in the response text only; kept in the output
    stop_token_ids: tuple[int, ...] = ()  # extra end tokens besides the model's eos (e.g. <|im_end|>)
    ignore_eos: bool = False             # always generate max_new_tokens (benchmarks)
    seed: int = 0                        # call k of an engine uses seed + k unless a call passes seed=
    tp: int | None = None                # generation TP on the training ranks (3D-HybridEngine): every
    #                                      rank generates in groups of tp; None: one engine per DP group
    #                                      (on one rank an HF engine in the actor's dtype runs on the
    #                                      actor's own tensors: the layout with tp=1)
    max_prompt_len: int | None = None    # None: the model context minus max_new_tokens
    on_long_prompt: str = "error"        # "error" raises PromptTooLongError; "skip" drops it and reports it
    dtype: str = "auto"                  # "auto" (the checkpoint's), "float32", "bfloat16", "float16"
    hf_batch_size: int | None = None     # HF: prompts per generate() call (None: all at once)
    hf_decode: str = "auto"              # HF: "auto" = rlkit's lean decode loop where it matches the model
    #                                      (Llama/Qwen2/Mistral, default rope), else model.generate;
    #                                      "generate" = always model.generate
    gpu_memory_utilization: float = 0.5  # vLLM on GPU: share of GPU memory for weights + KV cache
    kv_cache_gb: float = 1.0             # vLLM on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int | None = None     # vLLM: context it reserves KV for (None: prompt + new tokens)
    enforce_eager: bool = True           # vLLM: no CUDA graphs / compile (fast start, what tests want)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed through to vllm.LLM(...)
    script: tuple[tuple[str, str], ...] = ()  # HF: scripted turns, (pattern, response) rules (below)
    record_routing: bool = False         # HF, mixture of experts: record each token's experts per layer (routing replay)

    def __post_init__(self):
        # stop lists arrive as lists from users; keep them hashable tuples
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        ids = tuple(self.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise RolloutError(f"stop_token_ids={list(ids)!r} must be token ids (integers >= 0), e.g. the id "
                               f"of <|im_end|> from tokenizer.convert_tokens_to_ids")
        object.__setattr__(self, "stop_token_ids", ids)
        if isinstance(self.script, (list, tuple)):  # rules arrive as lists from JSON (trainer.json)
            object.__setattr__(self, "script", tuple(tuple(r) if isinstance(r, list) else r for r in self.script))
        self.check()

    def check(self) -> None:
        """Every field, each with the value and the fix (called on construction and on overrides)."""
        from rlkit.checks import boolean, choice, integer, number

        err = {"error": RolloutError}
        choice("engine", self.engine, ENGINES, **err)
        integer("n", self.n, hint="samples per prompt; e.g. n=4 for GRPO", **err)
        number("temperature", self.temperature, ge=0, hint="0 means greedy; e.g. temperature=1.0", **err)
        number("top_p", self.top_p, gt=0, le=1, hint="use top_p=1.0 to turn it off", **err)
        integer("top_k", self.top_k, ge=-1, hint="use top_k=0 to turn it off", **err)
        integer("max_new_tokens", self.max_new_tokens, hint="e.g. max_new_tokens=64", **err)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RolloutError(f"stop={list(self.stop)!r} must be non-empty strings")
        boolean("ignore_eos", self.ignore_eos, **err)
        integer("seed", self.seed, ge=0, **err)
        integer("tp", self.tp, none_ok=True, hint="generation TP size on the training ranks; None: one "
                "engine per DP group", **err)
        integer("max_prompt_len", self.max_prompt_len, none_ok=True, hint="None: the model context", **err)
        choice("on_long_prompt", self.on_long_prompt, ON_LONG_PROMPT, **err)
        choice("dtype", self.dtype, DTYPES, **err)
        integer("hf_batch_size", self.hf_batch_size, none_ok=True, hint="None: all prompts in one batch", **err)
        choice("hf_decode", self.hf_decode, HF_DECODE, **err)
        number("gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1, hint="e.g. 0.5", **err)
        number("kv_cache_gb", self.kv_cache_gb, gt=0, hint="e.g. kv_cache_gb=1", **err)
        integer("max_model_len", self.max_model_len, none_ok=True, hint="None: prompt + new tokens", **err)
        boolean("enforce_eager", self.enforce_eager, **err)
        if not isinstance(self.engine_kwargs, dict) or not all(isinstance(k, str) for k in self.engine_kwargs):
            raise RolloutError(f"engine_kwargs={self.engine_kwargs!r} must be a dict of vllm.LLM keyword "
                               f"arguments, e.g. {{'enable_prefix_caching': True}}")
        check_script(self.script)
        boolean("record_routing", self.record_routing, **err)
        if self.record_routing and self.engine == "vllm":
            raise RolloutError("record_routing=True needs the experts the engine chose for every token; rlkit's vLLM "
                               "engine does not return them (vLLM's CPU build has no routed-experts output): use "
                               "engine='hf', or record_routing=False")
        if self.script and self.engine == "vllm":
            raise RolloutError(SCRIPT_HF_ONLY)

    def with_overrides(self, **overrides: Any) -> Rollout:
        """A copy with per-call sampling overrides (only ``SAMPLING_FIELDS``), checked again."""
        unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
        if unknown:
            raise RolloutError(f"generate() got {unknown}, which a call cannot override; "
                               f"per-call options are {list(SAMPLING_FIELDS)}")
        return dataclasses.replace(self, **overrides) if overrides else self
