"""rlkit against TRL 1.16's GRPOTrainer on a real reasoning-gym task, side by side on equal work, with a
held-out evaluation of both trained models.

    bash bench/setup_trl.sh                                  # once: TRL 1.16 in .venv-trl (git-ignored)
    .venv/bin/python bench/bench_task_vs_trl.py              # 2 rounds x 6 steps, then the held-out evaluation
    .venv/bin/python bench/bench_task_vs_trl.py --rounds 3 --steps 10 --eval-n 200
    .venv/bin/python bench/bench_task_vs_trl.py --rounds 3 --seed-per-round   # round r under seed r, both sides
    .venv/bin/python bench/bench_task_vs_trl.py --rounds 1 --steps 2 --warmup 1 --eval-n 8   # a smoke test

The work (``vs_trl_common.TASK``), identical on both sides: SmolLM2-135M-Instruct on reasoning-gym's
``basic_arithmetic`` (two 1-digit terms, asked in a chat: ``rlkit.tasks.reasoning_gym("basic_arithmetic",
chat=True, test_fraction=0.3, ...)``), per step 4 questions x 8 samples x up to 48 new tokens at temperature 1,
reward ``rlkit.MathAnswer()`` on the completion's text and the row's answer (TRL's reward function calls the
same rlkit scorer: ``vs_trl_common.recorded_math_answer``), GRPO, no KL, lr 1e-5 constant, grad-norm clip 1.0,
one optimizer step per batch, bf16 mixed precision (autocast on fp32 weights), HF generation, 1 torch thread
(``--threads``), dp=1. rlkit: ``Trainer(precision="bf16-mixed", epochs=1, rollout=Rollout(engine="hf",
dtype="bfloat16"))``. TRL: ``GRPOConfig(bf16=True, per_device_train_batch_size=32, num_generations=8,
gradient_accumulation_steps=1, num_iterations=1, beta=0, gradient_checkpointing=False)``, no vLLM. Both train
on the same rows: the driver writes the task's 1000 train rows and the order rlkit's sampler visits them in;
TRL gets them in that order with ``shuffle_dataset=False``, so each step trains on the same 4 questions on both
sides (checked: the questions each side's reward saw, step by step). The samples differ (each side's own RNG).
Under one seed every round repeats the same draw on each side, sampled lengths included; ``--seed-per-round``
runs round r under seed r on both sides (the rows, their order and the sampling), so medians average over
draws.

Each run is its own process; runs are interleaved, the order rotating each round; steps/s is over the steps
after ``--warmup`` (2); medians over rounds; per-step phase medians from rlkit's ``timing/*`` metrics and
TRL's timed ``generate`` / ``_prepare_inputs`` / reward / update. Round 1 saves both trained models; the driver
then evaluates the base model and both saved models the same way: rlkit's ``Trainer.evaluate`` (greedy, HF
engine in bf16, 48 new tokens) on ``--eval-n`` questions of the task's held-out (test) split, scored by
``MathAnswer``. Markdown tables on stdout; everything in ``runs/bench_task_vs_trl/results.json``.

TRL's venv lacks math-verify (``setup_trl.sh`` installs TRL alone): the driver installs the rlkit venv's
math-verify, latex2sympy2_extended and antlr4 runtime versions into it once, so both sides score alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module, by path
from vs_trl_common import BENCH, ROOT, TASK, WARMUP_STEPS, python_with, reasoning_task, run_one  # noqa: E402

VERIFIER = ("math-verify", "latex2sympy2_extended", "antlr4-python3-runtime")  # the reward's packages


def ensure_verifier(trl_python: str) -> None:
    """math-verify in the TRL venv, at the rlkit venv's versions (the reward imports it on both sides)."""
    if python_with(trl_python, "math_verify", "latex2sympy2_extended"):
        return
    from importlib.metadata import version

    pins = [f"{d}=={version(d)}" for d in VERIFIER]
    print(f"installing {' '.join(pins)} into {trl_python}'s venv (the reward's verifier)", flush=True)
    subprocess.run([trl_python, "-m", "pip", "install", "-q", *pins], check=True)


