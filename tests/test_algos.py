"""rlkit.algos against numbers computed by hand (each test states its arithmetic).

Tensors are float64 so hand values match to 1e-6; padding is filled with garbage (incl. NaN) to show
it changes nothing.
"""

import math

import pytest
import torch

from rlkit.algos import (
    ADVANTAGES,
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    apply_kl_penalty,
    compute_advantages,
    drgrpo,
    entropy_bonus,
    entropy_from_logprobs,
    gae,
    get_advantage,
    grpo,
    kl_loss,
    kl_penalty,
    policy_loss,
    register_advantage,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    value_loss,
)

TOL = dict(atol=1e-6, rtol=0)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(a, b):
    torch.testing.assert_close(a, b if isinstance(b, torch.Tensor) else torch.as_tensor(b, dtype=a.dtype), **TOL)


# ---------------------------------------------------------------- advantages

def test_gae_three_step_episode_by_hand():
    # gamma=0.9, lam=0.8 (gamma*lam = 0.72), rewards [0, 0, 1], values [.5, .6, .7]:
    # t=2: delta = 1 - .7 = .3                 A2 = .3
    # t=1: delta = .9*.7 - .6 = .03            A1 = .03 + .72*.3 = .246
    # t=0: delta = .9*.6 - .5 = .04            A0 = .04 + .72*.246 = .21712
    # returns = A + V = [.71712, .846, 1.0]. Row 2 is the same episode cut to 2 steps (reward on its
    # last real token): t=1: delta = 1 - .6 = .4; t=0: delta = .04 + .9*... -> .9*.6-.5 = .04, A0 = .04+.72*.4
    rewards = t([0, 0, 1, 0], [0, 1, 0, 0])
    values = t([.5, .6, .7, 123.0], [.5, .6, float("nan"), -7.0])     # garbage in padding
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    close(adv, t([.21712, .246, .3, 0], [.04 + .72 * .4, .4, 0, 0]))
    close(ret, t([.71712, .846, 1.0, 0], [.5 + .328, 1.0, 0, 0]))
    # one score per sequence lands on the last real token: same result
    close(gae(torch.tensor([1.0, 1.0], dtype=torch.float64), values, mask, gamma=0.9, lam=0.8, whiten=False)[0], adv)
    # whitening: mean 0, unbiased std 1 over the 5 real tokens, 0 on padding
    w, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    real = w[mask.bool()]
    assert abs(real.mean().item()) < 1e-9 and abs(real.std().item() - 1) < 1e-6
    assert (w[~mask.bool()] == 0).all()


def test_gae_padding_inside_a_response_is_skipped():
    # A hole (e.g. tool output in a multi-turn response) neither receives nor passes on value:
    # [r=0,V=.5] [hole] [r=1,V=.7] with gamma=lam=1 is the 2-step episode: A1 = .3, A0 = (0+.7-.5)+.3 = .5
    adv, ret = gae(t([0, 5.0, 1]), t([.5, 9.0, .7]), torch.tensor([[1, 0, 1]]), whiten=False)
    close(adv, t([.5, 0, .3]))
    close(ret, t([1.0, 0, 1.0]))


def test_grpo_group_of_four_and_singletons():
    # [1,0,0,1]: mean .5, unbiased std sqrt(4 * .25 / 3) = .57735 -> +-.5/.57735 = +-.866025
    # a group of size 1 (id "solo") has no baseline -> 0; string ids work
    scores = torch.tensor([1, 0, 0, 1, 5], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    adv, ret = grpo(scores, ["a", "a", "a", "a", "solo"], mask)
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)                             # eps=1e-6 is added to the std
    close(adv, t([s, s], [-s, 0], [-s, -s], [s, s], [0, 0]))
    assert ret is adv
    # per-token rewards are summed over real tokens first (garbage in padding ignored)
    tok = t([0, 1], [0, 99], [0, 0], [1, 0], [2, 3])
    close(grpo(tok, torch.tensor([3, 3, 3, 3, 4]), mask)[0], adv)
    # Dr.GRPO: no std division -> +-.5
    close(drgrpo(scores, [0, 0, 0, 0, 1], mask)[0][:, 0], t(.5, -.5, -.5, .5, 0))
    # all-equal group: 0 advantage, not NaN
    assert (grpo(torch.ones(3, dtype=torch.float64), [0, 0, 0], torch.ones(3, 2))[0] == 0).all()


