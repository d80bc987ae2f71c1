"""Tiny vision-language models (Qwen2.5-VL), built locally and saved like a hub checkpoint.

``tiny_lm("qwen2_5_vl")`` comes here. The folder holds what a real Qwen2.5-VL checkpoint holds: the model
(``Qwen2_5_VLForConditionalGeneration``: a vision tower, a merger into the language model's width, and a
Qwen2 language model with multimodal rotary positions, M-RoPE), the locally trained tokenizer with the
family's vision tokens, the family's image processor (14-px patches, 2x2 merged into one token) and a
chat template that renders ``{"type": "image"}`` parts as ``<|vision_start|><|image_pad|><|vision_end|>``.

Sizes are small on purpose: a 56 x 56 image is 4 x 4 patches, 4 tokens in the sequence.

``load_processor(path)`` loads the processor. transformers 5 builds a Qwen2.5-VL processor only with its
video processor, which needs torchvision; without torchvision (this project's CPU machines: its PyPI
wheel's operators do not load against the CPU torch) an image-only processor of the same class stands in,
with the same image processor, tokenizer and template.

>>> from transformers import AutoModelForImageTextToText
>>> from rlkit.models import tiny_lm
>>> path = tiny_lm("qwen2_5_vl")
>>> model = AutoModelForImageTextToText.from_pretrained(path)
>>> type(model).__name__, model.config.vision_config.out_hidden_size == model.config.text_config.hidden_size
('Qwen2_5_VLForConditionalGeneration', True)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rlkit import atomic
from rlkit.models.tiny import SIZES, SPECIAL_TOKENS, build_stamp, build_tokenizer, cache_dir

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# content may be a string or a list of parts; an image part becomes the family's three vision tokens, which
# the processor widens to one <|image_pad|> per merged patch
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' or p['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE, TEMPORAL = 14, 2, 2  # Qwen2.5-VL's: 14-px patches, 2 x 2 merged, 2 frames a patch
# images are resized to a multiple of PATCH * MERGE, between these pixel counts (28 x 28 .. 112 x 112 here;
# the released model's processor allows up to 12.8 M pixels)
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112
# the vision tower per size: depth, width, heads (its MLP is 2x wide); the last block attends to the full image
VISION_SIZES: dict[str, dict[str, int]] = {
    "test": dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64),
    "small": dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128),
    "demo": dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=256),
    "10m": dict(depth=4, hidden_size=192, num_heads=6, intermediate_size=384),
}


def mrope_section(head_dim: int) -> list[int]:
    """How M-RoPE splits a head's ``head_dim / 2`` rotary frequencies over (time, height, width), in the
    released model's proportions (16, 24, 24 of 64: a quarter, then three eighths twice).

    >>> mrope_section(128), mrope_section(16)
    ([16, 24, 24], [2, 3, 3])
    """
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def vl_config(size: str = "test", vocab_size: int = 512, **text_overrides: Any):
    """The ``Qwen2_5_VLConfig`` of a tiny model (``size`` in ``SIZES``; the language model as
    ``tiny_config("qwen2", size)``, the vision tower from ``VISION_SIZES``).

    >>> c = vl_config()
    >>> c.text_config.hidden_size, c.vision_config.depth, c.text_config.rope_parameters["mrope_section"]
    (64, 2, [2, 3, 3])
    """
    from transformers import Qwen2_5_VLConfig

    if size not in SIZES:
        raise ValueError(f"size={size!r} is not a tiny size; choose one of {list(SIZES)}")
    text = dict(SIZES[size], vocab_size=vocab_size, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    text.update(text_overrides)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)}
    vision = dict(VISION_SIZES[size], patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                  out_hidden_size=text["hidden_size"], window_size=PATCH * MERGE * 2,
                  fullatt_block_indexes=[VISION_SIZES[size]["depth"] - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def build_processor(vocab_size: int = 512):
    """The tokenizer (``build_tokenizer`` plus the vision tokens) and the image processor, as one
    image-only Qwen2.5-VL processor.

    >>> proc = build_processor()
    >>> proc.tokenizer.convert_tokens_to_ids("<|image_pad|>") > 0, proc.image_processor.patch_size
    (True, 14)
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(vocab_size)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                      patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    return _image_only()(image_processor=images, tokenizer=tok, chat_template=CHAT_TEMPLATE)


