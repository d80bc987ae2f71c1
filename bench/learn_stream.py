"""Learning with streaming and dynamic sampling, against on-policy, over seeds (issue 40).

    .venv/bin/python bench/learn_stream.py                    # 3 seeds x 6 runs, about 14 minutes on 2 cores
    .venv/bin/python bench/learn_stream.py --seeds 1 --steps 6 # smoke test

Two questions, each a table of per-seed numbers and their mean and spread:

1. **Reward per trained sample** (``rlkit.tasks.repeat``: repeat the prompt's letter 16 times, a per-letter
   reward; the tiny Qwen2 learns it from a random init). GRPO, split placement, the same steps and samples
   per step in every loop: split sync (on-policy), one-step-off (TIS), streaming with partial rollouts
   (``max_staleness=2``, chunks of 4 of the 17 tokens, so most samples cross updates; TIS) and the same with
   ``stream_stale_kv=True``. Reported: the mean training reward of the last ``--tail`` steps (the reward
   of the very samples each step trains on) and the greedy held-out reward after the last step.
2. **Dynamic sampling's held-out gain per step** on a task where many groups saturate:
   ``Repeat(length=2)`` (rewards 0, 0.5 or 1; a random policy's groups are mostly all 0, a trained one's
   mostly all 1). Split sync with and without ``dynamic_sampling=True``; the greedy held-out reward every
   ``--eval-every`` steps, the gain per step a least-squares slope over them, and the filtered share and the
   samples generated per kept one (what the gain costs).

Each run is a fresh process; runs and seeds interleave. Nothing here is timed for a claim.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASYNC = {"split sync": dict(),
         "one-step-off": dict(off_policy_steps=1, offpolicy_correction="tis"),
         "streaming": dict(streaming=True, max_staleness=2, stream_chunk_tokens=4, offpolicy_correction="tis"),
         "streaming stale KV": dict(streaming=True, max_staleness=2, stream_chunk_tokens=4, offpolicy_correction="tis",
                                    stream_stale_kv=True)}
DS = {"plain (length 2)": dict(), "dynamic sampling (length 2)": dict(dynamic_sampling=True, max_sampling_rounds=16)}
CONFIGS = {**ASYNC, **DS}


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    torch.set_num_threads(1)
    ds = args.config in DS
    task = rlkit.tasks.Repeat(length=2) if ds else rlkit.tasks.repeat
    tr = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="small"), dataset=task, algorithm="grpo",
                       placement="split", rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=task.max_new_tokens),
                       prompts_per_step=args.prompts, lr=args.lr, seed=args.seed,
                       run_dir=f"runs/learn-stream/{args.config}/{args.seed}", **CONFIGS[args.config])
    evals = []
    steps = 0
    while steps < args.steps:
        k = min(args.eval_every, args.steps - steps) if ds else args.steps
        tr.fit(steps=k, view="none")
        steps += k
        if ds:
            evals.append((steps, tr.evaluate(n=64)["reward"]))
    heldout = evals[-1][1] if ds else tr.evaluate(n=64)["reward"]
    df = tr.metrics
    tr.close()
    cols = [c for c in ("reward/mean", "dynamic/filtered_share", "dynamic/samples_per_kept") if c in df.columns]
    print("RESULT " + json.dumps({"config": args.config, "seed": args.seed, "heldout": heldout, "evals": evals,
                                  "rows": df[cols].to_dict(orient="list")}), flush=True)


def run(config: str, seed: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--config", config, "--seed", str(seed), "--steps", str(args.steps),
           "--n", str(args.n), "--prompts", str(args.prompts), "--lr", str(args.lr),
           "--eval-every", str(args.eval_every)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{config} seed {seed} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of held-out reward over the evaluated steps: the gain per step."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tail", type=int, default=10, help="training reward: the mean of the last steps")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    results: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    for seed in range(args.seeds):
        order = list(CONFIGS)
        order = order[seed % len(order):] + order[:seed % len(order)]
        for c in order:
            res = run(c, seed, args)
            results[c].append(res)
            tail = statistics.mean(res["rows"]["reward/mean"][-args.tail:])
            print(f"seed {seed} {c}: training reward (last {args.tail}) {tail:.3f}, held-out {res['heldout']:.3f}",
                  flush=True)

    print(f"\n1. reward per trained sample: tiny Qwen2, rlkit.tasks.repeat, GRPO, {args.prompts} prompts x "
          f"n={args.n}, {args.steps} steps, {args.seeds} seeds (mean ± sd over seeds)\n")
    print(f"| run | training reward, last {args.tail} steps, per seed | mean ± sd | held-out reward | "
          "held-out mean ± sd |")
    print("| --- | --- | --- | --- | --- |")
    for c in ASYNC:
        tails = [statistics.mean(r["rows"]["reward/mean"][-args.tail:]) for r in results[c]]
        held = [r["heldout"] for r in results[c]]
        print(f"| {c} | {' '.join(f'{t:.3f}' for t in tails)} | {spread(tails)} | "
              f"{' '.join(f'{h:.3f}' for h in held)} | {spread(held)} |")

    print(f"\n2. dynamic sampling: Repeat(length=2), split sync, held-out reward (greedy, 64 prompts) every "
          f"{args.eval_every} steps\n")
    print("| run | held-out by step (seed 0) | held-out at the last step, per seed | gain per step (slope), per seed "
          "| mean ± sd | filtered share | samples per kept |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in DS:
        gains = [slope(r["evals"]) for r in results[c]]
        filt = [statistics.mean(r["rows"].get("dynamic/filtered_share", [0.0])) for r in results[c]]
        kept = [statistics.mean(r["rows"].get("dynamic/samples_per_kept", [1.0])) for r in results[c]]
        curve = " ".join(f"{s}:{v:.2f}" for s, v in results[c][0]["evals"])
        last = " ".join(f"{r['heldout']:.3f}" for r in results[c])
        print(f"| {c} | {curve} | {last} | {' '.join(f'{g:.4f}' for g in gains)} | {spread(gains)} | "
              f"{statistics.mean(filt):.2f} | {statistics.mean(kept):.2f} |")


if __name__ == "__main__":
    main()
