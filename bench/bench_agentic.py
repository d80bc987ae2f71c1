"""Agentic RL on a real model (issue 24): SmolLM2-135M-Instruct learns to call a calculator tool for the
multiplications it gets wrong on its own.

    .venv/bin/python bench/bench_agentic.py                  # the proof run (RECIPE below), tables at the end
    .venv/bin/python bench/bench_agentic.py --rl-steps 4 --n-eval 8 --no-zero-shot   # a quick smoke run

The task is ``rlkit.tasks.Calculator(digits=(3, 2))`` ("What is 347 * 58?", reward 1 when the episode's last
message ends on the product); train and held-out questions are disjoint (the task's hash split). The recipe:

1. held-out greedy accuracy with no tool (a plain single-turn Trainer, same held-out rows);
2. held-out greedy accuracy with the tool, zero-shot (the base model never calls it: measured 0 calls in
   32 episodes, with rlkit's TOOL_PROMPT and with the short prompt below);
3. a short SFT warm start on ``RECIPE["sft_rows"]`` demonstrations (``task.demonstrations``: the tool call
   after the question, the answer after the tool's result), kept weak on purpose so RL has room;
4. held-out accuracy with the tool after SFT, then GRPO with the tool for ``RECIPE["rl_steps"]`` steps
   (seeded), then held-out accuracy again.

The tool prompt is a short one (``SHORT_TOOL_PROMPT``, ~60 tokens, through ``MultiTurn(tool_prompt=...)``):
rlkit's default TOOL_PROMPT with the JSON schema is ~250 tokens, which would make each step ~3x dearer on 2
CPU cores. ``tests/test_agentic_real.py`` runs ``proof_run()`` and asserts half of the measured RL gain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SHORT_TOOL_PROMPT = (
    'You have a calculator tool. To use it, reply only with\n<tool_call>\n'
    '{"name": "calculator", "arguments": {"expression": "<a> * <b>"}}\n</tool_call>\n'
    'Its result comes back in a message from "tool"; then answer with the result.')

# The proof's recipe: every number here is what bench/README.md reports and the slow test replays.
RECIPE: dict[str, Any] = dict(
    model="smollm2-135m-instruct", digits=(3, 2),
    sft_rows=48, sft_steps=6, sft_batch=8, sft_lr=3e-5,       # 24 problems x 2 rows (call; answer after result)
    rl_steps=12, prompts_per_step=4, n=4, lr=3e-5, seed=0,    # GRPO, 16 episodes a step
    max_turns=2, max_new_tokens=40, max_tokens=96,            # call the tool, then answer
    n_eval=32, threads=1,                                     # held-out questions; torch threads (a shared CPU)
)


def warm_start(recipe: dict[str, Any] = RECIPE, progress: bool = False) -> str:
    """The SFT warm start (cached by its arguments in rlkit's cache): a checkpoint folder."""
    import rlkit
    from rlkit.tasks import Calculator, sft_warmstart

    model = rlkit.models.pretrained(recipe["model"])
    demos = Calculator(digits=tuple(recipe["digits"])).demonstrations(model, tool_prompt=SHORT_TOOL_PROMPT)
    return sft_warmstart(model, demos, steps=recipe["sft_steps"], batch_size=recipe["sft_batch"],
                         lr=recipe["sft_lr"], n=recipe["sft_rows"], seed=recipe["seed"],
                         threads=recipe["threads"], progress=progress)


def trainer(model: str, recipe: dict[str, Any] = RECIPE, tools: bool = True, run_dir: str | None = None):
    """The GRPO Trainer of the recipe on ``model``: multi-turn with the calculator, or single-turn without."""
    import tempfile

    import rlkit
    from rlkit.tasks import Calculator

    task = Calculator(digits=tuple(recipe["digits"]))
    agentic = dict(tools=task.tools, multi_turn=rlkit.MultiTurn(
        max_turns=recipe["max_turns"], max_tokens=recipe["max_tokens"], tool_prompt=SHORT_TOOL_PROMPT)) if tools else {}
    return rlkit.Trainer(model=model, dataset=task, algorithm="grpo", seed=recipe["seed"], lr=recipe["lr"],
                         rollout=rlkit.Rollout(engine="hf", n=recipe["n"], max_new_tokens=recipe["max_new_tokens"]),
                         prompts_per_step=recipe["prompts_per_step"],
                         run_dir=run_dir or tempfile.mkdtemp(prefix="rlkit-agentic-"), **agentic)


def proof_run(recipe: dict[str, Any] = RECIPE, zero_shot: bool = True, no_tool: bool = True,
              log=print) -> dict[str, Any]:
    """The whole proof: evaluations ``no_tool``, ``zero_shot`` (optional), ``sft``, ``rl`` (dicts of
    ``Trainer.evaluate``), the RL run's metrics (a DataFrame), samples, and the seconds each part took."""
    import torch

    import rlkit

    torch.set_num_threads(recipe["threads"])
    base = rlkit.models.pretrained(recipe["model"])
    out: dict[str, Any] = {"recipe": dict(recipe), "seconds": {}}
    t0 = time.perf_counter()

    def timed(name: str, fn):
        t = time.perf_counter()
        value = fn()
        out["seconds"][name] = round(time.perf_counter() - t, 1)
        log(f"{name}: {value if isinstance(value, dict) else ''} ({out['seconds'][name]} s)")
        return value

    def evaluate(model: str, tools: bool) -> dict:
        tr = trainer(model, recipe, tools=tools)
        try:
            return tr.evaluate(n=recipe["n_eval"])
        finally:
            tr.close()

    if no_tool:
        out["no_tool"] = timed("no_tool", lambda: evaluate(base, tools=False))
    if zero_shot:
        out["zero_shot"] = timed("zero_shot", lambda: evaluate(base, tools=True))
    warm = timed("sft_warm_start", lambda: warm_start(recipe))
    out["warm"] = warm
    tr = trainer(warm, recipe, tools=True)
    try:
        out["sft"] = timed("sft", lambda: tr.evaluate(n=recipe["n_eval"]))
        timed("rl", lambda: tr.fit(steps=recipe["rl_steps"], view="none"))
        out["metrics"] = tr.metrics
        out["samples"] = tr.samples(last=1)
        out["rl"] = timed("after_rl", lambda: tr.evaluate(n=recipe["n_eval"]))
    finally:
        tr.close()
    out["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    return out


def tables(out: dict[str, Any]):
    """The accuracy / tool-use table and the RL curve (DataFrames)."""
    import pandas as pd

    names = {"no_tool": "(a) no tool, base model", "zero_shot": "with tools, base model (zero-shot)",
             "sft": "(b) with tools, after SFT, before RL", "rl": "(c) with tools, after RL"}
    rows = []
    for key, label in names.items():
        if key in out:
            e = out[key]
            rows.append({"held-out (greedy)": label, "accuracy": e["exact"], "n": e["n"],
                         "tool calls/episode": e.get("episode/tool_calls", float("nan")),
                         "well-formed calls": e.get("episode/well_formed_calls", float("nan")),
                         "tool errors/episode": e.get("episode/tool_errors", float("nan")),
                         "turns/episode": e.get("episode/turns", 1.0)})
    acc = pd.DataFrame(rows).set_index("held-out (greedy)")
    cols = ["step", "reward/mean", "episode/tool_calls", "episode/well_formed_calls", "episode/tool_errors",
            "response_length/mean", "timing/step"]
    curve = out["metrics"][[c for c in cols if c in out["metrics"].columns]]
    return acc, curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rl-steps", type=int, default=RECIPE["rl_steps"])
    ap.add_argument("--sft-rows", type=int, default=RECIPE["sft_rows"])
    ap.add_argument("--sft-steps", type=int, default=RECIPE["sft_steps"])
    ap.add_argument("--n-eval", type=int, default=RECIPE["n_eval"])
    ap.add_argument("--seed", type=int, default=RECIPE["seed"])
    ap.add_argument("--threads", type=int, default=RECIPE["threads"], help="torch threads (1: a shared 2-core CPU)")
    ap.add_argument("--no-zero-shot", action="store_true", help="skip the zero-shot evaluation with tools")
    ap.add_argument("--json", default=None, help="write the evaluations and seconds here")
    args = ap.parse_args()
    import os

    import pandas as pd

    recipe = dict(RECIPE, rl_steps=args.rl_steps, sft_rows=args.sft_rows, sft_steps=args.sft_steps,
                  n_eval=args.n_eval, seed=args.seed, threads=args.threads)
    print(f"recipe: {recipe}\nload average before: {os.getloadavg()}", flush=True)
    out = proof_run(recipe, zero_shot=not args.no_zero_shot, log=lambda s: print(s, flush=True))
    pd.set_option("display.width", 200)
    pd.set_option("display.max_colwidth", 120)
    acc, curve = tables(out)
    print("\n" + acc.round(3).to_string())
    print(f"\nRL gain on top of SFT: {out['rl']['exact'] - out['sft']['exact']:+.3f} "
          f"({out['sft']['exact']:.3f} -> {out['rl']['exact']:.3f}) in {recipe['rl_steps']} GRPO steps, seed {recipe['seed']}")
    print("\n" + curve.round(3).to_string(index=False))
    print(f"\nseconds: {out['seconds']}\nload average after: {os.getloadavg()}")
    print("\nlast step's episodes:\n" + out["samples"][["completion", "reward"]].head(4).to_string())
    if args.json:
        Path(args.json).write_text(json.dumps({k: out[k] for k in ("recipe", "seconds", "no_tool", "zero_shot", "sft", "rl")
                                               if k in out}, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
