"""Off-policy correction (TIS / MIS) and the engine-vs-trainer mismatch it corrects.

The weights are held against a hand computation on small tensors; through the Trainer, the correction on an
fp32 engine (no mismatch: weights 1) leaves the on-policy run as it was, and the mismatch metrics show a bf16
engine feeding the fp32 trainer (measurable) against an fp32 one (almost none).
"""

from __future__ import annotations

import math

import pytest
import torch

import rlkit
from rlkit.algos import policy_loss
from rlkit.algos.offpolicy import importance_weights, mismatch_metrics
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer
from rlkit.widgets.live import metrics_figure

torch.set_num_threads(1)


def test_tis_and_mis_against_a_hand_computation():
    # pi_old / mu per token: 1, 4, 0.5 | 3, 1 (a padded column in row 2)
    old = torch.log(torch.tensor([[0.4, 0.8, 0.1], [0.6, 0.3, 0.7]]))
    mu = torch.log(torch.tensor([[0.4, 0.2, 0.2], [0.2, 0.3, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, m = importance_weights(old, mu, mask, mode="tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 0.0]]), atol=1e-6)
    assert m["offpolicy/truncated_frac"] == pytest.approx(2 / 5)
    assert m["offpolicy/ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert m["offpolicy/ratio_mean"] == pytest.approx((1 + 4 + 0.5 + 3 + 1) / 5, rel=1e-5)
    # k3 = r - 1 - log r per token, averaged
    k3 = [r - 1 - math.log(r) for r in (1, 4, 0.5, 3, 1)]
    assert m["offpolicy/kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert m["offpolicy/max_abs_dlogp"] == pytest.approx(math.log(4), rel=1e-5)

    w, m = importance_weights(old, mu, mask, mode="mis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0]]), atol=1e-6)

    # sequence level: one weight per sample, exp of the summed log ratio: row 1: 1 * 4 * 0.5 = 2, row 2: 3
    w, _ = importance_weights(old, mu, mask, mode="tis", cap=2.5, level="sequence")
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0], [2.5, 2.5, 0.0]]), atol=1e-5)
    w, _ = importance_weights(old, mu, mask, mode="mis", cap=2.5, level="sequence")
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]), atol=1e-5)


def test_weighting_the_advantages_weights_each_tokens_ppo_loss():
    """PPO's clipped surrogate on w * A equals the per-token loss weighted by w (the loss is positively
    homogeneous in A), which is how the Trainer applies the weights."""
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 5, generator=g) * 0.1 - 1, torch.randn(3, 5, generator=g) * 0.1 - 1
    adv, mask = torch.randn(3, 5, generator=g), torch.ones(3, 5)
    w = torch.rand(3, 5, generator=g) * 2
    weighted, _ = policy_loss(lp, old, adv * w, mask, agg="token-mean")
    ratio = torch.exp(lp - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert weighted.item() == pytest.approx((w * per_token).mean().item(), rel=1e-5)


def test_no_mismatch_means_no_metric():
    lp = torch.randn(2, 4)
    m = mismatch_metrics(lp, lp, torch.ones(2, 4))
    assert m == {"offpolicy/kl": 0.0, "offpolicy/max_abs_dlogp": 0.0, "offpolicy/ratio_mean": 1.0,
                 "offpolicy/ratio_max": 1.0}


def _run(tmp_path, name, steps=3, rollout_dtype="float32", epochs=2, **kw):
    tr = Trainer(model=tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                 rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=12, dtype=rollout_dtype),
                 prompts_per_step=4, lr=2e-3, seed=0, epochs=epochs, run_dir=str(tmp_path / name), **kw)
    try:
        return tr.fit(steps=steps, view="none")
    finally:
        tr.close()


