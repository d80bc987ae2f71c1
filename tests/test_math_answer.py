"""MathAnswer (rlkit.rewards.math_answer): math-verify's equality on answers the test writes, in the forms a
model gives them; failures counted, never raised; usable from a thread."""

import threading

import pytest

import rlkit
from rlkit.rewards import MathAnswer, RewardFunctions

CASES = [  # (gold, completion, reward)
    ("\\frac{1}{2}", "The answer is \\boxed{0.5}", 1.0),
    ("0.5", "<answer>1/2</answer>", 1.0),
    ("1/2", "so we get $\\frac{2}{4}$", 1.0),
    ("12", "<answer> 12 </answer><|endoftext|>garbage 13", 1.0),
    ("12", "<answer>13</answer>", 0.0),
    ("x^2 + 2x + 1", "\\boxed{(x+1)^2}", 1.0),
    ("\\sqrt{2}", "\\boxed{1.41}", 0.0),
    ("3", "I do not know", 0.0),
    ("3", "", 0.0),
]


def test_math_answer_scores_equal_mathematics_not_equal_text():
    reward = MathAnswer()
    gold, completions, expect = zip(*CASES)
    assert reward(["q"] * len(CASES), list(completions), answer=list(gold)) == list(expect)
    assert reward.failures == 2   # the two completions with no mathematics in them


def test_math_answer_reads_another_column_and_sums_with_other_rewards():
    reward = MathAnswer(answer_column="solution")
    fns = RewardFunctions.of([(reward, 1.0), (lambda p, c, **_: [0.25] * len(c), 1.0)])
    assert fns.score({"prompt": ["a", "b"], "solution": ["4", "5"]}, ["\\boxed{4}", "\\boxed{4}"]).tolist() == [1.25, 0.25]
    with pytest.raises(TypeError, match="needs the 'solution' column"):
        reward(["a"], ["4"], answer=["4"])


def test_math_answer_in_a_thread_runs_without_its_signal_timer():
    out = []
    t = threading.Thread(target=lambda: out.append(MathAnswer()(["q"], ["\\boxed{2}"], answer=["2"])))
    t.start()
    t.join(timeout=60)
    assert out == [[1.0]]


@pytest.mark.parametrize("kw,match", [({"answer_column": ""}, "answer_column=''"), ({"timeout_s": 0.5}, "timeout_s=0.5")])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        MathAnswer(**kw)


def test_math_answer_is_a_trainer_reward(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    with rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="test"), dataset=rows, reward=MathAnswer(),
                       rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2,
                       run_dir=str(tmp_path / "r")) as tr:
        row = tr.train_step()
    assert row["reward/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)
