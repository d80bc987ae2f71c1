"""Streaming RL with partial rollouts (``rlkit.stream``), on real Ray workers, with lengths the test controls.

Half the prompts are answered by a script in one token and an end token (they finish in the first chunk);
the others run to ``max_new_tokens`` over several chunks, so they cross weight updates. A quarter of the
prompts are saturated (every sample gets reward 1: dynamic sampling filters them out). Checked:

- every token's log-prob is the engine's under the weights of the version it records: recomputed with a
  plain transformers model loaded with the actor's weights of that version (and a version off by one
  misses);
- no trained token is more than ``max_staleness`` versions old, and the groups that would be are dropped
  and counted;
- nothing lost or repeated: every admitted group is trained once, dropped, filtered, or still in the stream;
- a run saved mid-stream (samples running, a chunk in flight) resumes exactly;
- with ``partial_rollouts=False`` a sample started after the switch never crosses an update;
- with ``stream_stale_kv=True`` a sample that crossed an update went on over its older keys and values;
- a rollout worker killed mid-stream is a WorkerError naming its rank and the call.
"""

from __future__ import annotations

import pytest
import torch
from _logprob_ref import layout_logprobs

import rlkit
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer, TrainerError
from rlkit.widgets.live import metrics_figure

pytestmark = pytest.mark.usefixtures("one_torch_thread")

P, N, NEW, CHUNK = 4, 2, 16, 4
ROWS = [{"prompt": c * k, "easy": i % 4 == 0} for i, (c, k) in enumerate((c, k) for c in "abcdefgh" for k in range(2, 10))]
SHORT = tuple(r["prompt"] for i, r in enumerate(ROWS) if i % 2 == 1)
SCRIPT = tuple((rf"\A{p}", "a<|endoftext|>") for p in SHORT)  # the prompt alone (not a continuation): "a", end


def reward(prompts, completions, easy, **_):
    return [1.0 if e else float(i) for i, e in enumerate(easy)]


def _trainer(tmp_path, name, cluster):
    return Trainer(model=tiny_lm("qwen2", size="small"), dataset=ROWS, reward=reward, algorithm="grpo",
                   rollout=rlkit.Rollout(engine="hf", n=N, max_new_tokens=NEW, script=SCRIPT), prompts_per_step=P,
                   lr=2e-2, seed=0, placement="split", cluster=cluster, streaming=True, max_staleness=1,
                   stream_chunk_tokens=CHUNK, dynamic_sampling=True, offpolicy_correction="tis",
                   run_dir=str(tmp_path / name))


def _steps_keeping_weights(tr, steps):
    """``steps`` steps by hand; the batches and the actor's full weights of every version (0 = the start)."""
    weights, batches = {0: tr.workers.full_weights()}, []
    for _ in range(steps):
        batch = tr.generate()
        batches.append(batch)
        tr.update(tr.estimate(batch))
        weights[tr.step] = tr.workers.full_weights()
    return weights, batches


