"""The tiny mixture-of-experts model (``tiny_lm("qwen3_moe")``: transformers' Qwen3-MoE, 8 experts, top-2)
through the Trainer on one rank: the HF engine generates, the actor's log-probs are a plain transformers
forward's, GRPO steps move the experts and the router, and ``save_pretrained`` writes a folder transformers
loads with those weights. Expert parallelism is issue 42's next step; this is the model it starts from."""

import zlib

import torch
from _logprob_ref import layout_logprobs
from transformers import AutoModelForCausalLM

import rlkit
from rlkit.models import tiny_lm

torch.set_num_threads(1)


def by_text(prompts, completions, **kw):
    """A reward the test controls: different completions score differently, whatever the model samples (the
    task's own reward can give a group equal scores, and GRPO's advantages would then all be 0)."""
    return [zlib.crc32(c.encode()) % 97 / 97 for c in completions]


def test_the_tiny_moe_trains_through_the_trainer_and_saves_a_loadable_folder(tmp_path):
    path = tiny_lm("qwen3_moe", size="test")
    start = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(start.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    with rlkit.Trainer(model=path, dataset=rlkit.tasks.repeat, reward=by_text, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=6), prompts_per_step=2, lr=1e-2,
                       seed=0, epochs=2, run_dir=str(tmp_path / "run")) as tr:
        batch = tr.estimate(tr.generate())
        s, mask = batch.samples, batch.samples.response_mask.bool()
        want = layout_logprobs(start, s, tr.layout.prompt_len)
        assert (s.old_logprobs - want)[mask].abs().max() < 1e-4   # the actor's forward is the HF model's
        row = tr.update(batch)
        tr.fit(steps=1, view="none")
        saved = tr.save_pretrained(tmp_path / "hf")
    assert row["actor/grad_norm"] > 0
    after = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    moved = {n for n, p in after.named_parameters() if not torch.equal(p, start.get_parameter(n))}
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight"} <= moved
