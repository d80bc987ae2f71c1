"""Rollout engines on a real tiny Qwen2: shapes, end handling, log-probs vs a forward pass, weight sync.

The reference for every log-prob is an unpadded fp32 forward of prompt + response through a plain
transformers model at the same temperature (rlkit's convention). The vLLM engine's tests are in
test_vllm.py (they run in the vLLM venv that `make test` builds).
"""


import pytest
import torch
from _logprob_ref import forward_logprobs, max_masked_diff

from rlkit.models import load, tiny_lm
from rlkit.rollout import HFEngine, PromptTooLongError, Rollout, RolloutError, make_engine, vllm_available

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["the quick brown fox", "12+7=", "what is the answer ? the answer is"]
TOL = 1e-4  # fp32 log-prob agreement with a forward pass



@pytest.fixture(scope="module")
def path():
    return tiny_lm("qwen2", size="test")


@pytest.fixture(scope="module")
def model_tok(path):
    model, tok = load(path)
    return model.eval(), tok


# ---- config -----------------------------------------------------------------------------------------

def test_config_errors_name_value_and_fix():
    with pytest.raises(RolloutError, match=r"engine='sglang'.*choose one of"):
        Rollout(engine="sglang")
    with pytest.raises(RolloutError, match=r"n=0 must be a positive integer"):
        Rollout(n=0)
    with pytest.raises(RolloutError, match=r"top_p=0"):
        Rollout(top_p=0)
    with pytest.raises(RolloutError, match=r"on_long_prompt='truncate'"):
        Rollout(on_long_prompt="truncate")
    with pytest.raises(RolloutError, match=r"\['dtype'\].*per-call options"):
        Rollout().with_overrides(dtype="float16")
    assert Rollout(stop="\n").stop == ("\n",)  # a single string is one stop string, not characters


# ---- HF engine --------------------------------------------------------------------------------------

def test_hf_n_samples_shapes_and_masks(model_tok):
    model, tok = model_tok
    eng = HFEngine(model, tok, n=3, max_new_tokens=6, seed=0)
    b = eng.generate(PROMPTS)
    lens = [len(tok(p)["input_ids"]) for p in PROMPTS]
    assert b.num_samples == 9 and b.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert b.prompt_ids.shape == (9, max(lens)) and b.response_ids.shape[1] <= 6
    for i in range(9):  # left-padded prompts are exactly the tokenized prompt of their group
        p = int(b.prompt_index[i])
        assert b.prompt_mask[i].sum() == lens[p]
        assert b.prompt_ids[i][b.prompt_mask[i].bool()].tolist() == tok(PROMPTS[p])["input_ids"]
    # the response mask is a prefix of ones; log-probs are <= 0 inside and exactly 0 outside it
    n = b.response_lengths
    assert torch.equal(b.response_mask, (torch.arange(b.response_ids.shape[1]) < n[:, None]).long())
    assert (b.response_logprobs[b.response_mask.bool()] <= 0).all()
    assert (b.response_logprobs[~b.response_mask.bool()] == 0).all()
    assert b.texts == tok.batch_decode([r[:k] for r, k in zip(b.response_ids.tolist(), n.tolist())],
                                       skip_special_tokens=True)
    # samples of one prompt differ (sampling, not n copies of one sequence)
    assert len({tuple(r) for r in b.response_ids[:3].tolist()}) > 1
    assert b.input_ids.shape == b.attention_mask.shape == (9, b.prompt_ids.shape[1] + b.response_ids.shape[1])
    assert b.tokens_per_s > 0 and b.timings["generate"] > 0
    chunked = HFEngine(model, tok, n=3, max_new_tokens=6, hf_batch_size=2).generate(PROMPTS)
    assert chunked.prompt_index.tolist() == b.prompt_index.tolist()  # 2 generate calls, same layout
    assert max_masked_diff(chunked.response_logprobs, forward_logprobs(model, chunked, 1.0),
                           chunked.response_mask) < TOL


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (0.7, 20), (0.0, 0)])
def test_hf_logprobs_equal_forward(model_tok, temperature, top_k):
    """Generate's log-probs == forward at the same temperature (top-k changes what is drawn, not the
    log-prob convention); greedy picks the forward's argmax."""
    model, tok = model_tok
    eng = HFEngine(model, tok, n=2, max_new_tokens=12, temperature=temperature, top_k=top_k, seed=1)
    b = eng.generate(PROMPTS)
    ref = forward_logprobs(model, b, temperature)
    assert max_masked_diff(b.response_logprobs, ref, b.response_mask) < TOL
    if top_k:  # every drawn token is in the forward's top-k
        with torch.no_grad():
            prompt = b.prompt_ids[0][b.prompt_mask[0].bool()]
            logits = model(torch.cat([prompt, b.response_ids[0]])[None]).logits[0, len(prompt) - 1:-1]
        ranks = (logits > logits.gather(1, b.response_ids[0][:, None])).sum(-1)
        assert (ranks[: int(b.response_lengths[0])] < top_k).all()
    if temperature == 0:
        assert torch.equal(b.response_ids[0], b.response_ids[1])  # greedy: the n samples coincide


