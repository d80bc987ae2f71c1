"""The planner on vision-language models (issue 45): Qwen2.5-VL's parameter counts against the real modules
(tiny, and the 7B built on the meta device), the published 7B count, the image-token rule against the
processor, the vision tower's saved activations against what autograd really saves, and the frozen tower
in the memory and throughput models."""

import json

import pytest
import torch
from PIL import Image

import rlkit
from rlkit import PlanError
from rlkit.plan import ModelSpec, ParallelPlan, as_spec, bundled_models, estimate_memory, estimate_throughput
from rlkit.plan.sharding import vision_tensors
from rlkit.plan.spec import CONFIG_DIR
from rlkit.plan.vision import image_tokens, vision_activation_bytes

# Qwen/Qwen2.5-VL-7B-Instruct (https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct): the Hub's numParameters (the
# model page's "8.29B params"), and its safetensors, every tensor bf16, 2 bytes a parameter (the total_size of
# its model.safetensors.index.json). Derivation: Qwen2.5-7B's language model, 7,615,616,512, plus the tower,
# 676,550,144 = patch embed 1280 x 1176 + 32 blocks x 19,702,200 + merger 44,574,464.
QWEN2_5_VL_7B_PARAMS = 8_292_166_656
QWEN2_5_VL_7B_BF16_BYTES = 16_584_333_312
# Qwen2.5-VL-7B-Instruct's config.json as released: its vision_config names only these, and transformers'
# Qwen2_5_VLVisionConfig fills in the rest (depth 32, intermediate 3420, 16 heads, out_hidden_size 3584...)
RELEASED_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 128000, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 152064,
    "vision_config": {"hidden_size": 1280, "in_chans": 3, "model_type": "qwen2_5_vl", "spatial_patch_size": 14,
                      "tokens_per_second": 2},
}


@pytest.fixture(scope="module")
def tiny():
    """The tiny Qwen2.5-VL checkpoint: (folder, model, processor)."""
    from transformers import AutoModelForImageTextToText

    path = rlkit.models.tiny_lm("qwen2_5_vl")
    return path, AutoModelForImageTextToText.from_pretrained(path), rlkit.models.load_processor(path)


