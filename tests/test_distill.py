"""On-policy distillation (TrainerConfig.teacher, algorithm="distill"): the teacher in the reference's place,
its log-probs against a plain transformers forward, the advantage against the formula by hand, the KL-term mode
beside a reward, and the driver's errors."""

import pytest
import torch
from _logprob_ref import layout_logprobs
from transformers import AutoModelForCausalLM

import rlkit
from rlkit.errors import TrainerError
from rlkit.models import tiny_lm

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
