"""The RL step-time model (``rlkit.plan.throughput.estimate_rl_step`` and ``predict_rl_step``): the formulas
against hand computations, the separate pi_old pass, the long tail and fully async, the measurements of
bench/README.md ("bench_async.py"), and errors that name the bad value."""

import math

import pytest

from rlkit.errors import PlanError
from rlkit.plan import estimate_generation, estimate_throughput
from rlkit.plan.throughput import estimate_rl_step, predict_rl_step


# ---- the three loops, by hand ------------------------------------------------------------------------
def test_loops_hand_computed_linear():
    # 4 devices, 1 for rollout, 3 to train: generation 6 s x 4/1 = 24 s, update 12 s x 4/3 = 16 s.
    # colocated 6 + 12 + 1.5 = 19.5; split sync 24 + 16 + 1.5 = 41.5; one-step-off max(24, 16 + 1.5) = 24
    r = estimate_rl_step(6.0, 12.0, 1.5, devices=4, rollout_devices=1, scaling=1.0)
    assert r["colocated_sync_s"] == pytest.approx(19.5)
    assert r["split_sync_s"] == pytest.approx(41.5)
    assert r["split_one_step_off_s"] == pytest.approx(24.0)
    assert r["one_step_off_vs_split_sync"] == pytest.approx(41.5 / 24)
    assert r["one_step_off_vs_colocated"] == pytest.approx(19.5 / 24)
    assert "fully_async_s" not in r  # only with staleness=


def test_loops_hand_computed_partial_scaling():
    # scaling 0.5: generation 6 x (4/1)^0.5 = 12 s; update 12 x (4/3)^0.5 = 12 x 1.1547005 = 13.856406 s
    r = estimate_rl_step(6.0, 12.0, devices=4, rollout_devices=1, scaling=0.5)
    assert r["split_sync_s"] == pytest.approx(12.0 + 13.856406, rel=1e-6)
    assert r["split_one_step_off_s"] == pytest.approx(13.856406, rel=1e-6)
    # flat: each side keeps its colocated time; default split is half the devices
    flat = estimate_rl_step(6.0, 12.0, devices=4, scaling=0.0)
    assert flat["split_sync_s"] == 18.0 and flat["split_one_step_off_s"] == 12.0


# ---- the separate pi_old pass -----------------------------------------------------------------------
def test_old_logprob_pass_only_in_the_off_policy_loops_by_default():
    # 2 devices, 1 + 1: G 4 -> 8, U 9 -> 18, O 3 -> 6, S 2. Colocated and split sync do not pay O;
    # one-step-off's trainer side does: max(8, 18 + 6 + 2) = 26 (without the pass: max(8, 20) = 20)
    base = estimate_rl_step(4.0, 9.0, 2.0, devices=2, rollout_devices=1)
    r = estimate_rl_step(4.0, 9.0, 2.0, devices=2, rollout_devices=1, old_logprob_s=3.0)
    assert (r["colocated_sync_s"], r["split_sync_s"]) == (base["colocated_sync_s"], base["split_sync_s"]) == (15.0, 28.0)
    assert base["split_one_step_off_s"] == 20.0
    assert r["split_one_step_off_s"] == 26.0


def test_old_logprob_pass_all_and_sync():
    # "all" (epochs > 1 or minibatches > 1): colocated 4 + 9 + 3 + 2 = 18, split sync 8 + 18 + 6 + 2 = 34,
    # one-step-off max(8, 26) = 26. "sync" (verl's fully async uses the rollout's log-probs): the
    # synchronous loops as "all", the off-policy ones as without the pass: one-step-off max(8, 20) = 20
    kw = dict(devices=2, rollout_devices=1, old_logprob_s=3.0)
    every = estimate_rl_step(4.0, 9.0, 2.0, old_logprob_in="all", **kw)
    assert (every["colocated_sync_s"], every["split_sync_s"], every["split_one_step_off_s"]) == (18.0, 34.0, 26.0)
    sync = estimate_rl_step(4.0, 9.0, 2.0, old_logprob_in="sync", staleness=1, **kw)
    assert (sync["colocated_sync_s"], sync["split_sync_s"], sync["split_one_step_off_s"]) == (18.0, 34.0, 20.0)
    assert sync["fully_async_s"] == 20.0  # max(8, 18 + 2, 0 / 1)


