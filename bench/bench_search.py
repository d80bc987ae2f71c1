"""Wall-clock time of the plan layer's hot paths: ``search_plans``, ``estimate_memory`` and the
512-rank ``PlanView`` widget. Prints a table; asserts nothing (speed is measured here, not in tests).

    .venv/bin/python bench/bench_search.py                 # the default cases, 405B on 16,384 GPUs included
    .venv/bin/python bench/bench_search.py --big           # also every (recompute, SP) variant at 16,384 GPUs
    .venv/bin/python bench/bench_search.py --repeat 3      # best of 3

Each case runs in a fresh process state for its first call only when it comes first: the search
memoises layouts (rank-group spans) across calls, so --repeat > 1 also shows the warm time.

The times depend on the machine (and on what else runs on it): compare rows measured together.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import pandas as pd

from rlkit.plan import ParallelPlan, RolloutMemory, estimate_memory, search_plans


def _time(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best wall-clock seconds of ``repeat`` calls, and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def cases(big: bool) -> list[tuple[str, Callable[[], object]]]:
    """(name, thunk) for each measured call."""
    plan512 = ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8)

    def widget() -> object:
        from rlkit.widgets.plan_view import PlanView

        return PlanView(plan512, model="llama-3-70b")

    out: list[tuple[str, Callable[[], object]]] = [
        ("search_plans qwen2.5-72b, 64 GPUs, seq 4096",
         lambda: search_plans("qwen2.5-72b", gpus=64, gpu_memory="80GB", seq_len=4096)),
        ("search_plans llama-3-70b, 512 GPUs, seq 4096",
         lambda: search_plans("llama-3-70b", gpus=512, gpu_memory="80GB", seq_len=4096)),
        ("estimate_memory llama-3-70b, 512 ranks, actor+ref+rollout",
         lambda: estimate_memory(plan512, "llama-3-70b", roles=("actor", "reference"), device_memory="80GB",
                                 rollout=RolloutMemory(tp=8, gpu_memory_utilization=0.4))),
        ("PlanView 512 ranks (llama-3-70b)", widget),
    ]
    out.append(("search_plans llama-3.1-405b, 16384 GPUs, seq 8192",
                lambda: search_plans("llama-3.1-405b", gpus=16384, gpu_memory="80GB", seq_len=8192,
                                     global_batch=2048)))
    out.append(("search_plans llama-3-70b, 16384 GPUs, seq 8192",
                lambda: search_plans("llama-3-70b", gpus=16384, gpu_memory="80GB", seq_len=8192,
                                     global_batch=2048)))
    if big:
        out.append(("search_plans llama-3.1-405b, 16384 GPUs, variants='all'",
                    lambda: search_plans("llama-3.1-405b", gpus=16384, gpu_memory="80GB", seq_len=8192,
                                         global_batch=2048, variants="all")))
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    """Run the cases and print one row each: name, seconds, rows returned."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--big", action="store_true", help="also the 16,384-GPU search with every variant kept")
    args = ap.parse_args(argv)
    rows = []
    for name, fn in cases(args.big):
        secs, out = _time(fn, args.repeat)
        rows.append(dict(case=name, seconds=round(secs, 3), rows=len(out) if hasattr(out, "__len__") else None))
        print(f"{name:60s} {secs:8.3f} s", flush=True)
    df = pd.DataFrame(rows)
    print()
    print(df.to_string(index=False))
    return df


if __name__ == "__main__":
    main()
