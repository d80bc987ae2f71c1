"""Rollout routing replay (R3) on the tiny Qwen3-MoE: route flips and the engine/trainer log-prob mismatch,
with and without replay, on the same run.

    .venv/bin/python bench/bench_routing_replay.py --steps 6 --size small

A bf16 HF engine samples (``Rollout(dtype="bfloat16", record_routing=True)``) and an fp32 actor trains with
``routing_replay=True``. Every step the actor also scores the same batch with replay switched off
(``RLWorker.set_routing_replay(False)``), so both columns describe the same samples and weights:
``|dlogp|`` is the mean over response tokens of |log pi_trainer - log mu_engine|, ``max`` its maximum, and
``flips`` the share of (token, layer) routing decisions where the trainer's own top-k differs from the
engine's. What replay cannot remove is bf16's rounding in everything else.
"""

from __future__ import annotations

import argparse
import tempfile

import pandas as pd

import rlkit
from rlkit.models import tiny_lm
from rlkit.workers.rl import RLWorker


def mismatch(old, rollout, mask) -> tuple[float, float]:
    d = (old - rollout)[mask.bool()].abs()
    return float(d.mean()), float(d.max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--size", default="small", help="tiny model size (test | small)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = tiny_lm("qwen3_moe", size=a.size)
    tr = rlkit.Trainer(model=path, dataset=rlkit.tasks.repeat, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=24, dtype="bfloat16", record_routing=True),
                       prompts_per_step=8, lr=2e-3, epochs=2, seed=a.seed, routing_replay=True,
                       run_dir=tempfile.mkdtemp(prefix="rlkit-r3-"))
    rows = []
    with tr:
        for step in range(a.steps):
            batch = tr.generate()
            s = batch.samples
            tr.group.call(RLWorker.set_routing_replay, False)
            own = tr.workers.old_logprobs(s)
            tr.group.call(RLWorker.set_routing_replay, True)
            batch = tr.estimate(batch)  # pi_old with replay
            out = tr.update(batch)
            with_mean, with_max = mismatch(batch.samples.old_logprobs, s.rollout_logprobs, s.response_mask)
            own_mean, own_max = mismatch(own, s.rollout_logprobs, s.response_mask)
            rows.append({"step": step + 1, "flips": round(out["router/flip_rate"], 4),
                         "|dlogp| own routing": own_mean, "|dlogp| replayed": with_mean,
                         "max own": own_max, "max replayed": with_max, "reward": out.get("reward/mean")})
            print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2e}"))
    print("\nmedians:", df.drop(columns="step").median().to_dict())


if __name__ == "__main__":
    main()
