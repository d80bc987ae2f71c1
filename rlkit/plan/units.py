"""Units and shared inputs of the cost models: bytes per element of each precision and dtype, sizes
read from strings, activation-recompute modes, and the argument checks every model runs first.

Pure Python (no torch import). ``rlkit.plan.memory``, ``comm``, ``throughput`` and ``search`` all read
their precisions and checks from here, so a setting means the same thing in every model.

>>> PRECISIONS["bf16-mixed"]["param"], DTYPE_BYTES["bf16"], parse_bytes("80GB")
(4, 2, 80000000000)
"""

from __future__ import annotations

import math
import re
from typing import Any

from rlkit.errors import PlanError
from rlkit.plan.spec import ModelSpec, as_spec
from rlkit.plan.topology import ParallelPlan

# bytes per element of: parameters as stored (the optimizer's copy), gradients, optimizer state,
# and the compute copy / activations
PRECISIONS: dict[str, dict[str, int]] = {
    "fp32": dict(param=4, grad=4, state=4, compute=4),
    "bf16-mixed": dict(param=4, grad=4, state=4, compute=2),
    "bf16": dict(param=2, grad=2, state=2, compute=2),
}
# optimizer state tensors per parameter tensor, each the parameter's shard size
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0}
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
RECOMPUTE = ("none", "selective", "full")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """Bytes from an int/float or a string: ``"80GB"`` = 80e9, ``"80GiB"`` = 80 * 2**30, ``"512 MiB"``.

    >>> parse_bytes("80GB"), parse_bytes("1.5 GiB"), parse_bytes(1024)
    (80000000000, 1610612736, 1024)
    """
    if isinstance(value, bool):
        raise PlanError(f"device_memory={value!r} is not a size; pass bytes or a string like '80GB' or '80GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise PlanError(f"memory size {value!r} must be a positive number of bytes")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise PlanError(f"cannot read a memory size from {value!r}; use bytes or a string like '80GB' "
                        f"(10**9) or '80GiB' (2**30); units: {', '.join(u for u in _UNITS if u)}")
    n = float(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise PlanError(f"memory size {value!r} must be positive")
    return int(round(n))


def dtype_bytes(name: str, what: str) -> int:
    """Bytes per element of dtype ``name``; ``what`` names the argument in the error.

    >>> dtype_bytes("bfloat16", "rollout dtype"), dtype_bytes("FP8", "kv_dtype")
    (2, 1)
    """
    if str(name).lower() not in DTYPE_BYTES:
        raise PlanError(f"{what}={name!r} is not a dtype; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[str(name).lower()]


def positive_int(name: str, value: Any) -> int:
    """``value`` when it is an int >= 1 (not a bool), else a PlanError naming ``name``.

    >>> positive_int("seq_len", 4096)
    4096
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer")
    return value


def recompute_mode(recompute: str | None = None, activation_checkpointing: bool | None = None) -> str:
    """The activation-recompute mode, one of ``RECOMPUTE``: ``recompute`` as given, or the older
    ``activation_checkpointing=True`` (an alias for "full"); "none" when neither is set.

    >>> recompute_mode(), recompute_mode("selective"), recompute_mode(activation_checkpointing=True)
    ('none', 'selective', 'full')
    """
    if activation_checkpointing is not None and not isinstance(activation_checkpointing, bool):
        raise PlanError(f"activation_checkpointing={activation_checkpointing!r} must be True or False "
                        f"(or use recompute='none' | 'selective' | 'full')")
    if recompute is None:
        return "full" if activation_checkpointing else "none"
    if recompute not in RECOMPUTE:
        raise PlanError(f"recompute={recompute!r} is not a recompute mode; choose one of {list(RECOMPUTE)}")
    if activation_checkpointing is not None and activation_checkpointing != (recompute == "full"):
        raise PlanError(f"activation_checkpointing={activation_checkpointing} contradicts recompute={recompute!r}; "
                        f"pass only recompute=")
    return recompute


def check_common(plan: Any, model: Any, seq_len: Any, micro_batch: Any,
                 precision: str) -> tuple[ModelSpec, int, int]:
    """The inputs every cost model shares, checked once: ``(spec, seq_len, micro_batch)``; the plan
    is validated against the model.

    >>> from rlkit.plan import ParallelPlan
    >>> spec, s, b = check_common(ParallelPlan(tp=2), "qwen2.5-7b", 4096, 1, "bf16-mixed")
    >>> spec.num_layers, s, b
    (28, 4096, 1)
    """
    if not isinstance(plan, ParallelPlan):
        raise PlanError(f"plan={plan!r} must be a ParallelPlan")
    spec = as_spec(model)
    plan.validate(model=spec)
    s = positive_int("seq_len", seq_len)
    b = positive_int("micro_batch", micro_batch)
    if precision not in PRECISIONS:
        raise PlanError(f"precision={precision!r} is unknown; choose one of {list(PRECISIONS)}")
    return spec, s, b


def check_vision(spec: ModelSpec, seq_len: int, image_tokens: Any, freeze_vision_tower: Any) -> None:
    """The vision options of the cost models, checked: ``image_tokens`` an int from 0 to ``seq_len`` (they are
    part of the sequence), and both only for a model with a vision tower.

    >>> from rlkit.plan.spec import as_spec
    >>> check_vision(as_spec("qwen2.5-7b"), 4096, 256, False)
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: image_tokens=256 needs a vision-language model; qwen2.5-7b has no vision tower (e.g. use "qwen2.5-vl-7b")
    """
    if isinstance(image_tokens, bool) or not isinstance(image_tokens, int) or image_tokens < 0:
        raise PlanError(f"image_tokens={image_tokens!r} must be an integer >= 0 (image tokens per sequence; "
                        f"rlkit.plan.vision.image_tokens(height, width) gives an image's)")
    if not isinstance(freeze_vision_tower, bool):
        raise PlanError(f"freeze_vision_tower={freeze_vision_tower!r} must be True or False")
    if not spec.is_vision_language:
        if image_tokens:
            raise PlanError(f"image_tokens={image_tokens} needs a vision-language model; {spec.name} has no vision "
                            f"tower (e.g. use \"qwen2.5-vl-7b\")")
        if freeze_vision_tower:
            raise PlanError(f"freeze_vision_tower=True needs a vision-language model; {spec.name} has no vision tower")
        return
    spec._check_vision()
    if image_tokens > seq_len:
        raise PlanError(f"image_tokens={image_tokens} is more than seq_len={seq_len}: a sequence's image tokens are "
                        f"part of its length; use seq_len >= {image_tokens} (text tokens + image tokens)")
