"""The controller-worker contract: algorithms a user registers train through the Trainer, the update's
settings are a function of the step alone, the sequence layout decides which tokens carry loss, worker
methods are called by reference, and a hand-made placement is the Trainer's own.

Every expected number is computed here, from the test's own definitions, not by the code under test."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rlkit
from rlkit.algos import (
    ADVANTAGES,
    ALGORITHMS,
    NEEDS,
    POLICY_LOSSES,
    register_advantage,
    register_algorithm,
    register_policy_loss,
)
from rlkit.config import TrainerConfig
from rlkit.errors import PlanError, TrainerError
from rlkit.models import tiny_lm
from rlkit.workers import Placement, SequenceLayout
from rlkit.workers.local import LocalWorkerGroup
from rlkit.workers.rl import UpdateSettings, actor_loss

torch.set_num_threads(1)
HALF = 0.5  # the constant advantage of the estimator below


# ---- a user's estimator and loss, registered here as in a notebook cell ------------------------------------
CALLS: list[dict] = []


def constant_half(rewards, response_mask):
    """Every real token gets advantage 0.5; it takes neither values nor group ids: n=1 is fine."""
    CALLS.append({"rewards": rewards.clone(), "mask": response_mask.clone()})
    adv = HALF * response_mask.float()
    return adv, adv


def vanilla_pg(logprobs, old_logprobs, advantages, response_mask):
    """-mean(A * log p) over real tokens (REINFORCE), and a marker metric that only this loss reports."""
    m = response_mask.bool()
    return -(advantages * logprobs)[m].mean(), {"vanilla_marker": 7.0}


@pytest.fixture
def registered():
    register_advantage("test-constant-half")(constant_half)
    register_policy_loss("test-vanilla")(vanilla_pg)
    register_algorithm("test-reinforce", advantage="test-constant-half", policy_loss="test-vanilla")
    CALLS.clear()
    yield
    for table, key in ((ADVANTAGES, "test-constant-half"), (NEEDS, "test-constant-half"),
                       (POLICY_LOSSES, "test-vanilla"), (ALGORITHMS, "test-reinforce")):
        table.pop(key, None)


def _trainer(tmp_path, name, algorithm, **kw):
    opts = dict(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm=algorithm,
                rollout=rlkit.Rollout(engine="hf", n=1, max_new_tokens=6), prompts_per_step=4, lr=1e-3, seed=1,
                run_dir=str(tmp_path / name))
    return rlkit.Trainer(**{**opts, **kw})


def test_a_registered_estimator_trains_through_the_trainer(registered, tmp_path):
    with _trainer(tmp_path, "estimator", "test-constant-half") as tr:
        assert tr.algo.advantage == "test-constant-half" and tr.algo.min_samples == 1
        assert not tr.algo.needs_critic and tr.group.apply(lambda w: w.critic is None) == [True]
        df = tr.fit(steps=2, view="none")
    assert len(CALLS) == 2 and all(c["rewards"].shape == (4,) for c in CALLS)
    # advantage 0.5 on every real token: mean 0.5, std 0; the PPO loss at ratio 1 is -A = -0.5 (token-mean)
    assert df["advantages/mean"].tolist() == [HALF, HALF] and df["advantages/std"].tolist() == [0.0, 0.0]
    assert df["actor/pg_loss"].tolist() == pytest.approx([-HALF, -HALF], abs=1e-6)
    assert (df["actor/grad_norm"] > 0).all()


def test_a_registered_algorithm_trains_with_its_own_loss(registered, tmp_path):
    with _trainer(tmp_path, "algorithm", "test-reinforce") as tr:
        df = tr.fit(steps=1, view="none")
    assert df["actor/vanilla_marker"].tolist() == [7.0]  # only the user's loss reports it
    assert "actor/clipfrac" not in df.columns             # the PPO loss did not run
    assert df["advantages/mean"].tolist() == [HALF]       # with the user's estimator


@pytest.mark.ray
def test_a_hand_made_placement_is_the_trainers_and_a_user_loss_runs_on_ray_workers(registered, tmp_path,
                                                                                    ray_cluster):
    plan = rlkit.ParallelPlan(dp=2)
    by_hand = Placement(pools={"train": plan, "gen": 1}, roles={"actor": "train", "rollout": "gen"})
    assert by_hand == Placement.of("split", plan, rollout_workers=1)
    with _trainer(tmp_path, "placed", "test-reinforce", plan=plan, placement=by_hand, cluster=ray_cluster) as tr:
        assert tr.placement.kind == "split" and tr.rollout_group is not None
        actor, gen = tr.group.pool, tr.rollout_group.pool
        # what Cluster.role_pools reserves for this mapping: one pool per role, each for one worker group
        assert (actor.name, actor.world_size, actor.colocate) == ("train", 2, 1)
        assert (gen.name, gen.world_size, gen.colocate) == ("gen", 1, 1)
        assert actor.bundle == gen.bundle == {"CPU": ray_cluster.cpus_per_rank(3)}
        df = tr.fit(steps=1, view="none")
    # the loss was defined in this test module: it reached the Ray workers by value and ran there
    assert df["actor/vanilla_marker"].tolist() == [7.0]
    assert len([c for c in df.columns if c.startswith("memory/rss_gb/")]) == 3  # 2 actor ranks + 1 engine


def test_what_an_estimator_takes_is_what_the_trainer_provides(registered, tmp_path):
    @register_advantage("test-needs-groups")
    def grouped(scores, response_mask, group_ids):
        return response_mask.float(), response_mask.float()

    @register_advantage("test-needs-critic")
    def with_values(rewards, values, response_mask):
        return values * response_mask, values * response_mask

    try:
        # group ids: n >= 2, refused in the driver before any worker starts
        with pytest.raises(TrainerError, match=r"test-needs-groups compares samples of the same prompt: set "
                                               r"Rollout\(n>=2\), got n=1"):
            _trainer(tmp_path, "groups", "test-needs-groups")
        # values: the worker builds a critic, and the estimator gets its values
        with _trainer(tmp_path, "critic", "test-needs-critic") as tr:
            assert tr.algo.needs_critic and tr.group.apply(lambda w: w.critic is not None) == [True]
            df = tr.fit(steps=1, view="none")
        assert "critic/loss" in df.columns and "timing/values" in df.columns
    finally:
        for name in ("test-needs-groups", "test-needs-critic"):
            ADVANTAGES.pop(name, None)
            NEEDS.pop(name, None)
    with pytest.raises(TrainerError, match=r"algorithm='test-nothing' is not known; choose one of"):
        _trainer(tmp_path, "none", "test-nothing")


# ---- settings are a function of the step ---------------------------------------------------------------------
def test_learning_rate_is_a_function_of_the_step_and_total_steps():
    lr, warm, total = 1e-3, 2, 10
    c = TrainerConfig(lr=lr, lr_warmup_steps=warm, lr_schedule="cosine", total_steps=total)
    for step in range(13):
        if step < warm:
            want = lr * (step + 1) / warm
        else:
            frac = min(1.0, (step - warm) / (total - warm))
            want = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        assert c.learning_rate(step) == pytest.approx(want, rel=1e-12), step
    s = c.update_settings(step=4)
    assert isinstance(s, UpdateSettings) and s.lr == c.learning_rate(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lr = 1.0
    # the KL goes in the loss unless it is in the reward
    assert TrainerConfig(kl_coef=0.1).update_settings(0).kl_loss_coef == 0.1
    assert TrainerConfig(kl_coef=0.1, kl_in_reward=True).update_settings(0).kl_loss_coef == 0.0


# ---- the sequence layout decides which tokens carry loss -----------------------------------------------------
def test_a_loss_mask_keeps_tool_tokens_out_of_loss_kl_and_entropy():
    """A multi-turn trajectory masks tool outputs: with ``loss_mask`` the actor's objective (policy loss,
    KL, entropy bonus) equals the one computed over the model's own tokens only, and the masked tokens get
    no gradient."""
    torch.manual_seed(0)
    layout = SequenceLayout(prompt_len=3, response_len=5)
    B, W = 2, layout.width
    lp = (-torch.rand(B, W)).requires_grad_(True)
    ent = torch.rand(B, W).requires_grad_(True)
    response = torch.ones(B, 5)
    loss_mask = torch.tensor([[1., 1., 0., 0., 1.], [1., 0., 0., 1., 1.]])  # 0: a tool's tokens
    adv, ref = torch.randn(B, 5), -torch.rand(B, 5)
    mb = {"response_mask": response, "loss_mask": loss_mask, "advantages": adv, "ref_logprobs": ref}
    s = UpdateSettings(lr=1e-3, kl_loss_coef=0.1, entropy_coef=0.01)
    loss, m = actor_loss(layout, {"logprobs": lp, "entropy": ent}, mb, s)
    loss.backward()
    # by hand, over the model's tokens only: ratio 1 -> pg = mean(-A); low-var KL; entropy bonus
    keep = loss_mask.bool()
    r = lp.detach()[:, 3:]
    log_ratio = ref - r
    kl = (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    want = (-adv)[keep].mean() + 0.1 * kl[keep].mean() - 0.01 * ent.detach()[:, 3:][keep].mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert m["entropy"] == pytest.approx(ent.detach()[:, 3:][keep].mean().item(), rel=1e-6)
    assert (lp.grad[:, 3:][~keep] == 0).all() and (ent.grad[:, 3:][~keep] == 0).all()
    assert (lp.grad[:, 3:][keep] != 0).all() and (lp.grad[:, :3] == 0).all()  # the prompt carries nothing


# ---- worker methods by reference ------------------------------------------------------------------------------
class Adder:
    def __init__(self, base):
        self.base = base

    def add(self, x):
        return self.base + x

    def add_each(self, xs):
        return [self.base + x for x in xs]

    def fail_like_torch_checkpoint(self):
        class CheckpointLikeException(BaseException):  # torch.distributed.checkpoint's is a BaseException
            pass

        raise CheckpointLikeException("a truncated shard")


def test_worker_methods_are_called_by_reference_or_name():
    with LocalWorkerGroup(1, Adder, 10, init_process_group=False) as g:
        assert g.call(Adder.add, 1) == [11] and g.call_rank0("add", 2) == 12
        assert g.call_dp(Adder.add_each, [1, 2, 3]) == [11, 12, 13]
        with pytest.raises(TypeError, match="is not a worker method"):
            g.call(lambda w: w, 1)
        # a library's BaseException arrives as an rlkit WorkerError (an Exception: `except Exception` holds)
        with pytest.raises(rlkit.WorkerError, match="CheckpointLikeException: a truncated shard"):
            g.call(Adder.fail_like_torch_checkpoint)
        assert g.call_rank0("add", 1) == 11  # and the group stays usable
        assert repr(g).startswith("LocalWorkerGroup('Adder'") and repr(g).endswith("running, in this process)")


# ---- placement --------------------------------------------------------------------------------------------------
def test_a_placement_is_checked_before_any_worker(tmp_path):
    plan = rlkit.ParallelPlan(dp=2)
    assert Placement.of("split", plan, 2) == Placement(pools={"train": plan, "gen": 2},
                                                      roles={"actor": "train", "rollout": "gen"})
    with pytest.raises(PlanError, match="the rollout is mapped to the actor's pool"):
        Placement(pools={"train": plan}, roles={"actor": "train", "rollout": "train"})
    with pytest.raises(PlanError, match=r"Placement roles \['critic'\] are not worker roles"):
        Placement(pools={"train": plan}, roles={"actor": "train", "critic": "train"})
    with pytest.raises(PlanError, match=r"pool\(s\) \['gpu'\]"):
        Placement(pools={"train": plan}, roles={"actor": "gpu"})
    with pytest.raises(PlanError, match="rollout_workers=3 needs placement='split'"):
        Placement.of("colocated", plan, 3)
    with pytest.raises(PlanError, match="the placement's actor pool is dp=2"):
        Placement.of(Placement.split(plan), rlkit.ParallelPlan(dp=4))


# ---- one step in cells: generate, look, change, estimate, update ---------------------------------------------
def test_a_step_in_cells_can_be_looked_at_changed_and_trained_on(tmp_path):
    opts = dict(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="grpo",
                rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=6), prompts_per_step=2, lr=1e-3, seed=1)
    with rlkit.Trainer(**opts, run_dir=str(tmp_path / "cells")) as tr:
        batch = tr.generate()
        table = batch.table(logprobs=True)
        assert len(table) == 8 and table.uid.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert (table.tokens == [len(lp) for lp in table.logprobs]).all()
        # every sample the same reward: GRPO's group baseline leaves no advantage and no policy gradient
        batch.set_rewards([0.5] * 8).drop([6, 7])
        tr.estimate(batch)
        assert batch.table().advantage.abs().max() == 0.0
        row = tr.update(batch)
        assert row["step"] == 1 and row["reward/skipped"] == 2 and row["reward/mean"] == 0.5
        assert row["advantages/std"] == 0.0 and abs(row["actor/pg_loss"]) < 1e-9
        with pytest.raises(TrainerError, match="a batch trains once"):
            tr.update(batch)
        row2 = tr.train_step()  # = update(estimate(generate())): the log goes on, one history
        assert row2["step"] == 2 and tr.metrics.step.tolist() == [1, 2]