def test_rloo_leave_one_out():
    # group [1,0,0,1]: 1 - mean(0,0,1) = 2/3; 0 - mean(1,0,1) = -2/3
    # group [3,1,2]:   3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0;   singleton -> 0
    scores = torch.tensor([1, 0, 0, 1, 3, 1, 2, 7], dtype=torch.float64)
    adv, _ = rloo(scores, [0, 0, 0, 0, 1, 1, 1, 2], torch.ones(8, 1))
    close(adv[:, 0], t(2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0, 0))


def test_reinforce_pp_discounted_and_whitened():
    # gamma=.5, token rewards row0 [0, 1, pad] -> returns [.5, 1]; row1 [2, pad, pad] -> [2]
    # whitening over {.5, 1, 2}: mean 7/6, unbiased var ((-2/3)^2 + (-1/6)^2 + (5/6)^2)/2 = 7/12
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, ret = reinforce_pp(t([0, 1, 9], [2, 9, 9]), mask, gamma=0.5)
    close(ret, t([.5, 1, 0], [2, 0, 0]))
    sd = math.sqrt(7 / 12)
    close(adv, t([(.5 - 7 / 6) / sd, (1 - 7 / 6) / sd, 0], [(2 - 7 / 6) / sd, 0, 0]))
    # baseline variant: groups {1,0}, {1,1} -> [.5, -.5, 0, 0], whitened: std sqrt(.5/3) -> +-1.224745
    b, _ = reinforce_pp_baseline(torch.tensor([1, 0, 1, 1.0], dtype=torch.float64), [0, 0, 1, 1], torch.ones(4, 1))
    close(b[:, 0], t(.5, -.5, 0, 0) / math.sqrt(.5 / 3))


def test_gae_and_returns_match_a_plain_python_loop_on_random_batches():
    # Independent reference: per sequence, drop padding, run the textbook recursions on lists.
    g = torch.Generator().manual_seed(0)
    B, T, gamma, lam = 6, 7, 0.95, 0.9
    lengths = [7, 1, 4, 6, 3, 5]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    r, v = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam, whiten=False)
    _, disc = reinforce_pp(r, mask, gamma=gamma)
    for b, n in enumerate(lengths):
        rs, vs = r[b, :n].tolist(), v[b, :n].tolist() + [0.0]
        a, G, want_a, want_g = 0.0, 0.0, [], []
        for k in reversed(range(n)):
            a = rs[k] + gamma * vs[k + 1] - vs[k] + gamma * lam * a
            G = rs[k] + gamma * G
            want_a.insert(0, a)
            want_g.insert(0, G)
        close(adv[b, :n], torch.tensor(want_a, dtype=torch.float64))
        close(ret[b, :n], torch.tensor(want_a, dtype=torch.float64) + v[b, :n])
        close(disc[b, :n], torch.tensor(want_g, dtype=torch.float64))
        assert (adv[b, n:] == 0).all() and (ret[b, n:] == 0).all()


def test_padding_rows_and_garbage_change_nothing():
    # Append an all-padding row with huge rewards: the real rows' advantages stay the same, except for
    # the batch-global whitening estimators, whose statistics must also ignore it (they do: masked).
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    r, v = t([0, 1, 5], [2, 7, 7]), t([.1, .2, 9], [.3, 9, 9])
    pad_mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    pad_r, pad_v = torch.cat([r, t([1e6, 1e6, 1e6])]), torch.cat([v, t([1e6, 1e6, 1e6])])
    close(gae(pad_r, pad_v, pad_mask)[0][:2], gae(r, v, mask)[0])
    close(reinforce_pp(pad_r, pad_mask)[0][:2], reinforce_pp(r, mask)[0])


