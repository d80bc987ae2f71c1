"""The 3D-HybridEngine's generation layout, ``Rollout(tp=t_g)``: every training rank generates.

Real process groups (gloo, 4 and 8 local ranks), a real tiny HF model, real Ray workers for the Trainer.
"""

import pytest
import torch

import rlkit
from rlkit.errors import PlanError
from rlkit.models import tiny_lm
from rlkit.parallel.launch import launch
from rlkit.plan import ParallelPlan, estimate_resharding
from rlkit.plan.hybrid import GenerationLayout, valid_generation_tp
from rlkit.rollout import RolloutError
from rlkit.trainer import Trainer, TrainerError

torch.set_num_threads(1)
TOLERANCE = 0.05  # the bound on bytes and memory against HybridFlow's formulas


# ---- the layout, pure arithmetic ------------------------------------------------------------------
def test_groups_follow_hybridflow_strided_grouping():
    lay = GenerationLayout(ParallelPlan(tp=4, pp=2), tp=2)  # k = 2 training chunks per generation chunk
    assert lay.micro_dp == 4 and lay.engines == 4
    # generation groups: one rank per generation chunk g, training tp = g*k + (j % k), stage j // k
    assert lay.generation_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # micro-DP groups: every rank whose training chunk lies inside generation chunk g, every stage
    assert lay.micro_dp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for r in range(8):  # a rank's training chunk tp_r sits inside its generation chunk g = tp_r // k
        assert lay.coords(r)["gen_tp"] == ParallelPlan(tp=4, pp=2).coords(r)["tp"] // 2
    # the prompts of a replica split into contiguous, ordered slices
    assert [(s.start, s.stop) for s in lay.prompt_slices(10)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert lay.received_fraction() == pytest.approx((8 - 2) / (2 * 8))


def test_bad_generation_tp_is_a_clear_error():
    with pytest.raises(PlanError, match=r"Rollout\(tp=3\) does not divide tp\*pp=4; choose tp in \{1, 2\}"):
        GenerationLayout(ParallelPlan(tp=2, pp=2), tp=3)
    with pytest.raises(PlanError, match=r"larger than the training group tp\*pp=2\*2=4"):
        GenerationLayout(ParallelPlan(tp=2, pp=2), tp=8)
    with pytest.raises(PlanError, match=r"not the training tp=1: a generation shard would not contain"):
        GenerationLayout(ParallelPlan(pp=2), tp=2)
    model = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 64}
    with pytest.raises(PlanError, match=r"does not divide num_key_value_heads=2; choose tp in \{1, 2\}"):
        GenerationLayout(ParallelPlan(tp=4), tp=4).validate(model)
    assert valid_generation_tp(ParallelPlan(tp=4), model) == [1, 2]


def test_trainer_rejects_bad_layouts_before_any_worker_starts(tmp_path):
    def make(**kw):
        opts = dict(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                    prompts_per_step=4, run_dir=str(tmp_path))
        return Trainer(**{**opts, **kw})

    plan = ParallelPlan(tp=2, pp=2)
    with pytest.raises(PlanError, match=r"Rollout\(tp=3\) does not divide"):
        make(plan=plan, rollout=rlkit.Rollout(engine="hf", n=2, tp=3))
    with pytest.raises(PlanError, match=r"larger than the training group"):
        make(plan=plan, rollout=rlkit.Rollout(engine="hf", n=2, tp=8))
    with pytest.raises(TrainerError, match=r"vLLM engines inside the training ranks run with tensor_parallel_size=1"):
        make(plan=plan, rollout=rlkit.Rollout(engine="vllm", n=2, tp=2))
    with pytest.raises(TrainerError, match=r"placement='split'"):
        make(plan=plan, rollout=rlkit.Rollout(engine="hf", n=2, tp=2), placement="split")
    with pytest.raises(RolloutError, match=r"tp=0 must be a positive integer or None"):
        rlkit.Rollout(tp=0)