def write_rows(path: Path, steps: int, seed: int) -> list[list[str]]:
    """The task's train rows and the order rlkit's default sampler visits them in over ``steps`` steps under
    ``seed``, as JSON for both workers; returns each step's questions."""
    from rlkit.sampler import EpochSampler

    rows = [{"prompt": r["prompt"], "question": r["question"], "answer": str(r["answer"])}
            for r in reasoning_task().dataset(n=TASK["train_rows"], seed=TASK["seed"], split="train")]
    k = TASK["prompts_per_step"]
    chosen = [EpochSampler().choose(rnd=s, k=k, n=len(rows), seed=seed) for s in range(steps)]
    path.write_text(json.dumps({"rows": rows, "order": [i for c in chosen for i in c]}))
    return [[rows[i]["question"] for i in c] for c in chosen]


def evaluate(model: str, n: int, threads: int) -> dict:
    """Greedy held-out accuracy of ``model``: rlkit's ``Trainer.evaluate`` on ``n`` questions of the task's test
    split (the same questions for every model), ``MathAnswer`` scoring, the HF engine in bf16."""
    import torch

    import rlkit

    torch.set_num_threads(threads)
    tr = rlkit.Trainer(model=model, dataset=reasoning_task(), reward=rlkit.MathAnswer(), algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=TASK["n"], max_new_tokens=TASK["max_new_tokens"],
                                             dtype="bfloat16"),
                       prompts_per_step=TASK["prompts_per_step"], precision="bf16-mixed", seed=TASK["seed"],
                       train_size=TASK["prompts_per_step"], run_dir=tempfile.mkdtemp(prefix="rlkit-eval-"))
    try:
        out = tr.evaluate(n=n)
        out["examples"] = tr.eval_samples[["completion", "reward"]].head(3).to_dict("records")
        return out
    finally:
        tr.close()


