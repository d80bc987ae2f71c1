"""Any data in (issue 28): a Trainer's dataset as rows, a DataFrame, a datasets.Dataset / DatasetDict, a
JSONL / JSON / CSV / Parquet file read with `datasets`, a hub name (offline: an error at once), or a
reasoning-gym task scored by the package's own verifier. Real files in tmp_path, real `datasets`, real
`reasoning-gym`; the expected rows are written out by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest
import reasoning_gym

import rlkit
from rlkit.data import read_rows
from rlkit.inputs import rows_of
from rlkit.models import tiny_lm
from rlkit.trainer import TrainerError

# what every file below holds, in this order ("answer" is not numeric, so CSV keeps it text)
ROWS = [{"prompt": "aaa", "answer": "x1", "k": 1},
        {"prompt": "bbb", "answer": "x2", "k": 2},
        {"prompt": "ccc", "answer": "x3", "k": 3},
        {"prompt": "ddd", "answer": "x4", "k": 4}]


@pytest.fixture(scope="module")
def model():
    return tiny_lm("qwen2", size="test")


def write(kind: str, folder: Path, rows=ROWS) -> Path:
    df = pd.DataFrame(rows)
    path = folder / f"rows.{kind}"
    if kind == "jsonl":
        df.to_json(path, orient="records", lines=True)
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path)
    return path


class Recorder:
    """A reward that keeps what it was called with and scores 1.0 when the completion is non-empty."""

    def __init__(self):
        self.calls: list[tuple[list, dict]] = []

    def __call__(self, prompts, completions, **columns):
        self.calls.append((list(prompts), {k: list(v) for k, v in columns.items()}))
        return [float(bool(c)) for c in completions]


def small_trainer(model, dataset, tmp_path, **kw):
    kw.setdefault("reward", Recorder())
    return rlkit.Trainer(model=model, dataset=dataset, prompts_per_step=2, run_dir=str(tmp_path / "run"),
                         rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), **kw)


# ---- files, read with datasets ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet"])
def test_a_file_gives_exactly_its_rows_in_order(kind, tmp_path):
    path = write(kind, tmp_path)
    assert rows_of(str(path), train_size=8, seed=0) == (None, ROWS)
    assert read_rows(path) == ROWS  # a pathlib.Path too


def test_trainer_takes_a_relative_jsonl_path_and_passes_the_other_columns_to_the_reward(model, tmp_path,
                                                                                       monkeypatch):
    """The reported bug: Trainer(dataset="rows.jsonl") iterated the string's characters."""
    monkeypatch.chdir(tmp_path)
    write("jsonl", tmp_path)
    reward = Recorder()
    with small_trainer(model, "rows.jsonl", tmp_path, reward=reward) as trainer:
        assert trainer.rows == ROWS
        trainer.fit(steps=2, view="none")
    assert len(reward.calls) == 2
    by_prompt = {r["prompt"]: r for r in ROWS}
    seen = set()
    for prompts, columns in reward.calls:
        assert sorted(columns) == ["answer", "k"] and len(prompts) == 4  # 2 prompts x n=2
        for i, p in enumerate(prompts):
            assert columns["answer"][i] == by_prompt[p]["answer"] and columns["k"][i] == by_prompt[p]["k"]
            seen.add(p)
    assert seen == {"aaa", "bbb", "ccc", "ddd"}  # 2 steps x 2 prompts: one epoch, every row once


def test_missing_file_unreadable_file_and_unknown_suffix_name_the_path(tmp_path, model):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TrainerError, match=f"dataset file '{missing}' does not exist; check the path"):
        rlkit.Trainer(model=model, dataset=str(missing), reward=Recorder())
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(TrainerError, match=f"cannot read dataset file '{broken}' as json"):
        read_rows(broken)
    notes = tmp_path / "notes.txt"
    notes.write_text("prompt\n")
    with pytest.raises(TrainerError, match=r"has suffix '.txt', which rlkit does not read; use one of \['.csv'"):
        read_rows(notes)
    with pytest.raises(TrainerError, match="is not a saved dataset \\(it holds \\['broken.jsonl', 'notes.txt'\\]\\)"):
        read_rows(tmp_path)


