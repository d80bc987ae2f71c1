"""GSPO, GSPO-token, CISPO and SAPO (rlkit.algos.ratio_losses): each against a hand computation of its paper's
formula (value and gradient, in plain Python floats), against TRL 1.16's own loss code on the same tensors, and
trained through the Trainer with its metrics."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import rlkit
from rlkit.algos import cispo_loss, gspo_loss, gspo_token_loss, policy_loss, sapo_loss
from rlkit.errors import TrainerError
from rlkit.models import tiny_lm

torch.set_num_threads(1)

# Three sequences of 4, 2 and 3 real tokens; new - old log-probs chosen so that some sequences and tokens
# leave a 0.1 clip range and some stay inside it (none on a boundary).
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
DELTA = [[0.30, 0.25, -0.10, 0.15], [-0.02, 0.05, 0.0, 0.0], [-0.40, -0.05, 0.10, 0.0]]
OLD = [[-1.2, -0.7, -2.0, -0.3], [-0.9, -1.6, -0.5, -0.5], [-0.4, -2.2, -1.1, -0.8]]
ADV_SEQ = [1.5, -0.7, -0.9]
ADV_TOK = [[1.5, 0.5, -1.0, 2.0], [-0.7, 0.3, 0.0, 0.0], [-0.9, 1.1, -0.2, 0.0]]
AGGS = ("token-mean", "seq-mean-token-mean")


def _tensors(adv_rows):
    mask = torch.tensor(MASK, dtype=torch.float64)
    old = torch.tensor(OLD, dtype=torch.float64)
    lp = (old + torch.tensor(DELTA, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor(adv_rows, dtype=torch.float64)
    if adv.dim() == 1:
        adv = adv[:, None].expand(-1, 4).contiguous()
    return lp, old, adv, mask


def _tokens(i):
    return [t for t in range(4) if MASK[i][t]]


def _aggregate(per_token, agg):
    """The hand reduction: token-mean over all real tokens, or the mean over sequences of their token means.
    Returns the value and each token's weight in it."""
    n = sum(len(_tokens(i)) for i in range(3))
    if agg == "token-mean":
        weights = {(i, t): 1 / n for i in range(3) for t in _tokens(i)}
    else:
        weights = {(i, t): 1 / (3 * len(_tokens(i))) for i in range(3) for t in _tokens(i)}
    return sum(weights[k] * per_token[k] for k in weights), weights


def _check(fn, adv_rows, hand_loss, hand_grad, agg, **kw):
    lp, old, adv, mask = _tensors(adv_rows)
    loss, metrics = fn(lp, old, adv, mask, agg=agg, **kw)
    loss.backward()
    assert loss.item() == pytest.approx(hand_loss, abs=1e-9)
    expect = [[hand_grad.get((i, t), 0.0) for t in range(4)] for i in range(3)]
    torch.testing.assert_close(lp.grad, torch.tensor(expect, dtype=torch.float64), atol=1e-9, rtol=0)
    return metrics


def _adv(adv_rows, i, t):
    return adv_rows[i] if not isinstance(adv_rows[i], list) else adv_rows[i][t]


# ---- the papers' formulas, by hand ----------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("token", [False, True], ids=["gspo", "gspo-token"])
def test_gspo_matches_the_sequence_ratio_formula_by_hand(agg, token):
    """GSPO (arXiv:2507.18071, eq. 5-7): s_i = (pi/pi_old)^(1/|y_i|) = exp(mean_t delta_it); each token of i
    carries max(-A s_i, -A clip(s_i, 1 - 0.1, 1 + 0.1)). The gradient of token t is -A s_i / |y_i| per unit of
    its sequence's loss (GSPO), or -A_it s_i / |y_i| (GSPO-token: s_it = sg[s_i] pi_t / sg[pi_t]); 0 where the
    clipped term is taken."""
    adv_rows = ADV_TOK if token else ADV_SEQ
    per_token, dloss = {}, {}
    s = [math.exp(sum(DELTA[i][t] for t in _tokens(i)) / len(_tokens(i))) for i in range(3)]
    for i in range(3):
        for t in _tokens(i):
            a = _adv(adv_rows, i, t)
            unclipped, clipped = -a * s[i], -a * min(max(s[i], 0.9), 1.1)
            per_token[(i, t)] = max(unclipped, clipped)
            inside = 0.9 <= s[i] <= 1.1   # the clip is the identity there: both terms move with s_i
            dloss[(i, t)] = -a * s[i] if inside or unclipped > clipped else 0.0   # d(token loss)/d(log s_i)
    value, w = _aggregate(per_token, agg)
    grad = {}
    for i in range(3):
        for t in _tokens(i):
            if token:   # each token's own advantage, through its own log-prob: d log s_it / d lp_it = 1
                grad[(i, t)] = w[(i, t)] * dloss[(i, t)]
            else:       # every token's loss of sequence i moves with log s_i = mean_t lp_it
                grad[(i, t)] = sum(w[(i, u)] * dloss[(i, u)] for u in _tokens(i)) / len(_tokens(i))
    m = _check(gspo_token_loss if token else gspo_loss, adv_rows, value, grad, agg, clip_low=0.1, clip_high=0.1)
    # s = [1.1618, 1.0151, 0.8899]: the first and last sequences leave [0.9, 1.1]; the first with A > 0, the
    # last with A < 0, whose clipped term (-A * 0.9 = 0.81) beats the unclipped one (0.801): both clipped
    assert m["seq_ratio_max"] == pytest.approx(s[0]) and m["seq_ratio_mean"] == pytest.approx(sum(s) / 3)
    if not token:
        assert m["seq_clipfrac"] == pytest.approx(2 / 3)


