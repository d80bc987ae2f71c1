"""Asynchronous (one-step-off) RL against synchronous RL, GRPO on the same work, interleaved rounds.

    .venv/bin/python bench/bench_async.py                               # tiny Qwen2, 3 rounds x 12 steps
    .venv/bin/python bench/bench_async.py --model smollm2-135m-instruct --task chat-arithmetic --steps 8
    .venv/bin/python bench/bench_async.py --rounds 1 --steps 4          # smoke test

Configurations (each run a fresh process: this script with ``--worker``):
- ``colocated sync``: one-rank colocated Trainer (the HybridEngine: generation and update take turns on
  the same process, which uses every core for each phase) - the best synchronous configuration here;
- ``split sync``: rollout on a worker of its own (``placement="split"``), ``off_policy_steps=0``;
- ``split one-step-off``: the same with ``off_policy_steps=1`` (and TIS): step k+1's batch samples while step
  k trains.
Split runs put the actor and the rollout worker on one core each (``Placement`` reserves one CPU per
worker); the colocated run's one process gets both cores.

Per step, from the metrics rows: step seconds (``timing/step``), the engines' own generation seconds
(``timing/generate``), the trainer's wait for a batch (``timing/wait_generate``, async only), the update
seconds. Overlap achieved (async): ``generate + (step - wait) - step``, the seconds both sides were busy at
once, as a share of the shorter side. The first ``--warmup`` steps are left out of the medians. Reward
per step and per wall-clock second are printed for the learning curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"colocated sync": dict(placement="colocated", off_policy_steps=0),
           "split sync": dict(placement="split", off_policy_steps=0),
           "split one-step-off": dict(placement="split", off_policy_steps=1, offpolicy_correction="tis")}


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    cfg = CONFIGS[args.config]
    torch.set_num_threads(2 if cfg["placement"] == "colocated" else 1)
    if args.model.startswith("tiny"):
        model = rlkit.models.tiny_lm("qwen2", size="small")
        task, reward = rlkit.tasks.repeat, None
    else:
        model = rlkit.models.pretrained(args.model)
        task = rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)
        reward = None
    max_new = args.max_new_tokens or getattr(task, "max_new_tokens", 16)
    t0 = time.perf_counter()
    tr = rlkit.Trainer(model=model, dataset=task, reward=reward, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=max_new),
                       prompts_per_step=args.prompts, lr=args.lr, seed=args.seed, run_dir=f"runs/bench-async/{args.config}",
                       **cfg)
    start = time.perf_counter() - t0
    t_fit = time.perf_counter()
    df = tr.fit(steps=args.steps, view="none")
    wall = time.perf_counter() - t_fit
    tr.close()
    cols = [c for c in ("reward/mean", "timing/step", "timing/generate", "timing/wait_generate", "timing/update",
                        "offpolicy/staleness_max", "offpolicy/kl") if c in df.columns]
    print("RESULT " + json.dumps({"config": args.config, "startup_s": start, "wall_s": wall,
                                  "rows": df[cols].to_dict(orient="list")}), flush=True)


def run(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--config", config, "--model", args.model, "--steps", str(args.steps),
           "--n", str(args.n), "--prompts", str(args.prompts), "--lr", str(args.lr),
           "--max-new-tokens", str(args.max_new_tokens or 0), "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{config} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summary(res: dict, warmup: int) -> dict:
    rows = res["rows"]
    step = rows["timing/step"][warmup:]
    gen = rows["timing/generate"][warmup:]
    upd = rows["timing/update"][warmup:]
    out = {"steps/s": 1 / med(step), "step s": med(step), "generate s": med(gen), "update s": med(upd)}
    if "timing/wait_generate" in rows:
        wait = rows["timing/wait_generate"][warmup:]
        busy = [s - w for s, w in zip(step, wait)]  # the trainer's side of each step
        overlap = [max(0.0, g + b - s) for g, b, s in zip(gen, busy, step)]
        out["wait s"] = med(wait)
        out["overlap s"] = med(overlap)
        out["overlap share"] = med([o / max(1e-9, min(g, b)) for o, g, b in zip(overlap, gen, busy)])
        out["floor s"] = med([max(g, b) for g, b in zip(gen, busy)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-new-tokens", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed (prompt order, sampling, adapters)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    order = list(CONFIGS)
    for r in range(args.rounds):
        for c in order[r % len(order):] + order[:r % len(order)]:  # rotate the order each round
            res = run(c, args)
            results[c].append(res)
            s = summary(res, args.warmup)
            print(f"round {r + 1} {c}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()), flush=True)
    print(f"\n{args.model}, GRPO, {args.prompts} prompts x n={args.n}, {args.steps} steps ({args.warmup} warm-up), "
          f"{args.rounds} rounds, {os.cpu_count()} CPU cores; medians over rounds of per-run medians\n")
    keys = ["steps/s", "step s", "generate s", "update s", "wait s", "overlap s", "overlap share", "floor s"]
    print("| run | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    table = {}
    for c, rs in results.items():
        sums = [summary(x, args.warmup) for x in rs]
        table[c] = {k: med([s[k] for s in sums if k in s]) for k in keys}
        print(f"| {c} | " + " | ".join("-" if v != v else f"{v:.3f}" for v in table[c].values()) + " |")
    a, s, co = table["split one-step-off"], table["split sync"], table["colocated sync"]
    print(f"\none-step-off / split sync steps/s: {a['steps/s'] / s['steps/s']:.2f}x; one-step-off / colocated sync: "
          f"{a['steps/s'] / co['steps/s']:.2f}x; one-step-off step time / the longer phase (floor): "
          f"{a['step s'] / a['floor s']:.2f}")
    print("\nreward per step (first round) and per wall-clock second:")
    for c, rs in results.items():
        rows = rs[0]["rows"]
        t = 0.0
        curve = []
        for rew, st in zip(rows["reward/mean"], rows["timing/step"]):
            t += st
            curve.append(f"{rew:.3f}@{t:.0f}s")
        print(f"  {c}: {' '.join(curve)}")


if __name__ == "__main__":
    main()