@pytest.mark.ray
def test_streamed_tokens_carry_their_version_and_log_prob_within_the_bound_and_resume_exactly(tmp_path, ray_cluster):
    from transformers import AutoModelForCausalLM

    tr = _trainer(tmp_path, "stream", ray_cluster)
    model = AutoModelForCausalLM.from_pretrained(tr.model_path, dtype=torch.float32)
    try:
        weights, batches = _steps_keeping_weights(tr, 4)
        crossed = 0
        for b in batches:
            s, mask = b.samples, b.samples.response_mask.bool()
            versions = s.token_version
            assert b.step - versions[mask].min() <= 1  # the bound, token by token
            assert torch.equal(s.policy_version, torch.where(mask, versions, 10**6).min(1).values)
            per_version = {}
            for v in versions[mask].unique().tolist():
                model.load_state_dict(weights[v])
                per_version[v] = layout_logprobs(model, s, tr.layout.prompt_len)
            expected = torch.zeros_like(s.rollout_logprobs)
            for v, lp in per_version.items():
                expected = torch.where(versions == v, lp, expected)
            assert (expected - s.rollout_logprobs)[mask].abs().max() <= 1e-4
            crossed += int((torch.where(mask, versions, -1).max(1).values > s.policy_version).sum())
            # the samples a script ended are one token and the end; every group's rewards differ
            assert set(s.response_mask.sum(1).tolist()) <= {2.0, float(NEW)}
            assert not any(r["easy"] for r in b.prompts)
        assert crossed > 0  # samples crossed updates: their tokens' versions differ
        model.load_state_dict(weights[1])  # a version off by one misses: the check above can fail
        b = next(b for b in batches if (b.samples.token_version[b.samples.response_mask.bool()] == 0).any())
        off = layout_logprobs(model, b.samples, tr.layout.prompt_len)
        zero = (b.samples.token_version == 0) & b.samples.response_mask.bool()
        assert (off - b.samples.rollout_logprobs)[zero].abs().max() > 1e-2

        df = tr.metrics
        assert df["offpolicy/staleness_max"].max() <= 1.0
        # the live view: samples by versions behind (stacked shares, 1 per step), those that crossed an update
        axes = {ax.get_title(): ax for ax in metrics_figure(df).axes}
        lags = [k for k in df.columns if k.startswith("stream/staleness/")]
        assert df[lags].fillna(0).sum(1).round(6).tolist() == [1.0] * len(df)
        assert len(axes["samples by versions behind (share)"].collections) == len(lags)
        assert list(axes["samples across an update (share)"].lines[0].get_ydata()) == df["stream/crossed_share"].tolist()
        assert df["stream/dropped_stale"].sum() > 0  # the long groups that crossed too many updates
        # chunks under unchanged weights went on over kept keys and values (the log-probs above hold for them)
        assert df["stream/kv_reused_share"].max() > 0.1
        tr.save(tmp_path / "ckpt")
        st = tr._stream
        assert st.running and st.inflight  # saved mid-stream: samples running, chunks in flight
        rest = tr.fit(steps=2, view="none").iloc[4:]
        df, st = tr.metrics, tr._stream
        # every admitted group: trained once, dropped, filtered, or still in the stream
        filtered = df["dynamic/filtered_groups"].sum() + st.filtered
        assert st.admitted == len(df) * P + st.dropped_stale + filtered + len(st.running) + len(st.buffer)
        trained = tr.samples()
        assert len(trained) == len(df) * P * N
        assert trained.groupby("step")["prompt"].nunique().tolist() == [P] * len(df)
        assert trained.drop_duplicates(["step", "prompt"])["prompt"].is_unique  # no prompt trained twice
        # partial_rollouts=False: from here the weights wait until no sample runs, so a sample started after
        # the switch never crosses an update
        tr.config.partial_rollouts, switched, late = False, tr.step, 0
        for _ in range(3):
            b = tr.generate()
            tr.update(tr.estimate(b))
            v, mask = b.samples.token_version, b.samples.response_mask.bool()
            first, last = v.masked_fill(~mask, 10**6).min(1).values, v.masked_fill(~mask, -1).max(1).values
            assert torch.equal(first[first >= switched], last[first >= switched])
            late += int((first >= switched).sum())
        assert late > 0
        # a step given up before its update (Ctrl-C in fit) puts its groups back: the next step trains them
        given_up = tr.generate()
        tr._put_back(given_up)
        again_taken = tr.generate()
        assert [g["prompt"] for g in again_taken.prompts] == [g["prompt"] for g in given_up.prompts]
        assert torch.equal(again_taken.samples.input_ids, given_up.samples.input_ids)
    finally:
        tr.close()
    again = Trainer.load(tmp_path / "ckpt", dataset=ROWS, reward=reward, run_dir=str(tmp_path / "resumed"),
                         cluster=ray_cluster)
    try:
        resumed = again.fit(steps=2, view="none").iloc[4:]
        for col in ("reward/mean", "actor/loss", "offpolicy/staleness_max", "stream/dropped_stale",
                    "stream/crossed_share", "dynamic/filtered_groups"):
            assert resumed[col].tolist() == rest[col].tolist(), col
    finally:
        again.close()