def test_registry_round_trip_with_a_user_estimator():
    @register_advantage("length_penalty")
    def length_penalty(scores, response_mask, group_ids, per_token=0.1):
        adv = (scores[:, None] - per_token * response_mask.sum(-1, keepdim=True)) * response_mask
        return adv, adv

    try:
        assert get_advantage("length_penalty") is length_penalty and "length_penalty" in ADVANTAGES
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
        adv, _ = compute_advantages("length_penalty", t(1.0, 1.0), mask, group_ids=[0, 0], per_token=0.5)
        close(adv, t([0, 0, 0], [.5, 0, 0]))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("length_penalty")(lambda scores, response_mask: None)
        first = length_penalty

        @register_advantage("length_penalty")        # the same cell run again: replaces quietly
        def length_penalty(scores, response_mask, group_ids, per_token=0.1):
            return first(scores, response_mask, group_ids, per_token)

        assert get_advantage("length_penalty") is length_penalty is not first
    finally:
        ADVANTAGES.pop("length_penalty")
    with pytest.raises(ValueError, match="unknown advantage estimator 'length_penalty'.*grpo"):
        get_advantage("length_penalty")
    # built-ins under their names and aliases; uniform call passes only what each one takes
    assert get_advantage("reinforce++") is reinforce_pp and get_advantage("ppo") is gae
    mask = torch.ones(4, 2)
    for name in ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"):
        adv, ret = compute_advantages(name, torch.tensor([1., 0, 0, 1]), mask, values=torch.zeros(4, 2),
                                      group_ids=[0, 0, 1, 1])
        assert adv.shape == ret.shape == (4, 2) and torch.isfinite(adv).all(), name
    with pytest.raises(ValueError, match="'gae' needs values="):
        compute_advantages("gae", torch.tensor([1., 0]), torch.ones(2, 2))


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"values has shape \(2, 3\) but response_mask has \(2, 2\)"):
        gae(torch.zeros(2, 2), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="group_ids has 3 entries but the batch has 2"):
        grpo(torch.zeros(2), [0, 0, 1], torch.ones(2, 2))
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="dual_clip=0.5 must be > 1"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), dual_clip=0.5)
    with pytest.raises(ValueError, match="unknown KL estimator kind='k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ---------------------------------------------------------------- losses

def test_aggregate_modes_with_uneven_lengths():
    # row0 has 3 tokens [1,2,3], row1 has 1 token [4] (then garbage), row2 is all padding
    loss = t([1, 2, 3], [4, 1e9, float("nan")], [7, 7, 7])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), 10 / 4)                  # (1+2+3+4)/4
    close(aggregate(loss, mask, "seq-mean-token-mean"), (2 + 4) / 2)    # (6/3 + 4/1)/2
    close(aggregate(loss, mask, "seq-mean-token-sum"), (6 + 4) / 2)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm"), (6 / 3 + 4 / 3) / 2)     # norm = T = 3
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm=5), (6 / 5 + 4 / 5) / 2)
    close(aggregate(loss, torch.zeros(3, 3), "seq-mean-token-mean"), 0.0)          # empty: 0, not NaN


def test_policy_loss_clip_fractions_on_crafted_ratios():
    # ratios [.5, 1.5, .5, 1.5], advantages [+1, +1, -1, -1], eps .2:
    # tok0: max(-.5, -.8) = -.5      (not clipped)
    # tok1: max(-1.5, -1.2) = -1.2   (clipped)
    # tok2: max(.5, .8) = .8         (clipped)
    # tok3: max(1.5, 1.2) = 1.5      (not clipped)      mean .15, clipfrac .5
    old = t([-1.0, -1.0, -1.0, -1.0, 0.0])
    lp = old + torch.log(t([.5, 1.5, .5, 1.5, 1.0]))
    lp[0, 4] = float("nan")                                         # padding log-prob: ignored
    adv, mask = t([1, 1, -1, -1, 50]), torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = policy_loss(lp, old, adv, mask)
    close(loss, 0.15)
    assert m["clipfrac"] == pytest.approx(0.5) and m["clipfrac_lower"] == 0
    assert m["ratio_mean"] == pytest.approx(1.0) and m["ratio_max"] == pytest.approx(1.5)
    assert m["approx_kl"] == pytest.approx(-(2 * math.log(.5) + 2 * math.log(1.5)) / 4)
    # DAPO clip-higher 0.28: tok1 becomes max(-1.5, -1.28) = -1.28 -> (-.5 - 1.28 + .8 + 1.5)/4 = .13
    close(policy_loss(lp, old, adv, mask, clip_high=0.28)[0], 0.13)