def main() -> None:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first --warmup are not measured)")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps left out of steps/s and phase medians")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (1: a shared 2-core CPU)")
    ap.add_argument("--eval-n", type=int, default=128, help="held-out questions per evaluated model")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--out", default=str(ROOT / "runs/bench_task_vs_trl"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed-per-round", action="store_true",
                    help="round r samples under seed r on both sides (default: every round under the task's seed)")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit(f"--steps {args.steps} must exceed --warmup {args.warmup} (steps/s is over the steps after it)")
    if not python_with(args.trl_python, "trl", "datasets"):
        sys.exit(f"{args.trl_python} cannot import trl and datasets: run `bash bench/setup_trl.sh`")
    ensure_verifier(args.trl_python)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import rlkit

    model = rlkit.models.pretrained(TASK["model"])
    print(f"model: {model}\nwork: {TASK}\nload average: {os.getloadavg()}", flush=True)
    trl_run = dict(label="TRL GRPOTrainer", side="trl", cmd=[args.trl_python, str(BENCH / "trl_task_worker.py")])
    rl_run = dict(label="rlkit Trainer", side="rlkit", cmd=[sys.executable, str(BENCH / "rlkit_task_worker.py")])
    runs = [trl_run, rl_run]
    results: dict[str, list[dict]] = {x["label"]: [] for x in runs}
    saved: dict[str, str] = {}
    for r in range(args.rounds):
        # round r's seed: both sides sample (and visit the rows) under the same one, and each round under
        # another, so the medians average over sampled lengths instead of repeating one draw
        seed = TASK["seed"] + (r if args.seed_per_round else 0)
        rows_file = out / f"rows-seed{seed}.json"
        expected = write_rows(rows_file, args.steps, seed)
        extra = ["--rows", str(rows_file), "--threads", str(args.threads), "--warmup", str(args.warmup),
                 "--seed", str(seed)]
        for x in runs[r % 2:] + runs[:r % 2]:
            save = ["--save", str(out / f"model-{x['side']}")] if r == 0 else []
            res = run_one(x, model, args.steps, out / f"r{r}-{x['side']}.log", args.timeout, extra + save)
            res["seed"] = seed
            res["same_questions_as_driver"] = [sorted(q) for q in res["questions_per_step"]] == \
                [sorted(q * TASK["n"]) for q in expected[:len(res["questions_per_step"])]]
            results[x["label"]].append(res)
            if r == 0:
                saved[x["label"]] = str(out / f"model-{x['side']}")
            print(f"round {r + 1} (seed {seed}): {x['label']:16s} {res['steps_per_s']:.4f} steps/s (median step "
                  f"{res['median_step_s']:.1f} s), load before {res['load_avg_1min_before']:.2f}, same questions: "
                  f"{res['same_questions_as_driver']}", flush=True)

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rs)

    speed = pd.DataFrame([{"run": label, "steps/s per round": ", ".join(f"{x['steps_per_s']:.4f}" for x in rs),
                           "steps/s (median)": med(rs, "steps_per_s"), "s/step (median)": med(rs, "median_step_s"),
                           "completion tokens/step": med(rs, "tokens_per_step"),
                           "tokens/step per round": ", ".join(f"{x['tokens_per_step']:.0f}" for x in rs),
                           "load (1 min) before": ", ".join(f"{x['load_avg_1min_before']:.1f}" for x in rs),
                           "peak RSS MB": med(rs, "peak_rss_mb"),
                           "same questions": all(x["same_questions_as_driver"] for x in rs)}
                          for label, rs in results.items()]).set_index("run")
    ratio = speed.loc[rl_run["label"], "steps/s (median)"] / speed.loc[trl_run["label"], "steps/s (median)"]
    phases = pd.DataFrame({label: pd.DataFrame([x["phases_median_s"] for x in rs]).median()
                           for label, rs in results.items()})
    per_step = pd.DataFrame({f"{label}, round {i + 1}": pd.Series(x["step_s_per_step"])
                             for label, rs in results.items() for i, x in enumerate(rs)})
    per_step.index = [f"step {i + 1}" + (" (warm-up)" if i < args.warmup else "") for i in range(len(per_step))]

    evals = {"base (step 0)": evaluate(model, args.eval_n, args.threads)}
    for label, path in saved.items():
        evals[f"{label} after {args.steps} steps"] = evaluate(path, args.eval_n, args.threads)
    acc = pd.DataFrame([{"model": k, "accuracy (exact)": v["exact"], "mean reward": v["reward"], "n": str(v["n"])}
                        for k, v in evals.items()]).set_index("model")

    print(f"\n{args.rounds} rounds x {args.steps} steps ({args.warmup} warm-up), {args.threads} thread(s)\n")
    print(speed.to_markdown(floatfmt=".4g"))
    print(f"\nrlkit / TRL steps/s (medians): {ratio:.3f}x")
    print("\nper-step phases, seconds (median over the measured steps, then over rounds; rlkit: its timing/* "
          "metrics; TRL: generate = inside HF generate, prepare = _prepare_inputs, update = batch ready to step end)\n")
    print(phases.to_markdown(floatfmt=".3f"))
    print("\neach step's seconds (the bench's clock)\n")
    print(per_step.to_markdown(floatfmt=".2f"))
    print(f"\nheld-out (greedy, rlkit's Trainer.evaluate on {args.eval_n} questions of the task's test split, "
          f"MathAnswer)\n")
    print(acc.to_markdown(floatfmt=".3f"))
    (out / "results.json").write_text(json.dumps({"work": TASK, "rounds": args.rounds, "steps": args.steps,
                                                  "warmup": args.warmup, "threads": args.threads, "runs": results,
                                                  "ratio_rlkit_over_trl": ratio, "expected_questions": expected,
                                                  "evals": evals}, indent=1, default=str))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
