"""Toy tasks: datasets, rewards on hand-made completions, tokenizer round-trip, SFT warm-start."""

from __future__ import annotations

import random

import pytest

import rlkit
from rlkit.tasks import Arithmetic, Repeat, arithmetic, evaluate, first_number, repeat, sft_log, sft_warmstart


# ---- datasets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [Arithmetic(digits=2, ops="+-*"), Repeat()], ids=["arithmetic", "repeat"])
def test_dataset_is_deterministic_per_seed_and_leaves_global_rng_alone(task):
    state = random.getstate()
    a, b, c = task(n=50, seed=1), task.dataset(n=50, seed=1), task(n=50, seed=2)
    assert random.getstate() == state
    assert a == b and a != c
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in a)
    assert task(n=10, seed=1) == a[:10]  # a longer draw extends a shorter one


def test_module_level_task_reads_like_the_design():
    rows = rlkit.tasks.arithmetic()
    assert len(rows) == 1000 and rows.columns() == ["prompt", "answer", "a", "b", "op"]
    assert rlkit.tasks.arithmetic.reward(None, rows.column("answer")[:3], answer=rows.column("answer")[:3]) \
        == [1.0, 1.0, 1.0]
    df = rows.to_pandas()
    assert list(df.columns) == rows.columns() and len(df) == 1000
    for r in rows[:100]:  # answers are right, operands within 2 digits
        assert 0 <= r["a"] <= 99 and 0 <= r["b"] <= 99 and int(r["answer"]) == r["a"] + r["b"]
        assert r["prompt"] == f"{r['a']}+{r['b']}="


@pytest.mark.parametrize("digits", [1, 2])
def test_train_and_test_are_disjoint(digits):
    task = Arithmetic(digits=digits, ops="+-")
    train = {r["prompt"] for r in task(n=3000, seed=0, split="train")}
    test = {r["prompt"] for r in task(n=300, seed=5, split="test")}
    assert train and test and not train & test
    # the hash split sends ~test_fraction of all problems to test (2-digit "+": 10,000 problems)
    if digits == 2:
        from rlkit.tasks.base import split_of
        share = sum(split_of(f"{a}+{b}=", 0.1) == "test" for a in range(100) for b in range(100)) / 10_000
        assert 0.08 < share < 0.12, share


def test_subtraction_is_non_negative_and_ops_are_mixed():
    rows = Arithmetic(digits=2, ops="-*").dataset(n=200, seed=3)
    assert {r["op"] for r in rows} == {"-", "*"}
    assert all(int(r["answer"]) >= 0 for r in rows)


@pytest.mark.parametrize("bad, match", [
    (dict(digits=0), "digits=0"), (dict(ops="/"), r"ops='/'"), (dict(test_fraction=1.0), "test_fraction=1.0"),
    (dict(template="{a}+"), "template="),
])
def test_bad_arithmetic_settings_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        Arithmetic(**bad)


def test_bad_dataset_arguments_name_the_value():
    with pytest.raises(ValueError, match="split='val'"):
        arithmetic(n=3, split="val")
    with pytest.raises(ValueError, match="n=-1"):
        repeat(n=-1)
    with pytest.raises(ValueError, match="letters='a b'"):
        Repeat(letters="a b")


# ---- rewards ------------------------------------------------------------------------------------------
GARBAGE = [None, "", "   ", "\x00\uffff🙂", "-", "<|endoftext|>", "9" * 5000, b"\xff42", 42, ["weird"],
           [{"role": "assistant"}], {"content": None}]


def test_arithmetic_rewards_on_hand_made_completions():
    comps = ["42", " 42 ", "42<|endoftext|>17", "<|endoftext|>42", "the answer is 42.", "41", "142", "",
             "abc", "-42", "42.0", [{"role": "assistant", "content": "42"}]]
    exact = arithmetic.reward(["17+25="] * len(comps), comps, answer=["42"] * len(comps))
    assert exact == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    strict = Arithmetic(strict=True).reward(None, comps, answer=[42] * len(comps))
    assert strict == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]

    partial = arithmetic.partial_reward(None, comps, answer="42")  # one answer for all completions
    assert partial[:3] == [1.0, 1.0, 1.0] and partial[3] == 0.0 and partial[7] == partial[8] == 0.0
    # "41": 0.1 (a number) + 0.4 * 1/2 digits + 0.4 * (1 - 1/43) closeness
    assert partial[5] == pytest.approx(0.1 + 0.2 + 0.4 * (1 - 1 / 43), abs=1e-12)
    # "142": digits "142" vs " 42" match 2/3, closeness 1 - 100/43 < 0 -> 0
    assert partial[6] == pytest.approx(0.1 + 0.4 * 2 / 3, abs=1e-12)
    # closer wrong answers score more, and every wrong answer stays below 0.9 < exact
    near, far, wrong = arithmetic.partial_reward(None, ["43", "50", "90"], answer=["42"] * 3)
    assert 0.1 == wrong < far < near < 0.9


