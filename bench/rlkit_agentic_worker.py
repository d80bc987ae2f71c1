"""One rlkit Trainer run with the calculator tool (bench_agentic_vs_trl.py's work), in its own process.

    .venv/bin/python bench/rlkit_agentic_worker.py MODEL_DIR STEPS [--save DIR] [--threads N]

``rlkit.Trainer(tools=[calculator], multi_turn=MultiTurn(max_turns, max_tokens))`` on
``vs_trl_common.AGENTIC``'s work, in-process (dp=1), HF engine, fp32: what trl_agentic_worker.py runs. The
model's chat template has tool syntax, so rlkit renders the tools with it (``apply_chat_template(tools=)``),
as TRL does. Prints ``RESULT {json}`` (steps/s after the warm-up steps, rlkit's episode metrics);
``--save DIR``: the trained model (``save_pretrained``), for the common held-out evaluation.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_trl_common import (  # noqa: E402
    AGENTIC,
    WARMUP_STEPS,
    PeakRSS,
    StepClock,
    agentic_worker_args,
    calculator_task,
    emit,
)

CLOCK = StepClock()  # before the heavy imports: they are part of start-up


def main() -> None:
    args = agentic_worker_args()
    rss = PeakRSS().start()
    import torch

    import rlkit

    if args.threads:
        torch.set_num_threads(args.threads)
    task = calculator_task()
    rows = task.dataset(n=AGENTIC["train_rows"], seed=AGENTIC["seed"], split="train")
    tr = rlkit.Trainer(model=args.model, dataset=rows, reward=task.reward, algorithm="grpo",
                       tools=task.tools, multi_turn=rlkit.MultiTurn(max_turns=AGENTIC["max_turns"],
                                                                    max_tokens=AGENTIC["max_tokens"]),
                       rollout=rlkit.Rollout(engine="hf", n=AGENTIC["n"], max_new_tokens=AGENTIC["max_new_tokens"],
                                             temperature=AGENTIC["temperature"]),
                       prompts_per_step=AGENTIC["prompts_per_step"], lr=AGENTIC["lr"], kl_coef=AGENTIC["kl"],
                       max_grad_norm=AGENTIC["max_grad_norm"], seed=AGENTIC["seed"],
                       run_dir=tempfile.mkdtemp(prefix="rlkit-agentic-"))
    step = tr.train_step

    def clocked_step():  # the bench's clock around each step (rlkit itself is not changed)
        CLOCK.begin()
        row = step()
        CLOCK.end()
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
    res = CLOCK.summary()
    eps = [c for c in m.columns if c.startswith("episode/") or c in ("reward/mean", "response_length/mean")]
    res.update(side="rlkit", version=getattr(rlkit, "__version__", "?"), threads=torch.get_num_threads(),
               peak_rss_mb=rss.peak_mb, episodes=m[eps].mean().to_dict(),
               phases_median_s={c[len("timing/"):]: float(m[c].iloc[WARMUP_STEPS:].median())
                                for c in m.columns if c.startswith("timing/")},
               step_s_median_rlkit=statistics.median(list(m["timing/step"].iloc[WARMUP_STEPS:])))
    emit(res)


if __name__ == "__main__":
    main()
