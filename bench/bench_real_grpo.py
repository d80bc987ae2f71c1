"""GRPO on the real SmolLM2-135M-Instruct: the held-out curve and the step time, printed as tables.

Chat arithmetic (``rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)``: 75 training and 25
held-out questions), 4 questions x 8 samples a step, HF engine, dp=2 on the embedded local cluster. Held-out questions (test split) are answered greedily and sampled
before training and every ``--eval-every`` steps. Nothing here is a test (tests/test_real_model.py holds
the margin); the numbers in bench/README.md come from this script.

    .venv/bin/python bench/bench_real_grpo.py [--steps 20] [--eval-every 5] [--eval-samples 4] [--lr 2e-5]
"""

from __future__ import annotations

import argparse
import os

import torch

from rlkit.demo import real_model_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-samples", type=int, default=4, help="sampled answers per held-out question")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="samples per question")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = real_model_run(steps=args.steps, eval_every=args.eval_every, eval_samples=args.eval_samples,
                         digits=args.digits,
                         lr=args.lr, dp=args.dp, prompts_per_step=args.prompts_per_step,
                         n=args.n, seed=args.seed, view="tqdm", run_dir="runs/bench-real-grpo")
    m = out["metrics"]
    print(f"\nGRPO, SmolLM2-135M-Instruct, ChatArithmetic(digits={args.digits}), {args.prompts_per_step} prompts x "
          f"n={args.n}, lr={args.lr}, "
          f"dp={args.dp}, {os.cpu_count()} CPU cores")
    print(out["curve"].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    phases = {k.removeprefix("timing/"): m[k].median() for k in m.columns if k.startswith("timing/")}
    print("\nmedian seconds per step and phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    print(f"peak RSS per worker: {m['memory/rss_max_gb'].max():.2f} GB")
    print("\nlast step's samples:")
    print(out["samples"][["completion", "reward"]].head(8).to_string(index=False))


if __name__ == "__main__":
    main()
