"""avg@k, pass@k and maj@k (rlkit.evaluation): the estimator against brute-force enumeration, the scores on
fixed samples against a hand computation, and ``eval_every`` inside ``fit``, recomputed by hand from the
samples it scored."""

import itertools
import math

import pytest

import rlkit
from rlkit.errors import TrainerError
from rlkit.evaluation import majority, pass_at_k, scores
from rlkit.models import tiny_lm


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
    """Chen et al.'s estimator equals, exactly, the mean over all k-subsets of the n samples of "one of them is
    correct": what it estimates without bias. Counted here subset by subset."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expect = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expect, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="need 0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_scores_on_fixed_samples_by_hand():
    """Three prompts, four samples each (reward, answer):
    - prompt A: rewards 1, 0, 0, 1; answers 12, 13, 13, 12: c = 2; the vote ties 12 / 13: 12 came first, correct;
    - prompt B: rewards 0, 0, 0, 0: c = 0; the vote: 5, wrong;
    - prompt C: rewards 0.5, 1, 0.5, 0.5; answers x, y, x, x: c = 1 (0.5 is not full marks); the vote: x, wrong.
    avg@4 = (0.5 + 0 + 0.625) / 3; pass@1 = (2/4 + 0 + 1/4) / 3; pass@2 = (1 - C(2,2)/C(4,2) + 0 + 1 - C(3,2)/C(4,2)) / 3
    = (5/6 + 1/2) / 3; pass@4 = (1 + 0 + 1) / 3; maj@4 = 1/3."""
    groups = [[(1.0, "12"), (0.0, "13"), (0.0, "13"), (1.0, "12")],
              [(0.0, "5"), (0.0, "5"), (0.0, "6"), (0.0, "7")],
              [(0.5, "x"), (1.0, "y"), (0.5, "x"), (0.5, "x")]]
    out = scores(groups)
    assert list(out) == ["avg@4", "pass@1", "pass@2", "pass@4", "maj@4"]
    assert out["avg@4"] == pytest.approx((0.5 + 0 + 0.625) / 3)
    assert out["pass@1"] == pytest.approx((0.5 + 0 + 0.25) / 3)
    assert out["pass@2"] == pytest.approx((5 / 6 + 0 + 1 / 2) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["maj@4"] == pytest.approx(1 / 3)
    assert majority(["13", "12", "12", "13"]) == 0   # a tie goes to the answer given first


def _by_hand(table, k):
    """avg@k, pass@1, pass@k and maj@k recomputed from a DataFrame of samples (row, answer, reward), with no
    rlkit code: counting and voting in plain Python."""
    out = {"avg": [], "pass1": [], "passk": [], "maj": []}
    for _, g in table.groupby("row"):
        rewards, answers = g["reward"].tolist(), g["answer"].tolist()
        assert len(rewards) == k
        correct = [r >= 1.0 for r in rewards]
        counts = {a: answers.count(a) for a in answers}
        voted = next(i for i, a in enumerate(answers) if counts[a] == max(counts.values()))
        out["avg"].append(sum(rewards) / k)
        out["pass1"].append(sum(correct) / k)
        out["passk"].append(float(any(correct)))
        out["maj"].append(float(correct[voted]))
    return {key: sum(v) / len(v) for key, v in out.items()}


def test_eval_every_logs_heldout_scores_that_match_its_samples_by_hand(tmp_path):
    k = 4
    with rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4, temperature=1.0), prompts_per_step=2,
                       lr=1e-3, seed=2, eval_every=2, eval_k=k, eval_prompts=6, run_dir=str(tmp_path / "run")) as tr:
        df = tr.fit(steps=4, view="none")
        last = tr.eval_samples
        by_hand = _by_hand(last, k)
        again = tr.evaluate(n=6, k=k)     # the same figures by hand call (same step, same seed: same samples)
    assert df["eval/avg@4"].notna().tolist() == [False, True, False, True]
    assert set(last["step"]) == {4} and len(last) == 6 * k and last["row"].nunique() == 6
    row = df.iloc[-1]
    assert row["eval/avg@4"] == pytest.approx(by_hand["avg"])
    assert row["eval/pass@1"] == pytest.approx(by_hand["pass1"])
    assert row["eval/pass@4"] == pytest.approx(by_hand["passk"])
    assert row["eval/maj@4"] == pytest.approx(by_hand["maj"])
    assert math.isfinite(row["eval/pass@2"]) and row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"]
    assert row["timing/eval"] > 0
    assert {key: again[key] for key in ("avg@4", "pass@1", "pass@4", "maj@4")} == pytest.approx(
        {key: row[f"eval/{key}"] for key in ("avg@4", "pass@1", "pass@4", "maj@4")})


def test_eval_every_without_a_heldout_split_fails_before_any_worker(tmp_path):
    rows = [{"prompt": "say a"}, {"prompt": "say b"}]
    with pytest.raises(TrainerError, match="eval_every=5 scores a held-out split, and this dataset has none"):
        rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rows, reward=lambda p, c, **kw: [0.0] * len(c),
                      eval_every=5, run_dir=str(tmp_path / "r"))


def test_evaluate_takes_heldout_prompts_longer_than_every_training_prompt(tmp_path):
    # the run's layout is as wide as its longest training prompt; a held-out prompt past it is laid out wider
    train = [{"prompt": "ab"}, {"prompt": "cd"}]
    held_out = [{"prompt": "a much longer held-out prompt than any training one, " * 3 + str(i)} for i in range(4)]
    with rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=train, algorithm="grpo",
                       reward=lambda p, c, **kw: [float(len(x)) for x in c],
                       rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=3, ignore_eos=True), prompts_per_step=2,
                       run_dir=str(tmp_path / "run")) as tr:
        width = tr.layout.prompt_len
        longest = len(tr.tokenizer(held_out[0]["prompt"])["input_ids"])
        out = tr.evaluate(held_out, n=4, k=2)
        samples = tr.eval_samples
    assert longest > width
    assert out["n"] == 8 and len(samples) == 8 and samples["row"].nunique() == 4
