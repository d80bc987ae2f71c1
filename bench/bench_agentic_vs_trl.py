"""rlkit against TRL 1.16's GRPOTrainer in tool mode, side by side on the same agentic GRPO work (issue 24).

    bash bench/setup_trl.sh                                  # once: TRL 1.16 in .venv-trl (git-ignored)
    .venv/bin/python bench/bench_agentic_vs_trl.py           # 2 rounds x 5 steps, then the held-out evaluation
    .venv/bin/python bench/bench_agentic_vs_trl.py --rounds 3 --steps 8

The work (``vs_trl_common.AGENTIC``), per step: 2 ``Calculator`` train questions ("What is 347 * 58?") x 4
episodes, each at most 2 assistant turns (a calculator call, then the answer after the tool's result) and 96
response tokens in all; reward 1 when the last message ends on the product; lr 2e-5 constant, no KL, grad-norm
clip 1.0, fp32, dp=1, HF generate on both sides. TRL: ``GRPOTrainer(tools=[calculator])`` with
``num_generations=4``, ``max_tool_calling_iterations=1``, ``max_completion_length=96``; rlkit:
``Trainer(tools=[calculator], multi_turn=MultiTurn(max_turns=2, max_tokens=96))``.

The model: SmolLM2-135M-Instruct's own template (plain ChatML, no tool syntax) is refused by TRL 1.16
(``supports_tool_calling`` is False: the error is recorded by a first, failing TRL run). So both sides get a
copy of the checkpoint whose tokenizer carries TRL's own Qwen2.5 chat template (``trl/chat_templates/
qwen2_5.jinja``: Hermes ``<tool_call>`` syntax, tools in the system message; TRL adds its response parser for
it and finds it prefix-preserving, rlkit renders the tools with it natively), SFT-warm-started on
``task.demonstrations`` rendered with that template. Each run is its own process; runs are interleaved, the
order rotating each round; steps/s is measured after the first 2 steps; medians over rounds. The held-out
accuracy of each side's model after round 1 (greedy, the task's test split, the same episodes: rlkit's
multi-turn evaluation of both saved models) is compared with the warm start's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module, by path
from vs_trl_common import AGENTIC, BENCH, ROOT, calculator_task, python_with, run_one  # noqa: E402

SFT = dict(rows=32, steps=4, batch_size=8, lr=3e-5)  # the comparison's warm start (16 problems x 2 rows)
N_EVAL = 32


def tool_template_model(trl_python: str, out: Path) -> str:
    """A copy of SmolLM2-135M-Instruct whose tokenizer has TRL's Qwen2.5 chat template (built once)."""
    from transformers import AutoTokenizer

    import rlkit

    dst = out.resolve() / "smollm2-135m-instruct-qwen25-template"  # absolute: the warm start's cache key holds it
    if (dst / "tokenizer_config.json").exists():
        return str(dst)
    site = subprocess.run([trl_python, "-c", "import trl, os; print(os.path.dirname(trl.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    template = (Path(site) / "chat_templates" / "qwen2_5.jinja").read_text()
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(rlkit.models.pretrained("smollm2-135m-instruct"), tmp)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = template
    tok.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(template)  # transformers 5 reads the template from this file
    os.replace(tmp, dst)
    return str(dst)


def warm_start(model: str) -> str:
    """The SFT warm start of the comparison: demonstrations rendered with ``model``'s (tool) template."""
    from rlkit.tasks import sft_warmstart

    demos = calculator_task().demonstrations(model)
    return sft_warmstart(model, demos, steps=SFT["steps"], batch_size=SFT["batch_size"], lr=SFT["lr"],
                         n=SFT["rows"], seed=AGENTIC["seed"], threads=1, progress=False)


def evaluate(model: str) -> dict:
    """Greedy held-out accuracy and tool use of ``model``: rlkit's multi-turn evaluation, AGENTIC's bounds."""
    import tempfile

    import rlkit

    task = calculator_task()
    tr = rlkit.Trainer(model=model, dataset=task, tools=task.tools, algorithm="grpo", seed=AGENTIC["seed"],
                       multi_turn=rlkit.MultiTurn(max_turns=AGENTIC["max_turns"], max_tokens=AGENTIC["max_tokens"]),
                       rollout=rlkit.Rollout(engine="hf", n=AGENTIC["n"], max_new_tokens=AGENTIC["max_new_tokens"]),
                       prompts_per_step=AGENTIC["prompts_per_step"], run_dir=tempfile.mkdtemp(prefix="rlkit-eval-"))
    try:
        return tr.evaluate(n=N_EVAL)
    finally:
        tr.close()


def main() -> None:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="steps per run (the first 2 are not measured)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on both sides (1: a shared 2-core CPU)")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--own-model", default=None,
                    help="a warm start with SmolLM2's own template, for the recorded TRL error (bench_agentic.py's)")
    ap.add_argument("--out", default=str(ROOT / "runs/bench_agentic_vs_trl"))
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()
    if not python_with(args.trl_python, "trl", "datasets"):
        sys.exit(f"{args.trl_python} cannot import trl and datasets: run `bash bench/setup_trl.sh`")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = ["--threads", str(args.threads)]
    trl_run = dict(label="TRL GRPOTrainer(tools=)", side="trl", cmd=[args.trl_python, str(BENCH / "trl_agentic_worker.py")])
    rl_run = dict(label="rlkit Trainer(tools=)", side="rlkit", cmd=[sys.executable, str(BENCH / "rlkit_agentic_worker.py")])

    # 1. SmolLM2's own template: what TRL says
    own = args.own_model
    if own is None:
        from bench_agentic import warm_start as own_warm_start  # the proof's warm start (SmolLM2's ChatML)

        own = own_warm_start()
    try:
        run_one(trl_run, own, 3, out / "trl-own-template.log", args.timeout, threads)
        own_error = "none: it ran"
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        lines = str(e).strip().splitlines()
        own_error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])
    print(f"TRL with SmolLM2's own chat template: {own_error}", flush=True)

    # 2. the same tool template on both sides
    model = warm_start(tool_template_model(args.trl_python, out))
    print(f"model (SFT warm start, TRL's Qwen2.5 template): {model}\nload average: {os.getloadavg()}", flush=True)
    runs = [trl_run, rl_run]
    results: dict[str, list[dict]] = {x["label"]: [] for x in runs}
    saved: dict[str, str] = {}
    for r in range(args.rounds):
        for x in runs[r % 2:] + runs[:r % 2]:
            extra = threads + (["--save", str(out / f"model-{x['side']}")] if r == 0 else [])
            res = run_one(x, model, args.steps, out / f"r{r}-{x['side']}.log", args.timeout, extra)
            results[x["label"]].append(res)
            if r == 0:
                saved[x["label"]] = str(out / f"model-{x['side']}")
            print(f"round {r + 1}: {x['label']:24s} {res['steps_per_s']:.4f} steps/s (median step "
                  f"{res['median_step_s']:.1f} s), load before {res['load_avg_1min_before']:.2f}", flush=True)
    speed = pd.DataFrame([{"run": label, "steps/s (median)": statistics.median(x["steps_per_s"] for x in rs),
                           "s/step (median)": statistics.median(x["median_step_s"] for x in rs),
                           "rounds": len(rs), "steps/s per round": ", ".join(f"{x['steps_per_s']:.4f}" for x in rs),
                           "load (1 min) before": ", ".join(f"{x['load_avg_1min_before']:.1f}" for x in rs),
                           "peak RSS MB": statistics.median(x["peak_rss_mb"] for x in rs)}
                          for label, rs in results.items()]).set_index("run")
    ratio = speed.loc[rl_run["label"], "steps/s (median)"] / speed.loc[trl_run["label"], "steps/s (median)"]

    evals = {"warm start (step 0)": evaluate(model)}
    for label, path in saved.items():
        evals[f"{label} after {args.steps} steps"] = evaluate(path)
    acc = pd.DataFrame([{"model": k, "accuracy": v["exact"], "n": v["n"], "tool calls/episode": v["episode/tool_calls"],
                         "well-formed calls": v["episode/well_formed_calls"], "tool errors/episode": v["episode/tool_errors"]}
                        for k, v in evals.items()]).set_index("model")
    pd.set_option("display.width", 200)
    print(f"\nTRL with SmolLM2's own chat template: {own_error}")
    print(f"\n{args.rounds} rounds x {args.steps} steps ({AGENTIC})\n" + speed.round(4).to_string())
    print(f"\nrlkit / TRL steps/s: {ratio:.2f}x")
    print("\nheld-out (greedy, rlkit's evaluation of both saved models)\n" + acc.round(3).to_string())
    (out / "results.json").write_text(json.dumps({"own_template_error": own_error, "runs": results, "ratio": ratio,
                                                  "evals": evals}, indent=1, default=str))


if __name__ == "__main__":
    main()