@pytest.fixture(scope="module")
def meta_7b():
    """transformers' Qwen2.5-VL built from the bundled 7B config, on the meta device (no memory)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = {k: v for k, v in json.loads((CONFIG_DIR / "qwen2.5-vl-7b.json").read_text()).items() if k != "_source"}
    with torch.device("meta"):
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg))


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_tiny_counts_equal_the_module(tiny):
    path, model, _ = tiny
    visual = model.model.visual
    for spec in (as_spec(path), ModelSpec.from_config(model.config), ModelSpec.from_config(model.config.to_dict())):
        assert spec.is_vision_language and spec.vision_model_type in ("qwen2_5_vl_vision", "qwen2_5_vl")
        assert spec.num_params == model.num_parameters() == numel(model)
        assert spec.vision_params == numel(visual)
        assert spec.language_params == numel(model.model.language_model) + numel(model.lm_head)
        assert spec.vision_patch_embed_params == numel(visual.patch_embed)
        assert spec.vision_block_params == numel(visual.blocks[0])
        assert spec.vision_merger_params == numel(visual.merger)
    # the tensor list the memory model shards: the module's, name for name and shape for shape
    real = {f"visual.{n.removesuffix('.weight')}": p.numel() for n, p in visual.named_parameters()}
    assert {name: d0 * d1 for name, d0, d1, _ in vision_tensors(as_spec(path))} == real
    assert all(tp_dim is None for *_, tp_dim in vision_tensors(as_spec(path)))  # whole on every TP rank


def test_qwen2_5_vl_7b_published(meta_7b):
    spec = ModelSpec.from_name("qwen2.5-vl-7b")
    assert "qwen2.5-vl-7b" in bundled_models()
    assert spec.num_params == QWEN2_5_VL_7B_PARAMS and 2 * spec.num_params == QWEN2_5_VL_7B_BF16_BYTES
    assert meta_7b.num_parameters() == QWEN2_5_VL_7B_PARAMS  # the bundled config builds the published model
    assert spec.vision_params == numel(meta_7b.model.visual)
    assert spec.language_params == ModelSpec.from_name("qwen2.5-7b").num_params  # Qwen2.5-7B's language model
    # the released config.json, whose vision_config leans on transformers' defaults, and the config object
    assert ModelSpec.from_config(RELEASED_7B).num_params == QWEN2_5_VL_7B_PARAMS
    assert ModelSpec.from_config(meta_7b.config).num_params == QWEN2_5_VL_7B_PARAMS
    assert (spec.hidden_size, spec.vision_hidden_size, spec.vision_depth, spec.vision_num_heads,
            spec.vision_intermediate_size) == (3584, 1280, 32, 16, 3420)
    assert (spec.vision_window_size, spec.vision_fullatt_blocks, spec.vision_out_hidden_size) == (112, (7, 15, 23, 31),
                                                                                                3584)
    # the tower on the first pipeline stage
    first, last = spec.stage_params(ParallelPlan(pp=2))
    assert first + last == QWEN2_5_VL_7B_PARAMS and first - last > spec.vision_params // 2


@pytest.mark.parametrize("size", [(56, 56), (100, 60), (33, 250), (300, 200), (448, 448), (1000, 30)])
def test_image_tokens_as_the_tiny_processor(tiny, size):
    """``image_tokens`` = the ``<|image_pad|>`` tokens the processor puts in the sequence = grid_thw.prod() / 4."""
    from rlkit.models.vision import MAX_PIXELS, MIN_PIXELS

    _, _, proc = tiny
    h, w = size
    image = Image.new("RGB", (w, h), (120, 30, 200))
    grid = proc.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}])
    ids = proc(text=[text], images=[image], return_tensors="pt")["input_ids"][0]
    pads = int((ids == proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert pads == int(grid.prod()) // 4 == image_tokens(h, w, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def test_image_tokens_as_the_released_processor():
    """The released processor's pixel range (3,136 .. 12,845,056): the helper's defaults."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14,
                                      merge_size=2, temporal_patch_size=2)
    for h, w in ((448, 448), (1080, 1920), (20, 20), (375, 500)):
        grid = images(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"]
        assert int(grid.prod()) // 4 == image_tokens(h, w)
    assert image_tokens(448, 448) == 256
    with pytest.raises(PlanError, match="aspect ratio"):
        image_tokens(10, 3000)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tower_activations_are_what_autograd_saves(tiny, attn):
    """Every tensor the real tower saves for backward (unique storages, parameters aside), fp32, on images whose
    merged sides are whole windows: equal to ``vision_activation_bytes``."""
    from transformers import AutoModelForImageTextToText

    path, _, proc = tiny
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=attn)
    visual, spec = model.model.visual, as_spec(path)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for h, w in ((56, 56), (112, 56), (112, 112)):
        out = proc.image_processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            visual(out["pixel_values"], grid_thw=out["image_grid_thw"])
        tokens = int(out["image_grid_thw"].prod()) // 4
        assert sum(saved.values()) == vision_activation_bytes(spec, tokens, 1, 4, flash_attention=attn == "sdpa")


