"""One rlkit Trainer run of bench_task_vs_trl.py's work (reasoning-gym basic_arithmetic), in its own process.

    .venv/bin/python bench/rlkit_task_worker.py MODEL_DIR STEPS --rows ROWS.json [--threads N] [--save DIR] [--warmup K]

``rlkit.Trainer`` on ``vs_trl_common.TASK``'s work, in-process (dp=1): the driver's train rows (chat prompts,
``question``, ``answer``; rlkit's own epoch order picks each step's questions), ``recorded_math_answer`` (rlkit's
``MathAnswer``) as the reward, GRPO with ``epochs=1`` (one optimizer step per batch), no KL, constant lr, grad
clip 1.0, ``precision="bf16-mixed"``, ``Rollout(engine="hf", dtype="bfloat16")``: what trl_task_worker.py runs.
Prints ``RESULT {json}``: steps/s after the warm-up steps, the median of each of rlkit's ``timing/<phase>``
metrics over the measured steps, the questions each step trained on (the driver checks both sides saw the
same); ``--save DIR``: the trained model (``save_pretrained``), for the common held-out evaluation.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_trl_common import TASK, PeakRSS, StepClock, emit, recorded_math_answer, task_worker_args  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up


def main() -> None:
    args = task_worker_args()
    rss = PeakRSS().start()
    import torch

    import rlkit

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = json.loads(open(args.rows).read())["rows"]
    calls: list[dict] = []
    tr = rlkit.Trainer(model=args.model, dataset=rows, reward=recorded_math_answer(calls), algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=TASK["n"], max_new_tokens=TASK["max_new_tokens"],
                                             temperature=TASK["temperature"], dtype="bfloat16"),
                       prompts_per_step=TASK["prompts_per_step"], epochs=1, lr=TASK["lr"], lr_schedule="constant",
                       kl_coef=TASK["kl"], max_grad_norm=TASK["max_grad_norm"], precision="bf16-mixed",
                       seed=args.seed, run_dir=tempfile.mkdtemp(prefix="rlkit-task-"))
    step = tr.train_step
    steps_of_calls: list[int] = []  # the step each reward call belongs to

    def clocked_step():  # the bench's clock around each step (rlkit itself is not changed)
        CLOCK.begin()
        before = len(calls)
        row = step()
        CLOCK.end()
        steps_of_calls.extend([len(CLOCK.ends) - 1] * (len(calls) - before))
        CLOCK.tokens.append(round(row["response_length/mean"] * TASK["prompts_per_step"] * TASK["n"]))
        return row

    tr.train_step = clocked_step
    try:
        tr.fit(steps=args.steps, view="none")
        m = tr.metrics
        if args.save:
            tr.save_pretrained(args.save)
    finally:
        tr.close()
    rss.stop()
    res = CLOCK.summary(warmup=args.warmup)
    measured = m.iloc[args.warmup:]
    questions = [[q for c, s in zip(calls, steps_of_calls) if s == i for q in c["questions"]]
                 for i in range(len(CLOCK.ends))]
    res.update(side="rlkit", version=getattr(rlkit, "__version__", "?"), threads=torch.get_num_threads(),
               peak_rss_mb=rss.peak_mb, warmup=args.warmup,
               phases_median_s={c[len("timing/"):]: float(measured[c].median())
                                for c in m.columns if c.startswith("timing/")},
               step_s_median_rlkit=statistics.median(list(measured["timing/step"])),
               reward_per_step=[float(x) for x in m["reward/mean"]],
               response_length_per_step=[float(x) for x in m["response_length/mean"]],
               step_s_per_step=[e - b for b, e in zip(CLOCK.begins, CLOCK.ends)], questions_per_step=questions)
    emit(res)


if __name__ == "__main__":
    main()