def test_correction_on_an_exact_engine_leaves_the_on_policy_run_as_it_was(tmp_path):
    """fp32 engine, fp32 trainer: pi_old / mu is 1 up to rounding, so TIS changes nothing measurable; the
    metrics say the mismatch is ~0 (measured: KL < 1e-12, max |dlogp| ~1e-6)."""
    plain = _run(tmp_path, "plain")
    tis = _run(tmp_path, "tis", offpolicy_correction="tis", offpolicy_cap=2.0)
    for col in ("reward/mean", "response_length/mean"):
        assert plain[col].tolist() == tis[col].tolist(), col
    for col in ("actor/loss", "actor/grad_norm"):
        assert (plain[col] - tis[col]).abs().max() <= 1e-4 * plain[col].abs().max(), (plain[col], tis[col])
    assert tis["offpolicy/kl"].max() < 1e-9 and tis["offpolicy/max_abs_dlogp"].max() < 1e-4
    assert tis["offpolicy/truncated_frac"].max() == 0.0


def test_a_bf16_engine_shows_a_measurable_mismatch(tmp_path):
    """The same run with a bf16 rollout engine: its log-probs differ from the fp32 trainer's by far more
    than the fp32 engine's rounding (measured on the tiny model: max |dlogp| 5.6e-3, ratios up to 1.005), and MIS
    with a cap of 1.002 drops the worst tokens."""
    bf16 = _run(tmp_path, "bf16", steps=2, rollout_dtype="bfloat16", offpolicy_correction="mis", offpolicy_cap=1.002)
    fp32 = _run(tmp_path, "fp32", steps=2)
    assert bf16["offpolicy/max_abs_dlogp"].min() > 1e-3 > 100 * fp32["offpolicy/max_abs_dlogp"].max()
    assert bf16["offpolicy/kl"].min() > 1e3 * max(fp32["offpolicy/kl"].max(), 1e-12)
    assert bf16["offpolicy/truncated_frac"].max() > 0


@pytest.mark.parametrize("mode,level,cap", [("tis", "token", 1.002), ("mis", "sequence", 1.01)])
def test_the_correction_inside_the_update_equals_the_separate_scoring_pass(tmp_path, monkeypatch, mode, level, cap):
    """One optimizer step per batch: the update's own forward is pi_old, so the weights pi_old / mu are taken
    there and the scoring pass before the update is dropped. A bf16 engine (a real mismatch, caps that bite)
    against the same run made to take the separate pass: the same samples, losses and mismatch metrics."""
    kw = dict(epochs=1, rollout_dtype="bfloat16", offpolicy_correction=mode, offpolicy_cap=cap, offpolicy_level=level)
    fused = _run(tmp_path, "fused", steps=3, **kw)
    monkeypatch.setattr(rlkit.TrainerConfig, "fused_offpolicy", lambda self: False)
    scored = _run(tmp_path, "scored", steps=3, **kw)
    assert "timing/old_logprobs" not in fused and scored["timing/old_logprobs"].notna().all()
    assert fused["reward/mean"].tolist() == scored["reward/mean"].tolist()
    assert fused["offpolicy/truncated_frac"].max() > 0  # the cap bites: the weights are not all 1
    for col in ("actor/loss", "actor/grad_norm", "offpolicy/kl", "offpolicy/max_abs_dlogp", "offpolicy/ratio_mean",
                "offpolicy/ratio_max", "offpolicy/truncated_frac", "offpolicy/weight_mean"):
        assert (fused[col] - scored[col]).abs().max() <= 1e-4 * max(scored[col].abs().max(), 1e-3), (col, fused[col],
                                                                                                    scored[col])


# ---- one-step-off asynchronous RL (split placement, real Ray workers) -----------------------------------------
def _async_trainer(tmp_path, name, off_policy_steps=1, **kw):
    return Trainer(model=tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                   rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=12), prompts_per_step=4, lr=2e-3, seed=0,
                   placement="split", off_policy_steps=off_policy_steps, offpolicy_correction="tis",
                   run_dir=str(tmp_path / name), **kw)


@pytest.mark.ray
def _phases(trainer) -> dict:
    """``{(phase, step): {"start", "end"}}`` from ``trainer.timeline``."""
    return {(r.phase, r.step): {"start": r.start, "end": r.end} for r in trainer.timeline.itertuples()}


