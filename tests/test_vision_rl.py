"""Vision-language RL on the tiny Qwen2.5-VL (``tiny_lm("qwen2_5_vl")``): the checkpoint loads as transformers'
own, rlkit's multimodal positions are transformers', the HF engine generates from images as ``generate`` does,
every layout's log-probs, gradients and weights after 3 steps are the single-process model's, and the Trainer
runs GRPO on pictures end to end, with bad inputs refused in the driver."""

from __future__ import annotations

import math
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText

import rlkit
from rlkit.errors import TrainerError
from rlkit.models import load_processor, tiny_lm
from rlkit.models.vision import image_token_mask, mrope_positions
from rlkit.rollout import HFEngine, RolloutError
from rlkit.rollout.base import ImagePrompt

torch.set_num_threads(1)


def picture(color: str, size: tuple[int, int]) -> Image.Image:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle([5, 5, 30, 30], fill=color)
    return img


def ask(text: str, images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm():
    path = tiny_lm("qwen2_5_vl")
    return path, load_processor(path), AutoModelForImageTextToText.from_pretrained(path).eval()


def encode(proc, items):
    """One ImagePrompt per (question, image)."""
    out = []
    for text, img in items:
        rendered = proc.apply_chat_template(ask(text), add_generation_prompt=True, tokenize=False)
        enc = proc(text=[rendered], images=[img], return_tensors="pt")
        out.append(ImagePrompt(enc["input_ids"][0].tolist(), enc["pixel_values"], enc["image_grid_thw"], rendered))
    return out


def test_the_tiny_vlm_is_a_real_checkpoint_and_its_positions_are_transformers(vlm):
    path, proc, hf = vlm
    assert type(hf).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert hf.config.vision_config.out_hidden_size == hf.config.text_config.hidden_size
    # a 56 x 56 picture is 4 x 4 patches of 14 px, merged 2 x 2: 4 image tokens; 84 x 56 is 6
    texts = [proc.apply_chat_template(ask(q), add_generation_prompt=True, tokenize=False) + "7"
             for q in ("how many?", "count the shapes now")]
    proc.tokenizer.padding_side = "left"
    enc = proc(text=texts, images=[picture("red", (56, 56)), picture("blue", (84, 56))], return_tensors="pt",
               padding=True, return_mm_token_type_ids=True)
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert (enc["input_ids"] == hf.config.image_token_id).sum(-1).tolist() == [4, 6]
    want, _ = hf.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"],
                                      attention_mask=enc["attention_mask"])
    grids = [g[None] for g in enc["image_grid_thw"]]
    got = mrope_positions(enc["input_ids"], enc["attention_mask"], grids, hf.config.image_token_id)
    real = enc["attention_mask"].bool()
    assert torch.equal(got[:, real], want[:, real])
    # an image token the model samples after its images is text: it takes no picture's place
    ids = torch.cat([enc["input_ids"], torch.full((2, 1), hf.config.image_token_id)], 1)
    am = torch.cat([enc["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
    slots = image_token_mask(ids, grids, hf.config.image_token_id)
    assert slots.sum(-1).tolist() == [4, 6] and not slots[:, -1].any()
    pos = mrope_positions(ids, am, grids, hf.config.image_token_id)
    assert torch.equal(pos[:, :, -1], pos[:, :, -2] + 1)


def test_the_hf_engine_generates_from_images_as_generate_does(vlm):
    path, proc, hf = vlm
    prompts = encode(proc, [("how many?", picture("red", (56, 56))),
                            ("count the shapes now", picture("blue", (84, 56)))])
    engine = HFEngine(path, n=2, max_new_tokens=6, seed=0, temperature=0.0, ignore_eos=True)
    batch = engine.generate(prompts)  # one left-padded batch of both prompts, twice each
    for i, p in enumerate(prompts):  # each prompt alone through transformers' generate
        ids = torch.tensor([p.ids])
        alone = hf.generate(input_ids=ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                            mm_token_type_ids=(ids == hf.config.image_token_id).int(), max_new_tokens=6,
                            do_sample=False, eos_token_id=[])
        assert batch.response_ids[2 * i].tolist() == alone[0, len(p.ids):].tolist()
        assert batch.response_ids[2 * i + 1].tolist() == batch.response_ids[2 * i].tolist()
    assert engine.last_decode == "lean"  # rlkit's decode loop: the tower once, M-RoPE positions, a KV cache
    # sampled: the lean loop draws what transformers' generate draws from the same seeds, at the same log-probs
    lean = HFEngine(path, n=4, max_new_tokens=8, seed=3).generate(prompts)
    slow = HFEngine(path, n=4, max_new_tokens=8, seed=3, hf_decode="generate").generate(prompts)
    assert torch.equal(lean.response_ids, slow.response_ids)
    assert (lean.response_logprobs - slow.response_logprobs).abs().max() < 1e-5
    assert [tuple(g.shape) for g in batch.pixel_values] == [(16, 1176)] * 2 + [(24, 1176)] * 2
    assert [g.tolist() for g in batch.image_grid_thw[::2]] == [[[1, 4, 4]], [[1, 4, 6]]]
    with pytest.raises(RolloutError, match="text-only model"):
        HFEngine(tiny_lm("qwen2", size="test"), max_new_tokens=2).generate(prompts[:1])


LAYOUTS = {"dp2-packed": ["--dp", "2", "--padding-free"], "tp2": ["--tp", "2"],
           "dp2-lora": ["--dp", "2", "--lora", "4"], "tp2-frozen-tower": ["--tp", "2", "--freeze-vision"],
           "pp2": ["--pp", "2"], "pp2-packed": ["--pp", "2", "--padding-free"],
           "dp2-pp2": ["--dp", "2", "--pp", "2"]}  # 4 ranks


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_matches_the_single_process_model(name, tmp_path):
    """The layout's ranks against transformers' own forward of the whole model (images and positions its own way):
    log-probs, every gradient, the weights after 3 AdamW steps and the gathered weights loaded into a fresh
    model. The vision tower trains (its gradients compared), keeps its weights (frozen: no gradients, the
    weights compared unchanged), or with LoRA only the language model's adapters train. (dp=2 unpacked runs
    the same code as dp=2 packed minus the packing.)"""
    from rlkit.parallel.launch import launch

    args = LAYOUTS[name]
    ranks = math.prod(int(v) for k, v in zip(args, args[1:]) if k in ("--dp", "--tp", "--pp"))
    res = launch(ranks, [*args, "--model", "tiny-qwen2_5_vl", "--steps", "3", "--seq-len", "16"], tmp_path,
                 timeout=300)
    assert res.returncodes == [0] * ranks, res.log()[-3000:]
    r = res.report
    assert r["max_dlogprob"] < 1e-5 and r["max_dentropy"] < 1e-5
    assert r["max_dgrad"] < 1e-5 and r["max_dweight"] < 1e-5, r["max_dgrad_param"]
    assert r["strict_load"] and r["max_dlogprob_gathered_model"] < 1e-5
    tower = [n for n in r["grad_names"] if n.startswith("visual.")]
    if "lora" in name:
        assert not tower and all(".lora_" in n and n.startswith("model.layers.") for n in r["grad_names"])
        assert r["max_dadapter"] < 1e-5
    elif "frozen" in name:
        assert not tower and "model.layers.0.mlp.up_proj.weight" in r["grad_names"]
    else:
        assert "visual.patch_embed.proj.weight" in tower and "visual.merger.mlp.2.weight" in tower


def by_text(prompts, completions, **kw):
    """A reward the test controls: different completions score differently, whatever the model samples."""
    assert all("<|image_pad|>" in p for p in prompts)  # reward functions get the rendered prompt text
    return [zlib.crc32(c.encode()) % 97 / 97 for c in completions]


@pytest.mark.parametrize("freeze_vision", [False, True], ids=["tower-trained", "tower-frozen"])
def test_grpo_on_pictures_through_the_trainer(vlm, freeze_vision, tmp_path):
    path, proc, hf = vlm
    start = {n: p.detach().clone() for n, p in hf.named_parameters()}
    with rlkit.Trainer(model=path, dataset=rlkit.tasks.Shapes(), reward=by_text, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=4), prompts_per_step=2, lr=1e-2,
                       seed=0, kl_coef=0.0, epochs=2, freeze_vision=freeze_vision, run_dir=str(tmp_path / "run")) as tr:
        batch = tr.estimate(tr.generate())
        s = batch.samples
        assert len(s.pixel_values) == 8 and all(g.tolist() == [[1, 4, 4]] for g in s.image_grid_thw)
        # the actor's log-probs are transformers' own forward of each sample with its picture
        mask = s.response_mask.bool()
        P = tr.layout.prompt_len
        for i in range(len(s)):
            real = s.attention_mask[i].bool()
            ids = s.input_ids[i][real][None]
            with torch.no_grad():
                logits = hf(input_ids=ids, pixel_values=s.pixel_values[i], image_grid_thw=s.image_grid_thw[i],
                            mm_token_type_ids=(ids == hf.config.image_token_id).int()).logits[0]
            p, n = int(s.attention_mask[i, :P].sum()), int(mask[i].sum())
            want = logits[p - 1:p + n - 1].log_softmax(-1).gather(1, ids[0, p:p + n, None])[:, 0]
            assert (s.old_logprobs[i, :n] - want).abs().max() < 1e-4
            assert (s.rollout_logprobs[i, :n] - want).abs().max() < 1e-4  # the engine sampled with the same
        tr.update(batch)
        saved = tr.save_pretrained(tmp_path / "hf")
    after = AutoModelForImageTextToText.from_pretrained(saved)
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, start[n])}
    assert any(n.startswith("model.visual.") for n in moved) != freeze_vision and "lm_head.weight" in moved
    assert load_processor(saved).image_processor.merge_size == 2


