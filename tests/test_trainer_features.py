"""Trainer features on real Ray workers and a tiny model, each checked against a hand computation in plain
torch: PPO epochs x minibatches with the clip active, the KL to the reference (as a loss, and in the reward
with the adaptive controller), evaluate / samples / callbacks, LR warm-up and cosine, weighted dict and
list rewards, DataFrame and list-of-dicts datasets.

Two trainers are shared by the module (dp=1, 4 prompts x 4 samples x 8 tokens): ``run_a`` (GRPO with a
KL loss, 2 epochs x 2 minibatches, warm-up, a dict reward on a DataFrame) and ``run_b`` (KL in the reward
with a target, cosine schedule, a list reward on a list of dicts). Log-probs for the references come
from a plain transformers model loaded with the actor's gathered weights, one unpadded forward per sample.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

import rlkit
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_torch_thread")]

N, NEW, PROMPTS = 4, 8, 4                # Rollout.n, max_new_tokens, prompts_per_step
LR, WARMUP = 2e-2, 2
KL_A, KL_B, TARGET_B = 0.05, 0.1, 1e-3
CLIP = 0.2                               # TrainerConfig's clip_low / clip_high defaults
W_GIVEN, W_SHAPED = 2.0, 0.5
# unique prompts (so a sample's row is found from its prompt), 2 or 3 tokens each
ROWS = [{"prompt": c * k, "letter": c, "scale": float(k - 1), "base": round(0.05 * i, 2)}
        for i, (c, k) in enumerate((c, k) for c in "abcd" for k in (2, 3))]
BY_PROMPT = {r["prompt"]: r for r in ROWS}


# ---- rewards: plain callables that record what reached them -----------------------------------------
def shaped_value(completion: str, letter: str, scale: float) -> float:
    return scale * (sum(ch == letter for ch in completion[:NEW]) + len(completion) / 4) / NEW


def hand_total(completion: str, row: dict) -> float:
    base = row["base"]
    if base is None or base != base:
        return math.nan
    return W_GIVEN * base + W_SHAPED * shaped_value(completion, row["letter"], row["scale"])


class Given:
    """The row's ``base`` column (None / NaN: no reward)."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, base, **columns):
        self.calls.append({"prompts": list(prompts), "completions": list(completions), "base": list(base),
                           **{k: list(v) for k, v in columns.items()}})
        return [None if b is None or b != b else float(b) for b in base]


class Shaped:
    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, letter, scale, **columns):
        self.calls.append({"prompts": list(prompts), "letter": list(letter), "scale": list(scale),
                           "columns": sorted(columns)})
        return [shaped_value(c, lt, s) for c, lt, s in zip(completions, letter, scale)]


class Callback:
    """Records each call: the row, the trainer's state and the LR its actor's optimizer holds."""

    def __init__(self):
        self.calls = []

    def __call__(self, trainer, row):
        self.calls.append({"trainer": trainer, "row": dict(row), "step": trainer.step,
                           "samples": trainer.samples(last=1).copy(), "coef": trainer.kl_ctl.value,
                           "optimizer_lr": trainer.group.apply(_optimizer_lr)})


def _optimizer_lr(worker):
    return [g["lr"] for g in worker.actor.optimizer.param_groups]


class Spy:
    """Wraps ``trainer._advantages``: the actor's full weights and the KL coefficient going in, the batch,
    scores and returned KL mean coming out, for every step."""

    def __init__(self, tr):
        self.tr, self.orig, self.records = tr, tr._advantages, []
        tr._advantages = self

    def __call__(self, batch, scores, mask, sampling_logprobs):
        uids = batch.uid
        rec = {"step": self.tr.step + 1, "weights": self.tr.group.call("full_weights")[0],
               "coef_before": self.tr.kl_ctl.value}
        kl = self.orig(batch, scores, mask, sampling_logprobs)
        rec.update(batch={k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}, scores=scores.clone(),
                   uids=list(uids), kl=kl, coef_after=self.tr.kl_ctl.value)
        self.records.append(rec)
        return kl

    def at(self, step):
        (rec,) = [r for r in self.records if r["step"] == step]
        return rec


