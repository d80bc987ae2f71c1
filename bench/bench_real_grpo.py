"""GRPO on the real SmolLM2-135M-Instruct: the held-out curve, the reward per step and the step time, printed
as tables.

Chat arithmetic (``rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)``: 75 training and 25
held-out questions), 4 questions x 8 samples a step, HF engine, dp=2 on the embedded local cluster. Held-out questions (test split) are answered greedily and sampled
before training and every ``--eval-every`` steps. Nothing here is a test (tests/test_real_model.py holds
the margin); the numbers in bench/README.md come from this script.

    .venv/bin/python bench/bench_real_grpo.py [--steps 20] [--eval-every 5] [--eval-samples 4] [--lr 2e-5]
    .venv/bin/python bench/bench_real_grpo.py --lora 16      # the same run training LoRA adapters (lr 2e-4)

``--lora R`` trains LoRA adapters instead of all weights: ``Trainer(lora=R)``, rlkit's shorthand (r=R,
lora_alpha=2R, no dropout, on q/k/v/o/gate/up/down_proj). Its default learning rate is 10x full fine-tuning's
(2e-4: LoRA's usual ratio); pass ``--lr`` to choose another (``--lr 2e-5`` for full fine-tuning's). Run
without and with ``--lora`` to compare the curves: each run prints its training reward per step and writes
it (with the held-out curve) as CSV into its run folder, ``runs/bench-real-grpo`` or
``runs/bench-real-grpo-lora-r{R}``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from rlkit.demo import real_model_run

FULL_LR = 2e-5
LORA_LR_FACTOR = 10  # --lora's default lr: FULL_LR x this


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-samples", type=int, default=4, help="sampled answers per held-out question")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"learning rate (default {FULL_LR:g}; with --lora {FULL_LR * LORA_LR_FACTOR:g})")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train LoRA adapters of rank R (alpha 2R, all attention and MLP projections) instead of "
                         "all weights")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="samples per question")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.lora is not None and args.lora < 1:
        ap.error(f"--lora {args.lora}: the rank must be a positive int")
    lr = args.lr if args.lr is not None else FULL_LR * (LORA_LR_FACTOR if args.lora else 1)
    run_dir = "runs/bench-real-grpo" + (f"-lora-r{args.lora}" if args.lora else "")
    torch.set_num_threads(1)
    out = real_model_run(steps=args.steps, eval_every=args.eval_every, eval_samples=args.eval_samples,
                         digits=args.digits, lr=lr, dp=args.dp, prompts_per_step=args.prompts_per_step,
                         n=args.n, seed=args.seed, view="tqdm", run_dir=run_dir, lora=args.lora)
    m = out["metrics"]
    what = f"LoRA r={args.lora} (alpha {2 * args.lora})" if args.lora else "full fine-tuning"
    print(f"\nGRPO, SmolLM2-135M-Instruct, {what}, ChatArithmetic(digits={args.digits}), {args.prompts_per_step} "
          f"prompts x n={args.n}, lr={lr:g}, "
          f"dp={args.dp}, {os.cpu_count()} CPU cores")
    print(out["curve"].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    per_step = m[["step", "reward/mean", "reward/std", "response_length/mean", "timing/step"]]
    print(f"\ntraining reward per step (mean over the step's {args.prompts_per_step} x {args.n} samples):")
    print(per_step.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    per_step.to_csv(Path(run_dir) / "reward_per_step.csv", index=False)
    out["curve"].to_csv(Path(run_dir) / "held_out_curve.csv", index=False)
    phases = {k.removeprefix("timing/"): m[k].median() for k in m.columns if k.startswith("timing/")}
    print("\nmedian seconds per step and phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"peak RSS per worker: {m['memory/rss_max_gb'].max():.2f} GB")
    print(f"reward per step and held-out curve as CSV in {run_dir}/")
    print("\nlast step's samples:")
    print(out["samples"][["completion", "reward"]].head(8).to_string(index=False))


if __name__ == "__main__":
    main()
