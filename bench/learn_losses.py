"""GRPO, Dr.GRPO, GSPO, CISPO and GRPO with the curriculum on the real SmolLM2-135M-Instruct, the same budget
each, over seeds (issue 41): pass@1 and pass@8 on held-out questions before and after, steps/s, clip fractions.

    .venv/bin/python bench/learn_losses.py --steps 6 --lr 3e-5   # 2 seeds x 5 runs, ~55 minutes
    .venv/bin/python bench/learn_losses.py --seeds 1 --steps 2   # smoke test

Task: reasoning-gym's ``basic_arithmetic`` (two 1-digit terms, e.g. "Calculate ( -4 + -5 )."), asked in a chat,
scored by ``rlkit.MathAnswer`` (math-verify: 1 for the right number anywhere it reads as the final answer, else 0).
12 training questions, so each is sampled several times in the budget (else the curriculum has nothing to follow);
4 of them x n=8 a step, 48 new tokens, one rank in the script's process, two PPO epochs per batch (so the policy
moves off the sampling one and the losses' ratios matter: with one epoch all of them are the plain policy
gradient). Held out: 24 test questions (never in training) sampled 8 times at temperature 1
(``trainer.evaluate(k=8)``: pass@1, pass@8 by Chen et al.'s estimator, maj@8 voting on math-verify's reading of
each answer, ``MathAnswer.answer_of``). "before" is the starting model, evaluated once per seed. The losses at their papers' settings: GSPO
clips the sequence ratio at 3e-4 / 4e-4 with the mean over sequences; CISPO truncates at 1 + 4 (ScaleRL's
epsilon_max 5).

Each run is a fresh process; configs interleave within a seed. Nothing here is timed for a claim beyond the
table's steps/s, measured in the same session.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from learn_stream import spread  # mean ± sd over seeds, as learn_stream.py prints it

ROOT = Path(__file__).resolve().parent.parent
TASK, TASK_CONFIG = "basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
CONFIGS = {
    "GRPO": dict(algorithm="grpo"),
    "Dr.GRPO": dict(algorithm="drgrpo", loss_agg="seq-mean-token-sum-norm"),
    "GSPO": dict(algorithm="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"),
    "CISPO": dict(algorithm="cispo", clip_low=0.0, clip_high=4.0),
    "GRPO + curriculum": dict(algorithm="grpo", curriculum=True),
}


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    torch.set_num_threads(2)
    task = rlkit.tasks.reasoning_gym(TASK, chat=True, test_fraction=0.3, **TASK_CONFIG)
    held_out = task(n=args.held_out, split="test")

    def held_out_scores(tr: rlkit.Trainer) -> dict:  # maj@k votes on MathAnswer.answer_of (math-verify's reading)
        return tr.evaluate(held_out, n=len(held_out), k=args.k)

    def trainer(kw: dict, sampler=None) -> rlkit.Trainer:
        return rlkit.Trainer(model=rlkit.models.pretrained("smollm2-135m-instruct"), dataset=task(n=args.questions),
                             reward=rlkit.MathAnswer(), sampler=sampler,
                             rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=args.tokens),
                             prompts_per_step=args.prompts, lr=args.lr, seed=args.seed, epochs=2,
                             run_dir=f"runs/learn-losses/{args.config}/{args.seed}", **kw)

    if args.config == "before":  # the starting model, once per seed: every config starts from it
        tr = trainer({})
        print("RESULT " + json.dumps({"config": "before", "seed": args.seed, "scores": held_out_scores(tr)}), flush=True)
        return tr.close()
    kw = dict(CONFIGS[args.config])
    sampler = rlkit.CurriculumSampler(window=8) if kw.pop("curriculum", False) else None
    tr = trainer(kw, sampler)
    t0 = time.perf_counter()
    df = tr.fit(steps=args.steps, view="none")
    fit_s = time.perf_counter() - t0
    after = held_out_scores(tr)
    tr.close()
    clip = {c: float(df[c].mean()) for c in ("actor/clipfrac", "actor/seq_clipfrac", "actor/weight_mean")
            if c in df.columns}
    print("RESULT " + json.dumps({"config": args.config, "seed": args.seed, "scores": after,
                                  "steps_per_s": args.steps / fit_s, "clip": clip,
                                  "train_reward": df["reward/mean"].tolist()}), flush=True)


WORKER_FLAGS = ("steps", "n", "prompts", "lr", "k", "questions", "held_out", "tokens")


def run(config: str, seed: int, args: argparse.Namespace, script: str = __file__,
        flags: tuple[str, ...] = WORKER_FLAGS) -> dict:
    """One run of ``script --worker`` in a fresh process, with ``args``' ``flags``; its RESULT line."""
    cmd = [sys.executable, script, "--worker", "--config", config, "--seed", str(seed)]
    for flag in flags:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=7200)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{config} seed {seed} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--k", type=int, default=8, help="held-out samples per question (pass@k)")
    ap.add_argument("--questions", type=int, default=12, help="training questions (each seen several times)")
    ap.add_argument("--held-out", type=int, default=24, help="held-out questions")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per completion")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    names = [c.strip() for c in args.configs.split(",")]
    k = args.k
    results: dict[str, list[dict]] = {c: [] for c in ["before"] + names}
    for seed in range(args.seeds):
        order = names[seed % len(names):] + names[:seed % len(names)]
        for c in ["before"] + order:
            res = run(c, seed, args)
            results[c].append(res)
            sc = res["scores"]
            print(f"seed {seed} {c}: pass@1 {sc['pass@1']:.3f}, pass@{k} {sc[f'pass@{k}']:.3f}, maj@{k} "
                  f"{sc[f'maj@{k}']:.3f}" + (f", {res['steps_per_s']:.4f} steps/s, {res['clip']}, train reward "
                                             f"{[round(x, 2) for x in res['train_reward']]}" if c != "before" else ""),
                  flush=True)

    print(f"\nSmolLM2-135M-Instruct, reasoning-gym {TASK}({TASK_CONFIG}) in a chat, MathAnswer reward, "
          f"{args.questions} training questions, {args.prompts} prompts x n={args.n} a step, {args.tokens} tokens, "
          f"2 epochs, lr {args.lr:g}, {args.steps} steps, {args.seeds} seeds; held out: {args.held_out} test questions "
          f"x {k} samples (mean ± sd over seeds)\n")
    print(f"| run | pass@1 | pass@{k} | maj@{k} | steps/s | clip fraction (token / sequence) | CISPO weight |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in ["before"] + names:
        rs = results[c]
        cols = " | ".join(spread([r["scores"][key] for r in rs]) for key in ("pass@1", f"pass@{k}", f"maj@{k}"))
        if c == "before":
            print(f"| before (the starting model) | {cols} | - | - | - |")
            continue
        clips = [r["clip"] for r in rs]
        tok = spread([x.get("actor/clipfrac", float("nan")) for x in clips])
        seq = spread([x["actor/seq_clipfrac"] for x in clips]) if "actor/seq_clipfrac" in clips[0] else "-"
        weight = spread([x["actor/weight_mean"] for x in clips]) if "actor/weight_mean" in clips[0] else "-"
        print(f"| {c} | {cols} | {spread([r['steps_per_s'] for r in rs])} | {tok} / {seq} | {weight} |")

if __name__ == "__main__":
    main()