def test_one_step_off_trains_every_batch_once_within_the_bound_and_resumes_exactly(tmp_path):
    sync = _async_trainer(tmp_path, "sync", off_policy_steps=0)
    try:
        on_policy = sync.fit(steps=2, view="none")
        in_turn = _phases(sync)
    finally:
        sync.close()
    # synchronous: step 2's generation starts after step 1's update ended (times the workers and driver recorded)
    assert in_turn["generate", 2]["start"] > in_turn["update", 1]["end"], in_turn
    tr = _async_trainer(tmp_path, "async")
    try:
        first = tr.fit(steps=2, view="none")
        # the first step has nothing in flight: on-policy, the same samples as the synchronous run's
        assert first["reward/mean"].iloc[0] == on_policy["reward/mean"].iloc[0]
        assert first["offpolicy/staleness_max"].tolist() == [0.0, 1.0]  # then one version old, never more
        # the live view draws the staleness and the engine/trainer mismatch, step by step
        axes = {ax.get_title(): ax for ax in metrics_figure(first).axes}
        assert list(axes["staleness (versions behind)"].lines[0].get_ydata()) == [0.0, 1.0]
        drawn = axes["engine vs trainer max |Δ log p|"].lines[0].get_ydata()
        assert list(drawn) == pytest.approx(first["offpolicy/max_abs_dlogp"].tolist())
        assert len(tr._ahead) == 1 and next(iter(tr._ahead)).step == 2  # step 3's batch is sampling (or sampled)
        tr.save(tmp_path / "ckpt")
        # a step given up before its update (Ctrl-C in fit) puts its batch back: it is trained next, once
        given_up = tr.generate()
        tr._put_back(given_up)
        in_flight = []   # at the end of each step: the batches sampling, launched by its generate, before its update
        tr.callbacks = [lambda trainer, row: in_flight.append((row["step"], [e.step for e in trainer._ahead]))]
        rest = tr.fit(steps=2, view="none").iloc[2:]
        tr.callbacks = []
        assert rest["offpolicy/staleness_max"].tolist() == [1.0, 1.0]
        # the overlap: while step k trained, step k + 1's batch was in flight (0-based step k)
        assert in_flight == [(3, [3]), (4, [4])]
        # each step trained on its own prompts, in order: the rows of steps 1..4, each once
        samples = tr.samples(last=4)
        assert len(samples) == 4 * 4 * 4
        for step in range(1, 5):
            trained = sorted(samples[samples.step == step]["prompt"])
            assert trained == sorted(r["prompt"] for r in tr._prompts_of(step - 1) for _ in range(4)), step
        # (not from the recorded times: on a busy machine a worker may pick a launched generation up only after
        # a short update has ended; the in-flight batches above are the overlap's cause, and stay true)
    finally:
        tr.close()
    again = Trainer.load(tmp_path / "ckpt", dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    try:
        assert len(again._ahead) == 1  # the batch sampled before the save is trained, not sampled again
        resumed = again.fit(steps=2, view="none").iloc[2:]
        for col in ("reward/mean", "actor/loss", "offpolicy/staleness_max"):
            assert resumed[col].tolist() == rest[col].tolist(), col
    finally:
        again.close()


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.parametrize("side", ["rollout", "actor"])
def test_a_worker_killed_mid_overlap_is_reported_with_its_rank_and_phase(tmp_path, side):
    """One-step-off: the worker of one side is killed (SIGKILL) at the end of step 1, while the other side is
    busy with the next batch. The run stops with a WorkerError naming the dead rank and the call it died in,
    and the trainer closes (bounded waits, no hang on the weight channel)."""
    from _kill import fit_until_killed

    tr = _async_trainer(tmp_path, side)
    try:
        error, phase = fit_until_killed(tr, tr.rollout_group if side == "rollout" else tr.group)
        expected = {"rollout": {"generate", "receive_weights"}, "actor": {"send_weights", "update_actor"}}[side]
        assert error.rank == 0 and phase in expected, str(error)
        assert 1 <= len(tr.metrics) <= 2  # step 1 was logged; step 2 too when its batch was sampled before the kill
    finally:
        tr.close()
