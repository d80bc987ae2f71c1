"""Supervised warm-start and greedy evaluation of a (tiny) model on a task, single process on CPU.

RL from a random init only works on the easiest tasks; for arithmetic a short SFT run first gives
the policy a non-zero success rate, and RL then has something to improve. torch and transformers are
imported inside the functions so ``rlkit.tasks`` itself stays pure Python.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rlkit import atomic
from rlkit.tasks.base import Rows

LOG_NAME = "sft_log.json"


def _encode(tok, task, rows: Rows, processor: Any = None) -> list[tuple[list[int], list[int], Any]]:
    """(prompt ids, completion ids + eos, images) per row, tokenized apart: exactly what generation sees.
    With a vision-language model's ``processor``, rows with images are encoded with them (``images``: their
    ``(pixel_values, image_grid_thw)``; None for a text row)."""
    eos = tok.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; set one so the model learns where to stop")
    targets = tok([task.target(r) for r in rows], add_special_tokens=False)["input_ids"]
    if processor is None:
        prompts = tok([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
        return [(p, t + [eos], None) for p, t in zip(prompts, targets)]
    from rlkit.models.vision import encode
    from rlkit.vision import row_images

    out = []
    for i, (row, t) in enumerate(zip(rows, targets)):
        ids, pixels, grid, _ = encode(processor, row["prompt"], row_images(row, index=i))
        out.append((ids, t + [eos], (pixels, grid)))
    return out


def _collate(examples: list[tuple[list[int], list[int], Any]], pad_id: int, image_token_id: int | None = None):
    """Right-padded batch; labels are -100 on prompt and pad tokens so only the answer is learned. The
    model's keywords for the examples' images (joined in row order) come as a dict."""
    import torch

    width = max(len(p) + len(t) for p, t, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, t, _) in enumerate(examples):
        seq = p + t
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(t)
        mask[i, : len(seq)] = 1
    images = [x for _, _, x in examples if x is not None]
    extra = {} if not images else {"pixel_values": torch.cat([x[0] for x in images]),
                                   "image_grid_thw": torch.cat([x[1] for x in images]),
                                   "mm_token_type_ids": (ids == image_token_id).int()}
    return ids, mask, labels, extra


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _default_out(model_path: str, task: Any, key: dict) -> Path:
    from rlkit.models.tiny import cache_dir

    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return cache_dir() / "sft" / f"{Path(model_path).name}-{getattr(task, 'name', 'task')}-{digest}"


def _train(model, examples, pad_id: int, steps: int, lr: float, batch_size: int, seed: int, warmup: int,
           desc: str, progress: bool, image_token_id: int | None = None) -> tuple[list[float], float]:
    """The SFT loop: AdamW, warmup then cosine, clipping at 1.0; returns (loss per step, seconds)."""
    import torch
    from tqdm.auto import tqdm

    with torch.random.fork_rng(devices=[]):  # seed our run without moving the caller's RNG
        torch.manual_seed(seed)
        model.train()
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        losses: list[float] = []
        start = time.perf_counter()
        bar = tqdm(range(steps), desc=desc, disable=not progress)
        for step in bar:
            # cycle through the rows in order; with the default n every step sees fresh rows
            batch = [examples[(step * batch_size + i) % len(examples)] for i in range(batch_size)]
            ids, mask, labels, images = _collate(batch, pad_id, image_token_id)
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, steps, lr, warmup)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, **images).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        seconds = time.perf_counter() - start
    return losses, seconds


def sft_warmstart(model_path: str, task: Any, steps: int = 1000, lr: float = 3e-3, batch_size: int = 64,
                  seed: int = 0, out: str | os.PathLike | None = None, *, n: int | None = None,
                  warmup: int | None = None, threads: int | None = 1, progress: bool = True,
                  force: bool = False, freeze_vision: bool = False) -> str:
    """Fine-tune ``model_path`` on ``task``'s train rows with next-token loss; save; return the folder.

    Each example is ``prompt + task.target(row) + eos``; prompt and pad tokens are masked out of the
    loss. AdamW with warmup and cosine decay, gradient clipping at 1.0, batches drawn in order from
    ``n`` rows (default ``steps * batch_size``, fresh rows every step). A vision-language model (rows with
    images) is trained on its images, its tower kept fixed with ``freeze_vision=True``. The model and tokenizer
    (and a processor) are ``save_pretrained`` to ``out``; ``out/sft_log.json`` holds the per-step losses and the seconds taken.
    With ``out=None`` the folder goes to the rlkit cache, keyed by every argument and by the code and library
    versions that build it (``rlkit.models.tiny.build_stamp``), and a finished one is reused (``force=True``
    retrains). The run is deterministic: seeded, with torch's deterministic algorithms, and ``threads`` (1 by
    default; then restored) fixes how reductions split, so the same call gives the same weights on another
    machine. ``threads=None`` keeps the caller's thread count (faster on an idle multi-core machine, but the
    weights then depend on it).

    Measured on this 2-core CPU with ``tiny_lm("qwen2", size="small")`` (greedy exact match on 200
    held-out problems, 0% before SFT):

    ==============================  ========  =========================  ===========
    task                            steps     batch                      exact match
    ==============================  ========  =========================  ===========
    ``Arithmetic(digits=1)``        300       32 (7 s, idle machine)     100%
    ``Arithmetic(digits=2)``        300       32 (7 s, idle machine)     11.5%
    ``Arithmetic(digits=2)``        1500      32                         19%
    ``Arithmetic(digits=2)``        1000      64 (default; 55 s, busy)   39%
    ==============================  ========  =========================  ===========

    (lr=1e-2 was worse: 6% after 600 x 64.) "busy": ``threads=1`` while other jobs loaded the 2 cores.

    >>> from rlkit.models import tiny_lm
    >>> from rlkit.tasks import Arithmetic, evaluate
    >>> path = sft_warmstart(tiny_lm("qwen2", size="test"), Arithmetic(digits=1), steps=5,
    ...                      batch_size=8, progress=False)
    >>> 0.0 <= evaluate(path, Arithmetic(digits=1), n=16)["accuracy"] <= 1.0
    True
    """
    import torch

    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be positive (e.g. lr=3e-3 for a tiny model)")
    model_path = str(model_path)
    n = steps * batch_size if n is None else n
    warmup = max(1, steps // 20) if warmup is None else warmup
    from rlkit.models.tiny import build_stamp

    key = dict(model=os.path.abspath(model_path) if os.path.exists(model_path) else model_path,
               task=repr(task), steps=steps, lr=lr, batch_size=batch_size, seed=seed, n=n, warmup=warmup,
               threads=threads, build=build_stamp(__name__, type(task).__module__),
               **({"freeze_vision": True} if freeze_vision else {}))
    out_dir = Path(out) if out is not None else _default_out(model_path, task, key)
    if out is None and not force and (out_dir / LOG_NAME).exists():
        return str(out_dir)

    model, tok, processor = _load(model_path)
    if freeze_vision:
        if processor is None:
            raise ValueError(f"freeze_vision=True keeps a vision tower fixed; {model_path!r} is a text-only model")
        model.model.visual.requires_grad_(False)
    rows = task.dataset(n=n, seed=seed, split="train")
    if not rows:
        raise ValueError(f"n={n} gives no training rows; use n >= batch_size")
    examples = _encode(tok, task, rows, processor)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        losses, seconds = _train(model, examples, pad_id, steps, lr, batch_size, seed, warmup,
                                 desc=f"sft {getattr(task, 'name', 'task')}", progress=progress,
                                 image_token_id=getattr(model.config, "image_token_id", None))
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)
    model.eval()

    # a half-written folder is never mistaken for a result (rlkit.atomic); an older one is replaced
    with atomic.folder(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if processor is not None:
            from rlkit.models.vision import save_processor

            save_processor(processor, tmp)
        log = dict(key, losses=losses, seconds=seconds, first_loss=losses[0],
                   last_loss=sum(losses[-10:]) / len(losses[-10:]))
        (tmp / LOG_NAME).write_text(json.dumps(log, indent=1))
    return str(out_dir)


def _image_batch(processor: Any, model: Any, rows: list[dict], first: int) -> dict:
    """``generate``'s keywords for rows with images, left-padded (``rows[k]`` is dataset row ``first + k``)."""
    from rlkit.vision import row_images

    texts = [processor.apply_chat_template(list(r["prompt"]), tokenize=False, add_generation_prompt=True)
             for r in rows]
    images = [img for k, r in enumerate(rows) for img in row_images(r, index=first + k)]
    enc = dict(processor(text=texts, images=images, return_tensors="pt", padding=True))
    enc["mm_token_type_ids"] = (enc["input_ids"] == model.config.image_token_id).int()
    model.model.rope_deltas = None  # positions from this batch's tokens, not the last call's
    return enc