def test_gspo_token_equals_gspo_when_each_sequence_has_one_advantage():
    for agg in AGGS:
        out = []
        for fn in (gspo_loss, gspo_token_loss):
            lp, old, adv, mask = _tensors(ADV_SEQ)
            loss, _ = fn(lp, old, adv, mask, clip_low=0.1, clip_high=0.1, agg=agg)
            loss.backward()
            out.append((loss.item(), lp.grad.clone()))
        assert out[0][0] == pytest.approx(out[1][0], abs=1e-12)
        torch.testing.assert_close(out[0][1], out[1][1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_cispo_matches_the_truncated_is_reinforce_formula_by_hand(agg):
    """CISPO (arXiv:2506.13585, eq. 4): -sg(min(r_it, 1 + eps)) A_it log pi_it; its gradient is the truncated
    weight times -A on every token, none dropped."""
    cap = 1.2
    per_token, grad = {}, {}
    for i in range(3):
        for t in _tokens(i):
            a, r = _adv(ADV_TOK, i, t), math.exp(DELTA[i][t])
            per_token[(i, t)] = -min(r, cap) * a * (OLD[i][t] + DELTA[i][t])
    value, w = _aggregate(per_token, agg)
    for (i, t), wt in w.items():
        grad[(i, t)] = -wt * min(math.exp(DELTA[i][t]), cap) * _adv(ADV_TOK, i, t)
    m = _check(cispo_loss, ADV_TOK, value, grad, agg, clip_high=0.2)
    # ratios above 1.2: exp(0.30), exp(0.25): 2 of the 9 real tokens
    assert m["clipfrac"] == pytest.approx(2 / 9)


@pytest.mark.parametrize("agg", AGGS)
def test_sapo_matches_the_soft_gate_formula_by_hand(agg):
    """SAPO (arXiv:2511.20347, eq. 8-10): -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos for A > 0 else tau_neg;
    d/d log pi = -A 4 sigma (1 - sigma) r."""
    tau_pos, tau_neg = 1.0, 1.5
    per_token, grad, gates = {}, {}, []
    for i in range(3):
        for t in _tokens(i):
            a, r = _adv(ADV_TOK, i, t), math.exp(DELTA[i][t])
            tau = tau_pos if a > 0 else tau_neg
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            per_token[(i, t)] = -a * sig * 4 / tau
            grad[(i, t)] = -a * 4 * sig * (1 - sig) * r
            gates.append(4 * sig * (1 - sig) * r)
    value, w = _aggregate(per_token, agg)
    grad = {k: w[k] * g for k, g in grad.items()}
    m = _check(sapo_loss, ADV_TOK, value, grad, agg, tau_pos=tau_pos, tau_neg=tau_neg)
    assert m["gate_mean"] == pytest.approx(sum(gates) / len(gates)) and m["gate_min"] == pytest.approx(min(gates))


# ---- against TRL's own code -----------------------------------------------------------------------------------
def _trl_loss(loss_type, level="token", epsilon_low=0.2, epsilon_high=0.2, tau_pos=1.0, tau_neg=1.05):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on the shared tensors: the trainer object is a namespace holding
    the attributes that method reads, its model forward replaced by our log-probs (what the loss is about), and
    a real single-process ``accelerate.Accelerator`` for its metric reductions."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from trl.trainer.grpo_trainer import GRPOTrainer

    lp, old, _, mask = _tensors(ADV_SEQ)
    had_group = dist.is_initialized()
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=0.0, loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=Accelerator(cpu=True), _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), max_completion_length=4,
        args=SimpleNamespace(delta=None, sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
                             use_bias_correction_kl=False, steps_per_generation=1))
    inputs = {"prompt_ids": torch.zeros(3, 1, dtype=torch.long), "prompt_mask": torch.ones(3, 1),
              "completion_ids": torch.zeros(3, 4, dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor(ADV_SEQ, dtype=torch.float64), "old_per_token_logps": old,
              "num_items_in_batch": mask.sum()}
    try:
        loss = GRPOTrainer._compute_loss(fake, None, inputs)
        loss.backward()
    finally:  # accelerate's state, and the process group it may start (it does after a Ray test set RANK etc.)
        AcceleratorState._reset_state(reset_partial_state=True)
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    return loss.item(), lp.grad.clone()


def _ours(fn, agg, **kw):
    lp, old, adv, mask = _tensors(ADV_SEQ)
    loss, _ = fn(lp, old, adv, mask, agg=agg, **kw)
    loss.backward()
    return loss.item(), lp.grad.clone()


@pytest.mark.parametrize("name", ["ppo-grpo", "ppo-dapo", "gspo", "cispo", "sapo"])
def test_each_loss_agrees_with_trls_code_on_the_same_tensors(name):
    """TRL's names: GSPO is importance_sampling_level="sequence" with loss_type="grpo" (its mean over sequences
    of token means); its CISPO caps the ratio at epsilon_high itself (ScaleRL's epsilon_max), where rlkit caps
    at 1 + clip_high (MiniMax-M1's 1 + eps_high): the same loss, TRL epsilon_high = 1 + clip_high; its CISPO
    sums over tokens / their number (token-mean). TRL's SAPO is the paper's formula with its mean over
    sequences. PPO's clip is there as the control: TRL's "grpo" and "dapo" loss types."""
    ours, trl = {
        "ppo-grpo": (lambda: _ours(policy_loss, "seq-mean-token-mean", clip_low=0.1, clip_high=0.15),
                     lambda: _trl_loss("grpo", epsilon_low=0.1, epsilon_high=0.15)),
        "ppo-dapo": (lambda: _ours(policy_loss, "token-mean", clip_low=0.1, clip_high=0.15),
                     lambda: _trl_loss("dapo", epsilon_low=0.1, epsilon_high=0.15)),
        "gspo": (lambda: _ours(gspo_loss, "seq-mean-token-mean", clip_low=0.1, clip_high=0.1),
                 lambda: _trl_loss("grpo", level="sequence", epsilon_low=0.1, epsilon_high=0.1)),
        "cispo": (lambda: _ours(cispo_loss, "token-mean", clip_high=0.2),
                  lambda: _trl_loss("cispo", epsilon_high=1.2)),
        "sapo": (lambda: _ours(sapo_loss, "seq-mean-token-mean", tau_pos=1.0, tau_neg=1.5),
                 lambda: _trl_loss("sapo", tau_pos=1.0, tau_neg=1.5)),
    }[name]
    (lo, go), (lt, gt) = ours(), trl()
    assert lo == pytest.approx(lt, abs=1e-9)
    torch.testing.assert_close(go, gt, atol=1e-9, rtol=0)
    assert go.abs().sum() > 0


# ---- through the Trainer --------------------------------------------------------------------------------------
def _fit(tmp_path, algorithm, **kw):
    with rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm=algorithm,
                       rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=6), prompts_per_step=2, lr=2e-2,
                       seed=3, epochs=2, run_dir=str(tmp_path / algorithm), **kw) as tr:
        return tr.fit(steps=2, view="none")


