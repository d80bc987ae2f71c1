"""Padding-free training against the padded layout: GRPO on the real SmolLM2-135M-Instruct.

    .venv/bin/python bench/bench_padding_free.py                              # 3 rounds x 4 steps, both tasks, dp=1, fp32
    .venv/bin/python bench/bench_padding_free.py --rounds 1 --steps 2         # smoke test
    .venv/bin/python bench/bench_padding_free.py --precision bf16-mixed       # bf16 autocast update
    .venv/bin/python bench/bench_padding_free.py --dp 2                       # two Ray ranks (embedded cluster, FSDP2)
    .venv/bin/python bench/bench_padding_free.py --micro-batch-tokens 2048    # padding-free micro-batches of <= 2048 tokens
    .venv/bin/python bench/bench_padding_free.py --tasks mixed                # one task only

Configurations: ``padded`` (``TrainerConfig(padding_free=False)``, the old layout: every row padded to the
longest prompt + max_new_tokens) and ``padding-free`` (``padding_free=True``, sequences packed several to a
row; ``--micro-batch-tokens`` sets ``micro_batch_tokens``). Each run is a fresh process (this script with
``--worker``), so start-up, memory and caches are per run; in round r the two run in alternating order,
on the same seed (the first step's samples are identical; later ones may drift with the weights).

Tasks (GRPO, HF engine, no KL, lr 1e-6, ``--prompts`` prompts x ``--n`` samples a step):
- ``arith``: ``rlkit.tasks.ChatArithmetic(digits=1)`` as bench_real_grpo.py runs it ("What is 9 + 4? Answer
  with just the number.", max_new_tokens = the task's 14 unless ``--arith-max-new-tokens``); replies
  range from a bare number to a sentence.
- ``mixed``: half the prompts ask for one word ("Answer with one word: what color is the sky?"), half
  for a long list ("List 30 fruits, one per line."), max_new_tokens ``--mixed-max-new-tokens`` (128):
  replies from a few tokens to the limit. Reward: a one-word reply, or the number of lines / 30.

Per step the worker records the metrics row's ``timing/update`` (the actor's update phase: forward,
backward, optimizer step), ``timing/step`` (the whole step), and from the step's batch the REAL tokens
(sum of ``attention_mask``: prompts and responses, no padding) and the padding share of the update's
layout: padded ``1 - real / (rows x width)``; padding-free ``1 - real / sum(packed rows x packed
width)``, recomputed with ``rlkit.parallel.packing.pack`` on each DP rank's chunk exactly as the workers
cut it (``balanced_order`` at dp > 1, the largest micro-batch count across ranks, empty rows kept).
Update tokens/s = real tokens / update seconds. The first ``--warmup`` steps of each run (default 1)
are left out. Peak RSS: ``ru_maxrss`` of each worker process (in-process at dp=1: the run's process,
model load included), the largest rank.

Tables: every run (medians over its measured steps), then per task and configuration the medians over
rounds, with the padding-free update's speed-up (padded update s / padding-free update s, median of the
per-round ratios). Timing numbers mean something only from a quiet machine and interleaved rounds.
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
MODEL = "smollm2-135m-instruct"

SHORT = ["what color is the sky on a clear day?", "what is the capital of France?", "what animal says moo?",
         "what is frozen water called?", "what is the opposite of hot?", "which planet do we live on?",
         "what do bees make?", "what is the largest ocean?"]
LONG = ["fruits", "animals", "countries", "colors", "vegetables", "cities", "sports", "musical instruments"]


def mixed_rows() -> list[dict]:
    """The mixed task's rows, short and long alternating (chats, with the kind as a column)."""
    rows = []
    for q, thing in zip(SHORT, LONG):
        rows.append({"prompt": [{"role": "user", "content": f"Answer with one word: {q}"}], "kind": "short"})
        rows.append({"prompt": [{"role": "user", "content": f"List 30 {thing}, one per line."}], "kind": "long"})
    return rows


def mixed_reward(prompts, completions, kind, **_):
    """short: 1 for a one-word reply; long: lines / 30 (at most 1)."""
    out = []
    for text, k in zip(completions, kind):
        text = str(text).split("<|im_end|>")[0].strip()
        if k == "short":
            out.append(1.0 if len(text.split()) == 1 else 0.0)
        else:
            out.append(min(len([ln for ln in text.splitlines() if ln.strip()]), 30) / 30)
    return out


