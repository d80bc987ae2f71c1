"""Checkpoints that change layout: saved under one ParallelPlan, loaded under another (torch Distributed
Checkpoint reshards the weights and the AdamW state by their HF names), and the run goes on as it would have.

1. ``rlkit.parallel`` on real gloo ranks: a plan saves after one step; another plan loads it and takes two more
   steps. The expected values are the single-process HF model's, trained on the same batches from the start:
   the loaded weights, the next steps' losses, and the weights after them (which a lost optimizer state would
   miss by ~1e-3: measured by dropping it, against a bound of 1e-5).
2. ``Trainer.load(path, plan=...)`` on Ray: the loaded weights are the saved ones bit for bit, and the next step
   samples the same completions (each prompt is seeded by its place in the step, not by its DP rank), so its
   rewards and advantages are equal and its loss and gradient norm equal within reduction order.
"""

from __future__ import annotations

import json

import pytest
import torch

import rlkit
from rlkit.errors import CheckpointError
from rlkit.models import tiny_lm
from rlkit.parallel.launch import launch
from rlkit.trainer import Trainer

# the saving plan, the loading plan: each pair takes the same global batch (dp x micro-batches rows)
PAIRS = {
    "dp2->tp2": ((2, ["--dp", "2"]), (2, ["--tp", "2", "--micro-batches", "2"])),
    "tp2xpp2->dp4": ((4, ["--tp", "2", "--pp", "2", "--micro-batches", "4"]), (4, ["--dp", "4"])),
    "fsdp2->one_rank": ((2, ["--dp", "2"]), (1, ["--micro-batches", "2"])),
}
# fp32 on the 4-layer tiny model: the saving plan's own weights are within 1e-5 of the reference after a step
# (tests/test_parallel.py), and two more steps keep it there (measured <= 8.1e-6, tp2 x pp2's the largest)
TOL = {"reshard_max_dweight_loaded": 1e-5, "reshard_max_dweight": 2e-5, "reshard_loss_rel": 1e-6}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each saving plan's step-1 checkpoint, written once (two pairs share the dp=2 one)."""
    model, made = tiny_lm("qwen2", size="test"), {}

    def get(nprocs: int, args: list[str]) -> str:
        key = " ".join(args)
        if key not in made:
            d = tmp_path_factory.mktemp("save")
            res = launch(nprocs, [*args, "--model", model, "--ckpt", str(d / "ckpt")], d, timeout=240)
            assert res.returncodes == [0] * nprocs, res.log()
            assert res.report["resume_max_dweight"] == 0.0  # under its own plan the resume is exact
            made[key] = str(d / "ckpt" / "step1")
        return made[key]

    return model, get


@pytest.mark.dist
@pytest.mark.parametrize("name", list(PAIRS))
def test_a_checkpoint_loads_under_another_plan_and_trains_on_as_the_single_process_model(saved, tmp_path, name):
    model, get = saved
    (na, a), (nb, b) = PAIRS[name]
    ckpt = get(na, a)
    assert json.loads(open(f"{ckpt}/layout.json").read())["world_size"] == na
    res = launch(nb, [*b, "--model", model, "--reshard-from", ckpt], tmp_path, timeout=240)
    assert res.returncodes == [0] * nb and res.report is not None, res.log()
    rep = res.report
    assert rep["world_size"] == nb and rep["reshard_step"] == 1
    for key, bound in TOL.items():
        assert rep[key] <= bound, (name, key, rep[key], rep)
    assert len(rep["reshard_losses"]) == 2


def _kw(cluster):
    return dict(dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                prompts_per_step=2, cluster=cluster)


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_trainer_load_under_another_plan_takes_the_uninterrupted_runs_next_step(tmp_path, ray_cluster):
    tr = Trainer(model=tiny_lm("qwen2", size="test"), plan=rlkit.ParallelPlan(dp=2), **_kw(ray_cluster))
    try:
        tr.fit(steps=2, view="none")
        ckpt = tr.save(tmp_path / "ckpt")
        saved = tr.workers.full_weights()
        tr.fit(steps=1, view="none")
        want = tr.metrics.iloc[-1]
    finally:
        tr.close()
    for plan in (rlkit.ParallelPlan(tp=2), rlkit.ParallelPlan()):
        resumed = Trainer.load(ckpt, cluster=ray_cluster, plan=plan, **{k: v for k, v in _kw(None).items()
                                                                       if k == "dataset"})
        try:
            assert resumed.plan == plan and resumed.step == 2 and len(resumed.metrics) == 2
            got = resumed.workers.full_weights()
            assert sorted(got) == sorted(saved)
            assert all(torch.equal(got[k], saved[k]) for k in saved), plan  # resharded, not changed
            resumed.fit(steps=1, view="none")
            row = resumed.metrics.iloc[-1]
            # the same completions: the same rewards and advantages, exactly
            for key in ("reward/mean", "reward/std", "advantages/std", "response_length/mean"):
                assert row[key] == want[key], (plan, key, row[key], want[key])
            # the update under another reduction order: equal within fp32 rounding
            assert row["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5), plan
            assert row["entropy"] == pytest.approx(want["entropy"], rel=1e-5), plan
            assert abs(row["actor/loss"] - want["actor/loss"]) <= 1e-6, plan
        finally:
            resumed.close()


def test_layout_changes_are_refused_with_the_fix_where_the_format_cannot_reshard(tmp_path):
    tr = Trainer(model=tiny_lm("qwen2", size="test"), plan=rlkit.ParallelPlan(), **_kw(None))
    try:
        tr.fit(steps=1, view="none")
        ckpt = tmp_path / "ckpt"
        tr.save(ckpt)
    finally:
        tr.close()
    with pytest.raises(CheckpointError, match=r"plan must be an rlkit.ParallelPlan, e.g. plan=rlkit.ParallelPlan"):
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, plan={"tp": 2})
    # a Megatron-Core run's trainer.json (its shard folders are Megatron's own format)
    state = json.loads((ckpt / "trainer.json").read_text())
    state["config"]["backend"] = "megatron"
    (ckpt / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"megatron backend under dp=1 x tp=1 x pp=1.*leave plan= out"):
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, plan=rlkit.ParallelPlan(tp=2))
