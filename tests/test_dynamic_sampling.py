"""Dynamic sampling (DAPO) and overlong shaping, with rewards and lengths the test controls.

Half the prompts are "easy": every sample of one gets reward 1 (a saturated group, no gradient); the
others' samples get their position in the reward call, so they always differ. Which prompts a step must
train on is then known without the model: walk the dataset's rounds of ``prompts_per_step`` rows in order
and take the first hard ones, DAPO's way. That is checked in the synchronous loop (one rank, in this
process) and in one-step-off asynchronous RL (split placement on Ray), each with an exact resume. The
overlong penalty is held against the paper's formula on lengths the test scripted.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rlkit
from rlkit.dynamic_sampling import SamplingError, informative_groups, overlong_penalty
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer, TrainerError
from rlkit.widgets.live import metrics_figure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N, P = 4, 4  # Rollout.n, prompts_per_step
ROWS = [{"prompt": c * k, "easy": i % 2 == 0} for i, (c, k) in enumerate((c, k) for c in "abcdefgh" for k in (2, 3))]
EASY = {r["prompt"] for r in ROWS if r["easy"]}
SATURATE = {"all": False}  # True: every group saturated (the bound test)


def reward(prompts, completions, easy, **_):
    """An easy prompt's samples all get 1; a hard prompt's get their position in the call (all differ)."""
    return [1.0 if e or SATURATE["all"] else float(i) for i, e in enumerate(easy)]


def expected_steps(trainer, steps, first_round=0):
    """What each step trains on, walked by hand: rounds of the dataset's rows in order, each step taking
    rounds until it holds P hard prompts (the rest of the last round's hard ones dropped). Returns
    ``[(prompts, rounds, filtered groups, dropped groups)]`` per step and the next round."""
    out, rnd = [], first_round
    for _ in range(steps):
        kept, rounds, filtered, dropped = [], 0, 0, 0
        while len(kept) < P:
            hard = [r["prompt"] for r in trainer._prompts_of(rnd) if r["prompt"] not in EASY]
            rnd, rounds, filtered = rnd + 1, rounds + 1, filtered + P - len(hard)
            dropped += max(0, len(hard) - (P - len(kept)))
            kept += hard[:P - len(kept)]
        out.append((kept, rounds, filtered, dropped))
    return out, rnd


def trained_prompts(trainer, step):
    s = trainer.samples(last=trainer.step)
    return list(dict.fromkeys(s[s.step == step]["prompt"]))


def _trainer(tmp_path, name, **kw):
    return Trainer(model=tiny_lm("qwen2"), dataset=ROWS, reward=reward, algorithm="grpo",
                   rollout=rlkit.Rollout(engine="hf", n=N, max_new_tokens=6), prompts_per_step=P, lr=1e-2, seed=0,
                   dynamic_sampling=True, run_dir=str(tmp_path / name), **kw)


def test_informative_groups_against_hand_picked_rewards():
    nan = float("nan")
    uid = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, nan, 1.0, nan, nan, 0.2, 0.2000001])
    # 0: equal; 1: differ; 2: one reward only; 3: none; 4: differ (by a little: any difference is a gradient)
    assert informative_groups(uid, rewards) == [1, 4]


def test_synchronous_steps_train_the_first_groups_that_differ_and_resume_exactly(tmp_path):
    tr = _trainer(tmp_path, "sync")
    try:
        want, _ = expected_steps(tr, 4)
        assert sum(w[1] for w in want) > 4  # the walk needs backfill rounds: the test exercises them
        batch = tr.generate()
        prompts, rounds, filtered, dropped = want[0]
        assert [p["prompt"] for p in batch.prompts] == prompts
        s = batch.samples
        assert s.uid == [u for u in range(P) for _ in range(N)]
        assert s.columns["prompt"] == [prompts[u] for u in s.uid]  # each sample under its own prompt's uid
        assert informative_groups(s.uid, batch.rewards) == list(range(P))
        assert batch.sampling == {"dynamic/rounds": rounds, "dynamic/filtered_share": filtered / (rounds * P),
                                  "dynamic/samples_per_kept": rounds * P * N / (P * N),
                                  "dynamic/surplus_groups": dropped}
        assert tr.rounds == 0  # taken once the batch trains: a batch made again at this step is the same
        assert batch.table()["version"].tolist() == [0] * (P * N)  # the policy version that sampled each
        row = tr.update(tr.estimate(batch))
        assert row["dynamic/rounds"] == rounds and row["reward/skipped"] == 0 and tr.rounds == rounds
        tr.fit(steps=1, view="none")
        tr.save(tmp_path / "ckpt")
        rest = tr.fit(steps=2, view="none").iloc[2:]
        for step in range(1, 5):
            assert trained_prompts(tr, step) == want[step - 1][0], step
        assert rest["dynamic/rounds"].tolist() == [w[1] for w in want[2:]]
        # the live view draws the filtered share, step by step
        axes = {ax.get_title(): ax for ax in metrics_figure(tr.metrics).axes}
        drawn = list(axes["filtered groups (share)"].lines[0].get_ydata())
        assert drawn == pytest.approx([w[2] / (w[1] * P) for w in want])
    finally:
        tr.close()
    again = Trainer.load(tmp_path / "ckpt", dataset=ROWS, reward=reward, run_dir=str(tmp_path / "resumed"))
    try:
        resumed = again.fit(steps=2, view="none").iloc[2:]
        for col in ("reward/mean", "actor/loss", "dynamic/rounds", "dynamic/filtered_share"):
            assert resumed[col].tolist() == rest[col].tolist(), col
        assert [trained_prompts(again, s) for s in (3, 4)] == [want[2][0], want[3][0]]
        # every group saturated: the step stops after max_sampling_rounds, naming the counts and the fixes
        again.config.max_sampling_rounds = 2
        SATURATE["all"] = True
        with pytest.raises(SamplingError, match=r"after 2 generation round\(s\) \(8 prompts\) only 0 of the 4 groups "
                                                r".*raise max_sampling_rounds \(now 2\)"):
            again.fit(steps=1, view="none")
        assert again.step == 4
    finally:
        SATURATE["all"] = False
        again.close()


@pytest.mark.ray
def test_one_step_off_backfills_from_the_rounds_in_flight_within_the_bound_and_resumes_exactly(tmp_path, ray_cluster):
    kw = dict(placement="split", off_policy_steps=1, offpolicy_correction="tis", cluster=ray_cluster)
    tr = _trainer(tmp_path, "async", **kw)
    try:
        want, _ = expected_steps(tr, 4)
        first = tr.fit(steps=2, view="none")
        tr.save(tmp_path / "ckpt")
        rest = tr.fit(steps=2, view="none").iloc[2:]
        for step in range(1, 5):
            assert trained_prompts(tr, step) == want[step - 1][0], step
        df = tr.metrics
        assert df["dynamic/rounds"].tolist() == [w[1] for w in want]
        # backfill takes the rounds in flight and launches fresher ones: never more than one version behind
        assert df["offpolicy/staleness_max"].max() <= 1.0 and first["offpolicy/staleness_max"].iloc[0] == 0.0
        assert len(tr._ahead) == 1 and tr.rounds == sum(w[1] for w in want) + 1  # one round in flight
    finally:
        tr.close()
    again = Trainer.load(tmp_path / "ckpt", dataset=ROWS, reward=reward, run_dir=str(tmp_path / "resumed"),
                         cluster=ray_cluster)
    try:
        resumed = again.fit(steps=2, view="none").iloc[2:]
        for col in ("reward/mean", "actor/loss", "dynamic/rounds", "offpolicy/staleness_max"):
            assert resumed[col].tolist() == rest[col].tolist(), col
    finally:
        again.close()


def test_overlong_penalty_against_the_papers_formula_and_truncated_samples_masked(tmp_path):
    # DAPO's soft overlong punishment, L_max = 8, L_cache = 4, by hand: 0 up to 4 tokens, then (4 - l) / 4
    assert overlong_penalty(torch.tensor([1, 4, 5, 6, 7, 8]), max_tokens=8, buffer=4).tolist() == \
        [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(torch.tensor([6]), max_tokens=8, buffer=4, factor=0.5).tolist() == [-0.25]
    # through the trainer: scripted answers of chosen lengths (ending in EOS), the others drawn to the limit
    script = (("aa", "a<|endoftext|>"), ("bb", "bbbb<|endoftext|>"), ("cc", "cccccc<|endoftext|>"))
    tr = Trainer(model=tiny_lm("qwen2"), dataset=[{"prompt": p} for p in ("aa", "bb", "cc", "dd")],
                 reward=lambda prompts, completions, **_: [float(i) for i in range(len(prompts))], algorithm="grpo",
                 rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=6, script=script), prompts_per_step=4,
                 lr=1e-2, seed=0, overlong_buffer=3, mask_truncated=True, run_dir=str(tmp_path / "overlong"))
    try:
        batch = tr.generate()
        lengths = batch.samples.response_mask.sum(1).long().tolist()
        assert len(set(lengths)) >= 3, lengths  # short, inside the buffer, and at the limit
        hand = [0.0 if n <= 3 else (3 - n) / 3 for n in lengths]  # L_max = 6, L_cache = 3
        assert (batch.rewards - torch.arange(len(lengths))).tolist() == pytest.approx(hand)  # the reward: i + penalty
        cut = [r == "length" for r in batch.samples.finish_reason]
        assert any(cut) and not all(cut)
        kept = copy.deepcopy(batch)
        tr.config.mask_truncated = False
        tr.estimate(kept)
        tr.config.mask_truncated = True
        tr.estimate(batch)
        for i, c in enumerate(cut):  # the truncated ones leave the loss; the others keep the same advantages
            if c:
                assert batch.samples.loss_tokens[i].sum() == 0 and batch.samples.advantages[i].abs().sum() == 0
            else:
                assert torch.equal(batch.samples.advantages[i], kept.samples.advantages[i])
        assert kept.samples.advantages[cut.index(True)].abs().sum() > 0  # they counted in the group's baseline
        row = tr.update(batch)
        assert row["overlong/masked"] == sum(cut) and row["actor/loss"] == row["actor/loss"]
    finally:
        tr.close()


def test_bad_settings_fail_in_the_driver(tmp_path):
    model = tiny_lm("qwen2")
    with pytest.raises(TrainerError, match=r"dynamic_sampling=True .* set Rollout\(n>=2\) \(got n=1\)"):
        Trainer(model=model, dataset=ROWS, reward=reward, algorithm="reinforce++", rollout=rlkit.Rollout(n=1),
                dynamic_sampling=True)
    with pytest.raises(TrainerError, match=r"overlong_buffer=16 must be shorter than Rollout.max_new_tokens=16"):
        Trainer(model=model, dataset=ROWS, reward=reward, rollout=rlkit.Rollout(n=4, max_new_tokens=16),
                overlong_buffer=16)
    with pytest.raises(TrainerError, match=r"overlong_buffer=4 / mask_truncated=False shape single-turn responses"):
        Trainer(model=model, dataset=ROWS, reward=reward, max_turns=2, overlong_buffer=4)