def test_policy_loss_dual_clip():
    # A = -1 everywhere, ratios [5, 2, .5], c = 3:
    # tok0: max(5, 1.2) = 5 -> capped at -A*c = 3     (clipfrac_lower counts it)
    # tok1: max(2, 1.2) = 2 < 3 stays
    # tok2: max(.5, .8) = .8 (ordinary clip)           mean (3 + 2 + .8)/3
    lp = torch.log(t([5, 2, .5])).requires_grad_(True)
    loss, m = policy_loss(lp, torch.zeros(1, 3, dtype=torch.float64), t([-1, -1, -1]), torch.ones(1, 3),
                          dual_clip=3.0)
    close(loss, (3 + 2 + .8) / 3)
    assert m["clipfrac_lower"] == pytest.approx(1 / 3) and m["clipfrac"] == pytest.approx(1 / 3)   # tok2
    loss.backward()
    # d/d lp of (ratio * 1)/3 = ratio/3 for the unclipped token only; clipped and capped tokens get 0
    close(lp.grad, t([0, 2 / 3, 0]))
    # without dual clip tok0 stays at 5
    close(policy_loss(lp.detach(), torch.zeros(1, 3, dtype=torch.float64), t([-1, -1, -1]), torch.ones(1, 3))[0],
          (5 + 2 + .8) / 3)


def test_gradients_flow_to_logprobs_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp = t([-1.0, -2.0, float("nan")], [-0.5, float("inf"), 3.0]).requires_grad_(True)
    old = t([-1.1, -1.9, 0.0], [-0.4, 0.0, 0.0]).requires_grad_(True)
    adv = t([1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]).requires_grad_(True)
    ref = t([-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]).requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask)
    (loss + 0.1 * kl_loss(lp, ref, mask)).backward()
    assert old.grad is None and adv.grad is None and ref.grad is None
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask.bool()] == 0).all()
    assert (lp.grad[mask.bool()] != 0).all()
    # value loss: only the new values get a gradient
    v = t([1.0, 2.0, 0.0], [1.0, 0.0, 0.0]).requires_grad_(True)
    old_v, ret = v.detach().clone().requires_grad_(True), t([2.0, 2.0, 0.0], [0.0, 0.0, 0.0]).requires_grad_(True)
    value_loss(v, old_v, ret, mask)[0].backward()
    assert old_v.grad is None and ret.grad is None and v.grad is not None


def test_value_loss_clipping():
    # V_old = 1, R = 2, clip .2:
    # V=1.5: clipped 1.2 -> max(.25, .64) = .64 (clipped)   V=1.1: inside, .81 both   V=.5: clipped .8 ->
    # max(2.25, 1.44) = 2.25 (unclipped).  0.5 * mean(.64, .81, 2.25) = .616667, clipfrac 1/3
    old, ret, mask = t([1, 1, 1, 1]), t([2, 2, 2, 2]), torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(t([1.5, 1.1, .5, 1e9]), old, ret, mask, clip=0.2)
    close(loss, 0.5 * (.64 + .81 + 2.25) / 3)
    assert m["vf_clipfrac"] == pytest.approx(1 / 3)
    loss, m = value_loss(t([1.5, 1.1, .5, 1e9]), old, ret, mask, clip=None)      # plain 0.5 * MSE
    close(loss, 0.5 * (.25 + .81 + 2.25) / 3)


