"""Tiny causal LMs of real HF architectures, built locally and saved like a hub checkpoint.

No hub is needed: a byte-level BPE tokenizer (single-digit tokens, chat template, pad and eos) is
trained on a small built-in corpus with ``tokenizers``, a Llama, Qwen2 or Qwen3-MoE model is built from a config
(a Qwen2.5-VL vision-language model: ``rlkit.models.vision``)
with a seeded random init, and both are ``save_pretrained`` into a cache folder whose path is
returned. Everything downstream loads it with ``from_pretrained(path)``, exactly as a real
checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from rlkit import atomic

SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Sizes by name: ~100k params for tests up to ~10M for demos (with the default 512-token vocab).
SIZES: dict[str, dict[str, int]] = {
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    "demo": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=4),
    "10m": dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
}
ARCHS = ("llama", "qwen2", "qwen3_moe", "qwen2_5_vl")  # qwen2_5_vl: a vision-language model (rlkit.models.vision)
# a mixture of experts in every layer, enough experts that routing matters: 8, top-2, each half the dense MLP
MOE = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)


def cache_dir() -> Path:
    """Where built models live: ``$RLKIT_CACHE`` or ``~/.cache/rlkit``."""
    return Path(os.environ.get("RLKIT_CACHE") or Path.home() / ".cache" / "rlkit")


@functools.cache
def build_stamp(*modules: str) -> str:
    """A short hash of what a cached build depends on beyond its arguments: the source of the code that
    builds it (this module and ``modules``) and the installed torch, transformers and tokenizers. Cache keys
    include it, so a change to any of them builds a new folder instead of reusing one another code made.

    >>> build_stamp() == build_stamp() and len(build_stamp("rlkit.tasks.sft")) == 8
    True
    """
    h = hashlib.sha1()
    for name in (__name__, *modules):
        h.update(Path(importlib.util.find_spec(name).origin).read_bytes())
    for dist in ("torch", "transformers", "tokenizers"):
        h.update(f"{dist}=={importlib.metadata.version(dist)};".encode())
    return h.hexdigest()[:8]


def _corpus() -> list[str]:
    """Text the tokenizer learns from: letters, digits, punctuation, arithmetic, chat words."""
    lines = [
        "the quick brown fox jumps over the lazy dog",
        "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
        "reinforcement learning from verifiable rewards trains language models",
        "what is the answer ? the answer is",
        "user assistant system question answer reward policy value",
        "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > . , ; : ! ? ' \" # $ % & @ ^ _ ` | ~ \\",
        "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    ]
    lines += [f"{a}+{b}={a + b}" for a in range(0, 100, 7) for b in range(0, 100, 11)]
    lines += [f"{a}*{b}={a * b}" for a in range(0, 20, 3) for b in range(0, 20, 4)]
    return lines * 5


def build_tokenizer(vocab_size: int = 512):
    """A fast byte-level BPE tokenizer with single-digit tokens (so "17+25=42" splits into digits).

    >>> tok = build_tokenizer()
    >>> tok.decode(tok("17+25=42")["input_ids"])
    '17+25=42'
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|endoftext|>",
                                 bos_token="<|endoftext|>", unk_token=None)
    hf.chat_template = CHAT_TEMPLATE
    hf.padding_side = "left"  # generation pads prompts on the left
    return hf


def tiny_config(arch: str = "qwen2", size: str = "test", vocab_size: int = 512, **overrides: Any):
    """The HF config of a tiny model (``arch`` in ``ARCHS``, ``size`` in ``SIZES``; ``"qwen3_moe"`` is
    transformers' Qwen3-MoE with ``MOE``'s experts in every layer).

    >>> c = tiny_config("qwen3_moe")
    >>> c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.head_dim
    (8, 2, 64, 16)
    """
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not a tiny architecture; choose one of {list(ARCHS)}")
    if arch == "qwen2_5_vl":
        raise ValueError("tiny_config makes causal LMs' configs; a tiny Qwen2.5-VL's is rlkit.models.vision.vl_config")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not a tiny size; choose one of {list(SIZES)}")
    kwargs = dict(SIZES[size], vocab_size=vocab_size, max_position_embeddings=512, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    if arch == "qwen3_moe":
        kwargs.update(MOE, moe_intermediate_size=kwargs["intermediate_size"] // 2,
                      head_dim=kwargs["hidden_size"] // kwargs["num_attention_heads"])
    kwargs.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    return cls(**kwargs)


def tiny_lm(arch: str = "qwen2", size: str = "test", seed: int = 0, *, vocab_size: int = 512,
            path: str | os.PathLike | None = None, **overrides: Any) -> str:
    """Build (once) and save a tiny random-init causal LM with its tokenizer; return the folder.

    The folder is keyed by the arguments and by ``build_stamp()`` (this code, the torch / transformers /
    tokenizers versions), and the build is seeded and deterministic, so the same call gives the same weights
    on any machine. Building is atomic (a temp folder renamed into place), so parallel ranks may call it at
    once.

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> path = tiny_lm("llama", size="test", seed=0)
    >>> model = AutoModelForCausalLM.from_pretrained(path)
    >>> AutoTokenizer.from_pretrained(path).decode([7]) != ""
    True
    """
    if arch == "qwen2_5_vl":
        from rlkit.models.vision import tiny_vlm

        return tiny_vlm(size, seed, vocab_size=vocab_size, path=path, **overrides)
    cfg = tiny_config(arch, size, vocab_size, **overrides)
    key = json.dumps({"arch": arch, "size": size, "seed": seed, "vocab": vocab_size, "over": overrides,
                      "build": build_stamp()}, sort_keys=True, default=str)
    name = f"tiny-{arch}-{size}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    out = Path(path) if path is not None else cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return str(out)

    from transformers import AutoModelForCausalLM

    return build_and_save(cfg, out, AutoModelForCausalLM, seed)


def build_and_save(cfg: Any, out: Path, auto_cls: Any, seed: int) -> str:
    """Train the tokenizer, build ``auto_cls.from_config(cfg)`` with a seeded init, and save both into
    ``out`` atomically (a temp folder renamed into place; a concurrent builder's result is kept)."""
    import torch

    tok = build_tokenizer(cfg.vocab_size)
    specials = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = (specials["<pad>"], specials["<|endoftext|>"],
                                                            specials["<|endoftext|>"])
    cfg.vocab_size = max(cfg.vocab_size, len(tok))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_cls.from_config(cfg, dtype=torch.float32)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = cfg.pad_token_id
        model.generation_config.eos_token_id = cfg.eos_token_id
    # a complete folder from a concurrent builder is kept; a leftover without weights is replaced
    with atomic.folder(out, keep_existing=lambda p: (p / "config.json").exists()) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return str(out)


def load(path: str, dtype: Any = None, attn_implementation: str = "eager"):
    """``(model, tokenizer)`` from a folder or hub id, as a user would load them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation)
    return model, AutoTokenizer.from_pretrained(path)
