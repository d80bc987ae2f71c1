"""Tiny causal LMs and tokenizers built locally (no hub needed)."""

from rlkit.models.tiny import ARCHS, SIZES, build_tokenizer, cache_dir, load, tiny_config, tiny_lm

__all__ = ["ARCHS", "SIZES", "build_tokenizer", "cache_dir", "load", "tiny_config", "tiny_lm"]