def test_bad_image_inputs_are_driver_errors(vlm, tmp_path):
    path, _, _ = vlm
    rows = [{"prompt": ask("how many?"), "image": picture("red", (56, 56)), "answer": "1"}]
    kw = dict(reward=by_text, rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=2), prompts_per_step=1,
              run_dir=str(tmp_path / "run"))
    with pytest.raises(TrainerError, match=r"rows have images but model .* is a text-only model"):
        rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rows, **kw)
    two = [{**rows[0], "images": [picture("blue", (56, 56))]}]  # two pictures, one image part
    with pytest.raises(TrainerError, match=r"row 0 has 2 images but its prompt has 1 image slot"):
        rlkit.Trainer(model=path, dataset=two, **kw)
    bare = tmp_path / "no-processor"  # the checkpoint without its processor_config.json
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(path) / f, bare / f)
    with pytest.raises(TrainerError, match=r"its processor does not load .* processor.save_pretrained"):
        rlkit.Trainer(model=str(bare), dataset=rows, **kw)
    with pytest.raises(TrainerError, match=r"row 0, image 0: .*cannot open|row 0, image 0"):
        rlkit.Trainer(model=path, dataset=[{**rows[0], "image": str(tmp_path / "missing.png")}], **kw)
    with pytest.raises(TrainerError, match=r"freeze_vision=True keeps a vision tower fixed, but model .* text-only"):
        rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, freeze_vision=True, **kw)