def test_a_dataset_saved_to_disk_reads_back(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert read_rows(tmp_path / "saved") == ROWS


# ---- datasets.Dataset / DatasetDict --------------------------------------------------------------------
def test_dataset_and_datasetdict_splits():
    train, test = datasets.Dataset.from_list(ROWS[:3]), datasets.Dataset.from_list(ROWS[3:])
    assert rows_of(train, 8, 0) == (None, ROWS[:3])
    both = datasets.DatasetDict({"train": train, "test": test})
    assert rows_of(both, 8, 0)[1] == ROWS[:3]
    assert rows_of(both, 8, 0, split="heldout")[1] == ROWS[3:]
    validation = datasets.DatasetDict({"train": train, "validation": test})
    assert read_rows(validation, "heldout") == ROWS[3:]
    assert read_rows(datasets.DatasetDict({"train": train}), "heldout") == ROWS[:3]  # no held-out: train
    with pytest.raises(TrainerError, match=r"dataset has splits \['test', 'validation'\] and no 'train' split; "
                                           r"pass the split to train on, e.g. dataset=dataset\['test'\]"):
        rows_of(datasets.DatasetDict({"test": test, "validation": test}), 8, 0)


def test_datasetdict_trains_on_train_evaluates_on_test_with_a_named_prompt_column(model, tmp_path):
    questions = [{"question": f"{c * 3}", "answer": c} for c in "abcdefgh"]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(questions[:4]),
                               "test": datasets.Dataset.from_list(questions[4:])})
    reward = Recorder()
    with small_trainer(model, dd, tmp_path, reward=reward, prompt_column="question") as trainer:
        assert [r["prompt"] for r in trainer.rows] == ["aaa", "bbb", "ccc", "ddd"]
        trainer.fit(steps=1, view="none")
        prompts, columns = reward.calls[-1]
        assert sorted(columns) == ["answer", "question"]
        assert all(q == p and a == p[0] for p, q, a in zip(prompts, columns["question"], columns["answer"]))
        result = trainer.evaluate()
        assert result["n"] == 4
        assert sorted(reward.calls[-1][0]) == ["eee", "fff", "ggg", "hhh"]  # the test split, once each


def test_missing_prompt_column_names_the_columns(model):
    rows = [{"question": "aaa", "answer": "a"}]
    with pytest.raises(TrainerError, match=r"dataset has no 'prompt' column \(its columns: \['question', 'answer'\]\); "
                                           r"name the column that holds the prompts with prompt_column=, e\.g\. "
                                           r"prompt_column='question'"):
        rlkit.Trainer(model=model, dataset=rows, reward=Recorder())
    with pytest.raises(TrainerError, match=r"dataset has no 'query' column \(its columns: \['question', 'answer'\]\)"):
        rlkit.Trainer(model=model, dataset=rows, reward=Recorder(), prompt_column="query")


@pytest.mark.parametrize("bad, message", [
    (["2+2="], "dataset row 0 is a str ('2+2='), not a dict"),
    ({"prompt": ["a", "b"], "answer": ["1", "2"]}, "dataset is a dict with keys ['prompt', 'answer'], not rows"),
    (42, "dataset=42 (int) is not a dataset; give rows (a list of dicts"),
])
def test_other_shapes_are_named(bad, message):
    with pytest.raises(TrainerError) as e:
        rows_of(bad, 8, 0)
    assert message in str(e.value)


def test_dataframe_and_list_of_dicts_as_before():
    assert rows_of(pd.DataFrame(ROWS), 8, 0)[1] == ROWS
    assert rows_of(iter(ROWS), 8, 0)[1] == ROWS


# ---- a hub name, offline --------------------------------------------------------------------------------
@pytest.mark.timeout(60)  # a generous bound: the answer comes at once, not after network retries
def test_hub_name_offline_fails_at_once_naming_the_local_file_alternative(monkeypatch, model):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TrainerError) as e:
        rlkit.Trainer(model=model, dataset="someorg/some-dataset", reward=Recorder())
    msg = str(e.value)
    assert "dataset='someorg/some-dataset' is not an existing file" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "pass the .jsonl/.parquet path" in msg


