"""The DeepSpeed backend on real gloo ranks (CPU) against the single-process HF model.

One launch per group of layouts runs ``python -m rlkit.backends.deepspeed_check``: each layout builds a
``DeepSpeedModel`` (and an lr=0 reference beside it) and compares, on a batch of left-padded prompts and
right-padded responses, log-probs / entropy (or values), the loss, every gradient (HF names; ZeRO via
``deepspeed.utils.safe_get_full_grad``), the pre-clip grad norm, the weights after 3 clipped AdamW steps at
lr=1e-3 (set through ``optimizer.param_groups``, as the workers do), the full-weight gather strict-loaded into a
fresh HF model, save -> load -> continue (bit-exact) and a missing checkpoint's error, ``set_scoring``, the
padding-free refusal, and the measured memory of the trained model and of the forward-only reference.

Tolerances (fp32), the torch backend's: log-probs 2e-6, entropy 1e-5, loss 1e-6 relative, grad norm 1e-5
relative, grads 1e-6, weights after 3 steps 1e-5, the gathered model's log-probs 1e-5. Measured here (deepspeed
0.19.8, 2026-12-05): log-probs and entropy 0 (the same Stage computes them), loss equal, grads <= 6.0e-8,
weights <= 1.9e-6 (ZeRO-1 qwen2), grad norm within 5e-8 relative, gathered model 4.8e-7; resume 0.0.

No op is JIT-built: not the ``deepspeed_shm_comm`` op (inference only, skipped by rlkit; a test below checks
that the cache gets no build), nor a fused CPU Adam (AdamW is torch's).
"""

from __future__ import annotations

import json

import pytest
from _require import need_module

need_module("deepspeed", "RLKIT_REQUIRE_BACKENDS")

from rlkit.models import tiny_lm  # noqa: E402
from rlkit.parallel.launch import launch  # noqa: E402

TOL = {"max_dlogprob": 2e-6, "max_dentropy": 1e-5, "max_dgrad": 1e-6, "max_dweight": 1e-5,
       "max_dlogprob_refmodel": 2e-6}
LM_TOL = {"max_dlogprob_gathered_model": 1e-5, "max_dscoring": 2e-6, "max_unscored": 0.0}


@pytest.fixture(scope="module")
def tiny_paths():
    # built once here, so the ranks only read the cached folders
    return {"qwen2": str(tiny_lm("qwen2", size="test")),
            "llama-tied": str(tiny_lm("llama", size="test", tie_word_embeddings=True))}


def run_layouts(tmp_path, tiny_paths, nprocs: int, layouts: list[str], ckpt: bool = False) -> list[dict]:
    args = ["--models", json.dumps(tiny_paths)] + [a for lay in layouts for a in ("--layout", lay)]
    if ckpt:
        args += ["--ckpt", str(tmp_path / "ckpt")]
    res = launch(nprocs, args, tmp_path, timeout=300, module="rlkit.backends.deepspeed_check")
    assert res.returncodes == [0] * nprocs and res.report is not None, res.log()
    reps = res.report["layouts"]
    assert [r["layout"] for r in reps] == layouts
    assert all(r["interface_missing"] == [] for r in reps)  # DeepSpeedModel is a TrainingModel
    for i, rep in enumerate(reps):
        bounds = TOL | (LM_TOL if rep["head"] == "lm" else {})
        for key, bound in bounds.items():  # a missing key fails: nothing passes unchecked
            assert rep.get(key) is not None and rep[key] <= bound, (key, rep.get(key), rep["layout"])
        assert abs(rep["loss"] - rep["ref_loss"]) <= 1e-6 * max(1.0, abs(rep["ref_loss"])), rep
        assert abs(rep["grad_norm"] - rep["ref_grad_norm"]) <= 1e-5 * rep["ref_grad_norm"], rep
        # micro-batches weighted by their response tokens (weight_fn), as the workers' token-mean losses
        assert abs(rep["weighted_loss"] - rep["ref_weighted_loss"]) <= 1e-6 * max(1.0, abs(rep["ref_weighted_loss"]))
        assert rep["max_dgrad_weighted"] <= TOL["max_dgrad"], (rep["max_dgrad_weighted"], rep["layout"])
        assert rep["strict_load"] is True
        assert rep["padding_free_refused"] is True
        # every HF parameter's gradient was compared on some rank
        assert sum(rep["grads_compared"]) >= rep["n_params"], (rep["grads_compared"], rep["n_params"])
        assert len(rep["memory"]) == nprocs
        # the reference policy (lr=0) is forward-only: no optimizer state, no gradients, ZeRO-3's weights partitioned
        for row, trained in zip(rep["refmodel_memory"], rep["memory"]):
            assert row["optimizer"] == 0 and row["grads"] == 0, row
            assert abs(row["weights"] - trained["weights"]) <= 0.01 * trained["weights"], (row, trained)  # ZeRO pads
        if ckpt and i == 0:
            assert rep["resume_step"] == 1
            assert rep["resume_max_dweight"] == 0.0, rep  # bit-exact resume
            assert rep["missing_ckpt_error"].startswith("CheckpointError") and "nothing-here" in \
                rep["missing_ckpt_error"]
    return reps


