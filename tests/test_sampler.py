"""Prompt samplers (rlkit.sampler): the curriculum's weights and draws against their formula, its preference
through the Trainer on rows whose pass rates the test sets, its histogram, exact resume, and a sampler of your
own. The rewards here depend on the row and the sample's position only, never on what the model writes."""

import pytest

import rlkit
from rlkit.errors import TrainerError
from rlkit.models import tiny_lm
from rlkit.sampler import CurriculumSampler, EpochSampler, PromptSampler
from rlkit.trainer import Trainer

ALWAYS, NEVER, MIXED = ("a0", "a1"), ("n0", "n1"), ("m0", "m1")
ROWS = [{"prompt": p} for p in ALWAYS + NEVER + MIXED]


def reward(prompts, completions, **_):
    """1 for ALWAYS rows, 0 for NEVER rows, and 1, 0, 1, 0, ... by position for MIXED rows: with n = 2 samples per
    prompt each group of a MIXED row passes exactly once."""
    return [1.0 if p in ALWAYS else 0.0 if p in NEVER else float(i % 2 == 0) for i, p in enumerate(prompts)]


def _trainer(tmp_path, name, sampler, **kw):
    return Trainer(model=tiny_lm("qwen2", size="test"), dataset=ROWS, reward=reward, sampler=sampler,
                   rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=3), prompts_per_step=2, seed=0,
                   run_dir=str(tmp_path / name), **kw)


def _trained(trainer, step):
    s = trainer.samples(last=trainer.step)
    return list(dict.fromkeys(s[s.step == step]["prompt"]))


def test_weights_and_draws_follow_the_formula():
    """weight = max(4 p (1 - p), explore), unseen 1; a draw of one row out of weights w takes row i with
    probability w_i / sum(w) (Efraimidis-Spirakis): counted over 2000 seeded rounds."""
    s = CurriculumSampler(window=4, explore=0.1)
    s.observe([0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 1, 0, 0, 0])   # p = 0.75 and 0.25: weight 0.75 each
    s.observe([2, 2], [1.0, 1.0])                                   # p = 1: explore
    assert [s.weight(r) for r in range(4)] == pytest.approx([0.75, 0.75, 0.1, 1.0])
    counts = [0] * 4
    for rnd in range(2000):
        counts[s.choose(rnd=rnd, k=1, n=4, seed=5)[0]] += 1
    total = 0.75 + 0.75 + 0.1 + 1.0
    for r, w in enumerate([0.75, 0.75, 0.1, 1.0]):
        assert counts[r] / 2000 == pytest.approx(w / total, abs=0.03), (r, counts)
    # the window keeps the last 4 samples: two more passes for row 1 make it 0, 0, 1, 1 -> p = 0.5, weight 1
    s.observe([1, 1], [1.0, 1.0])
    assert s.pass_rate(1) == 0.5 and s.weight(1) == 1.0


def test_the_epoch_sampler_visits_every_row_once_per_epoch():
    rows = [EpochSampler().choose(rnd, k=2, n=6, seed=0) for rnd in range(6)]
    assert sorted(sum(rows[:3], [])) == list(range(6)) and sorted(sum(rows[3:], [])) == list(range(6))
    assert sum(rows[:3], []) != sum(rows[3:], [])   # another order in the second epoch


def test_the_curriculum_prefers_rows_solved_some_of_the_time_and_logs_its_choices(tmp_path):
    with _trainer(tmp_path, "curriculum", CurriculumSampler(window=4)) as tr:
        df = tr.fit(steps=12, view="none")
        s = tr.sampler
        assert [s.pass_rate(ROWS.index({"prompt": p})) for p in ALWAYS + NEVER + MIXED] == [1, 1, 0, 0, 0.5, 0.5]
        late = [p for step in range(5, 13) for p in _trained(tr, step)]
    # after every row was seen (steps 1-3 take the unseen ones first), the two MIXED rows weigh 1 and the four
    # others 0.05: a round of 2 takes a MIXED row first with probability 2 / 2.2
    assert df["curriculum/unseen"].iloc[0] == 1.0 and df["curriculum/rows_seen"].iloc[-1] == 6
    assert sum(p in MIXED for p in late) / len(late) >= 0.7, late
    bins = df[[f"curriculum/{b}" for b in ("unseen", "never", "hard", "easy", "always")]]
    assert bins.sum(axis=1).tolist() == pytest.approx([1.0] * 12)
    assert df["curriculum/easy"].iloc[4:].mean() > df["curriculum/always"].iloc[4:].mean()


def test_a_resumed_curriculum_chooses_as_the_uninterrupted_run(tmp_path):
    with _trainer(tmp_path, "run", CurriculumSampler(window=4)) as tr:
        tr.fit(steps=3, view="none")
        tr.save(tmp_path / "ckpt")
        want = tr.fit(steps=3, view="none").iloc[3:]
        prompts = [_trained(tr, step) for step in (4, 5, 6)]
        state = tr.sampler.state_dict()
    with pytest.raises(TrainerError, match="trained with sampler CurriculumSampler, and this load has EpochSampler"):
        Trainer.load(tmp_path / "ckpt", dataset=ROWS, reward=reward)
    with Trainer.load(tmp_path / "ckpt", dataset=ROWS, reward=reward, sampler=CurriculumSampler(window=4),
                      run_dir=str(tmp_path / "resumed")) as again:
        got = again.fit(steps=3, view="none").iloc[3:]
        assert [_trained(again, step) for step in (4, 5, 6)] == prompts
        assert again.sampler.state_dict() == state
    cols = [c for c in want.columns if c.startswith("curriculum/")] + ["reward/mean"]
    assert got[cols].to_dict("records") == want[cols].to_dict("records")


class FirstTwo(PromptSampler):
    """A sampler of your own: rows 0 and 1, every round."""

    def choose(self, rnd, k, n, seed):
        return [0, 1][:k]


class OutOfRange(PromptSampler):
    def choose(self, rnd, k, n, seed):
        return [n + 1] * k


def test_a_sampler_of_your_own_chooses_the_rows_and_a_bad_one_is_named(tmp_path):
    with _trainer(tmp_path, "own", FirstTwo()) as tr:
        tr.fit(steps=2, view="none")
        assert _trained(tr, 1) == _trained(tr, 2) == ["a0", "a1"]
    with _trainer(tmp_path, "bad", OutOfRange()) as tr:
        with pytest.raises(TrainerError, match=r"OutOfRange.choose\(rnd=0, k=2, n=6\) returned \[7, 7\]"):
            tr.fit(steps=1, view="none")
    with pytest.raises(TrainerError, match="sampler=CurriculumSampler is the class: pass an instance"):
        _trainer(tmp_path, "cls", CurriculumSampler)
