"""One TRL GRPOTrainer run in tool mode (bench_agentic_vs_trl.py's work), in its own process (the TRL venv).

    .venv-trl/bin/python bench/trl_agentic_worker.py MODEL_DIR STEPS [--save DIR] [--threads N]

``GRPOTrainer(tools=[calculator])`` on ``vs_trl_common.AGENTIC``'s work: ``Calculator`` train questions as
conversational prompts, ``num_generations=n``, ``max_tool_calling_iterations=max_turns - 1`` (one tool round,
then the answer), ``max_completion_length=max_tokens`` (TRL's budget for everything after the prompt: the
turns, the tool results), the task's own reward on the last message. Gradient checkpointing off (TRL 1.16
defaults to on; off is its faster configuration here). Prints ``RESULT {json}`` (steps/s after the warm-up
steps, TRL's own tool-call counts); ``--save DIR``: the trained model, for the common held-out evaluation.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # vs_trl_common, and the checkout's rlkit.tasks (pure Python)
from vs_trl_common import AGENTIC, PeakRSS, StepClock, agentic_worker_args, calculator_task, emit  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up


def main() -> None:
    args = agentic_worker_args()
    rss = PeakRSS().start()
    import tempfile

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlkit.tasks import calculator

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(AGENTIC["seed"])
    task = calculator_task()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = task.dataset(n=AGENTIC["train_rows"], seed=AGENTIC["seed"], split="train")
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    stats: list[dict] = []

    def reward(prompts, completions, answer, **kw):
        return task.reward(prompts, completions, answer=answer)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            CLOCK.begin()

        def on_step_end(self, *a, **k):
            CLOCK.end()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs:
                stats.append({k: v for k, v in logs.items() if "tool" in k or k in ("reward", "loss", "completions/mean_length")})

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-agentic-"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=AGENTIC["prompts_per_step"] * AGENTIC["n"], num_generations=AGENTIC["n"],
        gradient_accumulation_steps=1, max_completion_length=AGENTIC["max_tokens"],
        max_tool_calling_iterations=AGENTIC["max_turns"] - 1, temperature=AGENTIC["temperature"],
        learning_rate=AGENTIC["lr"], lr_scheduler_type="constant", beta=AGENTIC["kl"],
        max_grad_norm=AGENTIC["max_grad_norm"], max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=AGENTIC["seed"], gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          tools=[calculator], callbacks=[Clock()])
    t = time.perf_counter()
    trainer.train()
    rss.stop()
    res = CLOCK.summary()
    res.update(side="trl", version=trl.__version__, threads=torch.get_num_threads(), peak_rss_mb=rss.peak_mb,
               train_s=time.perf_counter() - t, trl_logs=stats, chat_template_replaced=trainer.chat_template is not None)
    if args.save:
        trainer.save_model(args.save)
        tok.save_pretrained(args.save)
    emit(res)


if __name__ == "__main__":
    main()