# ---- resharding and generation on real process groups ----------------------------------------------
def _run(nprocs, plans, tmp_path, *extra):
    res = launch(nprocs, ["--plans", *plans, *extra], tmp_path, module="rlkit.workers.hybrid_check", timeout=600)
    assert res.returncodes == [0] * nprocs and res.report is not None, res.log()
    return [r for run in res.report["runs"] for r in run["rows"]]


def _check(rows, plan, nprocs):
    seen_tg = set()
    for r in rows:
        seen_tg.add(r["t_g"])
        where = f"{r['plan']} t_g={r['t_g']} rank {r['rank']}"
        # the generation shard is the full weights' t_g slice, and the training weights come back, exactly
        assert r["shard_err"] == 0.0 and r["restore_err"] == 0.0, where
        m = r["model_bytes"]
        print(f"{where}: received {r['bytes'] / m:.4f} M (HybridFlow {r['bytes_formula'] / m:.4f} M), "
              f"held while generating {r['param_bytes'] / m:.4f} M (formula {r['param_formula'] / m:.4f} M), "
              f"transient peak {r['peak_param_bytes'] / m:.4f} M, {r['seconds'] * 1e3:.1f} ms")
        assert abs(r["bytes"] - r["bytes_formula"]) <= TOLERANCE * r["bytes_formula"], where
        # rlkit.plan's per-tensor count of the same resharding: exact, byte for byte
        dp, tp, pp = r["dims"]
        est = estimate_resharding(ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=r["dp_shard"]), r["model_path"],
                                  r["t_g"]).set_index("rank").loc[r["rank"]]
        assert (r["bytes"], r["param_bytes"]) == (est["received_bytes"], est["generation_param_bytes"]), where
        assert abs(r["param_bytes"] - r["param_formula"]) <= TOLERANCE * r["param_formula"], where
        # every rank generated: its group sampled a share of the replica's prompts
        assert r["greedy_prompts_here"] > 0 and r["sampled_prompts_here"] > 0, where
        # each DP replica's collector (its tp=0 rank on the last stage) compares with one engine on the full
        # model: there the comparison must be in the row (a missing key fails), elsewhere it is not made
        collectors = {ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=r["dp_shard"]).rank(dp=d, tp=0, pp=pp - 1)
                      for d in range(dp)}
        if r["rank"] not in collectors:
            assert "greedy_same_tokens" not in r and "sampled_same_tokens" not in r, where
        else:
            assert "greedy_same_tokens" in r and "sampled_same_tokens" in r, (where, sorted(r))
            assert r["greedy_same_tokens"] and r["sampled_same_tokens"], where
            assert r["greedy_max_dlogprob"] < 1e-5 and r["sampled_max_dlogprob"] < 1e-5, where
    assert seen_tg == {1, 2} and len(rows) == 2 * nprocs * len(plan)


def test_tp2_pp2_reshards_with_hybridflow_volumes_and_generates_the_single_engine_tokens(tmp_path):
    _check(_run(4, ["1x2x2"], tmp_path), ["1x2x2"], 4)


@pytest.mark.slow  # 8 ranks on this 2-core machine: make test-all (tp2 x pp2 and the tied model cover the resharding
# in the default suite; tests/test_parallel.py trains 3D there)
def test_3d_dp2_tp2_pp2_megatron_and_fsdp_layouts(tmp_path):
    # dp_shard="replicate" is Megatron's layout (HybridFlow's Table 2 as is); full_shard adds the DP
    # gather of each rank's TP shard: received = M/t_g - M/(tp*pp*dp), held = M/t_g + M/(tp*pp*dp)
    plans = ["2x2x2:replicate", "2x2x2:full_shard"]
    _check(_run(8, plans, tmp_path), plans, 8)