def _trainer(cluster, tmp_path_factory, name, dataset, reward, callbacks, **kw):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _optimizer_lr runs on the workers
    return Trainer(model=tiny_lm("qwen2", size="small"), dataset=dataset, reward=reward, algorithm="grpo",
                   plan=rlkit.ParallelPlan(), rollout=rlkit.Rollout(engine="hf", n=N, max_new_tokens=NEW),
                   cluster=cluster, callbacks=callbacks, prompts_per_step=PROMPTS, lr=LR, seed=0,
                   run_dir=str(tmp_path_factory.mktemp(name)), **kw)


def _fitted(tr, steps: int, **parts):
    """Fit ``tr`` for ``steps`` with a Spy on it, yield what the tests read, and close it after."""
    try:
        spy = Spy(tr)
        df = tr.fit(steps=steps, view="none")
        yield SimpleNamespace(tr=tr, df=df, spy=spy, **parts)
    finally:
        tr.close()


@pytest.fixture(scope="module")
def run_a(ray_make_cluster, tmp_path_factory):
    """GRPO + KL loss to the reference, epochs=2 x minibatches=2, warm-up then constant LR, a dict reward
    on a DataFrame; fit(steps=3)."""
    given, shaped, cb = Given(), Shaped(), Callback()
    tr = _trainer(ray_make_cluster(), tmp_path_factory, "a", pd.DataFrame(ROWS), {given: W_GIVEN, shaped: W_SHAPED}, [cb],
                  kl_coef=KL_A, epochs=2, minibatches=2, lr_warmup_steps=WARMUP, keep_samples=40)
    yield from _fitted(tr, 3, cb=cb, given=given, shaped=shaped)


@pytest.fixture(scope="module")
def run_b(ray_make_cluster, tmp_path_factory):
    """GRPO with the KL in the reward and an adaptive coefficient (kl_target), warm-up then cosine, a list
    reward on a list of dicts (the same rows as run_a's DataFrame); fit(steps=5)."""
    given, shaped, cb = Given(), Shaped(), Callback()
    tr = _trainer(ray_make_cluster(), tmp_path_factory, "b", [dict(r) for r in ROWS], [(given, W_GIVEN), (shaped, W_SHAPED)], [cb],
                  kl_coef=KL_B, kl_in_reward=True, kl_target=TARGET_B, lr_warmup_steps=WARMUP,
                  lr_schedule="cosine", total_steps=5)
    yield from _fitted(tr, 5, cb=cb, given=given, shaped=shaped)


# ---- independent references ------------------------------------------------------------------------
def _hf_model(path, weights=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights)
    return model