@pytest.mark.ray
def test_stale_keys_and_values_carry_a_sample_across_updates(tmp_path, ray_cluster):
    """``stream_stale_kv=True``: a sample that crosses an update goes on over the keys and values its earlier
    chunks computed (no prefill under the new weights). A sample that never crossed one scores every token
    as its version's weights do (within 1e-4); one that crossed scores its later tokens otherwise (its
    history's keys are older), and the engines report the kept history tokens."""
    from transformers import AutoModelForCausalLM

    tr = Trainer(model=tiny_lm("qwen2", size="small"), dataset=ROWS, reward=reward, algorithm="grpo",
                 rollout=rlkit.Rollout(engine="hf", n=N, max_new_tokens=NEW, script=SCRIPT), prompts_per_step=P,
                 lr=2e-2, seed=0, placement="split", cluster=ray_cluster, streaming=True, max_staleness=4,
                 stream_chunk_tokens=CHUNK, stream_stale_kv=True, offpolicy_correction="tis",
                 run_dir=str(tmp_path / "stale"))
    model = AutoModelForCausalLM.from_pretrained(tr.model_path, dtype=torch.float32)
    try:
        weights, batches = _steps_keeping_weights(tr, 4)
        same_gap, crossed_gap = 0.0, 0.0
        for b in batches:
            s, mask = b.samples, b.samples.response_mask.bool()
            versions = s.token_version
            expected = torch.zeros_like(s.rollout_logprobs)
            for v in versions[mask].unique().tolist():
                model.load_state_dict(weights[v])
                expected = torch.where(versions == v, layout_logprobs(model, s, tr.layout.prompt_len), expected)
            gap = (expected - s.rollout_logprobs).abs().masked_fill(~mask, 0)
            crossed = torch.where(mask, versions, -1).max(1).values > s.policy_version
            same_gap = max(same_gap, gap[~crossed].max().item())
            crossed_gap = max(crossed_gap, gap[crossed].max().item() if crossed.any() else 0.0)
        assert same_gap <= 1e-4
        assert crossed_gap > 1e-3
        assert (tr.metrics["stream/kv_reused_share"].iloc[1:] > 0).all()
    finally:
        tr.close()


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_rollout_worker_killed_mid_stream_is_reported_with_its_rank_and_call(tmp_path, ray_cluster):
    """The rollout worker is killed (SIGKILL) after step 1, with chunks in flight: the run stops with a
    WorkerError naming rank 0 and the call it died in, and the trainer closes (bounded waits)."""
    from _kill import fit_until_killed

    tr = _trainer(tmp_path, "killed", ray_cluster)
    try:
        error, phase = fit_until_killed(tr, tr.rollout_group)
        assert error.rank == 0 and phase in {"continue_samples", "receive_weights"}, str(error)
        assert len(tr.metrics) == 1
    finally:
        tr.close()


def test_bad_streaming_settings_fail_in_the_driver(tmp_path):
    model = tiny_lm("qwen2")
    with pytest.raises(TrainerError, match=r"streaming=True generates on rollout workers of their own .* "
                                           r"use placement='split'"):
        Trainer(model=model, dataset=ROWS, reward=reward, rollout=rlkit.Rollout(n=2), streaming=True)
    with pytest.raises(TrainerError, match=r"streaming=True with off_policy_steps=1: streaming is its own"):
        rlkit.TrainerConfig(streaming=True, off_policy_steps=1)
    with pytest.raises(TrainerError, match=r"multi-turn episodes \(tools, environment\) are not streamed yet"):
        Trainer(model=model, dataset=ROWS, reward=reward, rollout=rlkit.Rollout(n=2), placement="split",
                streaming=True, max_turns=2)