def _memory_matches_zero(rep: dict, dp: int) -> None:
    """The measured rows against what each ZeRO stage keeps (fp32: 4 bytes a parameter, P of them; ZeRO 1-3
    keep an fp32 master partition beside Adam's two moments, 3 x 4P / dp; partitions are padded a little)."""
    full, zero = rep["param_bytes"], rep["zero_stage"]
    for row in rep["memory"]:
        weights = full / dp if zero == 3 else full
        assert abs(row["weights"] - weights) <= 0.02 * weights, (row, weights, rep["layout"])
        opt = 3 * full / dp if zero >= 1 else 2 * full
        assert abs(row["optimizer"] - opt) <= 0.02 * opt, (row, opt, rep["layout"])
        assert 0 < row["grads"] <= 1.1 * (full if zero <= 1 else full / dp), (row, rep["layout"])


def test_zero_1_2_3_over_dp2_match_single_process(tmp_path, tiny_paths):
    layouts = ["dp2-z3:qwen2", "dp2-z1:qwen2", "dp2-z2:llama-tied"]
    reps = run_layouts(tmp_path, tiny_paths, 2, layouts, ckpt=True)
    for rep in reps:
        _memory_matches_zero(rep, dp=2)
    z3 = reps[0]  # ZeRO-3 gathers what it partitioned: rank 0 received the other half of the weights
    assert z3["gather_bytes_rank0"] > 0.4 * z3["param_bytes"]


@pytest.mark.slow  # the other architecture at ZeRO-3, and the critic: make test-all
def test_zero_3_tied_and_a_zero_2_critic_over_dp2_match_single_process(tmp_path, tiny_paths):
    for rep in run_layouts(tmp_path, tiny_paths, 2, ["dp2-z3:llama-tied", "dp2-z2:qwen2:value"], ckpt=True):
        _memory_matches_zero(rep, dp=2)


def test_pipeline_pp2_matches_single_process(tmp_path, tiny_paths):
    layouts = ["pp2-z0:qwen2", "pp2-z0:llama-tied", "pp2-z1:qwen2", "pp2-z1:llama-tied:value"]
    reps = run_layouts(tmp_path, tiny_paths, 2, layouts, ckpt=True)
    for rep in reps:  # each stage holds its layers only: about half the model each
        for row in rep["memory"]:
            assert 0.3 * rep["param_bytes"] < row["weights"] < 0.7 * rep["param_bytes"], (row, rep["layout"])


@pytest.mark.slow  # 4 ranks on this 2-core machine: make test-all
def test_dp2_pp2_on_4_ranks_matches_single_process(tmp_path, tiny_paths):
    # pipe outermost, data inside (rlkit's tp-dp-pp order with tp=1; the constructor checks DeepSpeed agrees)
    run_layouts(tmp_path, tiny_paths, 4, ["dp2-pp2-z1:llama-tied", "dp2-pp2-z0:qwen2"])


def test_one_rank_matches_single_process(tmp_path, tiny_paths, monkeypatch):
    ext = tmp_path / "torch_extensions"  # where DeepSpeed would JIT-build an op: it builds none
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    reps = run_layouts(tmp_path, tiny_paths, 1, ["dp1-z0:qwen2", "dp1-z2:llama-tied"], ckpt=True)
    _memory_matches_zero(reps[0], dp=1)
    assert not ext.exists() or not any(ext.iterdir()), sorted(p.name for p in ext.iterdir())


@pytest.mark.ray
@pytest.mark.slow  # 40 steps, a learning claim: make test-all (tests/test_backends_trainer.py runs the backend
# through Trainer fit / save / load in the default suite, and tutorial 10 trains on both)
def test_grpo_learns_on_deepspeed(tmp_path):
    """GRPO end to end through Trainer(backend=Backend("deepspeed", zero_stage=2)) on 2 Ray ranks (dp=2), as
    tests/test_trainer.py::test_algorithms_and_layouts_learn does on the torch backend. Measured (2026-12-05): reward 0.023 -> 0.109 over the first / last five of 40
    steps; the first three steps' rewards equal the torch backend's, their loss, grad norm and entropy within
    3e-7 relative."""
    import rlkit
    from rlkit.trainer import Trainer

    tr = Trainer(model=tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                 plan=rlkit.ParallelPlan(dp=2), rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=16),
                 prompts_per_step=8, lr=2e-3, seed=0, run_dir=str(tmp_path / "run"),
                 backend=rlkit.Backend("deepspeed", zero_stage=2))
    try:
        tr.fit(steps=40, view="none")
        rewards = tr.metrics["reward/mean"].tolist()
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        assert last > first + 0.04, rewards
    finally:
        tr.close()
