"""Rollout routing replay (R3) on the tiny Qwen3-MoE (8 experts, top-2, 4 layers).

The engine records, for every token and layer, the experts it chose (``Rollout(record_routing=True)``); the
actor's forwards replay them (``TrainerConfig(routing_replay=True)``), weighted by its own router's
probabilities. The references are plain transformers models: for the recording, the model's own top-k in one
unpadded forward per sample; for the replay, the same model with each router's top-k forced to the recorded
experts (``forced_routing`` below, written here, not rlkit's code). The engine runs in bf16 while the trainer
runs fp32, the case where routes flip: replay must take the routing's share out of the engine/trainer
log-prob mismatch."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import rlkit
from rlkit.models import tiny_lm
from rlkit.rollout import HFEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe_path():
    return tiny_lm("qwen3_moe", size="test")


@contextlib.contextmanager
def forced_routing(model, routing):
    """``model``'s routers choose ``routing[:, layer]`` (T, k) wherever it is >= 0 (a single unpadded sequence),
    weighted by their own softmax over those experts, renormalised (Qwen3-MoE's norm_topk_prob)."""
    saved = []
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, i=i):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = logits.float().softmax(-1)
            own = probs.topk(gate.top_k, dim=-1).indices
            rec = routing[:, i].long()
            idx = torch.where((rec >= 0).all(-1, keepdim=True), rec, own)
            top = probs.gather(-1, idx)
            return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx

        saved.append((gate, gate.forward))
        gate.forward = forward
    try:
        yield
    finally:
        for gate, fwd in saved:
            gate.forward = fwd


def reference_logprobs(model, samples, prompt_len, replay: bool):
    """Each response token's log-prob from one unpadded fp32 forward per sample, routed by the model itself or
    by the sample's recorded routing."""
    ids, attn, resp = samples.input_ids, samples.attention_mask, samples.response_mask
    out = torch.zeros(resp.shape)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            keep = attn[i].bool()
            p, n = int(attn[i, :prompt_len].sum()), int(resp[i].sum())
            seq = ids[i][keep]
            ctx = forced_routing(model, samples.routing[i][keep]) if replay else contextlib.nullcontext()
            with ctx:
                logits = model(seq[None]).logits[0].float()
            out[i, :n] = torch.log_softmax(logits[p - 1:p + n - 1], -1).gather(1, seq[p:p + n, None])[:, 0]
    return out


def test_the_engine_records_the_experts_its_model_chose(moe_path):
    """fp32 engine: every recorded choice is the model's own top-k in a plain forward of the sample; the last
    sampled token (never fed to the model) has none."""
    engine = HFEngine(moe_path, n=2, max_new_tokens=6, seed=0, record_routing=True, ignore_eos=True)
    b = engine.generate(["ab", "12+7=", "hello there"])
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    checked = 0
    for i in range(b.num_samples):
        seq = torch.cat([b.prompt_ids[i][b.prompt_mask[i].bool()], b.response_ids[i][b.response_mask[i].bool()]])
        rec = b.routing[i]
        assert rec.shape == (len(seq), 4, 2) and rec.dtype == torch.int16
        assert (rec[-1] == -1).all() and (rec[:-1] >= 0).all()
        with torch.no_grad():
            logits = model(seq[None], output_router_logits=True).router_logits
        for layer, g in enumerate(logits):
            own = g.float().softmax(-1).topk(2).indices.sort(-1).values
            assert torch.equal(own[:-1], rec[:-1, layer].long().sort(-1).values), (i, layer)
            checked += len(seq) - 1
    assert checked > 100


def _trainer(tmp_path, path, plan=None, replay=True, lr=1e-3, **kw):
    return rlkit.Trainer(model=path, dataset=rlkit.tasks.repeat, algorithm="grpo", plan=plan or rlkit.ParallelPlan(),
                         rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=16, dtype="bfloat16",
                                               record_routing=True),
                         prompts_per_step=4, lr=lr, epochs=2, seed=0, routing_replay=replay, run_dir=str(tmp_path / "run"), **kw)


@pytest.mark.parametrize("plan", [None, rlkit.ParallelPlan(dp=2, ep=2), rlkit.ParallelPlan(pp=2)],
                         ids=["one-rank", "dp2-ep2", "pp2"])
def test_the_actor_replays_the_engines_routing(tmp_path, moe_path, plan):
    """A bf16 engine feeds an fp32 trainer. With replay the actor's pi_old is the reference routed by the
    recorded experts (packed rows, DP slices and balancing, pipeline micro-batches in between); the routes
    that flip are counted; and replay leaves less engine/trainer mismatch than routing by the trainer's own
    router."""
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    with _trainer(tmp_path, moe_path, plan) as tr:
        batch = tr.estimate(tr.generate())
        s = batch.samples
        assert s.routing is not None and tuple(s.routing.shape[2:]) == (4, 2)
        mask = s.response_mask.bool()
        replayed = reference_logprobs(model, s, tr.layout.prompt_len, replay=True)
        own = reference_logprobs(model, s, tr.layout.prompt_len, replay=False)
        assert (s.old_logprobs - replayed)[mask].abs().max() < 1e-4
        assert (replayed - own)[mask].abs().max() > 1e-3  # replay changed something: routes flipped
        with_replay = (s.old_logprobs - s.rollout_logprobs)[mask].abs().mean()
        without = (own - s.rollout_logprobs)[mask].abs().mean()
        assert with_replay < without, (with_replay, without)
        row = tr.update(batch)
    assert 0 < row["router/flip_rate"] < 0.5 and "router/flip_rate/3" in row


def test_routing_is_compared_without_replay(tmp_path, moe_path):
    """record_routing without replay: the actor routes by itself (pi_old is the plain model's), and the flip
    rate is still measured."""
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    with _trainer(tmp_path, moe_path, replay=False) as tr:
        batch = tr.estimate(tr.generate())
        s = batch.samples
        own = reference_logprobs(model, s, tr.layout.prompt_len, replay=False)
        assert (s.old_logprobs - own)[s.response_mask.bool()].abs().max() < 1e-4
        row = tr.update(batch)
    assert 0 < row["router/flip_rate"] < 0.5


@pytest.mark.ray
def test_replay_through_one_step_off_async(tmp_path, moe_path):
    """Split placement with one step off policy: the rollout workers' engine records, the actor replays the
    recorded routing of the batch sampled a version earlier (flips now include the version's drift)."""
    # lr 1e-4: a version's drift moves few routes (at 1e-3 it flipped about half of them on some samples)
    with _trainer(tmp_path, moe_path, placement="split", off_policy_steps=1, offpolicy_correction="tis", lr=1e-4) as tr:
        df = tr.fit(steps=2, view="none")
    assert df["router/flip_rate"].notna().all() and (df["router/flip_rate"] < 0.5).all(), df["router/flip_rate"]
    assert df["offpolicy/staleness_max"].tolist()[-1] == 1