def test_a_length_distribution_sets_the_tail():
    # two batches: [8, 8, 8, 40] (mean 16, max 40) and [8, 8, 8, 8] (mean 8, max 8): lockstep decodes
    # (40 + 8) / 2 = 24 steps a batch on average for a mean of (16 + 8) / 2 = 12 tokens: half is tail.
    # G 6 s on 2 devices, 1 for rollout: tail 3 s stays, the parallel 3 s doubles: G_r = 9; U 1 -> 2, S 0.5.
    # fully async, k = 2: max(6, 2 + 0.5, 3 / 2) = 6; one-step-off max(9, 2.5) = 9
    r = estimate_rl_step(6.0, 1.0, 0.5, devices=2, rollout_devices=1, staleness=2,
                         lengths=[[8, 8, 8, 40], [8, 8, 8, 8]])
    assert r["tail_share"] == pytest.approx(0.5)
    assert r["split_one_step_off_s"] == pytest.approx(9.0)
    assert r["fully_async_s"] == pytest.approx(6.0)
    assert r["fully_async_vs_one_step_off"] == pytest.approx(1.5)
    same = estimate_rl_step(6.0, 1.0, 0.5, devices=2, rollout_devices=1, staleness=2, tail_s=3.0)
    assert {k: v for k, v in r.items() if k != "tail_share"} == pytest.approx(same)
    with pytest.raises(PlanError, match=r"give tail_s=1.0 or lengths, not both"):
        estimate_rl_step(6.0, 1.0, devices=2, tail_s=1.0, lengths=[[8]])
    with pytest.raises(PlanError, match=r"lengths must be batches \(lists\) of response lengths, positive integers"):
        estimate_rl_step(6.0, 1.0, devices=2, lengths=[8, 64])


def test_defaults_keep_the_model_as_it_was():
    # no pass, no tail, no staleness: the same numbers as before the extension (the docstring's)
    r = estimate_rl_step(10.0, 10.0, devices=2, rollout_devices=1, scaling=1.0, old_logprob_s=0.0, tail_s=0.0)
    assert (r["colocated_sync_s"], r["split_sync_s"], r["split_one_step_off_s"]) == (20.0, 40.0, 20.0)


# ---- the long tail and fully async ------------------------------------------------------------------
def test_tail_does_not_scale_and_streaming_hides_it():
    # G 10 s of which T 4 s tail, 4 devices, 2 for rollout (x2): G_r = 6 x 2 + 4 = 16; U 3 -> 6.
    # one-step-off max(16, 6) = 16; fully async (k=1) max(6 x 2, 6, 4 / 1) = 12
    r = estimate_rl_step(10.0, 3.0, devices=4, rollout_devices=2, tail_s=4.0, staleness=1)
    assert r["split_sync_s"] == 22.0 and r["split_one_step_off_s"] == 16.0
    assert r["fully_async_s"] == 12.0
    assert r["fully_async_vs_colocated"] == pytest.approx(13.0 / 12.0)


def test_staleness_bounds_the_tail():
    # G 10 s, T 8 s, U 1 s, 2 devices 1 + 1: W_r = 2 x 2 = 4, trainer 2. A response must end within k
    # versions: k = 1 -> step >= 8; k = 4 -> >= 2, so the parallel work (4) sets it
    kw = dict(devices=2, rollout_devices=1, tail_s=8.0)
    assert estimate_rl_step(10.0, 1.0, staleness=1, **kw)["fully_async_s"] == 8.0
    assert estimate_rl_step(10.0, 1.0, staleness=4, **kw)["fully_async_s"] == 4.0
    for g, u, t, k in ((10.0, 1.0, 8.0, 2), (5.0, 9.0, 1.0, 1), (7.0, 7.0, 0.0, 3)):  # never slower than one-step-off
        r = estimate_rl_step(g, u, 0.5, devices=4, rollout_devices=2, tail_s=t, staleness=k, old_logprob_s=1.0)
        assert r["fully_async_s"] <= r["split_one_step_off_s"]


# ---- against the measurements here (bench/README.md, "bench_async.py", 2026-12-05) -------------------
def test_formula_composes_the_measured_split_phases():
    # SmolLM2-135M, one core each side: split sync generate 6.581 s, update 14.448 s, sync 3.779 s ->
    # 24.808 s (measured 25.765); one-step-off: update 14.643 s + pi_old pass 5.280 s + sync 3.779 s
    # = 23.702 s on the trainer's side, above generation's 7.146 s (measured 23.457)
    kw = dict(devices=2, rollout_devices=1, scaling=0.0)
    sync = estimate_rl_step(6.581, 14.448, 3.779, **kw)["split_sync_s"]
    off = estimate_rl_step(7.146, 14.643, 3.779, old_logprob_s=5.280, **kw)["split_one_step_off_s"]
    assert sync == pytest.approx(24.808) and off == pytest.approx(23.702)
    assert abs(sync / 25.765 - 1) < 0.05 and abs(off / 23.457 - 1) < 0.05
    # without the pi_old pass the model missed the one-step-off step by 14%
    assert estimate_rl_step(7.146, 14.643, 3.779, **kw)["split_one_step_off_s"] / 23.457 < 0.87


