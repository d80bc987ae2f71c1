"""RewardModel: batched scores equal a plain HF forward of each text alone, on a real tiny model."""


import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import rlkit
from rlkit.models import tiny_config
from rlkit.rewards import RewardFunctions, RewardModel, tiny_reward_model

# different lengths, so batches of these need padding
PROMPTS = ["aaa", "12+30=", "bbb", "what is the answer ?", "c", "the quick brown fox"]
COMPLETIONS = ["aaaa", "42", "b", " the answer is 7 7 7 7 7", "ccccccccccccc", " jumps over the lazy dog"]
TOL = 1e-6


@pytest.fixture(scope="module")
def path():
    return tiny_reward_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def rm(path):
    return RewardModel(path, batch_size=4)


def manual(model, tok, text, max_length=None):
    """The reference: one unpadded forward of one text; the logit is the reward."""
    ids = tok(text, return_tensors="pt").input_ids[:, :max_length]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_tiny_reward_model_is_a_cached_one_logit_classifier(path, hf):
    assert tiny_reward_model("qwen2", seed=0) == path
    model, tok = hf
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.config.num_labels == 1 and model.score.out_features == 1
    assert model.config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<pad>")
    # same tokenizer as the policy's tiny_lm: the reward model reads the policy's tokens
    assert tok("17+25=42 aaaa")["input_ids"] == rlkit.models.build_tokenizer()("17+25=42 aaaa")["input_ids"]


def test_batched_scores_equal_one_by_one_forward(rm, hf):
    model, tok = hf
    want = [manual(model, tok, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert max(want) - min(want) > 1e-3  # random init still gives different texts different rewards
    for batch_size in (1, 4, 32):  # 4: two padded batches; 32: one
        rm.batch_size = batch_size
        got = rm(PROMPTS, COMPLETIONS)
        assert got == pytest.approx(want, abs=TOL), batch_size
    rm.batch_size = 4


def test_deterministic(path, rm):
    first = rm(PROMPTS, COMPLETIONS)
    assert rm(PROMPTS, COMPLETIONS) == first
    assert RewardModel(path, batch_size=3)(PROMPTS, COMPLETIONS) == pytest.approx(first, abs=TOL)
    # a batch's other members do not change a text's score
    assert rm(PROMPTS[:1], COMPLETIONS[:1])[0] == pytest.approx(first[0], abs=TOL)


def test_odd_completions_are_scored_not_raised(rm, hf):
    model, tok = hf
    odd = [None, "", "<|endoftext|>junk after eos", [{"role": "assistant", "content": "aaaa"}], [], 123]
    got = rm(["aaa"] * len(odd), odd, letter=["a"] * len(odd))  # extra columns are ignored
    assert len(got) == len(odd) and all(isinstance(x, float) and x == x for x in got)
    empty = manual(model, tok, "aaa")
    assert got[0] == pytest.approx(empty, abs=TOL)          # None -> ""
    assert got[1] == pytest.approx(empty, abs=TOL)          # ""
    assert got[2] == pytest.approx(empty, abs=TOL)          # cut at eos
    assert got[3] == pytest.approx(manual(model, tok, "aaaaaaa"), abs=TOL)  # conversational: last message
    assert got[4] == pytest.approx(empty, abs=TOL)          # empty conversation
    assert got[5] == pytest.approx(manual(model, tok, "aaa123"), abs=TOL)
    # a text with no tokens at all is scored as one eos token
    assert rm([""], [None])[0] == pytest.approx(manual(model, tok, "<|endoftext|>"), abs=TOL)
    assert rm([], []) == []


def test_right_truncation_and_normalize(path, hf):
    model, tok = hf
    text = PROMPTS[3] + COMPLETIONS[3]
    assert len(tok(text).input_ids) > 6
    short = RewardModel(path, max_length=6)([PROMPTS[3]], [COMPLETIONS[3]])[0]
    assert short == pytest.approx(manual(model, tok, text, max_length=6), abs=TOL)   # the first 6 tokens
    assert abs(short - manual(model, tok, text)) > 1e-4
    raw = manual(model, tok, "aaaaaaa")
    assert RewardModel(path, normalize=(0.5, 2.0))(["aaa"], ["aaaa"])[0] == pytest.approx((raw - 0.5) / 2, abs=TOL)


def test_model_object_and_tokenizer_without_pad(path):
    """A loaded model with no pad_token_id and a tokenizer with no pad token: eos becomes pad."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    model.config.pad_token_id = None
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = None
    rm = RewardModel(model, tok, batch_size=8)
    assert tok.pad_token == "<|endoftext|>" and model.config.pad_token_id == tok.eos_token_id
    got = rm(PROMPTS, COMPLETIONS)
    want = [manual(model, tok, p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(want, abs=TOL)


def test_template(path, rm, hf):
    model, tok = hf
    got = RewardModel(path, template="Q: {prompt}\nA: {completion}")(["aaa"], ["aaaa"])[0]
    assert got == pytest.approx(manual(model, tok, "Q: aaa\nA: aaaa"), abs=TOL)


def test_bad_inputs_name_the_value(path, rm):
    with pytest.raises(ValueError, match=r"num_labels=2"):
        RewardModel(AutoModelForSequenceClassification.from_config(tiny_config(num_labels=2)),
                    AutoTokenizer.from_pretrained(path))
    with pytest.raises(ValueError, match=r"normalize=\(0.0, 0.0\)"):
        RewardModel(path, normalize=(0.0, 0.0))
    with pytest.raises(ValueError, match="batch_size=0"):
        RewardModel(path, batch_size=0)
    with pytest.raises(ValueError, match="2 prompts and 1 completions"):
        rm(["a", "b"], ["c"])


def test_trainer_style_weighted_sum(rm):
    """As the Trainer's reward step scores a list of (f, weight): 0.5 * reward model + 1.0 * the repeat task."""
    fns = RewardFunctions.of([(rm, 0.5), (rlkit.tasks.repeat.reward, 1.0)], task=None)
    prompts, completions = ["aaa", "bbb", "ccc"], ["aaaaaaaa", "bb<|endoftext|>", None]
    total = fns.score({"prompt": prompts, "letter": ["a", "b", "c"]}, completions)
    rm_scores = rm(prompts, completions)
    task_scores = rlkit.tasks.repeat.reward(prompts, completions, letter=["a", "b", "c"])
    assert task_scores == [0.5, 0.125, 0.0]
    want = torch.tensor([0.5 * r + t for r, t in zip(rm_scores, task_scores)])
    assert total.dtype == torch.float32 and torch.allclose(total, want, atol=TOL, rtol=0)
