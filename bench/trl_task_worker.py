"""One TRL GRPOTrainer run of bench_task_vs_trl.py's work (reasoning-gym basic_arithmetic), in its own process
(the TRL venv).

    .venv-trl/bin/python bench/trl_task_worker.py MODEL_DIR STEPS --rows ROWS.json [--threads N] [--save DIR] [--warmup K]

``GRPOTrainer`` on ``vs_trl_common.TASK``'s work: the driver's train rows as conversational prompts, in the
order rlkit's sampler visits them (``shuffle_dataset=False``: each step trains on rlkit's questions of that
step), ``recorded_math_answer`` (rlkit's ``MathAnswer`` on the completion's text and the row's ``answer``) as
the reward; ``per_device_train_batch_size=prompts_per_step * n``, ``num_generations=n``,
``gradient_accumulation_steps=1``, ``num_iterations=1`` (one optimizer step per batch), ``beta=0``, constant
lr, grad clip 1.0, ``bf16=True`` (autocast on fp32 weights), HF generate (no vLLM), gradient checkpointing off
(TRL 1.16 defaults to on). Prints ``RESULT {json}``: steps/s after the warm-up steps and per-step phases over
the measured steps: ``generate`` (inside HF ``generate``), ``prepare`` (all of GRPOTrainer's
``_prepare_inputs``: generation, reward, advantages), ``reward`` (the reward call), ``update`` (from the batch
ready to the step's end: the loss forward, backward, clip, optimizer step); ``--save DIR``: the trained model,
for the common held-out evaluation.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # vs_trl_common, and the checkout's rlkit reward (pure Python)
from vs_trl_common import TASK, PeakRSS, StepClock, TRLPhases, emit, recorded_math_answer, task_worker_args  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up


def main() -> None:
    args = task_worker_args()
    rss = PeakRSS().start()
    import tempfile

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    spec = json.loads(open(args.rows).read())
    rows = [spec["rows"][i] for i in spec["order"]]  # rlkit's visiting order, step by step
    data = Dataset.from_list([{"prompt": r["prompt"], "question": r["question"], "answer": r["answer"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    calls: list[dict] = []
    score = recorded_math_answer(calls)
    phases = TRLPhases(CLOCK)

    def reward(prompts, completions, answer, question, completion_ids=None, **kw):
        out = score(prompts, completions, answer=answer, question=question)
        phases.add("reward", calls[-1]["s"])
        if completion_ids is not None:
            CLOCK.tokens.append(sum(len(ids) for ids in completion_ids))
        return out

    reward.__name__ = "math_answer"
    phases.time_generate()
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-task-"), use_cpu=True, bf16=True, fp16=False,
        per_device_train_batch_size=TASK["prompts_per_step"] * TASK["n"], num_generations=TASK["n"],
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=TASK["max_new_tokens"],
        temperature=TASK["temperature"], learning_rate=TASK["lr"], lr_scheduler_type="constant", beta=TASK["kl"],
        max_grad_norm=TASK["max_grad_norm"], max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=args.seed, gradient_checkpointing=False,
        shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          callbacks=phases.callbacks())
    phases.time_prepare(trainer)
    trainer.train()
    if args.save:
        trainer.save_model(args.save)
        tok.save_pretrained(args.save)
    rss.stop()
    res = CLOCK.summary(warmup=args.warmup)
    n = len(CLOCK.ends)
    per_step = phases.per_step()
    steps = [e - b for b, e in zip(CLOCK.begins, CLOCK.ends)]
    medians = phases.medians(args.warmup)
    medians["step"] = statistics.median(steps[args.warmup:])
    per_call = len(calls) // max(n, 1) or 1  # reward calls per step (TRL: one per batch)
    res.update(side="trl", version=trl.__version__, threads=torch.get_num_threads(), peak_rss_mb=rss.peak_mb,
               warmup=args.warmup, bf16=cfg.bf16, gradient_checkpointing=cfg.gradient_checkpointing,
               phases_median_s=medians, phases_per_step_s=per_step,
               reward_per_step=[statistics.mean(c["reward_mean"] for c in calls[i * per_call:(i + 1) * per_call])
                                for i in range(n)],
               response_length_per_step=[t / (TASK["prompts_per_step"] * TASK["n"]) for t in CLOCK.tokens[:n]],
               step_s_per_step=steps,
               questions_per_step=[[q for c in calls[i * per_call:(i + 1) * per_call] for q in c["questions"]]
                                   for i in range(n)],
               trl_logs=phases.logs)
    emit(res)


if __name__ == "__main__":
    main()