# ---- predict_rl_step: phases from estimate_generation and estimate_throughput -----------------------
def test_predict_tail_hand_computed():
    # qwen2.5-7b: 7,615,616,512 params x 2 B = 15,231,233,024 B; one response alone at an average context of
    # 256 + 8192 / 2 = 4352 tokens reads 4352 x 57,344 = 249,565,184 B of KV: 15,480,798,208 B per token at
    # 3.35e12 x 0.8 B/s = 5.776417 ms. From the mean 1024 to 8192: 7168 tokens -> 41.4054 s of tail
    r = predict_rl_step("qwen2.5-7b", gpu="H100", devices=16, rollout_devices=8, batch=1024, prompt_len=256,
                        response_len=1024, max_response_len=8192)
    assert r["tail_s"] == pytest.approx(7168 * 15_480_798_208 / 2.68e12, rel=1e-6)
    assert r["tail_s"] == pytest.approx(41.4054, rel=1e-5)
    # no longer response than the mean: no tail
    assert predict_rl_step("qwen2.5-7b", devices=16, batch=1024, response_len=1024)["tail_s"] == 0.0


def test_predict_feeds_the_phase_estimates():
    from rlkit.plan import ParallelPlan

    kw = dict(gpu="H100", devices=16, rollout_devices=4, batch=1024, prompt_len=256, response_len=1024)
    r = predict_rl_step("qwen2.5-7b", rollout_tp=2, token_budget=16384, minibatches=4, old_logprob="off_policy", **kw)
    # 8 engines of 2 GPUs, 128 responses each
    gen = estimate_generation("qwen2.5-7b", gpu="H100", tp=2, batch=128, prompt_len=256, response_len=1024)
    assert r["generate_s"] == pytest.approx(gen["seconds_per_rollout_batch"])
    plan = ParallelPlan(dp=16, devices_per_node=8)
    step = estimate_throughput(plan, "qwen2.5-7b", seq_len=1280, global_batch=256, gpu="H100", token_budget=16384)
    assert r["update_s"] == pytest.approx(4 * step["step_s"])  # 4 optimizer steps of 256 sequences
    fwd = estimate_throughput(plan, "qwen2.5-7b", seq_len=1280, global_batch=1024, gpu="H100", token_budget=16384)
    assert r["old_logprob_s"] == pytest.approx(fwd["step_s"] / 3)
    # the same numbers through estimate_rl_step
    again = estimate_rl_step(r["generate_s"], r["update_s"], devices=16, rollout_devices=4,
                             old_logprob_s=r["old_logprob_s"])
    assert r["split_one_step_off_s"] == again["split_one_step_off_s"]
    none = predict_rl_step("qwen2.5-7b", rollout_tp=2, token_budget=16384, minibatches=4, **kw)
    assert none["old_logprob_s"] == 0.0 and none["split_one_step_off_s"] <= r["split_one_step_off_s"]


# ---- errors name the bad value ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    (dict(generate_s=-1.0), "generate_s=-1.0"),
    (dict(update_s=math.nan), "update_s=nan"),
    (dict(sync_s="2"), "sync_s='2'"),
    (dict(generate_s=math.inf), "generate_s=inf"),
    (dict(old_logprob_s=-0.5), "old_logprob_s=-0.5"),
    (dict(tail_s=-1.0), "tail_s=-1.0"),
    (dict(tail_s=11.0), "tail_s=11.0"),
    (dict(old_logprob_in="both"), "old_logprob_in='both'"),
    (dict(staleness=0), "staleness=0"),
    (dict(staleness=1.5), "staleness=1.5"),
    (dict(scaling=-1.0), "scaling=-1.0"),
    (dict(rollout_devices=4), "rollout_devices=4"),
    (dict(devices=True), "devices=True"),
])
def test_estimate_rl_step_errors(kwargs, named):
    args = dict(generate_s=10.0, update_s=5.0, sync_s=0.0, devices=4, rollout_devices=2)
    args.update(kwargs)
    with pytest.raises(PlanError, match=named.replace("(", r"\(").replace(".", r"\.")):
        estimate_rl_step(args.pop("generate_s"), args.pop("update_s"), args.pop("sync_s"), **args)


@pytest.mark.parametrize("kwargs, named", [
    (dict(batch=1000, minibatches=16), "minibatches=16"),
    (dict(rollout_tp=3), "rollout_tp=3"),
    (dict(max_response_len=100), "max_response_len=100"),
    (dict(old_logprob="yes"), "old_logprob='yes'"),
    (dict(batch=0), "batch=0"),
    (dict(sync_s=-1), "sync_s=-1"),
])
def test_predict_rl_step_errors(kwargs, named):
    args = dict(gpu="H100", devices=16, batch=1024, response_len=512)
    args.update(kwargs)
    with pytest.raises(PlanError, match=named.replace(".", r"\.")):
        predict_rl_step("qwen2.5-7b", **args)
