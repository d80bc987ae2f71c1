"""Chat prompts: the chat arithmetic task, and the Trainer rendering TRL-style conversational prompts with
the model's own chat template (real tokenizers: the tiny one and SmolLM2-135M-Instruct's)."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

import rlkit
from rlkit.inputs import render_chats
from rlkit.models import tiny_lm
from rlkit.tasks import ChatArithmetic, last_number
from rlkit.trainer import TrainerError


def test_chat_rows_are_messages_split_by_question_and_deterministic():
    task = ChatArithmetic(digits=2)
    train, test = task(n=300, seed=0), task(n=100, seed=5, split="test")
    assert train == task(n=300, seed=0) and train != task(n=300, seed=1)
    for row in train[:20]:
        assert row["prompt"] == [{"role": "user", "content": row["question"]}]
        assert row["question"] == f"What is {row['a']} + {row['b']}? Answer with just the number."
        assert int(row["answer"]) == row["a"] + row["b"]
    # held-out questions never appear in training, whatever the seeds
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    system = ChatArithmetic(system="Be brief.")(n=1, seed=0)[0]["prompt"]
    assert system[0] == {"role": "system", "content": "Be brief."} and system[1]["role"] == "user"


def test_chat_reward_checks_answer_and_format():
    task = ChatArithmetic()
    completions = ["42", "  42 <|im_end|>", "42.", "17 + 25 = 42", "The sum is 42.<|im_end|>extra 7",
                   "41", "-42", "17 + 25 = 43", "", None, "seventeen"]
    assert task.reward(None, completions, answer=["42"] * len(completions)) == \
        [1.0, 1.0, 0.6, 0.6, 0.6, 0.4, 0.4, 0.0, 0.0, 0.0, 0.0]
    # partial credit reads the last number too: "17 + 25 = 41" is close, not "17"
    partial = task.partial_reward(None, ["17 + 25 = 41", "17"], answer=[42, 42])
    assert round(partial[0], 3) == 0.691 and partial[1] < partial[0]  # as Arithmetic scores "41"
    assert last_number("1, 2, 3") == 3 and last_number("") is None


def _tiny_tokenizer():
    return AutoTokenizer.from_pretrained(tiny_lm("qwen2", size="test"))


def test_render_uses_the_models_template_and_opens_the_assistant_turn():
    tok = _tiny_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "answer": "3"}, {"prompt": "1+2=", "answer": "3"}]
    out = render_chats(rows, tok, "tiny")
    assert out[0]["prompt"] == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert out[1] == rows[1] and out[0]["answer"] == "3"
    assert rows[0]["prompt"][0]["role"] == "user"  # the caller's rows are not changed


def test_render_keeps_one_bos_when_the_tokenizer_adds_its_own():
    from tokenizers.processors import TemplateProcessing

    tok = _tiny_tokenizer()
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # this tokenizer adds BOS by itself
    text = render_chats([{"prompt": [{"role": "user", "content": "hi"}]}], tok, "tiny")[0]["prompt"]
    ids = tok(text)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_smollm2_chat_prompt_renders_with_its_system_prompt():
    """The real model's template adds its default system prompt; digits are single tokens."""
    tok = AutoTokenizer.from_pretrained(rlkit.models.pretrained("smollm2-135m-instruct"))
    row = ChatArithmetic()(n=1, seed=0)[0]
    text = render_chats([row], tok, "smollm2")[0]["prompt"]
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n")
    assert tok(text)["input_ids"].count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert len(tok("12345")["input_ids"]) == 5


def test_chat_prompts_without_a_chat_template_fail_before_any_worker(tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_lm("qwen2", size="test"), folder)
    (folder / "chat_template.jinja").unlink()
    assert not AutoTokenizer.from_pretrained(folder).chat_template
    before = rlkit.Cluster.current()
    with pytest.raises(TrainerError, match="prompts are chats .* has no chat template; give text prompts"):
        rlkit.Trainer(model=str(folder), dataset=ChatArithmetic())
    assert rlkit.Cluster.current() is before
    with pytest.raises(TrainerError, match="dataset row 1 has no 'prompt': a non-empty string, or a chat"):
        rlkit.Trainer(model=str(folder), dataset=[{"prompt": "1+1="}, {"prompt": [{"role": "user"}]}],
                      reward=lambda p, c, **k: [0.0] * len(p))