def test_frozen_tower_keeps_weights_only(tiny, meta_7b):
    """A frozen tower: the same weights; grads and optimizer state less by exactly the tower's (fp32 grads, two
    fp32 AdamW states: 12 bytes a parameter, sharded over dp); none of its activations."""
    path, model, _ = tiny
    tower = numel(model.model.visual)
    for plan in (ParallelPlan(), ParallelPlan(dp=4), ParallelPlan(dp=2, tp=2)):
        kw = dict(seq_len=64, image_tokens=16, precision="bf16-mixed")
        trained = estimate_memory(plan, path, **kw)
        frozen = estimate_memory(plan, path, freeze_vision_tower=True, **kw)
        assert (trained.weights == frozen.weights).all()
        assert ((trained.grads - frozen.grads) == 4 * tower // plan.dp).all()
        assert ((trained.optimizer - frozen.optimizer) == 8 * tower // plan.dp).all()
        assert ((trained.activations - frozen.activations)
                == vision_activation_bytes(as_spec(path), 16, 1, 2)).all()
        assert frozen.attrs["freeze_vision_tower"] and trained.attrs["vision_params"] == tower
    # the 7B, by name, on 8 FSDP ranks: FSDP2 shards each of the real tower's tensors on dim 0, grads padded to
    # ceil(rows / 8) on every rank, AdamW's two states the rank's real rows (3420 = 8 x 428 - 4: uneven)
    plan = ParallelPlan(dp=8)
    trained = plan.memory("qwen2.5-vl-7b", seq_len=2048, image_tokens=1024)
    frozen = plan.memory("qwen2.5-vl-7b", seq_len=2048, image_tokens=1024, freeze_vision_tower=True)
    shapes = [(p.shape[0], p.numel() // p.shape[0]) for p in meta_7b.model.visual.parameters()]
    padded = sum(-(-rows // 8) * rest for rows, rest in shapes)
    real = [sum(max(0, min(-(-rows // 8), rows - j * -(-rows // 8))) * rest for rows, rest in shapes) for j in range(8)]
    assert sum(real) == 676_550_144
    assert ((trained.grads - frozen.grads) == 4 * padded).all()
    assert list(trained.optimizer - frozen.optimizer) == [8 * n for n in real]
    assert (trained.weights == frozen.weights).all()


def test_image_tokens_are_part_of_the_sequence():
    """The language model sees seq_len tokens, images included: with a frozen tower, 1024 tokens of which 256
    are an image's cost what 1024 text tokens cost; only the trained tower adds its activations."""
    plan = ParallelPlan(pp=2, micro_batches=4)
    text = estimate_memory(plan, "qwen2.5-vl-7b", seq_len=1024)
    frozen = estimate_memory(plan, "qwen2.5-vl-7b", seq_len=1024, image_tokens=256, freeze_vision_tower=True)
    trained = estimate_memory(plan, "qwen2.5-vl-7b", seq_len=1024, image_tokens=256)
    assert (text.activations == frozen.activations).all()
    tower = vision_activation_bytes(as_spec("qwen2.5-vl-7b"), 256, 1, 2)
    # the first stage holds 2 micro-batches in flight under 1F1B, the last stage none of the tower
    assert list(trained.activations - text.activations) == [2 * tower, 0]
    with pytest.raises(PlanError, match="part of its length"):
        estimate_memory(plan, "qwen2.5-vl-7b", seq_len=128, image_tokens=256)
    with pytest.raises(PlanError, match="no vision tower"):
        estimate_memory(plan, "qwen2.5-7b", seq_len=1024, image_tokens=256)


def test_throughput_runs_the_tower():
    kw = dict(seq_len=1024, global_batch=64)
    plan = ParallelPlan(dp=8)
    text = estimate_throughput(plan, "qwen2.5-vl-7b", **kw)
    trained = estimate_throughput(plan, "qwen2.5-vl-7b", image_tokens=256, **kw)
    frozen = estimate_throughput(plan, "qwen2.5-vl-7b", image_tokens=256, freeze_vision_tower=True, **kw)
    assert text["vision_s"] == 0 and text["step_s"] < frozen["step_s"] < trained["step_s"]
    assert trained["vision_s"] == pytest.approx(3 * frozen["vision_s"])
    assert trained["vision_flops_per_step"] == 64 * 3 * as_spec("qwen2.5-vl-7b").vision_flops(256)
    # the language model is the same as Qwen2.5-7B's: same compute for the same tokens
    assert text["compute_s"] == estimate_throughput(plan, "qwen2.5-7b", **kw)["compute_s"]


def test_unmodelled_tower_is_refused():
    """Another model's vision tower is not counted as Qwen2.5-VL's: its parameters raise, naming the type."""
    cfg = dict(RELEASED_7B, vision_config={"model_type": "siglip_vision_model", "hidden_size": 1152})
    spec = ModelSpec.from_config(cfg)
    assert spec.is_vision_language and spec.hidden_size == 3584
    with pytest.raises(PlanError, match="siglip_vision_model"):
        _ = spec.num_params
