"""Kill tests on a real multi-node Ray cluster: how long a run takes to recover by itself, how many steps it runs
again, and whether its metrics equal an uninterrupted run of the same seed.

    python bench/bench_recovery.py            # all scenarios, ~6 min on 2 cores

Ray's own multi-node test cluster (``ray.cluster_utils.Cluster``): a head that runs no ranks and two worker
nodes of 2 CPUs, each a raylet process of its own. The run: GRPO on the tiny Qwen2 (2 prompts x 2 samples x 4
tokens a step), ``checkpoint_every=1``, ``max_restarts=1``, 4 steps; the loss lands at the end of step 2, so
the restart loads step 2's checkpoint: "steps lost" are steps finished after the checkpoint and trained again
(0 here; up to ``checkpoint_every - 1``), besides the step that failed, which runs again.

Scenarios: SIGKILL of one actor rank (dp=2, colocated), of the rollout worker (split placement), of an actor
rank with a one-step-off generation in flight (split, ``off_policy_steps=1``), and the removal of the node the
actor's ranks run on (its raylet and every worker on it). "recover s" is from the failure's report to the
workers started again with the checkpoint loaded.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import rlkit
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

VOLATILE = ("timing/", "memory/", "tokens_per_s", "sync/")
STEPS, KILL_AFTER = 4, 2


def make(cluster, run_dir, **kw):
    return Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, run_dir=str(run_dir),
                   rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2, cluster=cluster,
                   **kw)


def same(got, want) -> bool:
    cols = [c for c in want.columns if not c.startswith(VOLATILE)]
    return list(got["step"]) == list(want["step"]) and all(
        all(x == y or (x != x and y != y) for x, y in zip(got[c], want[c])) for c in cols)


def run(cluster, sim, nodes, name, kw, kill):
    root = Path(tempfile.mkdtemp())
    ref = make(cluster, root / "ref", **kw)
    try:
        want = ref.fit(steps=STEPS, view="none")
    finally:
        ref.close()
    tr = make(cluster, root / "run", checkpoint_every=1, max_restarts=1, **kw)
    try:
        tr.callbacks.append(kill(tr, sim, nodes))
        t0 = time.perf_counter()
        got = tr.fit(steps=STEPS, view="none")
        wall = time.perf_counter() - t0
        [r] = tr.restarts
        return {"scenario": name, "failed in step": r["failed_step"], "restarted from": r["from_step"],
                "steps lost": r["failed_step"] - 1 - r["from_step"], "recover s": round(r["seconds"], 1),
                "fit s": round(wall, 1), "metrics equal": same(got, want)}
    finally:
        tr.close()


def kill_rank(group_of):
    def make_kill(tr, sim, nodes):
        group = group_of(tr)
        victims = [group.apply(lambda w: os.getpid())[min(1, group.world_size - 1)]]

        def cb(_tr, row):
            if row["step"] == KILL_AFTER and victims:
                os.kill(victims.pop(), signal.SIGKILL)
        return cb
    return make_kill


def lose_node(tr, sim, nodes):
    where = tr.group.table()["node"][0]
    victims = [n for n in nodes if n.node_id.startswith(where)]

    def cb(_tr, row):
        if row["step"] == KILL_AFTER and victims:
            node = victims.pop()
            nodes.remove(node)
            sim.remove_node(node)
    return cb


def main() -> None:
    import pandas as pd
    import ray
    from ray.cluster_utils import Cluster as SimCluster

    sim = SimCluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [sim.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=sim.address, logging_level="WARNING")
    cluster = rlkit.Cluster()
    rows = []
    try:
        scenarios = [
            ("actor rank (dp=2, colocated)", dict(plan=rlkit.ParallelPlan(dp=2)), kill_rank(lambda t: t.group)),
            ("rollout worker (split)", dict(plan=rlkit.ParallelPlan(), placement="split", rollout_workers=1),
             kill_rank(lambda t: t.rollout_group)),
            ("actor rank, one-step-off in flight (split)",
             dict(plan=rlkit.ParallelPlan(), placement="split", rollout_workers=1, off_policy_steps=1),
             kill_rank(lambda t: t.group)),
            ("whole node (its raylet)", dict(plan=rlkit.ParallelPlan(dp=2)), lose_node),
        ]
        for name, kw, kill in scenarios:
            rows.append(run(cluster, sim, nodes, name, kw, kill))
            print(rows[-1], file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()
        ray.shutdown()
        sim.shutdown()
    print(pd.DataFrame(rows).to_markdown(index=False))


if __name__ == "__main__":
    main()
