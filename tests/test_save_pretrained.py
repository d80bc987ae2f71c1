"""trainer.save_pretrained: the trained actor as a plain Hugging Face folder, from any layout (one rank in
this process, dp=2 and tp=2 x pp=2 on Ray workers). A tied model (its lm_head is its embedding), so tied
writing is covered; the folder loads with AutoModelForCausalLM.from_pretrained and its per-token log-probs,
from a plain HF forward, equal the trainer's own (fp32). vLLM loading it: tests/test_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _logprob_ref import layout_logprobs, max_masked_diff
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlkit
from rlkit.errors import CheckpointError
from rlkit.models import tiny_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5  # fp32: the saved model's forward against the trainer's own log-probs


def _trainer(model, tmp_path, **kw):
    return rlkit.Trainer(model=model, dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=8),
                         prompts_per_step=4, lr=1e-2, seed=0, run_dir=str(tmp_path / "run"), **kw)


def _check_logprobs(tr, path):
    """The trainer's log-probs of a fresh batch against a plain HF forward of the saved folder (and of
    the model it started from, which the updates moved away from)."""
    tr.workers.sync_weights()
    gen = tr.workers.generate(tr._next_prompts(), seed=123, policy_version=tr.step)
    batch = {k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")}
    actor = tr.group.call_dp("actor_logprobs", batch)["logprobs"]
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(tr.model_path, dtype=torch.float32)
    diff = max_masked_diff(actor, layout_logprobs(saved, batch, tr.layout.prompt_len), batch["response_mask"])
    moved = max_masked_diff(actor, layout_logprobs(original, batch, tr.layout.prompt_len), batch["response_mask"])
    print(f"{tr.plan.describe()}: saved model vs trainer max |dlogp| = {diff:.2e} (vs the untrained model {moved:.2e})")
    assert diff < TOL and moved > 1e-3, (diff, moved)


def _safetensors_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as s:
            keys |= set(s.keys())
    return keys


def test_save_pretrained_in_process_is_the_hf_format(tmp_path):
    model = tiny_lm("qwen2", size="test", tie_word_embeddings=True)
    tr = _trainer(model, tmp_path)
    try:
        tr.fit(steps=2, view="none")
        path = Path(tr.save_pretrained(tmp_path / "final"))
        assert sorted(p.name for p in path.iterdir()) == ["chat_template.jinja", "config.json",
                                                          "generation_config.json", "model.safetensors",
                                                          "tokenizer.json", "tokenizer_config.json"]
        # tied embeddings written once, exactly the tensors HF's own save_pretrained writes for this model
        AutoModelForCausalLM.from_pretrained(model).save_pretrained(tmp_path / "by_hf")
        keys = _safetensors_keys(path)
        assert keys == _safetensors_keys(tmp_path / "by_hf") and "lm_head.weight" not in keys and len(keys) == 50
        config = json.loads((path / "config.json").read_text())
        assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        tok, orig_tok = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(model)
        text = "the answer is 12+7= 19"
        assert tok(text)["input_ids"] == orig_tok(text)["input_ids"] and tok.chat_template == orig_tok.chat_template
        assert (json.loads((path / "generation_config.json").read_text())["eos_token_id"]
                == json.loads((Path(model) / "generation_config.json").read_text())["eos_token_id"])
        _check_logprobs(tr, path)

        # a second save replaces the first; bf16 on request
        again = Path(tr.save_pretrained(path, dtype="bfloat16"))
        with safe_open(str(again / "model.safetensors"), framework="pt") as s:
            assert s.get_tensor("model.norm.weight").dtype == torch.bfloat16
        assert json.loads((again / "config.json").read_text())["dtype"] == "bfloat16"
        # refused before anything is gathered or written
        with pytest.raises(CheckpointError, match=r"is the model this Trainer started from .*; pass another folder"):
            tr.save_pretrained(model)
        with pytest.raises(CheckpointError, match=r"/run already holds other files \(\[.*'metrics\.jsonl'.*\]\); the "
                                                  r"trained model replaces its folder whole, so pass a new or empty"):
            tr.save_pretrained(tmp_path / "run")
        assert (tmp_path / "run" / "metrics.jsonl").is_file()
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
    finally:
        tr.close()


@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", [rlkit.ParallelPlan(dp=2), rlkit.ParallelPlan(tp=2, pp=2)], ids=["dp2", "tp2xpp2"])
def test_save_pretrained_gathers_any_layout(plan, tmp_path, ray_cluster):
    model = tiny_lm("qwen2", size="small", tie_word_embeddings=True)
    tr = _trainer(model, tmp_path, plan=plan, cluster=ray_cluster)
    try:
        tr.fit(steps=2, view="none")
        path = Path(tr.save_pretrained(tmp_path / "final"))
        assert "lm_head.weight" not in _safetensors_keys(path)
        _check_logprobs(tr, path)
    finally:
        tr.close()
