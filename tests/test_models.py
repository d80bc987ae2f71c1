"""Tiny models: built locally, loaded back through from_pretrained like a hub checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkit.models import build_tokenizer, tiny_lm


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_roundtrip_from_pretrained(arch):
    path = tiny_lm(arch, size="test", seed=3)
    assert tiny_lm(arch, size="test", seed=3) == path  # cached
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 300_000
    ids = tok(["12+7=19"], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_deterministic_for_a_seed(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(tiny_lm("llama", size="test", seed=1, path=tmp_path / "a"))
    b = AutoModelForCausalLM.from_pretrained(tiny_lm("llama", size="test", seed=1, path=tmp_path / "b"))
    c = AutoModelForCausalLM.from_pretrained(tiny_lm("llama", size="test", seed=2, path=tmp_path / "c"))
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tokenizer_arithmetic_exact():
    tok = AutoTokenizer.from_pretrained(tiny_lm("qwen2", size="test"))
    for text in ["17+25=42", "999*999=998001", "Q: what is 3-8? A: -5.", "Hello, World! (a/b)"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    # digits are single tokens, so the model sees the number's digits
    assert tok.convert_ids_to_tokens(tok("1234")["input_ids"]) == ["1", "2", "3", "4"]
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|endoftext|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_deterministic():
    assert build_tokenizer().get_vocab() == build_tokenizer().get_vocab()


def test_sizes():
    from rlkit.models import tiny_config

    cfg = tiny_config("qwen2", "10m")
    from rlkit.plan import ModelSpec

    assert 8e6 < ModelSpec.from_config(cfg).num_params < 2e7
    with pytest.raises(ValueError, match="arch='gpt2' is not a tiny architecture"):
        tiny_config("gpt2")