def test_tied_embeddings_reshard_exactly_as_counted_and_generate_the_single_engine_tokens(tmp_path):
    # one vocab matrix serves both ends: under pp=2 the first stage reshards it, the last stage's copy stays
    # training-only; HybridFlow's closed form does not hold, the per-tensor count must, to the byte
    plans = ["1x2x2", "2x1x2:full_shard"]
    rows = _run(4, plans, tmp_path, "--tied")
    assert len(rows) == sum(len(valid_generation_tp(_plan(p))) for p in plans) * 4
    for r in rows:
        where = f"tied {r['plan']} t_g={r['t_g']} rank {r['rank']}"
        assert r["shard_err"] == 0.0 and r["restore_err"] == 0.0, where
        dp, tp, pp = r["dims"]
        est = estimate_resharding(ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=r["dp_shard"]), r["model_path"],
                                  r["t_g"]).set_index("rank").loc[r["rank"]]
        assert (r["bytes"], r["param_bytes"]) == (est["received_bytes"], est["generation_param_bytes"]), where
        assert r["greedy_prompts_here"] > 0 and r["sampled_prompts_here"] > 0, where
        if "greedy_same_tokens" in r or "sampled_same_tokens" in r:  # this rank collected its replica
            assert r["greedy_same_tokens"] and r["sampled_same_tokens"], where
            assert r["greedy_max_dlogprob"] < 1e-5 and r["sampled_max_dlogprob"] < 1e-5, where
    collected = [r for r in rows if "greedy_same_tokens" in r]
    assert len(collected) == sum(_plan(p).dp * len(valid_generation_tp(_plan(p))) for p in plans), collected


def _plan(name: str) -> ParallelPlan:
    dims, _, shard = name.partition(":")
    dp, tp, pp = (int(x) for x in dims.split("x"))
    return ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=shard or "full_shard")


# ---- the Trainer: all ranks generate; a GRPO run reproduces the single-engine one ---------------------
def _grpo(tmp_path, name, rollout, cluster):
    return Trainer(model=tiny_lm("llama", size="test", vocab_size=256, tie_word_embeddings=False),
                   dataset=rlkit.tasks.repeat, algorithm="grpo", plan=ParallelPlan(tp=2, pp=2), rollout=rollout,
                   cluster=cluster, prompts_per_step=4, lr=2e-3, seed=0, run_dir=str(tmp_path / name))


@pytest.mark.ray
def test_grpo_in_the_generation_layout_reproduces_the_single_engine_run(tmp_path, ray_cluster):
    steps, rows = 3, {}
    for name, tg in (("single", None), ("hybrid", 2)):
        tr = _grpo(tmp_path, name, rlkit.Rollout(engine="hf", n=4, max_new_tokens=12, tp=tg), ray_cluster)
        try:
            rows[name] = tr.fit(steps=steps, view="none")
            if tg is not None:
                generated = tr.group.apply(lambda w: w.hybrid.prompts_generated)
                # 4 ranks in 2 generation groups of 2: each group sampled half of the 4 prompts per step
                assert generated == [2 * steps] * 4, generated
                m = tr.metrics
                model_bytes = _model_bytes(tr)
                lay = GenerationLayout(tr.plan, tg)
                assert (abs(m["sync/bytes"] - lay.received_fraction() * model_bytes)
                        <= TOLERANCE * lay.received_fraction() * model_bytes).all(), m["sync/bytes"]
                assert (abs(m["sync/param_bytes"] - model_bytes / tg) <= TOLERANCE * model_bytes / tg).all()
        finally:
            tr.close()
    a, b = rows["single"], rows["hybrid"]
    # per-prompt seeds: both layouts sample the same tokens, so the runs are the same run
    assert a["reward/mean"].tolist() == b["reward/mean"].tolist()
    assert a["response_length/mean"].tolist() == b["response_length/mean"].tolist()
    for key in ("actor/loss", "actor/grad_norm", "entropy"):
        assert torch.allclose(torch.tensor(a[key].tolist()), torch.tensor(b[key].tolist()), rtol=1e-4, atol=1e-6, equal_nan=True), key


def _model_bytes(tr) -> int:
    from rlkit.plan import as_spec

    return as_spec(tr.model_path).num_params * 4  # float32 weights
