"""A learned reward: an HF sequence-classification model (one logit) scores prompt + completion.

``RewardModel`` is a callable with TRL's batched reward signature, ``f(prompts, completions, **columns)
-> list[float]``, so it plugs into ``Trainer(reward=...)`` alone or next to rule-based rewards as a
list of ``(f, weight)``. ``tiny_reward_model`` builds a random-init one locally (no hub needed) with
the same tokenizer as ``rlkit.models.tiny_lm``, for tests and demos.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError
from rlkit.tasks.base import completion_text


class RewardModelError(RlkitError, ValueError):
    """A RewardModel setting that cannot work; the message names the value and the fix."""


class RewardModel:
    """Score each ``prompt + completion`` with an ``AutoModelForSequenceClassification`` (num_labels=1).

    The reward is the model's logit at the last non-pad token (HF's own pooling), optionally normalized
    as ``(logit - mean) / std``. Texts are built with ``template`` (``{prompt}`` and ``{completion}``),
    tokenized, **right-truncated** to ``max_length`` tokens (the end of a too-long completion is not
    seen), right-padded and scored ``batch_size`` at a time under ``torch.no_grad()``. Right padding
    keeps every real token at the position it has unpadded, so a batched score equals scoring the text
    alone.

    Completions are read as ``rlkit.tasks.completion_text`` does (cut at the first end-of-sequence
    marker; ``None`` or an empty list is the empty string; a conversational completion gives its last
    message), so odd completions are scored, never raised on. A text with no tokens at all is scored
    as a single eos token.

    Args:
        path_or_model: a checkpoint folder / hub id, or a loaded model (then its config is used as is).
        tokenizer: default: loaded from the checkpoint. One without a pad token gets eos as pad.
        batch_size, max_length: texts per forward, tokens per text.
        device: where the model runs ("cpu", "cuda", ...).
        template: how a prompt and a completion join into one text.
        normalize: ``(mean, std)``: return ``(logit - mean) / std``.

    Note: the tokenizer's pad token and the model config's ``pad_token_id`` are set when missing (the
    objects you pass are changed), because HF picks the scored token as the last one that is not pad.

    >>> from rlkit.rewards import RewardModel, tiny_reward_model
    >>> rm = RewardModel(tiny_reward_model(), batch_size=8)
    >>> scores = rm(["aaa", "bbb"], ["aaaa", None])
    >>> len(scores), all(isinstance(s, float) for s in scores)
    (2, True)
    """

    def __init__(self, path_or_model: Any, tokenizer: Any = None, *, batch_size: int = 32, max_length: int = 512,
                 device: str = "cpu", template: str = "{prompt}{completion}",
                 normalize: tuple[float, float] | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlkit.checks import integer

        integer("batch_size", batch_size, hint="texts per forward pass, e.g. 32", error=RewardModelError)
        integer("max_length", max_length, hint="tokens kept per text, e.g. 512", error=RewardModelError)
        _check_template(template)
        device = _check_device(device)
        if normalize is not None:
            numbers = isinstance(normalize, (tuple, list)) and len(normalize) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in normalize)
            if not numbers or normalize[1] <= 0:
                raise RewardModelError(f"normalize={normalize!r} must be (mean, std), finite, with std > 0, or None")
            normalize = (float(normalize[0]), float(normalize[1]))
        if tokenizer is not None and not callable(tokenizer):
            raise RewardModelError(f"tokenizer={tokenizer!r} is not a tokenizer; pass an AutoTokenizer, or None to "
                                   f"load the checkpoint's own")
        if isinstance(path_or_model, (str, os.PathLike)):
            from rlkit.hub import resolve_checkpoint

            path_or_model = resolve_checkpoint(path_or_model, what="reward model", tokenizer=tokenizer is None)
        elif not hasattr(path_or_model, "config") or not callable(path_or_model):
            raise RewardModelError(f"RewardModel({type(path_or_model).__name__}) needs a checkpoint folder, a hub "
                                   f"id or a loaded AutoModelForSequenceClassification")

        if isinstance(path_or_model, (str, os.PathLike)):
            self.name = str(path_or_model)
            model = AutoModelForSequenceClassification.from_pretrained(self.name, dtype=torch.float32)
        else:
            model = path_or_model
            self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if tokenizer is None:
            if not isinstance(path_or_model, (str, os.PathLike)) and not getattr(model.config, "_name_or_path", ""):
                raise RewardModelError("RewardModel(model) needs tokenizer=...: the model has no checkpoint path to "
                                 "load one from")
            tokenizer = AutoTokenizer.from_pretrained(self.name)
        num_labels = getattr(model.config, "num_labels", None)
        if num_labels != 1:
            raise RewardModelError(f"{self.name}: num_labels={num_labels}; a reward model has one output "
                             f"(load or build it with num_labels=1)")

        if tokenizer.pad_token_id is None:  # common for decoder reward models: pad with eos
            if tokenizer.eos_token is None:
                raise RewardModelError(f"the tokenizer of {self.name} has neither a pad nor an eos token; set "
                                 "tokenizer.pad_token first")
            tokenizer.pad_token = tokenizer.eos_token
        text_config = model.config.get_text_config()
        if text_config.pad_token_id is None:  # HF pools at the last token that is not pad_token_id
            text_config.pad_token_id = tokenizer.pad_token_id
        self.pad_id = text_config.pad_token_id
        # an empty text still needs one token to score
        self.empty_ids = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.pad_id]

        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self.template, self.normalize = template, normalize

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """The strings that get scored (template applied, completions cleaned)."""
        return [self.template.format(prompt=self._prompt_text(p), completion=completion_text(c))
                for p, c in zip(prompts, completions)]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        """One reward per completion (TRL signature; extra columns are ignored)."""
        import torch

        if isinstance(prompts, str) or isinstance(completions, str):
            raise TypeError("RewardModel takes lists: rm([prompt, ...], [completion, ...])")
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts and {len(completions)} completions; pass one prompt "
                             "per completion")
        if len(completions) == 0:
            return []
        encoded = self.tokenizer(self.texts(prompts, completions))["input_ids"]
        ids = [x[: self.max_length] or self.empty_ids for x in encoded]  # right truncation
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch: less padding
        out = [0.0] * len(ids)
        with torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in chunk)
                input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
                    attention[row, : len(ids[i])] = 1
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=attention.to(self.device)).logits
                for row, i in enumerate(chunk):
                    out[i] = float(logits[row, 0])
        if self.normalize is not None:
            mean, std = self.normalize
            out = [(x - mean) / std for x in out]
        return out

    def _prompt_text(self, prompt: Any) -> str:
        if prompt is None:
            return ""
        if isinstance(prompt, (list, tuple)):  # conversational: [{"role", "content"}, ...]
            if getattr(self.tokenizer, "chat_template", None):
                return self.tokenizer.apply_chat_template(list(prompt), tokenize=False)
            return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
        return prompt if isinstance(prompt, str) else str(prompt)

    def __repr__(self) -> str:
        return f"RewardModel({self.name!r}, max_length={self.max_length}, normalize={self.normalize})"


def _check_template(template: Any) -> None:
    if not isinstance(template, str) or "{completion}" not in template:
        raise RewardModelError(f"template={template!r} has no '{{completion}}' field; e.g. '{{prompt}}{{completion}}'")
    try:
        template.format(prompt="", completion="")
    except (KeyError, IndexError, ValueError) as e:
        raise RewardModelError(f"template={template!r} cannot be filled ({type(e).__name__}: {e}); it may use only "
                               f"{{prompt}} and {{completion}} (double other braces: {{{{ }}}})") from None


def _check_device(device: Any) -> str:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise RewardModelError(f"device={device!r} is not a torch device ({e}); e.g. device='cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RewardModelError(f"device={device!r} but this machine has no CUDA device; use device='cpu'")
    return str(device)


def tiny_reward_model(arch: str = "qwen2", seed: int = 0, *, size: str = "test",
                      path: str | os.PathLike | None = None) -> str:
    """Build (once) and save a tiny random-init sequence-classification model (num_labels=1); return the folder.

    Same tokenizer as ``rlkit.models.tiny_lm`` (so it reads the policy's text), cached under
    ``rlkit.models.cache_dir()`` and keyed by the arguments; built in a temp folder renamed into place.

    >>> from transformers import AutoModelForSequenceClassification
    >>> AutoModelForSequenceClassification.from_pretrained(tiny_reward_model()).config.num_labels
    1
    """
    from rlkit.models import cache_dir, tiny_config
    from rlkit.models.tiny import build_and_save, build_stamp

    cfg = tiny_config(arch, size, num_labels=1)
    key = json.dumps({"arch": arch, "size": size, "seed": seed, "kind": "reward", "build": build_stamp(__name__)},
                     sort_keys=True)
    name = f"tiny-reward-{arch}-{size}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    out = Path(path) if path is not None else cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)

    from transformers import AutoModelForSequenceClassification

    return build_and_save(cfg, out, AutoModelForSequenceClassification, seed)