# ---- the worker: one run in this process ------------------------------------------------------------
def _peak_rss_mb(worker) -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def layout_stats(input_ids, attention_mask, *, padding_free: bool, dp: int, token_budget: int | None,
                 n_micro: int = 1) -> dict:
    """Real tokens, the update's (rows, width, area) and its padding share, for the layout the update ran."""
    from rlkit.parallel.packing import balanced_order, pack

    real = int(attention_mask.sum())
    B, S = input_ids.shape
    if not padding_free:
        return {"real_tokens": real, "rows": B, "width": S, "area": B * S, "pad_share": 1 - real / (B * S)}
    order = list(range(B))
    if dp > 1 and B % dp == 0:  # as RLWorkers._call_dp deals the samples (minibatches=1)
        order = balanced_order(attention_mask.sum(-1).tolist(), dp, 1)
    ids, am = input_ids[order], attention_mask[order]
    k = B // dp
    chunks = [(ids[d * k:(d + 1) * k], am[d * k:(d + 1) * k]) for d in range(dp)]

    def packs(n: int):
        return [pack(i, a, token_budget=token_budget, n_micro=n, keep_empty=dp > 1) for i, a in chunks]

    per_rank = packs(n_micro)
    most = max(len(p) for p in per_rank)
    if dp > 1 and any(len(p) < most for p in per_rank):  # ParallelModel._pack: every rank takes the largest count
        per_rank = packs(most)
    mbs = [mb for p in per_rank for mb in p]
    area = sum(mb.input_ids.numel() for mb in mbs)
    return {"real_tokens": real, "rows": sum(mb.input_ids.shape[0] for mb in mbs),
            "width": max(mb.input_ids.shape[1] for mb in mbs), "micro_batches": most, "area": area,
            "pad_share": 1 - real / area}


def worker(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import tempfile

    import torch

    import rlkit

    if args.threads:
        torch.set_num_threads(args.threads)
    path = rlkit.models.pretrained(MODEL)
    pf = args.config == "padding-free"
    common = dict(algorithm="grpo", plan=rlkit.ParallelPlan(dp=args.dp), prompts_per_step=args.prompts,
                  lr=1e-6, kl_coef=0.0, seed=args.seed, precision=args.precision, padding_free=pf,
                  micro_batch_tokens=args.micro_batch_tokens if pf else None,
                  run_dir=tempfile.mkdtemp(prefix="rlkit-bench-pf-"))
    cluster = rlkit.Cluster(cpus_per_worker=args.threads) if (args.dp > 1 and args.threads) else None
    if args.task == "arith":
        task = rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)
        new = args.arith_max_new_tokens or task.max_new_tokens
        tr = rlkit.Trainer(model=path, dataset=task, cluster=cluster, **common,
                           rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=new, dtype=args.rollout_dtype))
    else:
        new = args.mixed_max_new_tokens
        tr = rlkit.Trainer(model=path, dataset=mixed_rows(), reward=mixed_reward, cluster=cluster, **common,
                           rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=new, dtype=args.rollout_dtype))
    ready = time.perf_counter() - t0
    steps = []
    try:
        for s in range(args.steps):
            prompts = None
            if args.task == "mixed":  # half short, half long every step (tr.rows: the chats rendered)
                short = [r for r in tr.rows if r["kind"] == "short"]
                long_ = [r for r in tr.rows if r["kind"] == "long"]
                half, rest = args.prompts // 2, args.prompts - args.prompts // 2
                pick = [short[(s * half + j) % len(short)] for j in range(half)]
                pick += [long_[(s * rest + j) % len(long_)] for j in range(rest)]
                prompts = [dict(r, _row=tr.rows.index(r)) for r in pick]
            batch = tr.generate(prompts)
            row = tr.update(tr.estimate(batch))
            ids, am, rm = batch.samples["input_ids"], batch.samples["attention_mask"], batch.samples["response_mask"]
            st = layout_stats(ids, am, padding_free=pf, dp=args.dp, token_budget=common["micro_batch_tokens"])
            resp = rm.sum(1)
            steps.append({"step": s + 1, "update_s": row["timing/update"], "step_s": row["timing/step"],
                          "generate_s": row["timing/generate"], "samples": len(resp),
                          "resp_min": int(resp.min()), "resp_median": float(resp.median()), "resp_max": int(resp.max()),
                          "reward": row["reward/mean"], **st})
            print(f"step {s + 1}: " + json.dumps(steps[-1]), file=sys.stderr, flush=True)
        rss = tr.group.apply(_peak_rss_mb)
    finally:
        tr.close()
        if cluster is not None:
            cluster.shutdown()
    print("RESULT " + json.dumps({"ready_s": ready, "max_new_tokens": new, "threads": torch.get_num_threads(),
                                  "peak_rss_mb": max(rss), "peak_rss_mb_ranks": rss, "steps": steps}), flush=True)


# ---- the orchestrator ---------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, task: str, config: str, log_dir: Path, r: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--task", task, "--config", config,
           "--steps", str(args.steps), "--seed", str(args.seed), "--precision", args.precision, "--dp", str(args.dp),
           "--prompts", str(args.prompts), "--n", str(args.n), "--rollout-dtype", args.rollout_dtype,
           "--mixed-max-new-tokens", str(args.mixed_max_new_tokens)]
    for flag, v in (("--micro-batch-tokens", args.micro_batch_tokens), ("--threads", args.threads),
                    ("--arith-max-new-tokens", args.arith_max_new_tokens)):
        if v is not None:
            cmd += [flag, str(v)]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    wall = time.perf_counter() - t
    log = log_dir / f"{task}-{config}-round{r}.log"
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
        raise RuntimeError(f"{task} / {config} (round {r}) failed with exit {proc.returncode}; log {log}:\n{tail}")
    res = json.loads(lines[-1][len("RESULT "):])
    res.update(wall_s=wall, load_1min=load)
    return res


