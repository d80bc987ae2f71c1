"""On-policy distillation (TrainerConfig.teacher, algorithm="distill"): the teacher in the reference's place,
its log-probs against a plain transformers forward, the advantage against the formula by hand, the KL-term mode
beside a reward, and the driver's errors."""

import pytest
import torch
from _logprob_ref import layout_logprobs
from _require import need_module
from transformers import AutoModelForCausalLM

import rlkit
from rlkit.errors import PlanError, TrainerError
from rlkit.models import tiny_lm
from rlkit.plan import ParallelPlan

torch.set_num_threads(1)


def _trainer(tmp_path, name, **kw):
    return rlkit.Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat,
                         rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=5), prompts_per_step=2, lr=1e-3,
                         seed=4, run_dir=str(tmp_path / name), **kw)


def _teacher_logprobs(path, samples, prompt_len):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sent = {"input_ids": samples.input_ids, "attention_mask": samples.attention_mask,
            "response_mask": samples.response_mask}
    return layout_logprobs(model, sent, prompt_len)


def test_distill_advises_each_token_by_the_teachers_log_prob(tmp_path):
    """A teacher of another size (the student's tokenizer): its log-probs of the student's own samples come from
    the teacher (a plain transformers forward of the teacher's folder agrees), and the advantage of each real
    token is log pi_teacher - log pi_student, the student's being the engine's (one step per batch)."""
    teacher = tiny_lm("qwen2", size="small", seed=1)
    with _trainer(tmp_path, "distill", algorithm="distill", teacher=teacher) as tr:
        batch = tr.estimate(tr.generate())
        s, mask = batch.samples, batch.samples.loss_tokens.bool()
        want = _teacher_logprobs(teacher, s, tr.layout.prompt_len)
        assert (s.ref_logprobs - want)[mask].abs().max() < 1e-4
        assert (s.advantages - (want - s.rollout_logprobs))[mask].abs().max() < 1e-4
        assert s.advantages[mask].abs().mean() > 0.1   # a teacher of other weights disagrees
        row = tr.update(batch)
        assert row["actor/grad_norm"] > 0 and tr.step == 1
        # the step's "kl": the reverse KL's sample mean over the tokens, log pi_student - log pi_teacher
        assert row["kl"] == pytest.approx((s.rollout_logprobs - want)[mask].mean().item(), abs=1e-4)


def test_a_teacher_beside_a_reward_is_the_kl_term(tmp_path):
    teacher = tiny_lm("qwen2", size="small", seed=1)
    with _trainer(tmp_path, "kl", algorithm="grpo", teacher=teacher, kl_coef=0.1) as tr:
        batch = tr.estimate(tr.generate())
        s, mask = batch.samples, batch.samples.loss_tokens.bool()
        assert (s.ref_logprobs - _teacher_logprobs(teacher, s, tr.layout.prompt_len))[mask].abs().max() < 1e-4
        row = tr.update(batch)
    assert row["actor/kl_loss"] > 0.01   # the KL to the teacher, not to the student's own start (0 at step 1)


def test_the_student_as_its_own_teacher_advises_nothing(tmp_path):
    with _trainer(tmp_path, "self", algorithm="distill", teacher=tiny_lm("qwen2", size="test")) as tr:
        batch = tr.estimate(tr.generate())
        assert batch.samples.advantages.abs().max() < 1e-4


def test_a_teacher_with_another_tokenizer_or_no_reference_pass_is_refused_before_any_worker(tmp_path):
    with pytest.raises(TrainerError, match="has another tokenizer than the student"):
        _trainer(tmp_path, "tok", algorithm="distill", teacher=tiny_lm("qwen2", size="test", vocab_size=384))
    with pytest.raises(TrainerError, match="this run has no reference pass: use algorithm='distill'"):
        _trainer(tmp_path, "noref", algorithm="grpo", teacher=tiny_lm("qwen2", size="test"))
    with pytest.raises(TrainerError, match=r"has a teacher pool \(dp=1 x tp=2 x pp=1 = 2 ranks; DP full_shard\) "
                                           r"and the run has no teacher"):
        _trainer(tmp_path, "nopool", algorithm="grpo",
                 placement=rlkit.Placement.colocated(ParallelPlan(), teacher=ParallelPlan(tp=2)))
    with pytest.raises(TrainerError, match="a teacher pool of its own runs on the torch backend, and this run has "
                                           "backend='megatron'"):
        _trainer(tmp_path, "mpool", algorithm="distill", teacher=tiny_lm("qwen2", size="test"), backend="megatron",
                 placement=rlkit.Placement.colocated(ParallelPlan(), teacher=ParallelPlan(tp=2)))
    with pytest.raises(PlanError, match="the teacher is mapped to pool 'train', which another role uses"):
        rlkit.Placement(pools={"train": ParallelPlan()}, roles={"actor": "train", "teacher": "train"})
    with pytest.raises(PlanError, match="the teacher's pool 't' must be a ParallelPlan"):
        rlkit.Placement(pools={"train": ParallelPlan(), "t": 2}, roles={"actor": "train", "teacher": "t"})


def test_a_teacher_on_a_pool_of_its_own_sharded_by_its_plan(tmp_path):
    """The teacher on two ranks of its own (tensor-parallel), the student on one: the same log-probs as a plain
    transformers forward of the teacher's folder; the actor's workers hold no reference; a checkpoint keeps the
    teacher's pool."""
    teacher = tiny_lm("qwen2", size="small", seed=1)
    placement = rlkit.Placement.colocated(ParallelPlan(), teacher=ParallelPlan(tp=2))
    with _trainer(tmp_path, "pool", algorithm="distill", teacher=teacher, placement=placement) as tr:
        assert tr.workers.teacher_group.world_size == 2
        assert tr.workers.group.apply(lambda w: w.ref is None) == [True]
        batch = tr.estimate(tr.generate())
        s, mask = batch.samples, batch.samples.loss_tokens.bool()
        want = _teacher_logprobs(teacher, s, tr.layout.prompt_len)
        assert (s.ref_logprobs - want)[mask].abs().max() < 1e-4
        assert (s.advantages - (want - s.rollout_logprobs))[mask].abs().max() < 1e-4
        tr.update(batch)
        tr.save(tmp_path / "ckpt")
    with rlkit.Trainer.load(tmp_path / "ckpt", rlkit.tasks.repeat) as again:
        assert again.placement.teacher_plan == ParallelPlan(tp=2) and again.step == 1
        assert again.workers.teacher_group.world_size == 2


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_a_colocated_teacher_on_the_other_backends(tmp_path, backend):
    """The teacher in the reference's place on Megatron-Core and DeepSpeed (one rank, in-process): its log-probs
    of the student's samples are a plain transformers forward's, and the step trains."""
    need_module("megatron.core" if backend == "megatron" else "deepspeed", "RLKIT_REQUIRE_BACKENDS")
    teacher = tiny_lm("qwen2", size="small", seed=1)
    with _trainer(tmp_path, backend, algorithm="distill", teacher=teacher, backend=backend, padding_free=False) as tr:
        batch = tr.estimate(tr.generate())
        s, mask = batch.samples, batch.samples.loss_tokens.bool()
        assert (s.ref_logprobs - _teacher_logprobs(teacher, s, tr.layout.prompt_len))[mask].abs().max() < 1e-4
        row = tr.update(batch)
    assert row["actor/grad_norm"] > 0
