"""Step time, tokens/s and memory per plan for a tiny model on local CPU ranks (gloo).

    .venv/bin/python bench/bench_parallel.py                      # a few small plans
    .venv/bin/python bench/bench_parallel.py --plans "dp=2" "dp=2,tp=2,pp=2" --seq-len 64
    .venv/bin/python bench/bench_parallel.py --model tiny-qwen3_moe --plans "dp=2" "dp=2,ep=2" --rounds 3

``--rounds N`` runs the plans N times, interleaved (plan A, B, A, B, ...), and reports each plan's median.
A mixture-of-experts model (``tiny-qwen3_moe``) also takes ``ep=`` in a plan (expert parallelism, cut out of
dp: "dp=2,ep=2" is 2 ranks).

Each plan is one launch of ``python -m rlkit.parallel`` (which also verifies the plan against the
single-process model); the step time is the mean of the steps after the first. On a 2-core machine
with 8 ranks these numbers measure oversubscription more than parallelism: use them to compare
plans on the same machine, not as absolute speeds.
"""

from __future__ import annotations

import argparse
import tempfile

import pandas as pd

from rlkit.parallel.launch import launch

DEFAULT_PLANS = ["dp=1", "dp=2", "tp=2", "pp=2", "dp=2,tp=2", "dp=2,tp=2,pp=2"]


def plan_args(spec: str) -> tuple[int, list[str]]:
    """"dp=2,tp=2" -> (world size, CLI args)."""
    kv = dict(part.split("=") for part in spec.split(",") if part)
    world, args = 1, []
    for key in ("dp", "tp", "pp"):
        n = int(kv.get(key, 1))
        world *= n
        args += [f"--{key}", str(n)]
    if "ep" in kv:  # not a factor of the world: cut out of dp
        args += ["--ep", kv["ep"]]
    m = int(kv.get("micro_batches", max(2, int(kv.get("pp", 1)))))
    return world, args + ["--micro-batches", str(m)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="*", default=DEFAULT_PLANS)
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="runs of every plan, interleaved; medians reported")
    a = p.parse_args()
    rows = []
    for spec in [s for _ in range(a.rounds) for s in a.plans]:
        world, args = plan_args(spec)
        args += ["--model", a.model, "--seq-len", str(a.seq_len), "--micro-batch-size", str(a.micro_batch_size),
                 "--steps", str(a.steps)]
        res = launch(world, args, tempfile.mkdtemp(prefix="rlkit-bench-"), timeout=600)
        rep = res.report or {}
        mem = pd.DataFrame(rep.get("memory", [{"total": float("nan")}]))
        m = int(args[args.index("--micro-batches") + 1])
        dp = int(args[args.index("--dp") + 1])
        tokens = dp * m * a.micro_batch_size * a.seq_len
        step = rep.get("step_time_s") or float("nan")
        rows.append({"plan": spec, "ranks": world, "ok": rep.get("ok", False), "step_s": round(step, 3),
                     "tokens/s": round(tokens / step, 1), "max_mem_MiB": round(mem["total"].max() / 2**20, 2),
                     "max_dgrad": rep.get("max_dgrad"), "wall_s": round(res.seconds, 1)})
        print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    print(df.to_string(index=False))
    if a.rounds > 1:
        print("\nmedians over", a.rounds, "interleaved rounds")
        cols = ["step_s", "tokens/s", "max_mem_MiB", "wall_s"]
        print(df.groupby("plan", sort=False)[cols].median().to_string())


if __name__ == "__main__":
    main()
