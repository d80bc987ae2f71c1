"""Multi-turn episodes with tools and environments (rlkit.agent), end to end on tiny models.

No test here depends on what a model happens to sample. The model is a random-init tiny Qwen2, and the turns
that must call a tool are scripted (``Rollout(script=...)``): the real HF engine emits the call the test wrote,
scores it with the model (its log-probs are the model's own), and samples the turns no rule covers. Tools,
template glue, masks, log-probs and the update then run for real on turns the test chose.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from _countdown import Countdown
from _logprob_ref import layout_logprobs

import rlkit
from rlkit.agent import ChatFormat, MultiTurn, as_tools, parse_tool_calls, run_tool_calls
from rlkit.errors import TrainerError
from rlkit.models import load, tiny_lm
from rlkit.tasks.calc import TINY_TOOL_PROMPT, Calculator, calculator, calculator_script, tool_call_text

TASK = Calculator(digits=(2, 1))
TOL = 1e-4  # fp32 engine log-probs against a training forward (as single-turn, tests/test_trainer.py)
ASSISTANT = r"<\|im_start\|>assistant\n"  # the end of every context the engine is asked to continue
CALL = calculator_script()  # turn 1 after the question: the calculator call; later turns are sampled
ANSWER = calculator_script(answer=True)  # ... and after the tool's reply, the answer: the episode ends "stop"


def _rollout(script=CALL, **kw) -> rlkit.Rollout:
    return rlkit.Rollout(**{**dict(engine="hf", n=2, max_new_tokens=96, script=script), **kw})


@pytest.fixture(scope="module")
def tool_model() -> str:
    return tiny_lm("qwen2", size="small", max_position_embeddings=1024)


def _trainer(path, tmp_path, name, tools=(calculator,), **kw):
    opts = dict(model=path, dataset=TASK, tools=list(tools), algorithm="grpo",
                multi_turn=MultiTurn(max_turns=3, max_tokens=240, tool_prompt=TINY_TOOL_PROMPT, tool_timeout_s=2.0),
                rollout=_rollout(), prompts_per_step=4, lr=1e-3,
                kl_coef=0.01, entropy_coef=0.01, run_dir=str(tmp_path / name), seed=3)
    return rlkit.Trainer(**{**opts, **kw})


# ---- tools: every failure is a message and a count, never a crash ------------------------------------------
def test_every_kind_of_tool_failure_is_a_message_to_the_model_and_counted():
    def boom(x: str) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise ValueError("no " + x)

    def number(x: str) -> str:
        """Return a number, not text.

        Args:
            x: anything
        """
        return 7  # type: ignore[return-value]

    def hang(x: str) -> str:
        """Never return in time.

        Args:
            x: anything
        """
        time.sleep(30)
        return x

    def huge(x: str) -> str:
        """Return a lot.

        Args:
            x: anything
        """
        return x * 10_000

    tools = as_tools([boom, number, hang, huge, calculator])
    text = "".join(f'<tool_call>{json.dumps({"name": n, "arguments": {"x": "ab"}})}</tool_call>'
                   for n in ("boom", "number", "hang", "huge"))
    text += '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>'   # wrong type
    text += '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>'     # wrong name
    text += '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'                          # unknown tool
    text += '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'   # bad JSON
    text += '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'  # fine
    text += '<tool_call>{"name": "calculator"'                                                   # never closed
    calls = parse_tool_calls(text)
    t0 = time.monotonic()
    results = run_tool_calls(calls, tools, timeout_s=0.5, max_chars=100)
    assert time.monotonic() - t0 < 25  # the hung tool was not waited for (bound against a hang, not a speed)
    kinds = [r.error for r in results]
    assert kinds == ["raised", "not_string", "timeout", "truncated", "bad_arguments", "bad_arguments",
                     "unknown_tool", "bad_json", None, "bad_json"], kinds
    assert results[0].content == "Error: boom raised ValueError: no ab"
    assert results[3].content.startswith("ab" * 50) and "[truncated: 20000 characters]" in results[3].content
    assert "must be a string" in results[4].content and "missing ['expression']" in results[5].content
    assert results[8].content == "42"


def test_bad_tool_or_environment_configuration_fails_in_the_driver(tmp_path):
    def no_hints(expression):
        """Evaluate.

        Args:
            expression: what
        """
        return expression

    def no_doc(expression: str) -> str:
        return expression

    class NoStep:
        def reset(self, row):
            return [{"role": "user", "content": "hi"}]

    base = tiny_lm("qwen2", size="test", max_position_embeddings=1024)
    cases = [
        (dict(tools=[no_hints]), r"tool 'no_hints' cannot be described.*type hint on every argument"),
        (dict(tools=[no_doc]), r"tool 'no_doc' cannot be described.*docstring"),
        (dict(tools=[calculator, calculator]), r"two tools are named 'calculator'"),
        (dict(tools=calculator), r"must be a list of functions; wrap a single tool: tools=\[calculator\]"),
        (dict(environment=NoStep), r"environment NoStep has no step\(\)"),
        (dict(environment=NoStep()), r"must be a class or factory"),
        (dict(tools=[calculator], multi_turn=MultiTurn(max_turns=2), max_turns=3), r"disagree"),
    ]
    for kw, message in cases:
        with pytest.raises(TrainerError, match=message):
            rlkit.Trainer(model=base, dataset=TASK, run_dir=str(tmp_path / "r"), **kw)
    with pytest.raises(TrainerError, match=r"max_turns=0 must be"):
        MultiTurn(max_turns=0)


def test_the_glue_is_the_templates_own_rendering_of_the_conversation():
    """Prompt + the model's turn + glue, as text, is exactly apply_chat_template of the whole conversation,
    for a template without tool syntax (rlkit's tool prompt) and for one that renders tools itself."""
    from rlkit.rollout.base import load_tokenizer

    tok = load_tokenizer(tiny_lm("qwen2", size="test"))
    native = ("{% if tools %}<|im_start|>system\nTOOLS {{ tools | length }}<|im_end|>\n{% endif %}"
              "{% for m in messages %}<|im_start|>{% if m.role == 'tool' %}user\n<tool_response>{{ m.content }}"
              "</tool_response>{% else %}{{ m.role }}\n{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tools = as_tools([calculator])
    user = [{"role": "user", "content": "What is 12 * 3?"}]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 3"}}\n</tool_call>'
    reply = [{"role": "tool", "name": "calculator", "content": "36"}]
    for template in (tok.chat_template, native):
        saved, tok.chat_template = tok.chat_template, template
        try:
            fmt = ChatFormat(tok, tools)
            assert fmt.native == (template is native)
            text = fmt.render_prompt(user) + call + "<|im_end|>" + fmt.glue_text(reply, ended_turn=True)
            whole = fmt.with_tools(user + [{"role": "assistant", "content": call}] + reply)
            kwargs = {"tools": [t.schema for t in tools]} if fmt.native else {}
            assert text == tok.apply_chat_template(whole, tokenize=False, add_generation_prompt=True, **kwargs)
            assert tok.decode([fmt.end_of_turn]) == "<|im_end|>"
        finally:
            tok.chat_template = saved


# ---- episodes on a model that calls the tool ----------------------------------------------------------------
def test_episodes_are_token_in_token_out_masked_and_score_like_a_forward(tool_model, tmp_path):
    tr = _trainer(tool_model, tmp_path, "one")
    try:
        batch = tr.generate()
        gen, P = batch.samples, tr.layout.prompt_len
        eps = gen["episode"]
        assert all(e["tool_calls"] == 1 and e["turns"] >= 2 for e in eps), eps  # turn 1 is the scripted call
        assert set(gen["finish_reason"]) <= {"stop", "length", "max_tokens"}, gen["finish_reason"]
        fmt = tr.agent.format(tr.tokenizer)
        tok = tr.tokenizer
        for i, conv in enumerate(gen["completion"]):
            row = batch.prompts[gen["uid"][i]]
            assert conv[0]["content"] == tool_call_text("calculator", {"expression": f"{row['a']} * {row['b']}"})
            assert conv[1] == {"role": "tool", "name": "calculator", "content": str(row["a"] * row["b"])}
            ids = gen["input_ids"][i, P:][gen["response_mask"][i].bool()].tolist()
            keep = gen["loss_mask"][i][gen["response_mask"][i].bool()].bool().tolist()
            # runs of sampled (1) and not sampled (0) tokens, in order
            runs, start = [], 0
            for j in range(1, len(ids) + 1):
                if j == len(ids) or keep[j] != keep[start]:
                    runs.append((keep[start], ids[start:j]))
                    start = j
            assistant = [m for m in conv if m["role"] == "assistant"]
            sampled = [r for k, r in runs if k]
            assert len(sampled) == len(assistant) == eps[i]["turns"]
            for r, m in zip(sampled, assistant):  # the model's own tokens, never re-encoded
                assert tok.decode(r, skip_special_tokens=True) == m["content"]
            masked = [r for k, r in runs if not k]
            tools = [m for m in conv if m["role"] == "tool"]
            assert len(masked) == len(tools)  # exactly one masked run per tool result: the template's glue
            for r, m, turn in zip(masked, tools, sampled):
                ended = turn[-1] == fmt.end_of_turn
                assert r == fmt.glue_ids([m], ended_turn=ended)
                assert m["content"] == calculator(json.loads(tok.decode(turn, skip_special_tokens=True)
                                                             .split("<tool_call>")[1].split("</tool_call>")[0])
                                                  ["arguments"]["expression"])
        # the engine's log-probs of the sampled tokens equal a training forward on the same ids
        model, _ = load(tool_model)
        ref = layout_logprobs(model, gen, P)
        mask = gen["loss_mask"].bool()
        assert (ref - gen["rollout_logprobs"])[mask].abs().max().item() < TOL
        actor = tr.workers.old_logprobs({k: gen[k] for k in ("input_ids", "attention_mask", "response_mask")})
        assert (actor - gen["rollout_logprobs"])[mask].abs().max().item() < TOL
        # and a step trains on it: the metrics count the episodes
        row = tr.update(tr.estimate(batch))
        assert row["episode/tool_calls"] == sum(e["tool_calls"] for e in eps) / len(eps)
        assert row["response_length/mean"] == gen["loss_mask"].sum(1).mean().item()
        s = tr.samples(last=1)
        assert s["completion"].str.contains(r"\[tool calculator\]").any()
        assert {"turns", "tool_calls", "tool_errors", "finish_reason"} <= set(s.columns)
        ev = tr.evaluate(n=8)
        assert ev["n"] == 8 and ev["episode/tool_calls"] > 0
    finally:
        tr.close()


def test_tool_tokens_carry_no_gradient_whatever_the_tool_said(tool_model, tmp_path):
    """The policy loss with KL and entropy, as the update computes it (rlkit.workers.rl.actor_loss), has zero
    gradient on every non-sampled position's log-prob and entropy, and changing the tool's output text changes
    neither those zeros nor the gradient on the model's tokens before it."""
    from rlkit.workers.rl import actor_loss

    tr = _trainer(tool_model, tmp_path, "grad")
    try:
        batch = tr.estimate(tr.generate())
        tensors, P = dict(batch.samples), tr.layout.prompt_len
        tensors["ref_logprobs"] = tensors["ref_logprobs"] - 0.1  # a KL that is not zero
        settings = tr.update_settings()
        model, _ = load(tool_model)

        def grads(input_ids):
            t = dict(tensors, input_ids=input_ids)
            logits = model(input_ids, attention_mask=t["attention_mask"]).logits.float()
            lp_all = torch.log_softmax(logits[:, :-1], -1).gather(2, input_ids[:, 1:, None])[..., 0]
            lp_all = torch.cat([torch.zeros(lp_all.shape[0], 1), lp_all], 1).detach().requires_grad_(True)
            ent = torch.rand_like(lp_all).requires_grad_(True)
            loss, _ = actor_loss(tr.layout, {"logprobs": lp_all, "entropy": ent}, t, settings)
            loss.backward()
            return lp_all.grad[:, P:], ent.grad[:, P:]

        glue = (tensors["response_mask"] - tensors["loss_mask"]).bool()
        assert glue.any()
        g_lp, g_ent = grads(tensors["input_ids"])
        assert (g_lp[glue] == 0).all() and (g_ent[glue] == 0).all()
        assert (g_lp[tensors["loss_mask"].bool()] != 0).any()
        # another tool output: every glue token replaced (e.g. a tool that printed something else)
        other = tensors["input_ids"].clone()
        other[:, P:][glue] = (other[:, P:][glue] + 7) % 500 + 4
        g2_lp, g2_ent = grads(other)
        assert (g2_lp[glue] == 0).all() and (g2_ent[glue] == 0).all()
        first_glue = torch.where(glue.any(1), glue.float().argmax(1), torch.full((glue.shape[0],), glue.shape[1]))
        before = torch.arange(glue.shape[1])[None] < first_glue[:, None]
        assert torch.equal(g_lp[before], g2_lp[before])  # the loss is a function of the sampled log-probs alone
    finally:
        tr.close()


def test_a_failing_or_hanging_tool_is_counted_and_the_run_goes_on(tool_model, tmp_path):
    def calculator(expression: str) -> str:  # the same name the script calls, but broken
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "12 * 3"
        """
        if "1" in expression:
            time.sleep(5)  # past the 2 s timeout
        raise RuntimeError("the calculator is broken")

    tr = _trainer(tool_model, tmp_path, "broken", tools=[calculator], rollout=_rollout(ANSWER))
    try:
        rows = tr.fit(steps=2, view="none")
        questions = [r for step in (0, 1) for r in tr._prompts_of(step)]
        hang = sum("1" in f"{r['a']} * {r['b']}" for r in questions) * tr.rollout.n  # the inputs decide each kind
        assert 0 < hang < len(questions) * tr.rollout.n, "the rows should give both kinds of failure"
        n = tr.rollout.n * tr.config.prompts_per_step
        assert rows["episode/tool_calls"].tolist() == [1.0, 1.0]  # every episode called once, per the script
        assert rows["episode/tool_errors"].tolist() == [1.0, 1.0]  # ... and every call failed
        assert rows["episode/errors/timeout"].sum() * n == pytest.approx(hang)
        assert rows["episode/errors/raised"].sum() * n == pytest.approx(2 * n - hang)
        assert rows["actor/loss"].notna().all()
        s = tr.samples(last=1)
        assert s["completion"].str.contains("Error: calculator raised RuntimeError: the calculator is broken").any()
    finally:
        tr.close()


def test_bounded_episodes_end_and_are_marked_truncated(tool_model, tmp_path):
    tr = _trainer(tool_model, tmp_path, "bounds", multi_turn=MultiTurn(max_turns=1, tool_prompt=TINY_TOOL_PROMPT))
    try:
        gen = tr.generate().samples
        # every episode calls the tool in its one allowed turn: it ends there, and the call is not run
        assert gen["finish_reason"] == ["max_turns"] * len(gen["episode"])
        assert all(e["turns"] == 1 and e["tool_calls"] == 1 for e in gen["episode"]), gen["episode"]
        assert all(len(c) == 1 and c[0]["role"] == "assistant" for c in gen["completion"])
    finally:
        tr.close()
    # a budget that holds the call and the tool's reply but not the answer: the episode ends, marked truncated
    tr = _trainer(tool_model, tmp_path, "full", rollout=_rollout(ANSWER))
    try:
        full = tr.generate().samples
    finally:
        tr.close()
    assert full["finish_reason"] == ["stop"] * len(full["episode"]), full["finish_reason"]
    lengths = full["response_mask"].sum(1)
    answer = [len(tr.tokenizer.encode(c[-1]["content"], add_special_tokens=False)) + 1 for c in full["completion"]]
    budget = int(min(lengths.tolist())) - 1
    assert budget > max(lengths.tolist()) - min(answer)  # the answer never fits, the call and reply always do
    tr = _trainer(tool_model, tmp_path, "short", rollout=_rollout(ANSWER),
                  multi_turn=MultiTurn(max_turns=3, max_tokens=budget, tool_prompt=TINY_TOOL_PROMPT))
    try:
        gen = tr.generate().samples
        assert gen["response_mask"].sum(1).max() <= budget
        assert gen["finish_reason"] == ["max_tokens"] * len(gen["episode"])
        assert all(e["truncated"] and e["tool_calls"] == 1 for e in gen["episode"]), gen["episode"]
    finally:
        tr.close()


def test_an_environment_steps_rewards_and_its_messages_are_masked(tmp_path):
    path = tiny_lm("qwen2", size="test", max_position_embeddings=1024)
    rows = [{"prompt": "unused", "start": s} for s in (2, 3, 2, 3)]
    # every assistant turn is a short scripted reply, so each episode runs until the environment ends it
    tr = rlkit.Trainer(model=path, dataset=rows, environment=Countdown, max_turns=4, algorithm="grpo",
                       rollout=_rollout(((ASSISTANT, "ok<|im_end|>"),), max_new_tokens=6), prompts_per_step=4,
                       lr=1e-3, run_dir=str(tmp_path / "env"))
    try:
        assert "count down from" in tr.rows[0]["prompt"] and "unused" not in tr.rows[0]["prompt"]
        batch = tr.generate()
        gen = batch.samples
        starts = gen["columns"]["start"]
        assert gen["finish_reason"] == ["done"] * len(starts)  # the environment ended each, after `start` turns
        for e, start, conv in zip(gen["episode"], starts, gen["completion"]):
            assert e["turns"] == start and e["env_reward"] == pytest.approx(0.25 * start)
            assert [m["content"] for m in conv if m["role"] == "user"] == [str(k) for k in range(start - 1, -1, -1)]
        assert batch.rewards.tolist() == [0.25 * s for s in starts]
        glue = (gen["response_mask"] - gen["loss_mask"]).bool()
        assert (glue.sum(1) > 0).all()
        row = tr.update(tr.estimate(batch))
        assert row["reward/mean"] == pytest.approx(batch.rewards.mean().item())
    finally:
        tr.close()


# ---- the layouts rlkit has: each against the one-rank run on the same seed -----------------------------------
def _expected(tr) -> dict:
    """Step 0's episodes as one lone HF engine samples them for the whole step (each prompt seeded by its place in
    the step): what every layout must produce."""
    from rlkit.rollout import HFEngine
    from rlkit.workers.layout import generate_batch

    engine = HFEngine(tr.model_path, config=tr.rollout)
    rows = tr._prompts_of(0)
    request = {"prompt": [p["prompt"] for p in rows], "uid": list(range(len(rows))), "row": [p["_row"] for p in rows]}
    return generate_batch(engine, tr.layout, request, tr.config.seed * 100_003, agent=tr.agent)


def _same_episodes(gen: dict, want: dict, name: str) -> None:
    assert torch.equal(gen["input_ids"], want["input_ids"]), name
    assert torch.equal(gen["loss_mask"], want["loss_mask"]), name
    assert gen["finish_reason"] == want["finish_reason"] and gen["episode"] == want["episode"], name
    assert (gen["rollout_logprobs"] - want["rollout_logprobs"]).abs().max().item() < TOL, name


@pytest.mark.parametrize("name", ["dp2", pytest.param("hybrid", marks=pytest.mark.slow), "split"])
def test_dp2_on_ray_the_generation_layout_and_split_placement_match_the_one_rank_run(tool_model, tmp_path, ray_cluster,
                                                                                    name):
    """Per-episode, per-turn seeds: dp=2 on Ray, the 3D-HybridEngine's generation layout (tp=2; make test-all:
    the multi-turn variant of test_hybrid_engine's) and split placement (the tools run on the rollout worker)
    sample the episodes a lone engine samples for their chunks, and an update on the same batch gives the
    one-rank update's loss and gradient norm."""
    import copy

    layouts = {"dp2": dict(plan=rlkit.ParallelPlan(dp=2), cluster=ray_cluster),
               "hybrid": dict(plan=rlkit.ParallelPlan(tp=2), cluster=ray_cluster, rollout=_rollout(tp=2)),
               "split": dict(placement="split", cluster=ray_cluster)}
    tr = _trainer(tool_model, tmp_path, name, kl_coef=0.0, entropy_coef=0.0, **layouts[name])
    try:
        batch = tr.generate()
        want = _expected(tr)
        assert all(e["tool_calls"] == 1 for e in want["episode"])
        _same_episodes(batch.samples, want, name)
        same = copy.deepcopy(batch)
        row = tr.update(tr.estimate(batch))
    finally:
        tr.close()
    one = _trainer(tool_model, tmp_path, f"one-{name}", kl_coef=0.0, entropy_coef=0.0)
    try:
        if name != "dp2":  # one DP replica: the one-rank run samples the very same episodes
            _same_episodes(one.generate().samples, want, "one rank")
        ref = one.update(one.estimate(same))
    finally:
        one.close()
    for key in ("actor/loss", "actor/grad_norm", "reward/mean", "episode/tool_calls", "response_length/mean"):
        assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (name, key, row[key], ref[key])


def test_a_multi_turn_checkpoint_resumes_exactly_and_asks_for_its_tools(tool_model, tmp_path):
    tr = _trainer(tool_model, tmp_path, "save")
    try:
        tr.fit(steps=1, view="none")
        ckpt = tr.save(tmp_path / "ckpt")
        straight = tr.fit(steps=2, view="none").tail(2)
    finally:
        tr.close()
    with pytest.raises(TrainerError, match=r"tools \['calculator'\].*pass them again"):
        rlkit.Trainer.load(ckpt, dataset=TASK)
    again = rlkit.Trainer.load(ckpt, dataset=TASK, tools=[calculator], run_dir=str(tmp_path / "again"))
    try:
        assert again.agent.settings == MultiTurn(max_turns=3, max_tokens=240, tool_prompt=TINY_TOOL_PROMPT,
                                                 tool_timeout_s=2.0)
        resumed = again.fit(steps=2, view="none").tail(2)
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "episode/tool_calls", "episode/turns"):
            assert resumed[key].tolist() == pytest.approx(straight[key].tolist(), rel=1e-5, abs=1e-7), key
    finally:
        again.close()


def test_generate_takes_rows_of_your_own(tool_model, tmp_path):
    tr = _trainer(tool_model, tmp_path, "own")
    try:
        rows = TASK.dataset(n=2, seed=9, split="test")
        gen = tr.generate(prompts=list(rows)).samples
        assert gen["columns"]["prompt"][0] == tr.agent.format(tr.tokenizer).render_prompt(rows[0]["prompt"])
        assert gen["columns"]["answer"][0] == rows[0]["answer"] and len(gen["uid"]) == 2 * tr.rollout.n
    finally:
        tr.close()
