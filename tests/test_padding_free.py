"""Padding-free training through the Trainer: the same step, padded and packed, on real workers.

Each test runs one PPO step (critic, a KL-to-reference loss term, two epochs so pi_old is scored) on the
same sampled batch twice, with ``padding_free=False`` (the padded layout, one micro-batch) and with
``padding_free=True`` and a small token budget (many micro-batches of packed rows), and holds every scoring
pass and the update's results of the packed run against the padded one. The expected values come from the
padded path, which the rest of the suite holds against the single-process HF model.

Tolerances (fp32, tiny Qwen2): log-probs of the same weights 2e-6 and values 1e-5 (the equivalence tests'
bounds); losses 1e-5 relative; log-probs after the update's two AdamW steps at lr=1e-4: 1e-4 (Adam turns a
1e-7 difference in a near-zero gradient into up to one lr per step). A packed sequence attending to its
neighbour, a wrong position or a micro-batch weighted by rows instead of tokens is off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

import rlkit
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer, TrainerError

torch.set_num_threads(1)


# prompts of 1 to 15 tokens: with 8 response tokens each, the step's sequences are 9 to 23 tokens long
PROMPTS = [{"prompt": "ab" * k} for k in (1, 15, 3, 9, 2, 12, 5, 7)]


def _reward(prompts, completions, **kw):
    return [float(c.count("a")) / (1 + len(c)) for c in completions]


def _trainer(tmp_path, name, plan, **kw):
    return Trainer(model=tiny_lm("qwen2", size="small"), dataset=PROMPTS, reward=_reward, algorithm="ppo", plan=plan,
                   # every response 8 tokens (ignore_eos): the prompts alone make the lengths ragged, whatever is sampled
                   rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=8, ignore_eos=True), prompts_per_step=8,
                   lr=1e-4, kl_coef=0.05, epochs=2, seed=3, run_dir=str(tmp_path / name), **kw)


def _one_step(tr):
    """(the batch's estimates, the update's metrics, the actor's log-probs after it, the batch)."""
    batch = tr.estimate(tr.generate())
    est = {k: batch.samples[k].clone() for k in ("ref_logprobs", "values", "old_logprobs")}
    row = tr.update(batch)
    after = tr.workers.old_logprobs(batch.samples)
    return est, row, after, batch


def _compare(padded, packed):
    (est_a, row_a, after_a, batch_a), (est_b, row_b, after_b, batch_b) = padded, packed
    assert torch.equal(batch_a.samples["input_ids"], batch_b.samples["input_ids"])  # the same samples
    mask = batch_a.samples["response_mask"].bool()
    lengths = batch_a.samples["attention_mask"].sum(-1)
    assert lengths.max() >= 2 * lengths.min(), lengths  # ragged enough for packing to matter
    for key, tol in (("ref_logprobs", 2e-6), ("old_logprobs", 2e-6), ("values", 1e-5)):
        gap = (est_a[key] - est_b[key])[mask].abs().max().item()
        assert gap <= tol, (key, gap)
    for key in ("actor/loss", "critic/loss", "actor/kl_loss"):
        assert abs(row_a[key] - row_b[key]) <= 1e-5 * max(1.0, abs(row_a[key])), (key, row_a[key], row_b[key])
    moved = (after_a - est_a["old_logprobs"])[mask].abs().max().item()
    gap = (after_a - after_b)[mask].abs().max().item()
    assert moved > 1e-3 and gap <= 1e-4, (moved, gap)  # the update moved the policy, the same way


def test_packed_step_equals_padded_step_in_process(tmp_path):
    results = []
    for name, kw in (("padded", dict(padding_free=False)), ("packed", dict(padding_free=True, micro_batch_tokens=64))):
        tr = _trainer(tmp_path, name, rlkit.ParallelPlan(), **kw)
        try:
            results.append(_one_step(tr))
            if name == "packed":  # the budget really cut the step into several packed micro-batches
                from rlkit.parallel.packing import pack

                gen = results[-1][3].samples
                packs = pack(gen["input_ids"], gen["attention_mask"], token_budget=64, n_micro=1)
                assert len(packs) >= 3 and max(int(pk.segments.max()) for pk in packs) >= 2
        finally:
            tr.close()
    _compare(*results)


@pytest.mark.ray
def test_dp2_balanced_packed_step_equals_one_rank_padded(tmp_path):
    """dp=2 on Ray workers, on one padded rank's batch: samples dealt to the ranks by tokens (not in order),
    each rank packing its own; per-sample results come back in the batch's order, and the update (critic,
    then actor) equals the padded rank's."""
    from rlkit.parallel.packing import balanced_order

    one = _trainer(tmp_path, "padded", rlkit.ParallelPlan(), padding_free=False)
    try:
        batch = one.estimate(one.generate())
        settings = one.update_settings()
        sent = batch.samples.tensors_only()
        tensors = sent.replace(**{k: v.clone() for k, v in sent.items() if torch.is_tensor(v)})
        est_a = {k: tensors[k] for k in ("ref_logprobs", "values", "old_logprobs")}
        row_a = one.update(batch)
        after_a = one.workers.old_logprobs(tensors)
    finally:
        one.close()
    two = _trainer(tmp_path, "packed_dp2", rlkit.ParallelPlan(dp=2), micro_batch_tokens=64)
    try:
        w = two.workers
        est_b = {"ref_logprobs": w.ref_logprobs(tensors), "values": w.values(tensors),
                 "old_logprobs": w.old_logprobs(tensors)}
        row_b = {**w.update_critic(tensors, settings), **w.update_actor(tensors, settings)}
        after_b = w.old_logprobs(tensors)
    finally:
        two.close()
    _compare((est_a, row_a, after_a, batch), (est_b, row_b, after_b, batch))
    lengths = batch.samples["attention_mask"].sum(-1).tolist()
    assert balanced_order(lengths, dp=2) != list(range(len(lengths)))  # the deal really moved samples


def test_token_budget_errors_name_the_value_and_the_fix(tmp_path):
    path = tiny_lm("qwen2", size="small")
    with pytest.raises(TrainerError, match=r"micro_batch_tokens=8 is smaller than the longest sequence this run "
                                           r"can make: \d+ tokens .*use micro_batch_tokens >= \d+"):
        Trainer(model=path, dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=16),
                micro_batch_tokens=8, run_dir=str(tmp_path / "a"))
    for bad in (0, -5, 2.5, "4k", True):
        with pytest.raises(TrainerError, match="micro_batch_tokens"):
            rlkit.TrainerConfig(micro_batch_tokens=bad)
    with pytest.raises(TrainerError, match=r"set padding_free=True, or micro_batch_tokens=None"):
        rlkit.TrainerConfig(padding_free=False, micro_batch_tokens=4096)
    with pytest.raises(TrainerError, match="padding_free"):
        rlkit.TrainerConfig(padding_free="yes")
    with pytest.raises(TrainerError, match=r"micro_batch_tokens=4096 with plan dp=2 .*pp=2.* not supported yet.*"
                                           r"use padding_free=False"):
        Trainer(model=path, dataset=rlkit.tasks.repeat, plan=rlkit.ParallelPlan(dp=2, pp=2, micro_batches=2),
                rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=16), micro_batch_tokens=4096,
                run_dir=str(tmp_path / "b"))