# ---- reasoning-gym -------------------------------------------------------------------------------------
SMALL_SPACE = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)  # ~8,000 distinct questions


def test_reasoning_gym_splits_do_not_share_a_question_where_nearby_seeds_would():
    # the package itself: item i of a dataset made with seed s is made from s + i, so seeds 0 and 1 overlap
    a = [e["question"] for e in reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=200)]
    b = [e["question"] for e in reasoning_gym.create_dataset("basic_arithmetic", seed=1, size=200)]
    assert a[1:] == b[:-1]
    task = rlkit.tasks.reasoning_gym("basic_arithmetic", **SMALL_SPACE)
    for train_seed, test_seed in ((0, 1), (0, 0), (3, 4)):
        train = set(task.dataset(n=1000, seed=train_seed, split="train").column("question"))
        test = set(task.dataset(n=200, seed=test_seed, split="test").column("question"))
        assert len(train) > 300 and len(test) > 50 and not train & test
    assert task.dataset(n=50, seed=0) == task.dataset(n=50, seed=0) != task.dataset(n=50, seed=1)


def test_reasoning_gym_reward_is_the_packages_verifier():
    task = rlkit.tasks.reasoning_gym("basic_arithmetic", **SMALL_SPACE)
    rows = task.dataset(n=4, seed=0)
    verifier = reasoning_gym.create_dataset("basic_arithmetic", **SMALL_SPACE)
    completions = [rows[0]["answer"], f"work <answer>{rows[1]['answer']}</answer>", "", "7 and 9"]
    columns = {c: rows.column(c) for c in ("question", "answer", "metadata")}
    got = task.reward(rows.column("prompt"), completions, **columns)
    assert got[:3] == [1.0, 1.0, 0.0]
    assert got[3] == verifier.score_answer("7 and 9", dict(rows[3]))
    with pytest.raises(TypeError, match="needs the 'metadata' column"):
        task.reward(rows.column("prompt"), completions, question=columns["question"], answer=columns["answer"])


def test_reasoning_gym_bad_settings_are_named():
    with pytest.raises(TrainerError, match="no task 'basic_arithmetc' \\(did you mean 'basic_arithmetic'\\?\\)"):
        rlkit.tasks.reasoning_gym("basic_arithmetc")
    with pytest.raises(TrainerError, match="refuses config \\{'max_digit': 2\\}.*its options: \\['min_terms'"):
        rlkit.tasks.reasoning_gym("basic_arithmetic", max_digit=2)
    with pytest.raises(TrainerError, match="seed= is chosen per split by the task"):
        rlkit.tasks.reasoning_gym("basic_arithmetic", seed=3)
    chat = rlkit.tasks.reasoning_gym("chain_sum", chat=True, system="Just the number.")
    assert chat.dataset(n=1, seed=0)[0]["prompt"][0] == {"role": "system", "content": "Just the number."}


def test_trainer_on_a_reasoning_gym_task_trains_and_evaluates_on_held_out_questions(model, tmp_path):
    task = rlkit.tasks.reasoning_gym("basic_arithmetic", **SMALL_SPACE)
    reward = Recorder()

    def verifier(prompts, completions, **columns):  # the task's reward, with what it was called on kept
        reward(prompts, completions, **columns)
        return task.reward(prompts, completions, **columns)

    with small_trainer(model, task, tmp_path, reward=verifier, train_size=200) as trainer:
        assert trainer.task is task and len(trainer.rows) == 200
        metrics = trainer.fit(steps=2, view="none")
        assert list(metrics["step"]) == [1, 2]
        assert all(0.0 <= r <= 1.0 for r in metrics["reward/mean"])
        result = trainer.evaluate(n=16)
    assert result["n"] == 16 and 0.0 <= result["reward"] <= 1.0
    train = {r["question"] for r in trainer.rows}
    trained_on = {q for _, c in reward.calls[:2] for q in c["question"]}
    held_out = set(reward.calls[2][1]["question"])
    assert trained_on <= train and len(held_out) >= 8 and not held_out & train
