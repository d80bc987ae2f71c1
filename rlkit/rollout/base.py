"""The rollout interface every engine implements, and the batch it returns.

An engine turns prompts into sampled responses with the log-probs of the sampled tokens, and takes
new weights from the trainer between steps. The shared parts live here so the engines agree to the
token: prompts are tokenized once by rlkit (never by the engine), length limits are checked before
anything is generated, and both engines fill the same ``RolloutBatch`` through ``assemble``.
"""

from __future__ import annotations

import numbers
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlkit.rollout.config import PromptTooLongError, Rollout, RolloutError

_TOKENIZERS: dict[tuple, Any] = {}


def load_tokenizer(path: str | os.PathLike) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, loaded once per process for a local folder.

    The driver and an in-process worker (one-rank plans) read the same tokenizer; a second load costs
    0.3 s at SmolLM2's 49k vocab. Keyed on the folder and its tokenizer files' mtimes, so a folder
    rewritten in place loads anew. Callers share the object: change it only inside a call and restore
    it (as ``rlkit.tasks.sft.evaluate`` does with ``padding_side``).

    >>> from rlkit.models import tiny_lm
    >>> path = tiny_lm("qwen2", size="test")
    >>> load_tokenizer(path) is load_tokenizer(path)
    True
    """
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():  # a hub id: transformers' own cache applies
        return AutoTokenizer.from_pretrained(str(path))
    files = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in folder.iterdir()
                         if f.is_file() and any(k in f.name for k in ("token", "vocab", "merges", "chat_template"))))
    key = (str(folder.resolve()), files)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = AutoTokenizer.from_pretrained(str(path))
    return _TOKENIZERS[key]


def template_bos(tokenizer: Any) -> str | None:
    """The BOS text to drop from the front of a rendered chat template: the tokenizer's BOS when the tokenizer
    adds it itself (else the prompt would hold two), None when it does not.

    >>> from rlkit.models import tiny_lm
    >>> template_bos(load_tokenizer(tiny_lm("qwen2", size="test"))) is None
    True
    """
    bos = getattr(tokenizer, "bos_token", None)
    return bos if bos is not None and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id] else None


@dataclass
class RolloutBatch:
    """Sampled responses, one row per sample; samples of one prompt are adjacent (``n`` rows each).

    Tensors (N = kept prompts x n, P = longest prompt, R = longest response):
    ``prompt_ids`` (N, P) left-padded with ``prompt_mask``; ``response_ids`` (N, R) right-padded with
    ``response_mask`` (1 up to and including the end token); ``response_logprobs`` (N, R) float32, 0
    where masked; ``prompt_index`` (N,) index into the prompts given to ``generate`` (group the n samples
    of a prompt by it). Lists: ``texts`` (decoded responses), ``finish_reason`` ("stop" = eos/stop
    token/stop string, "length" = hit max_new_tokens). ``skipped``: (index, length) of prompts dropped
    with ``on_long_prompt="skip"``. ``timings`` in seconds.

    Multi-turn episodes (``rlkit.agent.episodes.run_episodes``) also fill ``loss_mask`` (N, R): 1 on the
    tokens the engine sampled, 0 on tool and environment messages and template glue; ``messages``: each
    sample's conversation after the prompt; ``episodes``: each one's turns, tool calls, errors, truncation.

    Prompts with images (``ImagePrompt``) fill ``pixel_values`` and ``image_grid_thw``: per sample, its prompt's
    images' patches and grids (``(0, ...)`` for a prompt without).

    ``Rollout(record_routing=True)`` (HF engine, mixture of experts) fills ``routing``: per sample, the experts
    each of its real tokens went to in every layer, ``(prompt + response tokens, layers, k)`` int16, -1 where
    none was recorded (``rlkit.rollout.routing``).

    >>> b = RolloutBatch.empty(pad_token_id=0)
    >>> b.num_samples, b.input_ids.shape
    (0, torch.Size([0, 0]))
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    response_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    texts: list[str]
    finish_reason: list[str]
    skipped: list[tuple[int, int]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    engine: str = ""
    loss_mask: torch.Tensor | None = None
    messages: list[list[dict[str, Any]]] | None = None
    episodes: list[dict[str, Any]] | None = None
    routing: list[torch.Tensor] | None = None
    pixel_values: list[torch.Tensor] | None = None
    image_grid_thw: list[torch.Tensor] | None = None

    @property
    def num_samples(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def num_tokens(self) -> int:
        """Generated tokens (masked ones not counted)."""
        return int(self.response_mask.sum())

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of engine time (``timings["generate"]``)."""
        return self.num_tokens / max(self.timings.get("generate", 0.0), 1e-9)

    @property
    def input_ids(self) -> torch.Tensor:
        """prompt + response, (N, P + R): what the actor and reference forward."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @classmethod
    def empty(cls, pad_token_id: int, skipped: list[tuple[int, int]] | None = None) -> RolloutBatch:
        z = torch.zeros(0, 0, dtype=torch.long)
        return cls(z, z.clone(), z.clone(), z.clone(), torch.zeros(0, 0), torch.zeros(0, dtype=torch.long),
                   [], [], skipped or [], {"generate": 0.0})

    def __repr__(self) -> str:
        return (f"RolloutBatch(samples={self.num_samples}, prompts={len(set(self.prompt_index.tolist()))}, "
                f"prompt_len={self.prompt_ids.shape[1]}, response_len={self.response_ids.shape[1]}, "
                f"tokens={self.num_tokens}, tokens/s={self.tokens_per_s:.0f}, engine={self.engine!r})")


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images, as a vision-language model's processor encoded it: token ids with one image token
    per merged patch, the images' patches ``pixel_values`` (patches, C*T*P*P) and grids ``image_grid_thw``
    (images, 3), in the order the images appear. Engines take it wherever they take a prompt's token ids.

    >>> p = ImagePrompt([1, 9, 9, 2], torch.zeros(8, 4), torch.tensor([[1, 2, 4]]))
    >>> len(p), p.images
    (4, 1)
    """

    ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    text: str = ""  # the rendered prompt (what reward functions get as the prompt)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) or (torch.is_tensor(t) and t.ndim == 0 and not t.is_floating_point())


def tokenize_prompts(prompts: Sequence[str] | Sequence[Sequence[int]], tokenizer) -> list[list[int]]:
    """Token ids of each prompt: text goes through ``tokenizer`` (special tokens as it adds them), id lists
    pass through. Tokenizing here, not in the engine, is what makes HF and vLLM see the same ids."""
    if isinstance(prompts, str):
        raise RolloutError("prompts must be a list of prompts; wrap a single prompt: generate([prompt])")
    prompts = list(prompts)
    if all(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            raise RolloutError("text prompts need a tokenizer; pass tokenizer= to the engine or give token ids")
        return [list(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, ImagePrompt):
            out.append(list(p.ids))
            continue
        if isinstance(p, str) or not all(_is_token(t) for t in p):
            raise RolloutError(f"prompt {i} is {type(p).__name__}; give all prompts as text or all as "
                               f"lists of token ids, not a mix")
        out.append([int(t) for t in p])
    return out


def check_lengths(ids: list[list[int]], limit: int, on_long_prompt: str, why: str
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """Indices of prompts to keep and (index, length) of those skipped; raises on the first bad prompt
    when ``on_long_prompt="error"``. Never truncates: a cut prompt is a different task."""
    keep, skipped = [], []
    for i, p in enumerate(ids):
        if len(p) == 0:
            raise RolloutError(f"prompt {i} is empty (0 tokens); give it at least one token")
        if len(p) > limit:
            if on_long_prompt == "skip":
                skipped.append((i, len(p)))
                continue
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens but at most {limit} fit ({why}); shorten it, raise "
                f"Rollout(max_prompt_len=...), or set Rollout(on_long_prompt='skip') to drop it",
                index=i, length=len(p), limit=limit)
        keep.append(i)
    return keep, skipped


def prompt_limit(cfg: Rollout, context_len: int | None) -> tuple[int, str]:
    """The longest prompt allowed and the reason, for error messages."""
    limits = []
    if cfg.max_prompt_len is not None:
        limits.append((cfg.max_prompt_len, f"max_prompt_len={cfg.max_prompt_len}"))
    if context_len is not None:
        limits.append((context_len - cfg.max_new_tokens,
                       f"context {context_len} - max_new_tokens {cfg.max_new_tokens}"))
    if not limits:
        return 1 << 62, "no limit"
    return min(limits)


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


def assemble(prompt_ids: list[list[int]], prompt_index: list[int], responses: list[list[int]],
             logprobs: list[list[float]], finish_reason: list[str], texts: list[str], pad_token_id: int,
             skipped: list[tuple[int, int]], timings: dict[str, float], engine: str) -> RolloutBatch:
    """Build a ``RolloutBatch`` from per-sample lists (one entry per sample, samples of a prompt adjacent)."""
    p_ids, p_mask = left_pad(prompt_ids, pad_token_id)
    width = max((len(r) for r in responses), default=0)
    r_ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    r_mask = torch.zeros((len(responses), width), dtype=torch.long)
    r_lp = torch.zeros((len(responses), width), dtype=torch.float32)
    for i, (r, lp) in enumerate(zip(responses, logprobs)):
        if len(lp) != len(r):
            raise RuntimeError(f"engine returned {len(lp)} log-probs for {len(r)} tokens in sample {i}")
        if r:
            r_ids[i, :len(r)] = torch.tensor(r)
            r_mask[i, :len(r)] = 1
            r_lp[i, :len(r)] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(p_ids, p_mask, r_ids, r_mask, r_lp, torch.tensor(prompt_index, dtype=torch.long),
                        texts, finish_reason, skipped, timings, engine)


def image_rows(images: Sequence[ImagePrompt | None]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per row, its prompt's ``pixel_values`` and ``image_grid_thw``; empty ``(0, ...)`` tensors for a prompt
    without images (shaped like the others', so rows join with ``torch.cat``).

    >>> pv, grids = image_rows([ImagePrompt([9], torch.ones(4, 6), torch.tensor([[1, 2, 2]])), None])
    >>> [tuple(t.shape) for t in pv], [tuple(g.shape) for g in grids]
    ([(4, 6), (0, 6)], [(1, 3), (0, 3)])
    """
    some = next(p for p in images if p is not None)
    none_pv = some.pixel_values.new_zeros((0, *some.pixel_values.shape[1:]))
    none_grid = some.image_grid_thw.new_zeros((0, 3))
    return ([none_pv if p is None else p.pixel_values for p in images],
            [none_grid if p is None else p.image_grid_thw for p in images])


def prompt_seeds(seed: int, first_index: int, count: int) -> list[int]:
    """Seeds of prompts ``first_index .. first_index + count - 1`` of a call seeded ``seed``: draw k of one
    seeded stream is prompt k's, so a slice of the call gets the seeds the whole call would give it.

    >>> prompt_seeds(3, 0, 4)[2:] == prompt_seeds(3, 2, 2)
    True
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (first_index + count,), generator=g).tolist()[first_index:]


def named_tensor_items(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]):
    """(name, plain local tensor) pairs from a dict or an iterable; DTensors are gathered to full tensors."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    for name, t in items:
        if hasattr(t, "full_tensor"):  # a DTensor from FSDP2/TP: the engine needs the whole weight
            t = t.full_tensor()
        yield name, t.detach()


class RolloutEngine(ABC):
    """Generates responses and takes weight updates; see ``HFEngine`` and ``VLLMEngine``.

    Subclasses implement ``generate_ids`` (token ids in, per-sample token ids + log-probs out) and
    ``load_weights``; prompt handling, seeding per call and batch assembly are shared here.

    >>> from rlkit.models import tiny_lm
    >>> from rlkit.rollout import make_engine, Rollout
    >>> eng = make_engine(Rollout(engine="hf", n=2, max_new_tokens=4), tiny_lm("qwen2", size="test"))
    >>> eng.generate(["1+1="]).response_ids.shape[0]
    2
    """

    name = "base"

    def __init__(self, config: Rollout, tokenizer, context_len: int | None, pad_token_id: int):
        self.config = config
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.pad_token_id = pad_token_id
        self.calls = 0  # generate() calls so far: call k samples with seed + k (fresh samples each step)

    # -- what an engine implements ------------------------------------------------------------------
    @abstractmethod
    def generate_ids(self, prompts: list[list[int]], cfg: Rollout, seeds: list[int],
                     images: list[ImagePrompt | None] | None = None
                     ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """For each prompt, ``cfg.n`` samples in order: (response ids, log-probs, finish reasons).
        ``seeds[i]`` seeds prompt i's samples alone (see ``prompt_seeds``); ``images[i]``: prompt i's images
        (a vision-language model), or None. The engine's token-level entry:
        ``generate`` wraps it for prompts as text or chat, and multi-turn episodes (``rlkit.agent``) call it for
        each turn's continuation."""

    def continue_ids(self, prefixes: list[list[int]], cfg: Rollout, seeds: list[int], keys: list[Any],
                     room: list[int] | None = None, stale_kv: bool = False, keep_ended: bool = False
                     ) -> tuple[list[list[int]], list[list[float]], list[str], list[int]]:
        """Streaming's chunks (``rlkit.stream``) and multi-turn episodes' turns (``rlkit.agent``): one
        continuation (``cfg.n == 1``) of each token-id prefix, as ``generate_ids``, and per prefix how many of
        its tokens were not prefilled again. ``keys[i]`` names prefix i's sample across calls and ``room[i]``
        the tokens it may still take, so an engine may keep its keys and values between calls (``HFEngine``
        does: while the weights stay, or across loads with ``stale_kv``; with ``keep_ended`` also for samples
        that stopped, whose turn ended); by default each prefix is prefilled again."""
        return (*self.generate_ids(prefixes, cfg, seeds), [0] * len(prefixes))

    def forget(self, keys: Iterable[Any]) -> None:
        """Drop what ``continue_ids`` kept for ``keys`` (samples that will not be continued); this default
        keeps nothing to drop."""
        return None

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy new weights (HF checkpoint names) into the engine; returns {"bytes", "seconds", "tensors"}."""

    def load_lora(self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float) -> dict[str, float]:
        """Take LoRA adapters (``rlkit.parallel.lora`` names, ``...q_proj.lora_A.default.weight``) and run the
        adapted model: each adapted layer's weight becomes ``W_base + scaling * B @ A``, loaded in place with
        ``load_weights``. Only the adapters cross from the trainer (bytes in proportion to the adapter); the
        base ``W_base`` of each adapted layer is read from the engine's checkpoint, one tensor at a time, at
        each sync (a LoRA base never changes, and the file stays in the page cache): no second copy of the
        adapted layers is held. Merged weights generate at full speed, and the merge works on every engine
        (vLLM-on-CPU included, whose own LoRA path this avoids). Returns ``load_weights``' report with
        ``bytes`` the adapters' bytes.

        >>> eng.load_lora(actor.iter_full_weights(to=0, adapters_only=True), scaling=2.0)  # doctest: +SKIP
        """
        from rlkit.parallel.lora import merge, module_of

        t0 = time.perf_counter()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        nbytes = 0
        for name, t in named_tensor_items(adapters):
            parts.setdefault(module_of(name), {})["A" if ".lora_A." in name else "B"] = t
            nbytes += t.numel() * t.element_size()
        merged = []
        for mod, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise RolloutError(f"load_lora got only lora_{''.join(ab)} of {mod}; send both adapters of a layer")
            key = f"{mod}.weight"
            merged.append((key, merge(self._base_weight(key), ab["A"], ab["B"], scaling)))
        report = self._load_merged(merged)
        return {**report, "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def _load_merged(self, merged: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load the merged layers of ``load_lora`` (the rest of the engine's weights are the base already)."""
        return self.load_weights(merged)

    def _base_weight(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor ``name`` (the base a LoRA adapter is merged into)."""
        from rlkit.parallel.loading import CheckpointReader

        path = getattr(self, "path", None)
        if path is None:
            raise RolloutError("load_lora needs the engine's base weights: build the engine from a checkpoint folder")
        if getattr(self, "_checkpoint", None) is None:
            self._checkpoint = CheckpointReader(path)  # the file index only; tensors are read on demand
        return self._checkpoint.get(name)

    def sleep(self) -> None:  # noqa: B027 (optional hook, a no-op by default)
        """Free accelerator memory between rollouts where the engine can; a no-op otherwise."""

    def wake_up(self) -> None:  # noqa: B027
        """Undo ``sleep``."""

    def close(self) -> None:  # noqa: B027
        """Release the engine's model and memory."""

    # -- shared ------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], *, first_index: int = 0,
                 **overrides: Any) -> RolloutBatch:
        """Sample ``n`` responses per prompt. ``overrides``: any of ``SAMPLING_FIELDS`` for this call only.

        Each prompt samples from a stream of its own, seeded by the call's seed and its position
        ``first_index + i``: a call split into slices (``first_index`` = where each slice starts) samples
        what the whole call would, however the prompts are batched or spread over engines."""
        cfg = self.config.with_overrides(**overrides)
        seed = cfg.seed if "seed" in overrides else cfg.seed + self.calls
        self.calls += 1
        t0 = time.perf_counter()
        ids = tokenize_prompts(prompts, self.tokenizer)
        limit, why = prompt_limit(cfg, self.context_len)
        keep, skipped = check_lengths(ids, limit, cfg.on_long_prompt, why)
        t1 = time.perf_counter()
        if not keep:
            return RolloutBatch.empty(self.pad_token_id, skipped)
        kept = [ids[i] for i in keep]
        seeds = prompt_seeds(seed, first_index, len(ids))
        images = [p if isinstance(p, ImagePrompt) else None for p in prompts]
        with_images = {"images": [images[i] for i in keep]} if any(images) else {}
        responses, logprobs, reasons = self.generate_ids(kept, cfg, [seeds[i] for i in keep], **with_images)
        t2 = time.perf_counter()
        texts = (self.tokenizer.batch_decode(responses, skip_special_tokens=True) if self.tokenizer is not None
                 else [""] * len(responses))
        sample_prompts = [p for p in kept for _ in range(cfg.n)]
        sample_index = [i for i in keep for _ in range(cfg.n)]
        batch = assemble(sample_prompts, sample_index, responses, logprobs, reasons, texts,
                         self.pad_token_id, skipped, {}, self.name)
        if with_images:  # each sample carries its prompt's images (the actor's forward needs them)
            batch.pixel_values, batch.image_grid_thw = image_rows([images[i] for i in sample_index])
        batch.timings = {"prepare": t1 - t0, "generate": t2 - t1, "assemble": time.perf_counter() - t2}
        if cfg.record_routing:
            batch.routing = getattr(self, "last_routing", None)
            if batch.routing is None:
                raise RolloutError(f"record_routing=True: the {self.name} engine recorded no routing")
        return batch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
