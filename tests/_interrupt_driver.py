"""A driver process for tests/test_interrupt.py: fits a tiny Trainer until the test signals it.

    python tests/_interrupt_driver.py once|twice|die RUN_DIR [local|ray|ADDRESS] [hf|vllm]

* ``once``: fit(500) is stopped by one SIGINT from the test; then fit(2) more; prints a RESULT line.
* ``twice``: the reward sleeps (and marks a file) so two SIGINTs land in one step: fit aborts; prints the
  error and what a later fit says.
* ``die``: on a Ray cluster at ADDRESS, a dp=2 Trainer runs 1 step, prints READY and waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import rlkit
from rlkit.models import tiny_lm

torch.set_num_threads(1)


def main() -> None:
    mode, run_dir = sys.argv[1], Path(sys.argv[2])
    where, engine = (sys.argv[3] if len(sys.argv) > 3 else "local"), (sys.argv[4] if len(sys.argv) > 4 else "hf")
    marker = run_dir / "in_reward"

    def reward(prompts, completions, **columns):
        if mode == "twice" and len(list(run_dir.glob("metrics.jsonl"))):  # from step 2 on: a long reward
            marker.write_text("x")
            time.sleep(5)  # the test's two SIGINTs land here
        return rlkit.tasks.repeat.reward(prompts, completions, **columns)

    # local: in this process; ray: an embedded Ray of its own; else the address of a running head
    cluster = None if where == "local" else rlkit.Cluster(num_cpus=2) if where == "ray" else rlkit.Cluster(where)
    plan = rlkit.ParallelPlan(dp=2) if mode == "die" else rlkit.ParallelPlan()
    # vLLM's CPU attention needs head_dim >= 32: the test size with 2 heads
    model = tiny_lm("qwen2", size="test", **({"num_attention_heads": 2, "num_key_value_heads": 1}
                                             if engine == "vllm" else {}))
    extra = {"dtype": "float32", "kv_cache_gb": 1} if engine == "vllm" else {}
    tr = rlkit.Trainer(model=model, dataset=rlkit.tasks.repeat, reward=reward, plan=plan,
                       rollout=rlkit.Rollout(engine=engine, n=2, max_new_tokens=8, **extra), prompts_per_step=2, lr=1e-3,
                       seed=0, run_dir=str(run_dir), cluster=cluster)
    if mode == "die":
        tr.fit(steps=1, view="none")
        print("READY", flush=True)
        time.sleep(600)
        return
    if mode == "once":
        first = tr.fit(steps=500, view="none")
        stopped_at = tr.step
        more = tr.fit(steps=2, view="none")
        # the engine still samples what the actor scores: the interrupted run left it usable and in sync
        tr.workers.sync_weights()
        gen = tr.workers.generate(tr._next_prompts(), seed=5, policy_version=tr.step)
        lp = tr.group.call_dp("actor_logprobs", {k: gen[k] for k in ("input_ids", "attention_mask")})["logprobs"]
        gap = (lp - gen["rollout_logprobs"])[gen["response_mask"].bool()].abs().max().item()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        print("RESULT " + json.dumps({"stopped_at": stopped_at, "first_rows": len(first), "step": tr.step,
                                      "steps": more["step"].tolist(), "engine_gap": gap,
                                      "file_steps": [json.loads(x)["step"] for x in lines]}), flush=True)
        tr.close()
        return
    try:  # twice
        tr.fit(steps=500, view="none")
        print("RESULT " + json.dumps({"aborted": False}), flush=True)
    except KeyboardInterrupt as e:
        try:
            tr.fit(steps=1, view="none")
            later = "fit ran"
        except rlkit.RlkitError as again:
            later = str(again)
        print("RESULT " + json.dumps({"aborted": True, "message": str(e), "later": later, "step": tr.step,
                                      "file_steps": [json.loads(x)["step"] for x in
                                                     (run_dir / "metrics.jsonl").read_text().splitlines()]}),
              flush=True)


if __name__ == "__main__":
    main()
