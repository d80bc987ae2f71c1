"""Vision-language models in the planner: how many tokens an image becomes, and what the vision tower keeps
for backward.

Pure Python (no torch import). An image reaches the language model as image tokens: Qwen2.5-VL's processor
resizes it to multiples of ``patch_size x merge_size`` (28 px) between a least and a most pixel count
(transformers' ``smart_resize``), cuts it into ``patch_size`` (14 px) patches and merges ``merge_size^2``
(2 x 2) neighbouring patches into one token: ``(H / 14) x (W / 14) / 4`` tokens (``image_tokens``). Those
tokens are part of the sequence the language model sees (``seq_len`` of the cost models counts them), and
the vision tower runs on their ``merge_size^2`` patches each.

The released processors allow 3,136 to 12,845,056 pixels (``min_pixels`` / ``max_pixels`` of Qwen2.5-VL's
``preprocessor_config.json``: 4 to 16,384 tokens an image); rlkit's tiny model allows 28 x 28 to 112 x 112
(``rlkit.models.vision.MIN_PIXELS`` / ``MAX_PIXELS``).

>>> image_tokens(448, 448), image_tokens(1080, 1920)
(256, 2691)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlkit.errors import PlanError

if TYPE_CHECKING:
    from rlkit.plan.spec import ModelSpec

#: Qwen2.5-VL's released image processor (``preprocessor_config.json``): least and most pixels of a resized image
MIN_PIXELS = 3136          # 56 x 56
MAX_PIXELS = 12845056      # 16384 x 28 x 28


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The size Qwen2-VL / Qwen2.5-VL's image processor resizes a ``height x width`` image to: each side
    rounded to a multiple of ``factor`` (``patch_size x merge_size``), then scaled, keeping the aspect ratio,
    to within ``min_pixels .. max_pixels`` (transformers' ``smart_resize``, rule for rule: Python's
    ``round``, ``floor`` when shrinking, ``ceil`` when growing).

    >>> smart_resize(448, 448), smart_resize(1080, 1920), smart_resize(10, 10)
    ((448, 448), (1092, 1932), (56, 56))
    """
    for name, value in (("height", height), ("width", width), ("factor", factor), ("min_pixels", min_pixels),
                        ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    if min_pixels > max_pixels:
        raise PlanError(f"min_pixels={min_pixels} is more than max_pixels={max_pixels}")
    if max(height, width) / min(height, width) > 200:
        raise PlanError(f"an image of {height} x {width} px has an aspect ratio over 200, which Qwen2.5-VL's "
                        f"processor refuses; crop or pad it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(height: int, width: int, *, patch_size: int = 14, merge_size: int = 2,
                 min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """Image tokens (``<|image_pad|>``) an image of ``height x width`` pixels becomes in Qwen2.5-VL's
    sequence: resized by ``smart_resize`` to multiples of ``patch_size x merge_size``, then
    ``(H / patch_size) x (W / patch_size) / merge_size^2`` (the processor's ``image_grid_thw.prod() / 4``).

    >>> image_tokens(448, 448)                  # 32 x 32 patches, 2 x 2 merged
    256
    >>> image_tokens(100, 60), image_tokens(4000, 3000)   # rounded to 112 x 56; shrunk to 4004 x 2996
    (8, 15301)
    >>> from rlkit.models.vision import MIN_PIXELS, MAX_PIXELS
    >>> image_tokens(448, 448, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)   # rlkit's tiny model: 112 x 112
    16
    """
    h, w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return (h // patch_size) * (w // patch_size) // merge_size ** 2


def vision_activation_bytes(spec: ModelSpec, image_tokens: int, micro_batch: int, compute_bytes: int,
                            flash_attention: bool = True) -> int:
    """Bytes a trained vision tower saves for backward for one micro-batch of ``micro_batch`` sequences of
    ``image_tokens`` image tokens each (``P = merge^2`` patches a token), tensor by tensor as transformers'
    Qwen2.5-VL tower saves them (its RMSNorms upcast to fp32, the rotary tables and SDPA's log-sum-exp are
    fp32, the rest is in the compute dtype, ``cb`` bytes), per patch:

    * the patch embedding's input, ``patch_dim`` values; the rotary cos and sin, ``2 x head_dim`` (fp32);
    * per block: each RMSNorm its fp32 input, ``rsqrt`` and normed output (``4h + 4 + cb h``) and its output
      (the next linear layer's input, ``cb h``); the ``qkv`` output (3h: v is a view of it), the rotated q and
      k, the attention output and the ``proj`` input (``7h`` in all, ``cb`` each), SDPA's log-sum-exp (``a``
      fp32); the gated MLP's gate and up outputs, SiLU and their product (``4i``). Eager attention keeps
      the probabilities instead of the output and log-sum-exp: ``a x span`` in fp32 (the softmax) and, below
      fp32, again in the compute dtype; ``span`` is the patches a patch attends to: a window
      (``ModelSpec.vision_window_patches``) or, in the full-attention blocks, the whole image (a sequence's
      image tokens taken as one image). Exact when the image's merged sides are multiples of the window;
      an image with partial windows at its edges attends to fewer, so this is an upper bound there;
    * the merger: ``ln_q`` as a norm (``4h + 4 + cb h``), the first linear's input, its output and GELU's
      (``3 cb h``);
    * the window permutation's and its inverse's indices (int64, one per image token each).

    A frozen tower (or a LoRA actor's) saves nothing: no parameter of it needs a gradient, nor does its input.
    Measured against the real tower (tiny Qwen2.5-VL, fp32, every tensor autograd saves): exact with SDPA and
    with eager attention on whole windows (``tests/test_plan_vision.py``).

    >>> from rlkit.plan.spec import as_spec
    >>> n = vision_activation_bytes(as_spec("qwen2.5-vl-7b"), 256, 1, 2)   # one 448 x 448 image, bf16
    >>> f"{n / 2**30:.2f} GiB, {n / 1024 / 2**20:.2f} MiB a patch"        # 1024 patches, 32 blocks
    '2.03 GiB, 2.03 MiB a patch'
    """
    if not image_tokens:
        return 0
    spec._check_vision()
    cb = compute_bytes
    h, i, a = spec.vision_hidden_size, spec.vision_intermediate_size, spec.vision_num_heads
    head_dim = h // a
    p = spec.image_patches(image_tokens)
    norm = 4 * h + 4 + cb * h + cb * h
    if flash_attention:
        attention = [cb * 7 * h + 4 * a] * spec.vision_depth
    else:
        full = set(spec.vision_fullatt_blocks)
        window = min(p, spec.vision_window_patches() or p)
        probs = 4 + (cb if cb != 4 else 0)  # the fp32 softmax, and its cast to the compute dtype (none in fp32)
        attention = [cb * 6 * h + a * (p if b in full else window) * probs for b in range(spec.vision_depth)]
    per_patch = (cb * spec.vision_patch_dim + 4 * 2 * head_dim + spec.vision_depth * (2 * norm + cb * 4 * i)
                 + sum(attention) + (4 * h + 4 + cb * h) + 3 * cb * h)
    return micro_batch * (p * per_patch + 16 * image_tokens)
