"""rlkit against TRL 1.16's GRPOTrainer on the same vision-language work, side by side (issue 45): GRPO on the
Shapes pictures with the tiny Qwen2.5-VL, steps/s in interleaved rounds.

    bash bench/setup_trl.sh                                              # once: TRL 1.16 in .venv-trl (git-ignored)
    .venv/bin/python bench/bench_vlm_vs_trl.py                           # 5 rounds x 12 steps, tiny VLM "10m", bf16 (~7 min)
    .venv/bin/python bench/bench_vlm_vs_trl.py --size small --out runs/bench_vlm_vs_trl-small   # overhead-bound (~3 min)
    .venv/bin/python bench/bench_vlm_vs_trl.py --dtype fp32 --rounds 3    # fp32 throughout
    .venv/bin/python bench/bench_vlm_vs_trl.py --rounds 1 --steps 3      # a smoke test

The model: rlkit's tiny Qwen2.5-VL (``rlkit.models.tiny_lm("qwen2_5_vl", size=--size)``: a vision tower, its
merger and a Qwen2 language model with M-RoPE, random init; a folder holding config, safetensors, tokenizer,
``processor_config.json`` and chat template), built here in the rlkit venv; both workers load that folder. Its
processor: transformers 5 builds Qwen2.5-VL's ``AutoProcessor`` only with its video processor, which needs
torchvision (not installed in either venv), so both sides use the image-only processor of the same class from the
same files (rlkit: ``rlkit.models.load_processor``; TRL: the same few lines in vlm_vs_trl_worker.py, passed as
``processing_class=``).

The work (``VLM`` below, written into the rows file both workers read), identical on both sides: per step
``--prompts-per-step`` (4) pictures x ``--n`` (8) samples x up to ``--max-new-tokens`` (16) new tokens at
temperature 1, GRPO, no KL (beta 0), lr 1e-5 constant, grad-norm clip 1.0, one optimizer step per batch
(epochs 1), HF generation (rlkit ``Rollout(engine="hf")``; TRL without vLLM), dp=1, 1 torch thread
(``--threads``), ``--dtype bf16`` (autocast on fp32 weights: rlkit ``precision="bf16-mixed"``,
``Rollout(dtype="bfloat16")``; TRL ``bf16=True``) or ``fp32``. The rows: ``rlkit.tasks.Shapes()``'s train split
(56 x 56 pictures of 1-3 shapes, "How many shapes are in the picture? Answer with just the number.", answer
"1".."3"), generated here and handed over as files (a PNG per picture, a JSON of prompts, answers, ids and the
order rlkit's sampler visits them in under the round's seed): TRL gets the rows in that order with
``shuffle_dataset=False``, so each step trains on the same pictures on both sides (checked: the row ids each
side's reward saw, step by step). The reward: ``Shapes().reward`` on rlkit's side, the same rule re-implemented
in vlm_vs_trl_worker.py (``shapes_reward``: the first integer of the completion == the answer) on TRL's,
checked equal on sample completions before the runs. The samples differ (each side's own RNG); the random-init
model rarely samples its eos, so nearly every completion runs to ``--max-new-tokens`` on both sides (the
completion tokens per step are printed). One known difference: TRL suppresses the image token in generation
(``suppress_tokens=[image_token_id]``), rlkit does not (its M-RoPE treats a sampled image token as text).

Each run is its own process; runs are interleaved, the order alternating each round; s/step and steps/s are
over the steps after ``--warmup`` (1); per round and side: s/step, generate and update seconds (rlkit: its
``timing/*`` metrics; TRL: inside HF ``generate``, and from the batch ready to the step's end); then medians over
rounds and the rlkit / TRL steps/s ratio (of the medians, and the median of the per-round ratios). Markdown
tables on stdout; everything in ``runs/bench_vlm_vs_trl/results.json`` (``--out``).

TRL's venv lacks Pillow (``setup_trl.sh`` installs TRL alone): the driver installs the rlkit venv's Pillow version
into it once, as bench_task_vs_trl.py does math-verify.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module and the worker, by path
from vs_trl_common import BENCH, ROOT, python_with, run_one  # noqa: E402

# the work per step, both sides: prompts_per_step pictures x n samples x up to max_new_tokens, one optimizer step
VLM: dict = dict(prompts_per_step=4, n=8, max_new_tokens=16, lr=1e-5, temperature=1.0, kl=0.0, max_grad_norm=1.0,
                 seed=0, train_rows=256, picture=56)


def write_rows(folder: Path, work: dict, steps: int, seed: int) -> list[list[int]]:
    """Shapes' train rows as files under ``folder`` (``img-<id>.png``, ``rows.json`` with the work, the rows and the
    order rlkit's default sampler visits them in over ``steps`` steps under ``seed``); returns each step's row ids."""
    from rlkit.sampler import EpochSampler
    from rlkit.tasks import Shapes

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, r in enumerate(Shapes(size=work["picture"]).dataset(n=work["train_rows"], seed=work["seed"], split="train")):
        name = f"img-{i:04d}.png"
        r["image"].save(folder / name)
        rows.append({"id": i, "prompt": r["prompt"], "image": name, "answer": str(r["answer"])})
    k = work["prompts_per_step"]
    chosen = [EpochSampler().choose(rnd=s, k=k, n=len(rows), seed=seed) for s in range(steps)]
    (folder / "rows.json").write_text(json.dumps({"work": work, "rows": rows,
                                                  "order": [i for c in chosen for i in c]}))
    return chosen


def ensure_pillow(trl_python: str) -> None:
    """Pillow in the TRL venv, at the rlkit venv's version: TRL's multimodal path, transformers' image processor
    and ``datasets``' image column need it, and ``setup_trl.sh`` installs TRL alone (its text-only runs need none)."""
    if python_with(trl_python, "PIL"):
        return
    from importlib.metadata import version

    pin = f"pillow=={version('pillow')}"
    print(f"installing {pin} into {trl_python}'s venv (images on TRL's side)", flush=True)
    subprocess.run([trl_python, "-m", "pip", "install", "-q", pin], check=True)