def _image_only():
    """``Qwen2_5_VLProcessor`` without its video processor (images and text only; see the module docstring)."""
    from transformers import Qwen2_5_VLProcessor

    class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
        """Qwen2.5-VL's processor for images and text: no video processor (which needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return Qwen2_5_VLImageProcessor


def load_processor(path: str | os.PathLike):
    """The processor of a vision-language checkpoint: ``AutoProcessor``'s, or where torchvision is missing
    (which transformers' Qwen2.5-VL video processor needs), the image-only one from the same files.

    >>> from rlkit.models import tiny_lm
    >>> proc = load_processor(tiny_lm("qwen2_5_vl"))
    >>> proc.image_processor.merge_size
    2
    """
    import importlib.util

    from transformers import AutoProcessor, AutoTokenizer

    if importlib.util.find_spec("torchvision") is not None:
        return AutoProcessor.from_pretrained(path)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = json.loads((Path(path) / "processor_config.json").read_text())
    images = Qwen2VLImageProcessorPil(**{k: v for k, v in config["image_processor"].items()
                                         if k not in ("image_processor_type", "processor_class")})
    tok = AutoTokenizer.from_pretrained(path)
    return _image_only()(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)


def encode(processor: Any, messages: list[dict], images: list) -> tuple[list[int], Any, Any, str]:
    """A chat prompt with its images as the model reads it: ``(token ids, pixel_values, image_grid_thw,
    rendered text)``, the assistant's turn opened; one image token per merged patch.

    >>> from PIL import Image
    >>> from rlkit.models import tiny_lm
    >>> ids, pixels, grid, text = encode(load_processor(tiny_lm("qwen2_5_vl")),
    ...     [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
    ...     [Image.new("RGB", (56, 56))])
    >>> tuple(pixels.shape), grid.tolist(), text.count("<|image_pad|>")
    ((16, 1176), [[1, 4, 4]], 1)
    """
    text = processor.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=list(images), return_tensors="pt")
    return enc["input_ids"][0].tolist(), enc["pixel_values"], enc["image_grid_thw"], text


def tiny_vlm(size: str = "test", seed: int = 0, *, vocab_size: int = 512, path: str | os.PathLike | None = None,
             **overrides: Any) -> str:
    """Build (once) and save a tiny random-init Qwen2.5-VL with its processor; return the folder (what
    ``tiny_lm("qwen2_5_vl", ...)`` returns). Keyed, seeded and atomic as ``tiny_lm``."""
    import torch
    from transformers import AutoModelForImageTextToText

    key = json.dumps({"arch": "qwen2_5_vl", "size": size, "seed": seed, "vocab": vocab_size, "over": overrides,
                      "build": build_stamp(__name__)}, sort_keys=True, default=str)
    name = f"tiny-qwen2_5_vl-{size}-s{seed}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    out = Path(path) if path is not None else cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "processor_config.json").exists():
        return str(out)
    proc = build_processor(vocab_size)
    tok = proc.tokenizer
    cfg = vl_config(size, max(vocab_size, len(tok)), **overrides)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + VISION_TOKENS}
    cfg.image_token_id, cfg.video_token_id = ids["<|image_pad|>"], ids["<|video_pad|>"]
    cfg.vision_start_token_id, cfg.vision_end_token_id = ids["<|vision_start|>"], ids["<|vision_end|>"]
    for c in (cfg, cfg.text_config):
        c.pad_token_id, c.eos_token_id, c.bos_token_id = ids["<pad>"], ids["<|endoftext|>"], ids["<|endoftext|>"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.eos_token_id = ids["<|endoftext|>"]
    with atomic.folder(out, keep_existing=lambda p: (p / "processor_config.json").exists()) as tmp:
        model.save_pretrained(tmp)
        save_processor(proc, tmp)
    return str(out)


def save_processor(processor: Any, folder: str | os.PathLike) -> None:
    """``processor.save_pretrained(folder)``, naming the class a real checkpoint names (``Qwen2_5_VLProcessor``),
    so ``AutoProcessor`` (with torchvision) builds the full processor from it."""
    processor.save_pretrained(folder)
    meta = Path(folder) / "processor_config.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "processor_class": "Qwen2_5_VLProcessor"},
                               indent=2) + "\n")


def is_vision_language(config: Any) -> bool:
    """Whether an HF config is a vision-language model's (it has a vision tower's config).

    >>> from rlkit.models.tiny import tiny_config
    >>> is_vision_language(vl_config()), is_vision_language(tiny_config("qwen2"))
    (True, False)
    """
    return getattr(config, "vision_config", None) is not None


def mrope_positions(input_ids, attention_mask, image_grid_thw, image_token_id: int, merge: int = MERGE):
    """Qwen2-VL's multimodal rotary positions (M-RoPE), ``(3, B, S)`` long: (time, height, width) per token.

    A text token's three positions are equal and count on from the previous token; an image's tokens (a run
    of ``image_token_id``, ``t x h x w`` merged patches from ``image_grid_thw`` / ``merge``) sit at the next
    position plus their (frame, row, column), and the text after it goes on from the image's start plus its
    larger side. Padding (``attention_mask == 0``) gets 0. ``image_grid_thw[b]``: row b's images' grids
    ``(k, 3)``, in order (patches, before merging). Image tokens past the row's images (a model may sample the
    image token in its response) are text, as they are to ``generate``.

    >>> import torch
    >>> ids = torch.tensor([[0, 5, 9, 9, 9, 9, 6, 7]]); am = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])
    >>> mrope_positions(ids, am, [torch.tensor([[1, 4, 4]])], image_token_id=9)[:, 0].tolist()
    [[0, 0, 1, 1, 1, 1, 3, 4], [0, 0, 1, 1, 2, 2, 3, 4], [0, 0, 1, 2, 1, 2, 3, 4]]
    """
    import torch

    B, S = input_ids.shape
    out = torch.zeros(3, B, S, dtype=torch.long, device=input_ids.device)
    for b in range(B):
        real = attention_mask[b] != 0
        ids = input_ids[b][real].tolist()
        grids = [] if image_grid_thw is None or image_grid_thw[b] is None else image_grid_thw[b].tolist()
        pos: list[list[int]] = [[], [], []]
        cur = i = k = 0
        while i < len(ids):
            if ids[i] == image_token_id and k < len(grids):
                t, h, w = grids[k][0], grids[k][1] // merge, grids[k][2] // merge
                for f in range(t):
                    for r in range(h):
                        for c in range(w):
                            pos[0].append(cur + f)
                            pos[1].append(cur + r)
                            pos[2].append(cur + c)
                i, k, cur = i + t * h * w, k + 1, cur + max(h, w)
            else:
                j = i + 1
                while j < len(ids) and (ids[j] != image_token_id or k >= len(grids)):
                    j += 1
                for axis in pos:
                    axis.extend(range(cur, cur + j - i))
                cur, i = cur + j - i, j
        out[:, b, real] = torch.tensor(pos, dtype=torch.long, device=input_ids.device)[:, :int(real.sum())]
    return out


def image_token_mask(input_ids, image_grid_thw, image_token_id: int, merge: int = MERGE):
    """``(B, S)`` bool: the tokens the images fill, each row's first ``sum(t * h * w) / merge**2`` image tokens
    (the prompt's; one the model sampled later is text).

    >>> import torch
    >>> image_token_mask(torch.tensor([[9, 9, 9, 9, 5, 9]]), [torch.tensor([[1, 4, 4]])], 9).int().tolist()
    [[1, 1, 1, 1, 0, 0]]
    """
    import torch

    hits = input_ids == image_token_id
    per_row = torch.tensor([0 if g is None or len(g) == 0 else int(g.prod(-1).sum()) // merge**2
                            for g in image_grid_thw], device=input_ids.device)
    return hits & (hits.long().cumsum(-1) <= per_row[:, None])


def causal_view(hf: Any):
    """A vision-language ``ForConditionalGeneration`` model seen as the causal LM inside it plus a tower, with
    the checkpoint's own parameter names: ``model.embed_tokens`` / ``model.layers.N`` / ``model.norm`` (the
    language model), ``lm_head``, ``visual.*`` (the vision tower and its merger). Every rlkit layout treats
    ``.model`` and ``.lm_head`` as it treats a text model's; the first pipeline stage also holds ``.visual``.
    Nothing is copied: the view's parameters are the model's, and ``view.full`` is the model itself.

    >>> from transformers import AutoModelForImageTextToText
    >>> from rlkit.models import tiny_lm
    >>> view = causal_view(AutoModelForImageTextToText.from_pretrained(tiny_lm("qwen2_5_vl")))
    >>> [n for n, _ in view.named_parameters()][:1], view.config.model_type, view.image_token_id > 0
    (['model.embed_tokens.weight'], 'qwen2_5_vl_text', True)
    """
    import torch.nn as nn

    class CausalView(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head, self.visual = hf.model.language_model, hf.lm_head, hf.model.visual
            self.config, self.vl_config = hf.config.text_config, hf.config
            self.image_token_id = int(hf.config.image_token_id)
            self.merge = int(hf.config.vision_config.spatial_merge_size)

    view = CausalView()
    view.__dict__["full"] = hf  # the whole model, for a reference forward (not a submodule: no second names)
    view.config.tie_word_embeddings = bool(getattr(hf.config, "tie_word_embeddings", False))
    return view


def module_name(name: str) -> str:
    """A checkpoint name of a Qwen2-VL-family model as transformers 5 names the loaded module's parameter:
    the language model under ``model.language_model``, the tower under ``model.visual``.

    >>> module_name("model.layers.0.mlp.up_proj.weight"), module_name("visual.merger.mlp.0.bias")
    ('model.language_model.layers.0.mlp.up_proj.weight', 'model.visual.merger.mlp.0.bias')
    >>> module_name("lm_head.weight"), module_name("model.visual.blocks.0.norm1.weight")
    ('lm_head.weight', 'model.visual.blocks.0.norm1.weight')
    """
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name


def checkpoint_name(name: str) -> str:
    """``module_name``'s inverse: a loaded Qwen2-VL-family module's parameter name as the checkpoint (and
    rlkit's trainer) names it.

    >>> checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight"), checkpoint_name("model.visual.x")
    ('model.layers.0.mlp.up_proj.weight', 'visual.x')
    """
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name
