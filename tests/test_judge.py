"""A generative reward (rlkit.rewards.Judge) and async rewards. The judge here is a real model on the real
engine whose weights the test sets by hand so that it always answers "7": what it scores is the test's, never
what a model happens to sample."""

import asyncio
import math
import os
import re
import threading

import pytest
import torch
from _seven import always_seven

import rlkit
from rlkit.models import tiny_lm
from rlkit.rewards import Judge, JudgeError, RewardFunctions

torch.set_num_threads(1)
TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nScore from 0 to 10:"


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    return always_seven(tmp_path_factory.mktemp("judge") / "seven")


def test_parse_reads_the_first_number_in_the_scale():
    p = r"-?\d+(?:\.\d+)?"
    assert Judge.parse("Score: 8/10", p, (0, 10)) == 0.8
    assert Judge.parse("2.5", p, (0, 5)) == 0.5
    assert Judge.parse("11", p, (0, 10)) is None and Judge.parse("none", p, (0, 10)) is None
    assert Judge.parse(None, p, (0, 10)) is None


def test_the_judge_scores_every_completion_in_one_batch_in_process(seven):
    judge = Judge(seven, TEMPLATE, max_new_tokens=1)
    try:
        assert judge(["1+1?", "2+2?", "3+3?"], ["2", "5", "six"]) == [0.7, 0.7, 0.7]
        assert judge.failures == {} and judge.metrics() == {}
        text = judge.render("1+1?", "2<|endoftext|>junk", {})
        assert "Question: 1+1?\nAnswer: 2\nScore" in text and text.endswith("<|im_start|>assistant\n")
    finally:
        judge.close()


def test_its_failures_are_counted_never_raised(seven):
    judge = Judge(seven, TEMPLATE, max_new_tokens=1, scale=(0, 5))   # "7" lies outside 0-5
    try:
        assert judge(["q", "q"], ["a", "b"]) == [None, None]
        assert judge(["q"], ["a " * 5000]) == [None]                    # longer than the judge's context
        assert judge.failures == {"unparseable": 2, "too_long": 1}
        assert judge.metrics() == {"judge/unparseable": 2.0, "judge/too_long": 1.0} and judge.metrics() == {}
        # a batch that does not finish in time: the judge's one call thread is held by the test until after
        judge.timeout_s = 0.5
        release = threading.Event()
        judge._calls.submit(release.wait)
        assert judge(["q"], ["a"]) == [None]
        release.set()
        assert judge.failures["timeout"] == 1
    finally:
        judge.close()


@pytest.mark.parametrize("kw,match", [({"prompt": "Score {prompt}"}, "has no {completion} slot"),
                                      ({"scale": (10, 0)}, "scale=(10, 0) must be"),
                                      ({"engine": "sglang"}, "engine='sglang'"),
                                      ({"pattern": "("}, "is not a regular expression")])
def test_bad_settings_are_clear_errors(seven, kw, match):
    with pytest.raises(JudgeError, match=re.escape(match)):
        Judge(**{"model": seven, "prompt": TEMPLATE, **kw})


def test_a_column_the_rows_lack_is_named(seven):
    judge = Judge(seven, "Reference: {solution}\n{completion}")
    with pytest.raises(JudgeError, match=r"reads \{solution\}, which the dataset's rows do not have"):
        judge(["q"], ["a"], answer=["4"])


@pytest.mark.ray
def test_a_judge_on_its_own_pool_rewards_a_trainer_step(seven, tmp_path, ray_cluster):
    judge = Judge(seven, TEMPLATE + " (reference: {answer})", cluster=ray_cluster, max_new_tokens=1)
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    try:
        with rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rows, reward=judge,
                           rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=3), prompts_per_step=2,
                           run_dir=str(tmp_path / "judged")) as tr:
            row = tr.train_step()
        assert row["reward/mean"] == pytest.approx(0.7) and row["reward/skipped"] == 0
        assert judge._group.info[0]["pid"] != os.getpid()    # a Ray worker of its own
    finally:
        judge.close()


# ---- async rewards -------------------------------------------------------------------------------------------
def test_async_rewards_run_together_and_a_slow_one_is_bounded():
    """Two async rewards that each wait for the other to start can only finish if they run concurrently; a third
    that never returns is cut at the bound: no reward for its batch (NaN), counted in reward/timeouts."""
    started = {}

    def waiter(name, other):
        async def reward(prompts, completions, **_):
            started[name] = asyncio.Event()
            for _ in range(200):
                if other in started:
                    break
                await asyncio.sleep(0.01)
            return [1.0 if other in started else 0.0] * len(completions)
        return reward

    fns = RewardFunctions([(waiter("a", "b"), 1.0), (waiter("b", "a"), 1.0)], timeout_s=30)
    assert fns.score({"prompt": ["p", "q"]}, ["x", "y"]).tolist() == [2.0, 2.0]

    async def never(prompts, completions, **_):
        await asyncio.Event().wait()

    bounded = RewardFunctions([(never, 1.0), (lambda p, c, **_: [0.5] * len(c), 1.0)], timeout_s=0.2)
    scores = bounded.score({"prompt": ["p", "q"]}, ["x", "y"]).tolist()
    assert all(math.isnan(s) for s in scores) and bounded.take_metrics() == {"reward/timeouts": 2.0}
    assert bounded.take_metrics() == {}


def test_async_rewards_run_inside_a_running_event_loop():
    """A notebook's kernel runs an event loop; the rewards get a loop of their own on another thread."""
    async def reward(prompts, completions, **_):
        await asyncio.sleep(0)
        return [0.25] * len(completions)

    async def inside():
        return RewardFunctions([(reward, 1.0)]).score({"prompt": ["p"]}, ["x"]).tolist()

    assert asyncio.run(inside()) == [0.25]
