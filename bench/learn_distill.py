"""On-policy distillation of SmolLM2-135M-Instruct into a smaller student, against plain GRPO with the same
budget (issue 41): held-out pass@1 / pass@8 before and after, over seeds.

    .venv/bin/python bench/learn_distill.py                        # 2 seeds x (distill, GRPO)
    .venv/bin/python bench/learn_distill.py --probe                # the candidate students' held-out scores
    .venv/bin/python bench/learn_distill.py --seeds 1 --steps 1    # smoke test

The student is SmolLM2-135M-Instruct with some of its 30 decoder layers dropped (``--drop``, a Python slice of
the layer indices), saved once under ``runs/learn-distill/``: the same tokenizer, so the teacher's per-token
log-probs are of the student's own tokens, and weaker than the teacher. The teacher is the whole model.

Task: as ``bench/learn_losses.py``: reasoning-gym ``basic_arithmetic`` (two 1-digit terms) in a chat, 12 training
questions, 4 a step x n=8, 48 new tokens, one rank. ``distill``: ``algorithm="distill"`` with the teacher (each
token's advantage is log pi_teacher - log pi_student; the reward, ``MathAnswer``, is logged, not trained on).
``GRPO``: ``algorithm="grpo"`` on ``MathAnswer``. The same steps, lr, epochs (1: distillation's advantage is the
sampling policy's, as in the papers) and seeds. Held out: 24 test questions x 8 samples.

Each run is a fresh process; the two interleave within a seed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import learn_losses
from learn_losses import TASK, TASK_CONFIG
from learn_stream import spread  # mean ± sd over seeds

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "learn-distill"


def student_path(drop: str) -> str:
    """SmolLM2-135M-Instruct without the decoder layers ``drop`` selects (a slice, e.g. "20:26"), saved once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rlkit

    out = RUNS / f"student-drop-{drop.replace(':', '_')}"
    if (out / "config.json").exists():
        return str(out)
    teacher = rlkit.models.pretrained("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    layers = list(model.model.layers)
    dropped = set(range(len(layers))[slice(*[int(x) if x else None for x in drop.split(":")])])
    kept = [layer for i, layer in enumerate(layers) if i not in dropped]
    for i, layer in enumerate(kept):  # the KV cache indexes layers by position
        layer.self_attn.layer_idx = i
    model.model.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


def worker(args: argparse.Namespace) -> None:
    import torch

    import rlkit

    torch.set_num_threads(2)
    task = rlkit.tasks.reasoning_gym(TASK, chat=True, test_fraction=0.3, **TASK_CONFIG)
    held_out = task(n=args.held_out, split="test")
    teacher = rlkit.models.pretrained("smollm2-135m-instruct")
    model = teacher if args.config == "teacher" else student_path(args.drop)
    kw = dict(algorithm="distill", teacher=teacher) if args.config == "distill" else dict(algorithm="grpo")
    tr = rlkit.Trainer(model=model, dataset=task(n=args.questions), reward=rlkit.MathAnswer(),
                       rollout=rlkit.Rollout(engine="hf", n=args.n, max_new_tokens=args.tokens),
                       prompts_per_step=args.prompts, lr=args.lr, seed=args.seed,
                       run_dir=str(RUNS / args.config / str(args.seed)), **kw)

    def held_out_scores() -> dict:  # maj@k votes on MathAnswer.answer_of: math-verify's reading of each answer
        return tr.evaluate(held_out, n=len(held_out), k=args.k)

    if args.config in ("before", "teacher"):  # the starting student, or the teacher: evaluated only
        print("RESULT " + json.dumps({"config": args.config, "seed": args.seed, "scores": held_out_scores()}),
              flush=True)
        return tr.close()
    t0 = time.perf_counter()
    df = tr.fit(steps=args.steps, view="none")
    fit_s = time.perf_counter() - t0
    after = held_out_scores()
    tr.close()
    kl = df["kl"].tolist() if "kl" in df.columns else []
    print("RESULT " + json.dumps({"config": args.config, "seed": args.seed, "scores": after,
                                  "steps_per_s": args.steps / fit_s, "kl": kl,
                                  "train_reward": df["reward/mean"].tolist()}), flush=True)


def run(config: str, seed: int, args: argparse.Namespace) -> dict:
    return learn_losses.run(config, seed, args, __file__, learn_losses.WORKER_FLAGS + ("drop",))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help="held-out scores of the teacher and of students "
                                                         "dropping each of --probe-drops")
    ap.add_argument("--probe-drops", default="20:26,16:26,10:26")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--k", type=int, default=8, help="held-out samples per question (pass@k)")
    ap.add_argument("--questions", type=int, default=12, help="training questions")
    ap.add_argument("--held-out", type=int, default=24, help="held-out questions")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per completion")
    ap.add_argument("--drop", default="20:26", help="the teacher's decoder layers the student lacks (a slice)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    k = args.k
    if args.probe:
        for drop in ["teacher"] + args.probe_drops.split(","):
            args.drop = "0:0" if drop == "teacher" else drop
            sc = run("teacher" if drop == "teacher" else "before", 0, args)["scores"]
            print(f"{drop}: pass@1 {sc['pass@1']:.3f}, pass@{k} {sc[f'pass@{k}']:.3f}, maj@{k} {sc[f'maj@{k}']:.3f}",
                  flush=True)
        return
    names = ["distill", "GRPO"]
    results: dict[str, list[dict]] = {c: [] for c in ["teacher", "before"] + names}
    for seed in range(args.seeds):
        order = names if seed % 2 == 0 else names[::-1]
        for c in (["teacher"] if seed == 0 else []) + ["before"] + order:
            res = run(c, seed, args)
            results[c].append(res)
            sc = res["scores"]
            print(f"seed {seed} {c}: pass@1 {sc['pass@1']:.3f}, pass@{k} {sc[f'pass@{k}']:.3f}, maj@{k} "
                  f"{sc[f'maj@{k}']:.3f}" + (f", {res['steps_per_s']:.4f} steps/s, kl {[round(x, 3) for x in res['kl']]}"
                                             f", train reward {[round(x, 2) for x in res['train_reward']]}"
                                             if c in names else ""), flush=True)

    print(f"\nStudent: SmolLM2-135M-Instruct without decoder layers [{args.drop}]; teacher: SmolLM2-135M-Instruct. "
          f"reasoning-gym {TASK}({TASK_CONFIG}) in a chat, {args.questions} training questions, {args.prompts} "
          f"prompts x n={args.n} a step, {args.tokens} tokens, lr {args.lr:g}, {args.steps} steps, {args.seeds} "
          f"seeds; held out: {args.held_out} test questions x {k} samples (mean ± sd over seeds)\n")
    print(f"| run | pass@1 | pass@{k} | maj@{k} | steps/s | reverse KL to the teacher, first -> last step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c, label in [("teacher", "the teacher"), ("before", "the student before"), ("distill", "student, distilled"),
                     ("GRPO", "student, GRPO")]:
        rs = results[c]
        cols = " | ".join(spread([r["scores"][key] for r in rs]) for key in ("pass@1", f"pass@{k}", f"maj@{k}"))
        speed = spread([r["steps_per_s"] for r in rs]) if c in names else "-"
        kl = (f"{spread([r['kl'][0] for r in rs])} -> {spread([r['kl'][-1] for r in rs])}"
              if c == "distill" and rs[0]["kl"] else "-")
        print(f"| {label} | {cols} | {speed} | {kl} |")


if __name__ == "__main__":
    main()