@pytest.mark.parametrize("hf_decode,temperature", [("auto", 1.0), ("generate", 1.0), ("auto", 0.0)])
def test_a_script_emits_its_tokens_and_the_model_scores_them(model_tok, hf_decode, temperature):
    """``Rollout(script=...)``: a prompt a rule matches gets the rule's response tokens (a group filled in from
    the match), then sampling goes on after them; other prompts are sampled as without a script, and every
    log-prob, scripted or drawn, is the model's own (a forward at the same temperature)."""
    model, tok = model_tok
    script = ((r"(\d+)\+(\d+)=", r"\2+\1="), (r"brown fox", "jumps"))
    opts = dict(n=2, max_new_tokens=10, temperature=temperature, seed=3, hf_decode=hf_decode)
    b = HFEngine(model, tok, script=script, **opts).generate(PROMPTS)
    plain = HFEngine(model, tok, **opts).generate(PROMPTS)
    assert max_masked_diff(b.response_logprobs, forward_logprobs(model, b, temperature), b.response_mask) < TOL
    for i, p in enumerate(b.prompt_index.tolist()):
        forced = tok.encode({0: "jumps", 1: "7+12="}.get(p, ""), add_special_tokens=False)
        got = b.response_ids[i, :int(b.response_lengths[i])].tolist()
        assert got[:len(forced)] == forced, (p, got)
        if p == 2:  # no rule matches its end: drawn exactly as without the script
            assert got == plain.response_ids[i, :int(plain.response_lengths[i])].tolist()
        else:
            assert len(got) > len(forced) or b.finish_reason[i] == "stop"  # sampling went on after the script


def test_a_script_is_checked_and_runs_on_the_hf_engine_only():
    with pytest.raises(RolloutError, match=r"script rule 0: pattern '\(' is not a regular expression"):
        Rollout(engine="hf", script=(("(", "x"),))
    with pytest.raises(RolloutError, match=r"must be a \(pattern, response\) pair"):
        Rollout(engine="hf", script=(("a",),))
    with pytest.raises(RolloutError, match=r"runs on the HF engine.*engine='hf'"):
        Rollout(engine="vllm", script=(("a", "b"),))
    assert Rollout(engine="hf", script=[["a", "b"]]).script == (("a", "b"),)  # as read back from trainer.json


def test_hf_end_tokens_stop_the_response(model_tok):
    """Replaying a seed with an extra end token: each sample is cut right after its first occurrence."""
    model, tok = model_tok
    eng = HFEngine(model, tok, n=4, max_new_tokens=16, ignore_eos=True)
    free = eng.generate(PROMPTS, seed=5)
    assert (free.response_lengths == 16).all() and set(free.finish_reason) == {"length"}
    end = int(free.response_ids[0, 4])  # a token sample 0 draws at step 5
    cut = eng.generate(PROMPTS, seed=5, stop_token_ids=[end])
    stopped = 0
    for i, row in enumerate(free.response_ids.tolist()):
        k = row.index(end) + 1 if end in row else 16
        assert cut.response_lengths[i] == k
        assert cut.response_ids[i, :k].tolist() == row[:k]
        assert cut.finish_reason[i] == ("stop" if end in row else "length")
        assert torch.allclose(cut.response_logprobs[i, :k], free.response_logprobs[i, :k], atol=1e-6)
        assert (cut.response_mask[i, k:] == 0).all()
        stopped += end in row
    assert stopped >= 1 and cut.response_lengths[0] == 5


def test_hf_model_eos_ends_response_unless_ignore_eos(model_tok):
    """The model's own eos (from generation_config) ends a row; ignore_eos really ignores it, also in a
    batch where other rows keep going (no pad tokens counted as response)."""
    model, tok = model_tok
    greedy = dict(temperature=0.0, max_new_tokens=8)
    free = HFEngine(model, tok, ignore_eos=True, **greedy).generate(PROMPTS)
    eos = int(free.response_ids[0, 1])  # what prompt 0 greedily emits second
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        eng = HFEngine(model, tok, **greedy)
        assert eng.eos_ids == [eos]
        b = eng.generate(PROMPTS)
        ignored = eng.generate(PROMPTS, ignore_eos=True)
    finally:
        model.generation_config.eos_token_id = saved
    assert b.response_lengths[0] == 2 and b.finish_reason[0] == "stop"
    assert torch.equal(ignored.response_ids, free.response_ids) and (ignored.response_lengths == 8).all()