def test_rewards_never_raise_on_garbage():
    n = len(GARBAGE)
    for fn in (arithmetic.reward, arithmetic.partial_reward, Arithmetic(strict=True).reward):
        out = fn(["1+1="] * n, GARBAGE, answer=["2"] * n)
        assert len(out) == n and all(0.0 <= r <= 1.0 for r in out)
        assert out[:6] == [0.0] * 6  # no number at all (5000 nines are a number: 0.1 partial credit)
    out = repeat.reward(["aaa"] * n, GARBAGE, letter=["a"] * n)
    assert len(out) == n and all(r == 0.0 for r in out)
    assert first_number("9" * 5000) == int("9" * 64)  # capped, no int() overflow error


def test_reward_call_mistakes_are_clear():
    with pytest.raises(TypeError, match="needs the 'answer' column"):
        arithmetic.reward(["1+1="], ["2"])
    with pytest.raises(ValueError, match="answer= has 2 entries but there are 3 completions"):
        arithmetic.reward(None, ["2", "2", "2"], answer=["2", "2"])


def test_repeat_reward_is_graded_per_character():
    comps = ["a" * 16, "a" * 40, "a" * 8, "a" * 8 + "<|endoftext|>" + "a" * 8, "b" * 16, "abab" * 4, ""]
    assert repeat.reward(["aaa"] * 7, comps, letter=["a"] * 7) == [1.0, 1.0, 0.5, 0.5, 0.0, 0.5, 0.0]
    # without the letter column, the prompt's first character is the target
    assert repeat.reward(["bbb", "aaa"], ["bbbb", "bbbb"]) == [0.25, 0.0]
    assert Repeat(length=4).reward(["kkk"], ["kkkkkk"], letter="k") == [1.0]


def test_repeat_random_policy_gets_a_small_dense_reward():
    # The documented random-policy level: uniform random tokens of the tiny tokenizer, 32 per sample.
    from rlkit.models import build_tokenizer

    tok, rng = build_tokenizer(), random.Random(0)
    rows = repeat(n=400, seed=0)
    comps = [tok.decode([rng.randrange(len(tok)) for _ in range(32)]) for _ in rows]
    rewards = repeat.reward(None, comps, letter=rows.column("letter"))
    mean, nonzero = sum(rewards) / len(rewards), sum(r > 0 for r in rewards) / len(rewards)
    assert 0.01 < mean < 0.05, mean  # measured 0.024
    assert 0.15 < nonzero < 0.5, nonzero  # measured ~0.3: GRPO groups of 4 mostly see some signal


# ---- tokenizer ---------------------------------------------------------------------------------------
def test_arithmetic_strings_round_trip_one_token_per_digit():
    from rlkit.models import build_tokenizer

    tok = build_tokenizer()
    for row in Arithmetic(digits=3, ops="+-*").dataset(n=50, seed=0):
        text = row["prompt"] + row["answer"]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert len(ids) == len(text)  # every digit and operator is its own token
    ids = tok("7<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == 2


# ---- SFT warm-start ----------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    # Other tests and engineers share 2 cores: two spinning OpenMP threads each are far slower than one.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_short_sft_lowers_loss_and_saves_a_loadable_model(tmp_path, one_thread):
    from rlkit.models import tiny_lm

    task = Arithmetic(digits=1)
    out = sft_warmstart(tiny_lm("qwen2", size="small"), task, steps=40, batch_size=16, seed=0,
                        out=tmp_path / "sft", progress=False)
    log = sft_log(out)
    assert len(log["losses"]) == 40
    # measured: first 6.24 (~ln 512, a random init), mean of the last 10 steps 1.19 (0.7 s of training)
    assert log["first_loss"] > 5.0
    assert log["last_loss"] < 0.5 * log["first_loss"], log["losses"]
    result = evaluate(out, task, n=32)  # loads the saved folder: model + tokenizer
    assert result["n"] == 32 and 0.0 <= result["accuracy"] <= 1.0
    assert 0.0 <= result["mean_partial_reward"] <= 1.0
    assert all(isinstance(e["completion"], str) for e in result["examples"])


@pytest.mark.slow
def test_default_sft_reaches_nontrivial_accuracy(tmp_path, one_thread):
    # ~1 min: the documented milestone, 2-digit addition with the default 1000 x 64 (measured 39%)
    from rlkit.models import tiny_lm

    base = tiny_lm("qwen2", size="small")
    task = Arithmetic(digits=2)
    before = evaluate(base, task, n=200)
    out = sft_warmstart(base, task, out=tmp_path / "sft", progress=False)
    after = evaluate(out, task, n=200)
    assert before["accuracy"] < 0.02 and after["accuracy"] > 0.2, (before, after)
    assert after["mean_partial_reward"] > before["mean_partial_reward"] + 0.3
