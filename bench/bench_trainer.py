"""Trainer speed: GRPO steps/s and per-phase time on the tiny model, for several placements.

Equal work to TRL's GRPO reference numbers in DEVELOPERS.md (tiny model, 8 prompts x 8 samples x 16
new tokens a step). Prints a table; nothing here is a test.

    .venv/bin/python bench/bench_trainer.py [--steps 20] [--engines hf,vllm]
"""

from __future__ import annotations

import argparse
import os

import torch

import rlkit


def run(name: str, steps: int, **kw) -> dict:
    tr = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat,
                       algorithm="grpo", prompts_per_step=8, lr=2e-3, run_dir=f"runs/bench-{name}", **kw)
    try:
        df = tr.fit(steps=steps, view="none").iloc[2:]  # the first steps carry warm-up
    finally:
        tr.close()
    row = {"config": name, "steps/s": 1 / df["timing/step"].mean(), "tokens/s": df["tokens_per_s"].mean()}
    for phase in ("generate", "reward", "update", "sync"):
        row[f"{phase} ms"] = 1e3 * df[f"timing/{phase}"].mean()
    row["sync MiB"] = df["sync/bytes"].iloc[-1] / 2**20
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engines", default="hf,vllm")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engines = [e for e in args.engines.split(",") if e != "vllm" or rlkit.rollout.vllm_available()]
    rows = []
    for engine in engines:
        rollout = rlkit.Rollout(engine=engine, n=8, max_new_tokens=16)
        rows.append(run(f"{engine} dp=1", args.steps, plan=rlkit.ParallelPlan(dp=1), rollout=rollout))
        rows.append(run(f"{engine} dp=2", args.steps, plan=rlkit.ParallelPlan(dp=2), rollout=rollout))
        rows.append(run(f"{engine} dp=2 split", args.steps, plan=rlkit.ParallelPlan(dp=2), rollout=rollout,
                        placement="split", rollout_workers=2))
    import pandas as pd

    print(f"GRPO, tiny Qwen2 (~1M params), 8 prompts x n=8 x 16 tokens, {os.cpu_count()} CPU cores")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
