"""GRPO, Dr.GRPO, GSPO, CISPO and GRPO with the curriculum on the real SmolLM2-135M-Instruct, the same budget
each, over seeds (issue 41): pass@1 and pass@8 on held-out questions before and after, steps/s, clip fractions.

    .venv/bin/python bench/learn_losses.py                       # 2 seeds x 5 runs
    .venv/bin/python bench/learn_losses.py --seeds 1 --steps 2   # smoke test

Task: ``rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)`` (reward 0.6 for the right number + 0.4 for a
bare-number reply; a sample "passes" with the right number, reward >= 0.6), 4 questions x n=8 a step, one rank in the script's process, two
PPO epochs per batch (so the policy moves off the sampling one and the losses' ratios matter: with one epoch all
of them are the plain policy gradient). Held out: every test question sampled 8 times at temperature 1
(``trainer.evaluate(k=8)``: avg@8, pass@1, pass@8, maj@8). The losses at their papers' settings: GSPO clips the
sequence ratio at 3e-4 / 4e-4 with the mean over sequences; CISPO truncates at 1 + 4 (ScaleRL's epsilon_max 5).

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
    kw = dict(CONFIGS[args.config])
    sampler = rlkit.CurriculumSampler(window=8) if kw.pop("curriculum", False) else None
    task = rlkit.tasks.ChatArithmetic(digits=1, test_fraction=0.3)
    held_out = list({r["question"]: r for r in task(n=200, split="test")}.values())
    tr = rlkit.Trainer(model=rlkit.models.pretrained("smollm2-135m-instruct"), dataset=task, sampler=sampler,
                       rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=task.max_new_tokens),
                       prompts_per_step=args.prompts, lr=args.lr, seed=args.seed, epochs=2,
                       run_dir=f"runs/learn-losses/{args.config}/{args.seed}", **kw)
    def held_out_scores() -> dict:
        # a question is solved by the right number (reward >= 0.6: ChatArithmetic gives 0.6 for it and 0.4 more
        # for a bare-number reply, which SmolLM2 rarely writes), so pass@k is re-read from the samples at 0.6
        tr.evaluate(held_out, n=len(held_out), k=args.k)
        groups = [list(zip(g["reward"], g["answer"])) for _, g in tr.eval_samples.groupby("row")]
        return rlkit.evaluation.scores(groups, threshold=0.6)

    before = held_out_scores()
    t0 = time.perf_counter()
    df = tr.fit(steps=args.steps, view="none")
    fit_s = time.perf_counter() - t0
    after = held_out_scores()
    tr.close()
    clip = {c: float(df[c].mean()) for c in ("actor/clipfrac", "actor/seq_clipfrac", "actor/weight_mean")
            if c in df.columns}
    print("RESULT " + json.dumps({"config": args.config, "seed": args.seed, "before": before, "after": after,
                                  "steps_per_s": args.steps / fit_s, "clip": clip,
                                  "train_reward": df["reward/mean"].tolist()}), flush=True)


def run(config: str, seed: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--config", config, "--seed", str(seed), "--steps", str(args.steps),
           "--n", str(args.n), "--prompts", str(args.prompts), "--lr", str(args.lr), "--k", str(args.k)]
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
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--k", type=int, default=8, help="held-out samples per question (pass@k)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    names = [c.strip() for c in args.configs.split(",")]
    results: dict[str, list[dict]] = {c: [] for c in names}
    for seed in range(args.seeds):
        order = names[seed % len(names):] + names[:seed % len(names)]
        for c in order:
            res = run(c, seed, args)
            results[c].append(res)
            print(f"seed {seed} {c}: pass@1 {res['before']['pass@1']:.3f} -> {res['after']['pass@1']:.3f}, "
                  f"pass@{args.k} {res['before'][f'pass@{args.k}']:.3f} -> {res['after'][f'pass@{args.k}']:.3f}, "
                  f"{res['steps_per_s']:.3f} steps/s, {res['clip']}", flush=True)

    k = args.k
    print(f"\nSmolLM2-135M-Instruct, ChatArithmetic(digits=1), {args.prompts} prompts x n={args.n}, 2 epochs, lr "
          f"{args.lr:g}, {args.steps} steps, {args.seeds} seeds; held out: every test question x {k} samples "
          f"(mean ± sd over seeds)\n")
    print(f"| run | pass@1 before | pass@1 after | pass@{k} before | pass@{k} after | maj@{k} after | steps/s | "
          "clip fraction (token / sequence) | CISPO weight |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in names:
        rs = results[c]

        def col(when: str, key: str, rs: list[dict] = rs) -> str:
            return spread([r[when][key] for r in rs])
        clips = [r["clip"] for r in rs]
        tok = spread([x.get("actor/clipfrac", float("nan")) for x in clips])
        seq = spread([x["actor/seq_clipfrac"] for x in clips]) if "actor/seq_clipfrac" in clips[0] else "-"
        weight = spread([x["actor/weight_mean"] for x in clips]) if "actor/weight_mean" in clips[0] else "-"
        print(f"| {c} | {col('before', 'pass@1')} | {col('after', 'pass@1')} | {col('before', f'pass@{k}')} | "
              f"{col('after', f'pass@{k}')} | {col('after', f'maj@{k}')} | "
              f"{spread([r['steps_per_s'] for r in rs])} | {tok} / {seq} | {weight} |")


if __name__ == "__main__":
    main()