def _load(model_path: str) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, processor)``: a vision-language checkpoint with its processor, else a causal LM
    (processor None)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rlkit.models.tiny import load
    from rlkit.models.vision import is_vision_language, load_processor

    if not is_vision_language(AutoConfig.from_pretrained(model_path)):
        return (*load(model_path), None)
    processor = load_processor(model_path)
    model = AutoModelForImageTextToText.from_pretrained(model_path, attn_implementation="eager")
    return model, processor.tokenizer, processor


def sft_log(path: str | os.PathLike) -> dict:
    """The log ``sft_warmstart`` saved next to the model: losses per step, seconds, arguments."""
    return json.loads((Path(path) / LOG_NAME).read_text())


def evaluate(model: Any, task: Any, n: int = 200, greedy: bool = True, *, tokenizer: Any = None,
             seed: int = 0, split: str = "test", batch_size: int = 64, max_new_tokens: int | None = None,
             temperature: float = 1.0, processor: Any = None) -> dict:
    """Generate for ``n`` rows of ``task``'s ``split`` with HF ``generate`` and score them.

    ``model`` is a folder / hub id, a ``(model, tokenizer)`` pair, or a model plus ``tokenizer=`` (a
    vision-language model object also takes its ``processor=``).
    Prompts are batched with left padding; each completion is cut at the first eos. Returns
    ``{"accuracy", "mean_reward", "n", "examples"}`` (accuracy = share of rewards >= 1.0; examples: the
    first 5 rows with their completions) plus ``"mean_partial_reward"`` when the task has one.

    >>> from rlkit.models import tiny_lm
    >>> from rlkit.tasks import Arithmetic
    >>> evaluate(tiny_lm("qwen2", size="test"), Arithmetic(digits=1), n=8)["n"]
    8
    """
    import torch

    # a vision-language model's processor (a folder's is loaded with it): rows are encoded with their images
    if isinstance(model, (str, os.PathLike)):
        model, tokenizer, processor = _load(str(model))
    elif isinstance(model, tuple):
        model, tokenizer = model
    if tokenizer is None:
        raise ValueError("evaluate() got a model object without tokenizer=; pass tokenizer=tok, a "
                         "(model, tokenizer) pair, or the model's folder")
    rows = task.dataset(n=n, seed=seed, split=split)
    max_new_tokens = max_new_tokens or getattr(task, "max_new_tokens", 32)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation appends on the right
    was_training = model.training
    model.eval()
    completions: list[str] = []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for i in range(0, len(rows), batch_size):
                chunk = rows[i : i + batch_size]
                if processor is None:
                    enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True,
                                    add_special_tokens=False)
                else:
                    enc = _image_batch(processor, model, chunk, first=i)
                sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if not greedy \
                    else dict(do_sample=False)
                gen = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                                     **sample)
                for seq in gen[:, enc["input_ids"].shape[1] :].tolist():
                    seq = seq[: seq.index(eos)] if eos in seq else seq
                    completions.append(tokenizer.decode(seq, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)

    prompts = [r["prompt"] for r in rows]
    columns = {c: rows.column(c) for c in rows.columns() if c != "prompt"}
    rewards = task.reward(prompts, completions, **columns)
    result = dict(accuracy=sum(r >= 1.0 for r in rewards) / max(1, len(rewards)),
                  mean_reward=sum(rewards) / max(1, len(rewards)), n=len(rows))
    if hasattr(task, "partial_reward"):
        partial = task.partial_reward(prompts, completions, **columns)
        result["mean_partial_reward"] = sum(partial) / max(1, len(partial))
    result["examples"] = [dict(row, completion=c) for row, c in zip(rows[:5], completions[:5])]
    return result
