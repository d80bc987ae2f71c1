"""What the fork server of ``rlkit.parallel.launch`` saves: the same parity runs launched with the ranks forked
from one process that imported torch once (``fork=True``, the default) and as fresh ``python -m``
processes (``fork=False``), in interleaved rounds; medians of the wall time and of the CPU time of every
process of the launch.

    .venv/bin/python bench/bench_launch.py                 # 3 rounds of the 2-, 4- and 8-rank plans
    .venv/bin/python bench/bench_launch.py --rounds 5 --plans "dp=2"

Each launch is ``python -m rlkit.parallel`` checking the plan against the single-process model on the
tiny test model (the runs the parity tests make), so both ways do identical work and must both pass.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from bench_parallel import plan_args  # noqa: E402

from rlkit.models import tiny_lm  # noqa: E402
from rlkit.parallel.launch import launch  # noqa: E402


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # every process waited for, and what they waited for
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="*", default=["dp=2", "dp=2,tp=2", "dp=2,tp=2,pp=2"])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model = tiny_lm("qwen2", size="test")  # built before timing
    runs = []
    for r in range(a.rounds):
        for spec in a.plans:
            world, args = plan_args(spec)
            for fork in ((True, False) if r % 2 == 0 else (False, True)):  # interleaved, order alternating
                cpu0 = children_cpu()
                res = launch(world, [*args, "--model", model, "--steps", "2", "--tol", "1e-5"],
                             tempfile.mkdtemp(prefix="bench-launch-"), timeout=600, fork=fork)
                if res.returncodes != [0] * world:
                    raise SystemExit(f"{spec} fork={fork} failed: {res.returncodes}\n{res.log()}")
                runs.append({"plan": spec, "ranks": world, "ranks forked": fork, "wall_s": res.seconds,
                             "cpu_s": children_cpu() - cpu0})
                print(runs[-1], flush=True)
    df = pd.DataFrame(runs)
    med = df.groupby(["plan", "ranks", "ranks forked"], sort=False)[["wall_s", "cpu_s"]].agg(statistics.median)
    print(f"\nmedians of {a.rounds} interleaved rounds:")
    print(med.round(1).to_string())


if __name__ == "__main__":
    main()
