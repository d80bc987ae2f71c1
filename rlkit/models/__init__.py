"""Tiny causal LMs, tiny vision-language models and tokenizers built locally (no hub needed), and real
pretrained models by name."""

from rlkit.models.tiny import ARCHS, SIZES, build_tokenizer, cache_dir, load, tiny_config, tiny_lm
from rlkit.models.vision import is_vision_language, load_processor
from rlkit.models.zoo import available, pretrained

__all__ = ["ARCHS", "SIZES", "available", "build_tokenizer", "cache_dir", "is_vision_language", "load",
           "load_processor", "pretrained", "tiny_config",
           "tiny_lm"]
