"""The same GRPO work on each training backend (rlkit.backends): torch-native, Megatron-Core, DeepSpeed.

    .venv/bin/python bench/bench_backends.py                          # tiny + SmolLM2, dp=1 and dp=2, 2 rounds x 4 steps
    .venv/bin/python bench/bench_backends.py --models tiny --rounds 1 --steps 2     # smoke test

Work (identical on every backend): GRPO, HF engine, ``--prompts`` prompts x ``--n`` samples a step, fp32, the
padded layout (``padding_free=False``: packing is the torch backend's feature, and the others train padded),
lr 1e-6 on SmolLM2-135M-Instruct (``rlkit.tasks.ChatArithmetic(digits=1)``), 2e-3 on the tiny model
(``rlkit.tasks.repeat``). Layouts: ``dp=1`` (one Ray rank) and ``dp=2`` with the weights replicated (DDP for
torch and Megatron; DeepSpeed at ZeRO-2, gradients and optimizer state sharded). Each run is a fresh process
(this script with ``--worker``); in each round the backends run one after another in a rotated order. The first
step of each run (warm-up) is left out; the tables give medians of ``timing/step`` and ``timing/update`` (the
actor's forward, backward and optimizer step) over the measured steps, then over rounds.

CPU timings say little about GPUs: Megatron's fused kernels (Transformer Engine, fused RoPE/softmax, gradient
accumulation fusion), its distributed optimizer and overlapped gradient reduction, and DeepSpeed's fused Adam and
CPU/NVMe offload are GPU features this machine cannot show.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("torch", "megatron", "deepspeed")


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    torch.set_num_threads(1)
    if args.model == "tiny":
        model, task, lr, new = rlkit.models.tiny_lm("qwen2", size="small"), rlkit.tasks.repeat, 2e-3, 16
    else:
        model, task, lr, new = rlkit.models.pretrained("smollm2-135m-instruct"), rlkit.tasks.ChatArithmetic(digits=1), \
            1e-6, 14
    plan = rlkit.ParallelPlan(dp=args.dp, dp_shard="replicate")
    backend = rlkit.Backend("deepspeed", zero_stage=2 if args.dp > 1 else 0) if args.backend == "deepspeed" \
        else args.backend
    trainer = rlkit.Trainer(model=model, dataset=task, plan=plan, backend=backend, padding_free=False,
                            rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=new),
                            prompts_per_step=args.prompts, lr=lr, seed=0, run_dir=args.run_dir)
    try:
        df = trainer.fit(steps=args.steps, view="none")
    finally:
        trainer.close()
    rows = df.iloc[1:] if len(df) > 1 else df
    print("RESULT " + json.dumps({"step": float(rows["timing/step"].median()),
                                  "update": float(rows["timing/update"].median()),
                                  "reward": float(df["reward/mean"].mean())}))


def run(model: str, backend: str, dp: int, args: argparse.Namespace, tag: str) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--backend", backend, "--dp", str(dp),
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
           "--run-dir", f"/tmp/bench_backends/{tag}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    print(f"  {tag} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}", file=sys.stderr)
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", default="tiny")
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--backend", default="torch")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dps", default="1,2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--run-dir", default="/tmp/bench_backends/run")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    import pandas as pd

    results = []
    for model in args.models.split(","):
        for dp in (int(d) for d in args.dps.split(",")):
            for r in range(args.rounds):
                order = BACKENDS[r % 3:] + BACKENDS[:r % 3]  # rotated: no backend always runs first
                for backend in order:
                    res = run(model, backend, dp, args, f"{model}-dp{dp}-{backend}-r{r}")
                    if res is not None:
                        results.append({"model": model, "dp": dp, "backend": backend, "round": r, **res})
                        print(f"  {model} dp={dp} {backend} round {r}: step {res['step']:.3f} s, update "
                              f"{res['update']:.3f} s", flush=True)
    df = pd.DataFrame(results)
    print("\nevery run (medians over its measured steps):")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    table = df.groupby(["model", "dp", "backend"], sort=False)[["step", "update"]].median()
    torch_rows = table.xs("torch", level="backend")
    table["update vs torch"] = [row["update"] / torch_rows.loc[(m, d), "update"] for (m, d, _b), row in table.iterrows()]
    print("\nmedians over rounds (seconds; update vs torch: the backend's update time / torch's):")
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