def check_reward() -> None:
    """TRL's re-implemented reward gives ``Shapes().reward``'s scores on sample completions."""
    from vlm_vs_trl_worker import shapes_reward

    from rlkit.tasks import Shapes

    comps = ["2", " 2 shapes", "There are 3", "3<|im_end|>", "<|endoftext|>2", "", "two", "-2", "02", "x12y",
             "1 or 2", "2.5", "\n\n3", [{"role": "assistant", "content": "3"}]]
    for answer in ("1", "2", "3"):
        want = Shapes().reward(None, comps, answer=[answer] * len(comps))
        got = shapes_reward(None, comps, [answer] * len(comps))
        if want != got:
            sys.exit(f"TRL's shapes_reward {got} != Shapes().reward {want} (answer {answer}) on {comps}")


def main() -> None:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the first --warmup are not measured)")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of s/step, steps/s and phase medians")
    ap.add_argument("--size", default="10m", help="the tiny Qwen2.5-VL's size (rlkit.models.tiny SIZES: test, small, "
                    "demo, 10m)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (1: a shared 2-core CPU)")
    ap.add_argument("--prompts-per-step", type=int, default=VLM["prompts_per_step"])
    ap.add_argument("--n", type=int, default=VLM["n"], help="samples per picture (TRL's num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=VLM["max_new_tokens"])
    ap.add_argument("--lr", type=float, default=VLM["lr"])
    ap.add_argument("--seed-per-round", action="store_true",
                    help="round r samples (and visits the rows) under seed r on both sides (default: every round seed 0)")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--out", default=str(ROOT / "runs/bench_vlm_vs_trl"))
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        sys.exit(f"--steps {args.steps} must exceed --warmup {args.warmup} (steps/s is over the steps after it)")
    if not python_with(args.trl_python, "trl", "datasets"):
        sys.exit(f"{args.trl_python} cannot import trl and datasets: run `bash bench/setup_trl.sh`")
    ensure_pillow(args.trl_python)
    check_reward()
    work = dict(VLM, prompts_per_step=args.prompts_per_step, n=args.n, max_new_tokens=args.max_new_tokens, lr=args.lr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import rlkit

    model = rlkit.models.tiny_lm("qwen2_5_vl", size=args.size)
    print(f"model: {model} (tiny Qwen2.5-VL {args.size!r})\nwork: {work}, dtype {args.dtype}, {args.threads} "
          f"thread(s)\nload average: {os.getloadavg()}", flush=True)
    worker = str(BENCH / "vlm_vs_trl_worker.py")
    trl_run = dict(label="TRL GRPOTrainer", side="trl", cmd=[args.trl_python, worker, "trl"])
    rl_run = dict(label="rlkit Trainer", side="rlkit", cmd=[sys.executable, worker, "rlkit"])
    runs = [trl_run, rl_run]
    results: dict[str, list[dict]] = {x["label"]: [] for x in runs}
    for r in range(args.rounds):
        seed = work["seed"] + (r if args.seed_per_round else 0)
        folder = out / f"rows-seed{seed}"
        expected = write_rows(folder, work, args.steps, seed)
        extra = ["--rows", str(folder / "rows.json"), "--threads", str(args.threads), "--warmup", str(args.warmup),
                 "--seed", str(seed), "--dtype", args.dtype]
        for x in runs[r % 2:] + runs[:r % 2]:
            res = run_one(x, model, args.steps, out / f"r{r}-{x['side']}.log", args.timeout, extra)
            res["round"], res["seed"] = r + 1, seed
            res["same_rows_as_driver"] = [sorted(ids) for ids in res["ids_per_step"]] == \
                [sorted(c * work["n"]) for c in expected[:len(res["ids_per_step"])]]
            results[x["label"]].append(res)
            ph = res["phases_median_s"]
            print(f"round {r + 1} (seed {seed}): {x['label']:16s} {res['median_step_s']:.3f} s/step "
                  f"({res['steps_per_s']:.3f} steps/s; generate {ph.get('generate', float('nan')):.3f} s, update "
                  f"{ph.get('update', float('nan')):.3f} s), {res['tokens_per_step']:.0f} completion tokens/step, "
                  f"load before {res['load_avg_1min_before']:.2f}, same rows: {res['same_rows_as_driver']}",
                  flush=True)

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in rs)

    def phase(x: dict, name: str) -> float:
        return x["phases_median_s"].get(name, float("nan"))

    per_round = pd.DataFrame([{"round": x["round"], "run": label, "s/step": x["median_step_s"],
                               "steps/s": x["steps_per_s"], "generate s": phase(x, "generate"),
                               "update s": phase(x, "update"), "completion tokens/step": x["tokens_per_step"],
                               "load before": x["load_avg_1min_before"]}
                              for label, rs in results.items() for x in rs]).sort_values(["round", "run"])
    speed = pd.DataFrame([{"run": label, "s/step (median)": med(rs, "median_step_s"),
                           "steps/s (median)": med(rs, "steps_per_s"),
                           "steps/s per round": ", ".join(f"{x['steps_per_s']:.3f}" for x in rs),
                           "generate s": statistics.median(phase(x, "generate") for x in rs),
                           "update s": statistics.median(phase(x, "update") for x in rs),
                           "completion tokens/step": med(rs, "tokens_per_step"), "peak RSS MB": med(rs, "peak_rss_mb"),
                           "same rows": all(x["same_rows_as_driver"] for x in rs)}
                          for label, rs in results.items()]).set_index("run")
    ratios = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results[rl_run["label"]], results[trl_run["label"]])]
    ratio = speed.loc[rl_run["label"], "steps/s (median)"] / speed.loc[trl_run["label"], "steps/s (median)"]
    phases = pd.DataFrame({label: pd.DataFrame([x["phases_median_s"] for x in rs]).median()
                           for label, rs in results.items()})
    per_step = pd.DataFrame({f"{label}, round {i + 1}": pd.Series(x["step_s_per_step"])
                             for label, rs in results.items() for i, x in enumerate(rs)})
    per_step.index = [f"step {i + 1}" + (" (warm-up)" if i < args.warmup else "") for i in range(len(per_step))]

    print(f"\n{args.rounds} round(s) x {args.steps} steps ({args.warmup} warm-up), tiny Qwen2.5-VL {args.size!r}, "
          f"{args.dtype}, {args.threads} thread(s), {work['prompts_per_step']} pictures x {work['n']} samples x "
          f"<= {work['max_new_tokens']} tokens a step\n")
    print(per_round.to_markdown(index=False, floatfmt=".3f"))
    print()
    print(speed.to_markdown(floatfmt=".4g"))
    print(f"\nrlkit / TRL steps/s: {ratio:.3f}x (of the medians); per round: "
          f"{', '.join(f'{q:.3f}x' for q in ratios)}; median of the per-round ratios: {statistics.median(ratios):.3f}x")
    print("\nper-step phases, seconds (median over the measured steps, then over rounds; rlkit: its timing/* metrics; "
          "TRL: generate = inside HF generate, prepare = _prepare_inputs, update = batch ready to step end)\n")
    print(phases.to_markdown(floatfmt=".3f"))
    print("\neach step's seconds (the bench's clock)\n")
    print(per_step.to_markdown(floatfmt=".3f"))
    (out / "results.json").write_text(json.dumps({"model": model, "size": args.size, "dtype": args.dtype, "work": work,
                                                  "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
                                                  "threads": args.threads, "runs": results,
                                                  "ratio_rlkit_over_trl": ratio, "ratios_per_round": ratios},
                                                 indent=1, default=str))
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    main()