def _hf_logprobs(model, batch, P):
    """Log-prob of each response token from one unpadded forward per sample ([P | R] layout)."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    out = torch.zeros(ids.shape[0], ids.shape[1] - P)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            prompt = ids[i, :P][attn[i, :P].bool()]
            n = int(attn[i, P:].sum())
            resp = ids[i, P:P + n]
            logits = model(torch.cat([prompt, resp])[None]).logits[0, len(prompt) - 1:-1].float()
            out[i, :n] = torch.log_softmax(logits, -1).gather(1, resp[:, None])[:, 0]
    return out


def _grpo_by_hand(scores, uids, mask):
    adv = torch.zeros(len(scores), dtype=torch.float64)
    for u in set(uids):
        idx = [i for i, x in enumerate(uids) if x == u]
        g = scores[idx].double()
        adv[idx] = (g - g.mean()) / (g.std() + 1e-6)   # unbiased std, as GRPO / verl / TRL
    return adv.float()[:, None] * mask


def _low_var_kl(lp, ref):
    """k3 = r - 1 - log r with r = p_ref / p, log r clamped to [-20, 20] and k3 to [-10, 10] (verl's)."""
    log_r = (ref - lp).clamp(-20, 20)
    return (torch.exp(log_r) - 1 - log_r).clamp(-10, 10)


def _close(a, b, tol=1e-5):
    return abs(a - b) <= tol * (1 + abs(b))


def _one(result):
    """update_actor's metrics from call_dp (one DP rank)."""
    return result[0] if isinstance(result, list) else result


# ---- 1. PPO: 2 epochs x 2 minibatches, the clip active -------------------------------------------------
def test_ppo_epochs_and_minibatches_match_a_hand_clipped_objective(run_a, tmp_path):
    """One real train_step with 4 optimizer steps; then rewound to the checkpoint before it and replayed one
    optimizer step at a time, reading the actor's log-probs between steps. The step's metrics are the
    averages of the clipped PPO objective, clip fraction, ratio and KL terms computed by hand from them."""
    tr, spy = run_a.tr, run_a.spy
    cfg = tr.update_settings()
    before = tr.save(tmp_path / "before")
    row = tr.train_step()
    rec = spy.at(row["step"])
    b = rec["batch"]
    mask, old, ref, adv = b["response_mask"], b["old_logprobs"], b["ref_logprobs"], b["advantages"]
    assert row["actor/lr"] == cfg.lr and cfg.epochs == 2 and cfg.minibatches == 2
    # GRPO advantages: (score - group mean) / (unbiased group std + 1e-6) over each prompt's n samples
    assert (adv - _grpo_by_hand(rec["scores"], rec["uids"], mask)).abs().max().item() < 1e-4
    assert adv.abs().max().item() > 0.5

    # replay: W0 -mb0-> W1 -mb1-> W2 -mb0-> W3 (-mb1-> W4), log-probs of the whole batch at W0..W3
    tr.group.call("load", before)
    halves = [slice(0, len(mask) // 2), slice(len(mask) // 2, len(mask))]
    single = dataclasses.replace(cfg, epochs=1, minibatches=1)
    out = tr.group.call_dp("actor_logprobs", b)
    lps, ents, replayed = [out["logprobs"]], [out["entropy"]], []
    assert (lps[0] - old)[mask.bool()].abs().max().item() < 1e-6  # rewound to pi_old exactly
    for j in (0, 1, 0):
        replayed.append(_one(tr.group.call_dp("update_actor", {k: v[halves[j]] for k, v in b.items()}, single)))
        out = tr.group.call_dp("actor_logprobs", b)
        lps.append(out["logprobs"])
        ents.append(out["entropy"])
    tr.workers.sync_weights()  # leave the engine on the actor's weights for the other tests

    def by_hand(lp, ent, mb):
        m = mask[mb].bool()
        a, r = adv[mb][m], torch.exp(lp[mb] - old[mb])[m]
        unclipped, clipped = -a * r, -a * r.clamp(1 - CLIP, 1 + CLIP)
        kl = _low_var_kl(lp[mb][m], ref[mb][m]).mean()
        pg = torch.maximum(unclipped, clipped).mean()
        near = ((r - (1 - CLIP)).abs() < 1e-4) | ((r - (1 + CLIP)).abs() < 1e-4)
        return {"pg_loss": pg.item(), "kl_loss": kl.item(), "loss": (pg + KL_A * kl).item(),
                "clipfrac": (clipped > unclipped).float().mean().item(), "ratio_mean": r.mean().item(),
                "ratio_max": r.max().item(), "approx_kl": (old[mb][m] - lp[mb][m]).mean().item(),
                "entropy": ent[mb][m].mean().item(), "near": near.float().mean().item()}

    hand = [by_hand(lps[k], ents[k], halves[k % 2]) for k in range(4)]
    assert hand[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and hand[0]["clipfrac"] == 0.0
    # the clip is active: after the first optimizer step some ratios left [0.8, 1.2] on the clipped side
    assert max(h["ratio_max"] for h in hand) > 1 + CLIP
    assert max(h["clipfrac"] for h in hand[1:]) > 0.05, hand
    for k, got in enumerate(replayed):
        for key in ("loss", "pg_loss", "kl_loss", "ratio_mean", "ratio_max", "approx_kl", "entropy"):
            assert _close(got[f"actor/{key}"], hand[k][key], 1e-4), (k, key, got, hand[k])
        assert abs(got["actor/clipfrac"] - hand[k]["clipfrac"]) <= hand[k]["near"] + 1e-6, (k, got, hand[k])
    for key in ("loss", "pg_loss", "kl_loss", "ratio_mean", "ratio_max", "approx_kl", "entropy"):
        want = sum(h[key] for h in hand) / 4
        assert _close(row[f"actor/{key}"], want, 1e-4), (key, row[f"actor/{key}"], want)
    assert row["entropy"] == row["actor/entropy"]
    near = sum(h["near"] for h in hand) / 4
    assert abs(row["actor/clipfrac"] - sum(h["clipfrac"] for h in hand) / 4) <= near + 1e-6
    assert row["actor/clipfrac"] > 0


# ---- 2. KL to the reference as a loss (GRPO) ------------------------------------------------------------
def _kl_k3_by_hand(rec, path, P):
    """Token-mean low_var_kl KL(actor || ref) over the real response tokens, from HF log-probs at the step's weights."""
    b = rec["batch"]
    lp = _hf_logprobs(_hf_model(path, rec["weights"]), b, P)
    ref = _hf_logprobs(_hf_model(path), b, P)
    m = b["response_mask"].bool()
    return _low_var_kl(lp[m], ref[m]).mean().item(), lp, ref


def test_kl_loss_metric_equals_low_var_kl_by_hand_and_is_zero_at_step_one(run_a):
    tr, spy, df = run_a.tr, run_a.spy, run_a.df
    P = tr.layout.prompt_len
    kls = df["kl"].tolist()
    assert abs(kls[0]) < 1e-6, kls  # the actor starts as the reference
    for step in (1, 3):  # epochs > 1: the trainer reports KL(pi_old || ref) from the kept old log-probs
        rec = spy.at(step)
        hand, lp, ref = _kl_k3_by_hand(rec, tr.model_path, P)
        m = rec["batch"]["response_mask"].bool()
        assert (lp - rec["batch"]["old_logprobs"])[m].abs().max().item() < 1e-4
        assert (ref - rec["batch"]["ref_logprobs"])[m].abs().max().item() < 1e-4
        assert _close(kls[step - 1], hand, 1e-4), (step, kls, hand)
    assert kls[2] > 1e-3, kls  # lr 2e-2 moves the actor well away from the reference
    # epochs=1: the KL comes from the loss term on the training forward (actor/kl_loss)
    saved = tr.config.epochs, tr.config.minibatches
    tr.config.epochs, tr.config.minibatches = 1, 1
    try:
        row = tr.train_step()
    finally:
        tr.config.epochs, tr.config.minibatches = saved
    rec = spy.at(row["step"])
    assert "old_logprobs" not in rec["batch"] and rec["kl"] is None
    hand, _, _ = _kl_k3_by_hand(rec, tr.model_path, P)
    assert hand > 1e-3 and _close(row["kl"], hand, 1e-4) and row["kl"] == row["actor/kl_loss"], (row["kl"], hand)
    assert row["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # one optimizer step: on-policy


# ---- 3. KL in the reward, adaptive coefficient ------------------------------------------------------------
def test_kl_in_reward_with_target_moves_the_coefficient_by_zieglers_rule(run_b):
    tr, spy, df, cb = run_b.tr, run_b.spy, run_b.df, run_b.cb
    P, batch_n = tr.layout.prompt_len, PROMPTS * N
    coefs = [KL_B] + [c["coef"] for c in cb.calls]
    went_up = 0
    for step in range(1, 6):
        rec, row = spy.at(step), df.iloc[step - 1]
        b = rec["batch"]
        m = b["response_mask"].bool()
        lp = _hf_logprobs(_hf_model(tr.model_path, rec["weights"]), b, P)
        ref = _hf_logprobs(_hf_model(tr.model_path), b, P)
        assert (ref - b["ref_logprobs"])[m].abs().max().item() < 1e-4
        k1 = torch.where(m, lp - ref, torch.zeros(()))
        per_seq = k1.sum(1) / m.sum(1)
        kl = per_seq.mean().item()   # mean over sequences of each one's token-mean k1
        assert _close(row["kl"], kl, 1e-4), (step, row["kl"], kl)
        # Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2); coef *= 1 + e * batch / horizon (10k)
        e = min(max(row["kl"] / TARGET_B - 1, -0.2), 0.2)
        assert rec["coef_before"] == pytest.approx(coefs[step - 1], rel=1e-12)
        assert coefs[step] == pytest.approx(coefs[step - 1] * (1 + e * batch_n / 10_000), rel=1e-12)
        assert (coefs[step] > coefs[step - 1]) == (row["kl"] > TARGET_B)
        went_up += row["kl"] > TARGET_B
        # the penalty reaches the advantages: GRPO of (score - coef * sum of per-token k1) per sequence
        want = _grpo_by_hand(rec["scores"] - coefs[step - 1] * k1.sum(1), rec["uids"], b["response_mask"])
        assert (b["advantages"] - want).abs().max().item() < 1e-3, step
    assert abs(df["kl"].iloc[0]) < 1e-6 and coefs[1] < KL_B  # step 1: no drift yet, so the coefficient drops
    assert went_up >= 2 and coefs[-1] > coefs[1], (df["kl"].tolist(), coefs)
    assert "actor/kl_loss" not in df.columns  # in the reward, not in the loss


# ---- 4. evaluate, samples, callbacks ------------------------------------------------------------------
EVAL = [{"prompt": "aa", "letter": "a", "scale": 0.0, "base": 0.5},     # 2 * 0.5 + 0 = exactly 1
        {"prompt": "bbb", "letter": "b", "scale": 1.0, "base": None},   # no reward: not counted
        {"prompt": "cc", "letter": "c", "scale": 2.0, "base": 0.25},
        {"prompt": "ddd", "letter": "d", "scale": 0.0, "base": 0.5},    # exactly 1
        {"prompt": "ccc", "letter": "a", "scale": 1.0, "base": 0.0},
        {"prompt": "dd", "letter": "d", "scale": 1.0, "base": 1.0}]     # past n=5


def _greedy_by_hand(model, tok, prompt):
    ends = model.generation_config.eos_token_id
    ends = set(ends if isinstance(ends, list) else [ends])
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(NEW):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in ends:
                break
    return tok.decode(out, skip_special_tokens=True)


def test_evaluate_decodes_greedily_and_aggregates_like_a_hand_count(run_a):
    from transformers import AutoTokenizer

    tr, given = run_a.tr, run_a.given
    res = tr.evaluate(dataset=pd.DataFrame(EVAL), n=5)
    call = given.calls[-1]
    assert call["prompts"] == [r["prompt"] for r in EVAL[:5]]  # one greedy sample per row, in order
    model, tok = _hf_model(tr.model_path, tr.group.call("full_weights")[0]), AutoTokenizer.from_pretrained(tr.model_path)
    assert call["completions"] == [_greedy_by_hand(model, tok, r["prompt"]) for r in EVAL[:5]]
    scores = [hand_total(c, r) for c, r in zip(call["completions"], EVAL)]
    finite = [s for s in scores if not math.isnan(s)]
    assert res["n"] == len(finite) == 4
    assert res["reward"] == pytest.approx(sum(finite) / len(finite), abs=1e-6)
    assert res["exact"] == pytest.approx(sum(s == 1.0 for s in finite) / len(finite), abs=1e-7)
    assert res["exact"] >= 0.5  # the two rows built to score exactly 1
    # no dataset and no task: the training rows
    res = tr.evaluate(n=3)
    assert given.calls[-1]["prompts"] == [r["prompt"] for r in ROWS[:3]] and res["n"] == 3
    want = [hand_total(c, r) for c, r in zip(given.calls[-1]["completions"], ROWS)]
    assert res["reward"] == pytest.approx(sum(want) / 3, abs=1e-6)


def test_callbacks_get_each_row_once_in_order_and_samples_keep_the_last_rows(run_a):
    tr, cb, df = run_a.tr, run_a.cb, run_a.df
    fit_calls = cb.calls[:3]
    assert len(cb.calls) == 3  # fit(steps=3) only; train_step() alone calls no callback
    assert [c["row"]["step"] for c in fit_calls] == [1, 2, 3] == [c["step"] for c in fit_calls]
    assert all(c["trainer"] is tr for c in fit_calls)
    for c, (_, row) in zip(fit_calls, df.iterrows()):
        for key in ("step", "reward/mean", "actor/loss", "kl", "actor/lr"):
            assert c["row"][key] == row[key], key
        s = c["samples"]
        assert len(s) == PROMPTS * N and (s.step == c["step"]).all()
        assert s.prompt.value_counts().tolist() == [N] * PROMPTS  # each prompt n times
        want = [hand_total(comp, BY_PROMPT[p]) for p, comp in zip(s.prompt, s.completion)]
        assert max(abs(a - b) for a, b in zip(s.reward, want)) < 1e-6
        assert c["row"]["reward/mean"] == pytest.approx(sum(want) / len(want), abs=1e-6)

    # samples(last=k): the rows of the last k steps, at most keep_samples=40 of them (16 per step)
    S, per = tr.step, PROMPTS * N
    assert S >= 3
    everything = tr.samples()
    assert list(everything.columns) == ["step", "prompt", "completion", "reward"] and len(everything) == 40
    for k, counts in ((1, {S: per}), (2, {S - 1: per, S: per}), (3, {S - 2: 40 - 2 * per, S - 1: per, S: per})):
        got = tr.samples(last=k)
        assert got.step.value_counts().sort_index().to_dict() == counts, (k, got.step.tolist())
    assert everything.equals(tr.samples(last=S)) and tr.samples(last=1).equals(everything.tail(per))

    # a reward of None skips the sample: samples() shows NaN for it (not a 0 that reward/mean left out)
    saved = tr.rewards.fns, tr.config.keep_samples
    tr.rewards.fns = [(lambda prompts, completions, **kw: [None] * 3 + [0.5] * (len(prompts) - 3), 1.0)]
    try:
        row = tr.train_step()
        got = tr.samples(last=1).reward.tolist()
        assert row["reward/skipped"] == 3 and row["reward/mean"] == 0.5
        assert all(math.isnan(r) for r in got[:3]) and got[3:] == [0.5] * (per - 3), got
        tr.config.keep_samples = 0  # "0 keeps no samples"
        tr.train_step()
        assert tr.samples().empty and tr.samples(last=1).empty
    finally:
        tr.rewards.fns, tr.config.keep_samples = saved


# ---- 5. LR: warm-up, constant, cosine --------------------------------------------------------------------
def _lr_by_hand(step0, total, schedule):
    """Linear warm-up to LR over WARMUP steps (the first at LR / WARMUP), then constant or cosine to 10%
    over the rest of the run's total_steps."""
    if step0 < WARMUP:
        return LR * (step0 + 1) / WARMUP
    if schedule == "constant":
        return LR
    p = (step0 - WARMUP) / (total - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def test_lr_warmup_constant_and_cosine_follow_the_formula(run_a, run_b):
    for run, schedule, steps in ((run_a, "constant", 3), (run_b, "cosine", 5)):
        want = [_lr_by_hand(s, steps, schedule) for s in range(steps)]
        got = run.df["actor/lr"].tolist()
        assert got == pytest.approx(want, rel=1e-12), (schedule, got, want)
        # the LR the actor's AdamW stepped with (read on the worker after each step)
        assert [c["optimizer_lr"][0][0] for c in run.cb.calls[:steps]] == pytest.approx(want, rel=1e-12)
    cos = run_b.df["actor/lr"].tolist()
    assert cos[1] == cos[2] == LR and cos[2] > cos[3] > cos[4] > 0.1 * LR


# ---- 6. weighted rewards; DataFrame vs list of dicts ---------------------------------------------------------
def test_dict_and_list_rewards_are_weighted_sums_and_columns_arrive_as_kwargs(run_a, run_b):
    for run in (run_a, run_b):
        for c, (_, row) in zip(run.cb.calls, run.df.iterrows()):
            s = c["samples"]
            want = [hand_total(comp, BY_PROMPT[p]) for p, comp in zip(s.prompt, s.completion)]
            assert row["reward/mean"] == pytest.approx(sum(want) / len(want), abs=1e-6)
            assert row["reward/std"] == pytest.approx(torch.tensor(want).std().item(), abs=1e-5)
        # every column but the prompt reaches each reward function as a keyword, row-aligned
        for call in run.shaped.calls[:3]:  # fit steps (both runs)
            assert call["columns"] == ["base"]
            assert call["letter"] == [BY_PROMPT[p]["letter"] for p in call["prompts"]]
            assert call["scale"] == [BY_PROMPT[p]["scale"] for p in call["prompts"]]
        for call in run.given.calls[:3]:
            assert call["base"] == [BY_PROMPT[p]["base"] for p in call["prompts"]]
            assert call["letter"] == [BY_PROMPT[p]["letter"] for p in call["prompts"]] and "_row" not in call
    # same rows, seed, weights and initial model: the DataFrame + dict trainer and the list-of-dicts + list
    # trainer sample and score step 1 identically
    a, b = run_a.cb.calls[0]["samples"], run_b.cb.calls[0]["samples"]
    assert a.reset_index(drop=True).equals(b.reset_index(drop=True))
    assert run_a.df["reward/mean"].iloc[0] == run_b.df["reward/mean"].iloc[0]
    assert run_a.df["reward/mean"].nunique() > 1  # rewards depend on the completions