def test_gspo_and_gspo_token_train_identically_with_grpos_advantages(tmp_path):
    """GRPO gives one advantage per sequence, so the two GSPO losses give the same updates: the same metrics,
    step by step, from the same seed (two epochs, so the second has moved off the sampling policy)."""
    a = _fit(tmp_path, "gspo", clip_low=3e-4, clip_high=4e-4)
    b = _fit(tmp_path, "gspo-token", clip_low=3e-4, clip_high=4e-4)
    for col in ("reward/mean", "actor/pg_loss", "actor/seq_clipfrac", "actor/seq_ratio_max", "actor/grad_norm"):
        assert a[col].tolist() == pytest.approx(b[col].tolist(), rel=1e-4, abs=1e-6), col
    # the paper's clip range is tight: the second epoch's sequences leave it (the metric is the epochs' mean)
    assert (a["actor/seq_clipfrac"] > 0).all() and (a["actor/seq_ratio_max"] > 1).all()


@pytest.mark.parametrize("algorithm,options,metric", [("cispo", {"clip_low": 0.0, "clip_high": 1e-3}, "actor/weight_mean"),
                                                      ("sapo", {"loss_options": {"tau_neg": 1.5}}, "actor/gate_mean")])
def test_cispo_and_sapo_train_through_the_trainer_with_their_metrics(tmp_path, algorithm, options, metric):
    df = _fit(tmp_path, algorithm, **options)
    assert (df["actor/grad_norm"] > 0).all() and df["actor/pg_loss"].notna().all()
    # epoch 1 is on-policy (weight / gate 1), epoch 2 has moved: the mean of the two differs from 1
    assert (df[metric] != 1.0).all() and (df[metric] > 0).all()
    if algorithm == "cispo":   # a cap at 1.001 truncates some of epoch 2's tokens
        assert (df["actor/clipfrac"] > 0).all()


@pytest.mark.parametrize("options,match", [
    ({"tau_neg": 0.0}, "tau_neg=0.0"), ({"temperature": 1.0}, "takes no 'temperature'"),
    ({"clip_high": 0.3}, "pass clip_high=")])
def test_a_bad_loss_option_is_a_clear_error_before_any_worker(tmp_path, options, match):
    with pytest.raises(TrainerError, match=match):
        rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="sapo",
                      loss_options=options, run_dir=str(tmp_path / "bad"))
