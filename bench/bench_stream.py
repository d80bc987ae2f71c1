"""Streaming with partial rollouts against one-step-off and synchronous RL on a long-tail workload (issue 40).

    .venv/bin/python bench/bench_stream.py                     # tiny Qwen2, 3 rounds x 16 steps
    .venv/bin/python bench/bench_stream.py --rounds 1 --steps 4 # smoke test
    .venv/bin/python bench/bench_stream.py --model smollm2-135m-instruct --rounds 1 --steps 8 --prompts 4 \
        --configs streaming,"streaming stale KV"

The workload: 100 prompts, one in ten answered at length (drawn to ``--long`` tokens), the other nine by a
script in ``--short`` tokens (seven tokens and the end token: ``Rollout(script=...)`` emits them while the
model scores every one, so the engine does the same work as for drawn tokens). GRPO, HF engine, split
placement (actor and rollout worker one core each), three loops on the same resources, each run a fresh
process, rounds rotating the order:

- ``split sync``: generate, then train;
- ``one-step-off``: ``off_policy_steps=1`` (TIS): step k+1's batch samples while step k trains;
- ``streaming``: ``streaming=True`` (TIS), chunks of ``--chunk`` tokens, weights landing mid-sample,
  ``max_staleness=--staleness``, ``stream_groups`` the default 2 x prompts_per_step;
- ``streaming 4P``: the same with 4 x prompts_per_step groups running or buffered (more samples per chunk);
- ``streaming stale KV``: ``stream_stale_kv=True``, a running sample keeps its keys and values across weight
  updates (no prefill after an update; without it, an update costs each running sample one prefill).

Per step from the metrics rows: step seconds, the trainer's wait for its batch, the update; trained tokens
(response tokens in the batch) per second of wall clock over the measured steps; the share of the wall clock
each side computes (rollout: the engines' own time, ``timing/generate``; trainer: the update) and both at
once (their sum past 1; 0 when the loop alternates). The first ``--warmup`` steps are left out.
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
CONFIGS = {"split sync": dict(),
           "one-step-off": dict(off_policy_steps=1, offpolicy_correction="tis"),
           "streaming": dict(streaming=True, offpolicy_correction="tis"),
           "streaming 4P": dict(streaming=True, offpolicy_correction="tis", stream_groups=4),  # x prompts_per_step
           "streaming stale KV": dict(streaming=True, offpolicy_correction="tis", stream_stale_kv=True)}
SHORT_TEXT = "xyzxyzx<|endoftext|>"  # 7 tokens and the end token in the tiny tokenizer


def short_text(tokenizer) -> str:
    """Seven tokens and the end token in ``tokenizer`` (the tiny one: ``SHORT_TEXT``)."""
    ids = tokenizer.encode("xyz" * 20, add_special_tokens=False)[:7]
    return tokenizer.decode(ids) + tokenizer.eos_token


def rows_and_script(long_every: int = 10, short: str = SHORT_TEXT) -> tuple[list[dict], tuple]:
    rows = [{"prompt": c * k, "letter": c} for c in "abcdefghij" for k in range(1, 11)]
    script = tuple((rf"\A{r['prompt']}", short) for i, r in enumerate(rows) if i % long_every)
    return rows, script


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    torch.set_num_threads(1)
    if args.model == "tiny-qwen2":
        model, short = rlkit.models.tiny_lm("qwen2", size="small"), SHORT_TEXT
    else:
        from transformers import AutoTokenizer

        model = rlkit.models.pretrained(args.model)
        short = short_text(AutoTokenizer.from_pretrained(model))
    rows, script = rows_and_script(short=short)
    cfg = dict(CONFIGS[args.config])
    if cfg.get("streaming"):
        cfg.update(stream_chunk_tokens=args.chunk, max_staleness=args.staleness,
                   stream_groups=cfg.get("stream_groups", 2) * args.prompts)
    tr = rlkit.Trainer(model=model, dataset=rows,
                       reward=rlkit.tasks.repeat.reward, algorithm="grpo", placement="split",
                       rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=args.long, script=script),
                       prompts_per_step=args.prompts, lr=args.lr, seed=args.seed, train_size=len(rows),
                       run_dir=f"runs/bench-stream/{args.config}", **cfg)
    t_fit = time.perf_counter()
    df = tr.fit(steps=args.steps, view="none")
    wall = time.perf_counter() - t_fit
    tr.close()
    df["trained_tokens"] = df["response_length/mean"] * args.prompts * args.n
    cols = [c for c in ("reward/mean", "timing/step", "timing/wait_generate", "timing/update", "timing/generate",
                        "trained_tokens",
                        "offpolicy/staleness_max", "stream/dropped_stale", "stream/crossed_share") if c in df.columns]
    print("RESULT " + json.dumps({"config": args.config, "wall_s": wall, "rows": df[cols].to_dict(orient="list")}),
          flush=True)


def run(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--config", config] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("worker", "config", "rounds", "configs")]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{config} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def summary(res: dict, warmup: int) -> dict:
    r = res["rows"]
    step, tokens = r["timing/step"][warmup:], r["trained_tokens"][warmup:]
    out = {"steps/s": 1 / statistics.median(step), "trained tok/s": sum(tokens) / sum(step),
           "step s": statistics.median(step), "update s": statistics.median(r["timing/update"][warmup:])}
    wait = r.get("timing/wait_generate")
    out["wait s"] = statistics.median(wait[warmup:]) if wait and all(w == w for w in wait[warmup:]) else float("nan")
    # the share of the step each side computes: the rollout engines (their own time for the step's tokens) and
    # the trainer (the update); both at once is what overlap bought (0 in the synchronous loop)
    gen, upd = r["timing/generate"][warmup:], r["timing/update"][warmup:]
    out["rollout busy"] = min(1.0, sum(gen) / sum(step))
    out["trainer busy"] = sum(upd) / sum(step)
    out["both busy"] = max(0.0, out["rollout busy"] + out["trainer busy"] - 1.0)
    out["staleness max"] = max(r.get("offpolicy/staleness_max", [0.0]))
    out["dropped groups"] = sum(r.get("stream/dropped_stale", [0.0]))
    out["crossed share"] = statistics.mean(r.get("stream/crossed_share", [0.0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--long", type=int, default=64, help="max_new_tokens: the long answers' length")
    ap.add_argument("--chunk", type=int, default=8, help="streaming: tokens per chunk")
    ap.add_argument("--staleness", type=int, default=8, help="streaming: max_staleness")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny-qwen2", help="tiny-qwen2, or a pretrained name (smollm2-135m-instruct)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated runs (split sync and one-step-off "
                                                                 "are always in: the ratios' baselines)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    chosen = args.configs.split(",")
    unknown = set(chosen) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    order = [c for c in CONFIGS if c in chosen or c in ("split sync", "one-step-off")]
    results: dict[str, list[dict]] = {c: [] for c in order}
    for r in range(args.rounds):
        for c in order[r % len(order):] + order[:r % len(order)]:
            res = run(c, args)
            results[c].append(res)
            print(f"round {r + 1} {c}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary(res, args.warmup).items()),
                  flush=True)
    print(f"\n{args.model}, GRPO, {args.prompts} prompts x n={args.n}, one prompt in ten answered in {args.long} tokens, "
          f"the rest in 8; {args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds, {os.cpu_count()} cores; "
          f"medians over rounds\n")
    keys = list(summary(results["split sync"][0], args.warmup))
    print("| run | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    table = {}
    for c, rs in results.items():
        sums = [summary(x, args.warmup) for x in rs]
        table[c] = {k: statistics.median([s[k] for s in sums]) for k in keys}
        print(f"| {c} | " + " | ".join("-" if v != v else f"{v:.3f}" for v in table[c].values()) + " |")
    off, sync = table["one-step-off"], table["split sync"]
    for name in [c for c in order if c.startswith("streaming")]:
        st = table[name]
        print(f"\n{name} / one-step-off trained tokens/s: {st['trained tok/s'] / off['trained tok/s']:.2f}x; "
              f"{name} / split sync: {st['trained tok/s'] / sync['trained tok/s']:.2f}x")
    print(f"one-step-off / split sync: {off['trained tok/s'] / sync['trained tok/s']:.2f}x")
    print("\nreward per step and wall-clock second (first round):")
    for c, rs in results.items():
        t, curve = 0.0, []
        for rew, s in zip(rs[0]["rows"]["reward/mean"], rs[0]["rows"]["timing/step"]):
            t += s
            curve.append(f"{rew:.3f}@{t:.1f}s")
        print(f"  {c}: {' '.join(curve)}")


if __name__ == "__main__":
    main()