def test_entropy_from_logprobs_stable_and_bonus():
    # uniform over 4: ln 4; p = [.25, .75]: -(.25 ln .25 + .75 ln .75) = .562335; huge logits stay finite
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e30, -1e30],
                           [1e30, 1e30, -1e30, 0.0]], dtype=torch.float64)
    h = entropy_from_logprobs(logits.log_softmax(-1))
    close(h[:2], t(math.log(4), -(.25 * math.log(.25) + .75 * math.log(.75))))
    assert h[2].item() == pytest.approx(math.log(2), abs=1e-6)
    logits.requires_grad_(True)
    entropy_from_logprobs(logits.log_softmax(-1)).sum().backward()      # probability-0 logits: finite gradient
    assert torch.isfinite(logits.grad).all()
    # bonus = -coef * token-mean over real tokens: -0.01 * (1 + 3)/2
    close(entropy_bonus(t([1.0, 3.0, 50.0]), torch.tensor([[1, 1, 0]]), coef=0.01), -0.02)


# ---------------------------------------------------------------- KL

def test_kl_estimators_on_known_distributions():
    # policy p = [.5, .5], reference q = [.25, .75]; KL(p||q) = .5 ln 2 + .5 ln(2/3) = .143841.
    # The exact expectation under p of k1 and k3 equals KL (both unbiased); k2 is biased upwards:
    # k2 = .5 (ln r)^2 with r = q/p = [.5, 1.5]: .5 * (.480453 + .164402)/2 = .161214
    p, q = t(.5, .5), t(.25, .75)
    lp, ref = p.log(), q.log()
    kl = .5 * math.log(2) + .5 * math.log(2 / 3)
    for kind in ("k1", "kl", "k3", "low_var_kl"):
        assert (p * kl_penalty(lp, ref, kind)).sum().item() == pytest.approx(kl, abs=1e-9), kind
    assert (p * kl_penalty(lp, ref, "k2")).sum().item() == pytest.approx(
        .5 * (math.log(.5) ** 2 + math.log(1.5) ** 2) / 2, abs=1e-9)
    close(kl_penalty(lp, ref, "mse"), kl_penalty(lp, ref, "k2"))
    close(kl_penalty(lp, ref, "abs"), torch.tensor([math.log(2), math.log(1.5)], dtype=torch.float64))
    close(kl_penalty(lp, ref, "k3"), t(math.log(2) - .5, .5 - math.log(1.5)))
    # low_var_kl clamps: r = e^30 -> k3 would be ~1e13, clamped to 10; k3 unclamped is huge
    assert kl_penalty(t(0.0), t(30.0), "low_var_kl").item() == 10.0
    assert kl_penalty(t(0.0), t(30.0), "k3").item() > 1e12


def test_kl_controllers():
    # Ziegler et al.: e = clip(9/6 - 1, -.2, .2) = .2; coef *= 1 + .2 * 256/10000 = 1.00512 -> .201024
    ctl = AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.201024, abs=1e-12)
    # below target: e = 3/6 - 1 = -.5 -> clipped -.2: coef *= 1 - .2 * 1000/10000 = .98
    ctl.update(current_kl=3.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.201024 * 0.98, abs=1e-12)
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0, horizon=10)


def test_apply_kl_penalty_in_reward():
    # k1 per token = logp - ref: row0 [.5, 0] (mean .25), row1 [-.2] (mean -.2) -> kl_mean = .025
    # score 1 sits on each row's last real token; rewards - .1 * kl
    lp, ref = t([-1.0, -2.0, 5.0], [-1.0, 0.0, 0.0]), t([-1.5, -2.0, 0.0], [-0.8, 9.0, 9.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    r, kl_mean = apply_kl_penalty(torch.tensor([1.0, 1.0], dtype=torch.float64), lp, ref, mask,
                                  coef=FixedKLController(0.1))
    close(r, t([-.05, 1.0, 0.0], [1.02, 0.0, 0.0]))
    assert kl_mean == pytest.approx(0.025)
    # per-token rewards and a plain float coef give the same
    r2, _ = apply_kl_penalty(t([0, 1.0, 0], [1.0, 0, 0]), lp, ref, mask, coef=0.1)
    close(r2, r)

