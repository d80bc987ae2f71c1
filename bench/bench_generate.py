"""One GRPO step's generation on the HF engine, timed: the rollout phase of bench_task_vs_trl.py's work alone.

    .venv/bin/python bench/bench_generate.py                          # 1 thread, 5 calls
    .venv/bin/python bench/bench_generate.py --threads 2 --calls 3
    PYTHONPATH=/path/to/older/checkout .venv/bin/python bench/bench_generate.py   # another commit's rlkit

The work: SmolLM2-135M-Instruct in bf16, 4 reasoning-gym ``basic_arithmetic`` questions in a chat, n=8 samples
each, 48 new tokens (``ignore_eos``: every call decodes the same number of steps), temperature 1, seed 0.
Prints one ``RESULT {json}`` line: the median seconds per ``generate`` call after one warm-up call, and each
call's. ``--ab OLD_CHECKOUT`` runs this script in alternating processes on this checkout's rlkit and
OLD_CHECKOUT's (``--rounds`` each) and prints both medians: a side-by-side of two commits.
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


def one(threads: int, calls: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import rlkit
    from rlkit.rollout import Rollout, make_engine

    task = rlkit.tasks.reasoning_gym("basic_arithmetic", chat=True, test_fraction=0.3, min_terms=2, max_terms=2,
                                     min_digits=1, max_digits=1)
    engine = make_engine(Rollout(engine="hf", n=8, max_new_tokens=48, ignore_eos=True, dtype="bfloat16"),
                         str(rlkit.models.pretrained("smollm2-135m-instruct")))
    prompts = [engine.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
               for row in task.dataset(n=4, seed=0)]  # the chat as the Trainer renders it
    engine.generate(prompts, seed=0)  # warm-up
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        engine.generate(prompts, seed=0)
        times.append(time.perf_counter() - t)
    return {"rlkit": str(Path(rlkit.__file__).parent.parent), "threads": threads,
            "median_s": statistics.median(times), "calls_s": [round(x, 3) for x in times]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--ab", default=None, help="an older checkout to run side by side with this one")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if a.ab is None:
        print("RESULT " + json.dumps(one(a.threads, a.calls)), flush=True)
        return
    runs: dict[str, list[float]] = {"this checkout": [], a.ab: []}
    for r in range(a.rounds):
        for tree in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            env = {**os.environ, "PYTHONPATH": str(ROOT if tree == "this checkout" else Path(a.ab).resolve())}
            out = subprocess.run([sys.executable, __file__, "--threads", str(a.threads), "--calls", str(a.calls)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            res = json.loads(out.split("RESULT ", 1)[1])
            runs[tree].append(res["median_s"])
            print(f"round {r + 1}: {tree} ({res['rlkit']}): {res['median_s']:.3f} s per generate", flush=True)
    print("\n| rlkit | seconds per generate (rounds) | median |\n| --- | --- | ---: |")
    for tree, xs in runs.items():
        print(f"| {tree} | {', '.join(f'{x:.2f}' for x in xs)} | {statistics.median(xs):.2f} |")


if __name__ == "__main__":
    main()