def test_hf_stop_strings_match_response_only(model_tok):
    model, tok = model_tok
    eng = HFEngine(model, tok, n=4, max_new_tokens=16)
    b = eng.generate(PROMPTS, seed=2, stop=["e"])
    assert "stop" in b.finish_reason
    for i in range(b.num_samples):
        toks = b.response_ids[i, : int(b.response_lengths[i])].tolist()
        if b.finish_reason[i] == "stop":  # the stop string ends the response and is kept in it
            assert "e" in tok.decode(toks, skip_special_tokens=True)
            assert "e" not in tok.decode(toks[:-1], skip_special_tokens=True)
        else:
            assert len(toks) == 16 and "e" not in b.texts[i]


def test_hf_seed_determinism(path, model_tok):
    model, tok = model_tok
    a = HFEngine(model, tok, n=2, max_new_tokens=8, seed=7)
    b = HFEngine(model, tok, n=2, max_new_tokens=8, seed=7)
    a1, a2, b1 = a.generate(PROMPTS), a.generate(PROMPTS), b.generate(PROMPTS)
    assert torch.equal(a1.response_ids, b1.response_ids)  # same seed, same call -> same samples
    assert torch.equal(a1.response_logprobs, b1.response_logprobs)
    assert not torch.equal(a1.response_ids, a2.response_ids)  # the next call draws fresh samples
    assert torch.equal(a.generate(PROMPTS, seed=3).response_ids, b.generate(PROMPTS, seed=3).response_ids)
    state = torch.random.get_rng_state()
    a.generate(PROMPTS)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is left alone


def test_hf_load_weights_changes_generation(path):
    model, tok = load(path)  # own copy: this test changes its weights
    trainer, _ = load(path)
    eng = HFEngine(model, tok, n=2, max_new_tokens=10, temperature=0.8, ignore_eos=True)
    before = eng.generate(PROMPTS, seed=4)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stats = eng.load_weights(trainer.named_parameters())
    assert stats["tensors"] == len(list(trainer.parameters()))
    assert stats["bytes"] == sum(p.numel() * 4 for p in trainer.parameters())
    after = eng.generate(PROMPTS, seed=4)
    assert max_masked_diff(after.response_logprobs, forward_logprobs(trainer, after, 0.8), after.response_mask) < TOL
    # the same seed now draws from the new weights: log-probs of the old samples moved
    old_under_new = forward_logprobs(trainer, before, 0.8)
    assert max_masked_diff(before.response_logprobs, old_under_new, before.response_mask) > 1e-2
    with pytest.raises(RolloutError, match=r"'model.nope.weight'.*does not have"):
        eng.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(RolloutError, match=r"lm_head.weight.*shape \(3,\)"):
        eng.load_weights({"lm_head.weight": torch.zeros(3)})


def test_prompt_limits_error_or_skip(model_tok):
    model, tok = model_tok
    long = "the quick brown fox jumps over the lazy dog " * 4
    n_long = len(tok(long)["input_ids"])
    eng = HFEngine(model, tok, n=2, max_new_tokens=4, max_prompt_len=12)
    with pytest.raises(PromptTooLongError, match=rf"prompt 1 has {n_long} tokens but at most 12.*max_prompt_len=12") as e:
        eng.generate(["1+1=", long, "2+2="])
    assert (e.value.index, e.value.length, e.value.limit) == (1, n_long, 12)
    skip = HFEngine(model, tok, n=2, max_new_tokens=4, max_prompt_len=12, on_long_prompt="skip")
    b = skip.generate(["1+1=", long, "2+2="])
    assert b.skipped == [(1, n_long)] and b.prompt_index.tolist() == [0, 0, 2, 2]
    assert skip.generate([long]).num_samples == 0
    # no max_prompt_len: the model context (512) minus max_new_tokens is the limit
    ctx = HFEngine(model, tok, max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match=r"prompt 0 has 20 tokens.*context 512 - max_new_tokens 500"):
        ctx.generate([[5] * 20], max_new_tokens=500)
    with pytest.raises(RolloutError, match=r"prompt 1 is empty"):
        ctx.generate([[5, 6], []])
    with pytest.raises(RolloutError, match=r"prompt 1 is str"):
        ctx.generate([[5, 6], "text"])


def test_make_engine_hf_and_token_prompts(path, model_tok):
    eng = make_engine(Rollout(engine="hf", n=2, max_new_tokens=5, seed=0), path)
    assert type(eng).__name__ == "HFEngine"
    ids = [model_tok[1](p)["input_ids"] for p in PROMPTS]
    # token-id prompts and text prompts are the same request
    assert torch.equal(eng.generate(ids, seed=1).response_ids, eng.generate(PROMPTS, seed=1).response_ids)
    if not vllm_available():
        with pytest.raises(RolloutError, match=r"vllm is not installed.*engine='hf'"):
            make_engine(Rollout(engine="vllm"), path)