def summarize_run(res: dict, warmup: int) -> dict:
    measured = res["steps"][warmup:] or res["steps"][-1:]  # too few steps: the last one, flagged below
    med = lambda k: statistics.median(s[k] for s in measured)  # noqa: E731
    return {"measured_steps": len(res["steps"][warmup:]), "update_s": med("update_s"), "step_s": med("step_s"),
            "generate_s": med("generate_s"),
            "update_real_tok_s": statistics.median(s["real_tokens"] / s["update_s"] for s in measured),
            "pad_share": statistics.mean(s["pad_share"] for s in measured), "real_tokens": med("real_tokens"),
            "rows_x_width": "/".join(f"{s['rows']}x{s['width']}" for s in measured[:3]),
            "resp_min_med_max": "/".join(f"{min(s['resp_min'] for s in measured)}"
                                         f" {statistics.median(s['resp_median'] for s in measured):g}"
                                         f" {max(s['resp_max'] for s in measured)}".split()),
            "peak_rss_mb": res["peak_rss_mb"], "ready_s": res["ready_s"], "wall_s": res["wall_s"],
            "load_1min": res["load_1min"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per run (the first --warmup are not counted)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tasks", nargs="+", default=["arith", "mixed"], choices=["arith", "mixed"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--rollout-dtype", default="float32", help="the HF engine's dtype (float32: the actor's tensors)")
    ap.add_argument("--dp", type=int, default=1, help="1: in-process; >1: Ray ranks on the embedded cluster")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="padding-free runs' micro_batch_tokens")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--arith-max-new-tokens", type=int, default=None, help="default: the task's (14)")
    ap.add_argument("--mixed-max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (dp=1) or CPUs per Ray rank (dp>1); default: rlkit's / torch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    ap.add_argument("--log-dir", default=None, help="each run's output (default: a temp folder)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    import tempfile

    import pandas as pd

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-padding-free-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    pf_label = "padding-free" + (f" (mbt={args.micro_batch_tokens})" if args.micro_batch_tokens else "")
    print(f"GRPO on {MODEL}, {args.prompts} prompts x n={args.n}, dp={args.dp}, {args.precision}, rollout "
          f"{args.rollout_dtype}, {args.rounds} round(s) x {args.steps} steps (first {args.warmup} not counted), "
          f"{os.cpu_count()} CPU cores; logs in {log_dir}", flush=True)
    runs = []
    for task in args.tasks:
        for r in range(args.rounds):
            order = ["padded", "padding-free"] if r % 2 == 0 else ["padding-free", "padded"]
            for config in order:
                res = run_one(args, task, config, log_dir, r)
                row = {"task": task, "round": r, "config": config if config == "padded" else pf_label,
                       **summarize_run(res, args.warmup)}
                runs.append(row)
                print(f"  {task:5s} round {r} {row['config']:14s} update {row['update_s']:.2f} s  step "
                      f"{row['step_s']:.2f} s  pad share {row['pad_share']:.1%}  ({row['wall_s']:.0f} s)", flush=True)
    df = pd.DataFrame(runs)
    if (df["measured_steps"] == 0).any():
        print(f"\nnote: --steps {args.steps} <= --warmup {args.warmup}: the statistics use the last (warm-up) step")
    pd.set_option("display.width", 220)
    pd.set_option("display.max_columns", 30)
    print("\nEvery run (medians over its measured steps; rows_x_width: the update's layout, first measured steps):")
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))

    out = []
    for task, g in df.groupby("task", sort=False):
        ratios = []
        for _, gr in g.groupby("round"):
            pad, free = gr[gr.config == "padded"], gr[gr.config != "padded"]
            if len(pad) and len(free):
                ratios.append(pad.update_s.iloc[0] / free.update_s.iloc[0])
        for config, gc in g.groupby("config", sort=False):
            out.append({"task": task, "config": config, "rounds": len(gc),
                        "update s/step": gc.update_s.median(), "step s": gc.step_s.median(),
                        "update real tok/s": gc.update_real_tok_s.median(),
                        "real tokens/step": gc.real_tokens.median(),
                        "pad share in update": gc.pad_share.median(),
                        "peak RSS MB": gc.peak_rss_mb.median(),
                        "update speed-up": statistics.median(ratios) if config != "padded" and ratios else float("nan")})
    table = pd.DataFrame(out)
    table["update speed-up"] = [f"{x:.2f}x" if x == x else "-" for x in table["update speed-up"]]
    print("\nMedians over rounds (update speed-up: padded / padding-free update s, median of per-round ratios):")
    print(table.to_string(index=False, formatters={
        "update s/step": "{:.2f}".format, "step s": "{:.2f}".format, "update real tok/s": "{:.0f}".format,
        "real tokens/step": "{:.0f}".format, "pad share in update": "{:.1%}".format, "peak RSS MB": "{:.0f}".format,
    }))
    print(f"\nload average (1 min) before the runs: {df.load_1min.min():.2f}-{df.load_1min.max():.2f}")


if __name__ == "__main__":
    main()
