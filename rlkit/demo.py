"""`rlkit demo`: the README's main job. A short GRPO run on the embedded default (local Ray, CPU, a
tiny model built locally), printing the reward as it rises.

Task: ``rlkit.tasks.repeat`` ("ccc" -> answer with as many 'c' as possible in 16 characters). A
random-init model scores ~0.03; reward is dense, so RL alone moves it within a minute or two.
"""

from __future__ import annotations

import os
import time


def main(quick: bool = False, steps: int | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    import rlkit
    from rlkit.doctor import main as doctor

    print("== rlkit doctor ==")
    if doctor() != 0:
        return 1
    torch.set_num_threads(1)
    steps = steps or (40 if quick else 100)  # --quick: 40 steps, enough for a reliable rise
    plan = rlkit.ParallelPlan(dp=2)
    print("\n== building a tiny Qwen2 model (random init, local tokenizer) ==")
    path = rlkit.models.tiny_lm("qwen2", size="small")
    print(f"saved to {path}; it loads with AutoModelForCausalLM.from_pretrained like a hub checkpoint")
    print(f"\n== GRPO on the 'repeat' task, actor plan: {plan.describe()} ==")
    t0 = time.perf_counter()
    trainer = rlkit.Trainer(model=path, dataset=rlkit.tasks.repeat, algorithm="grpo", plan=plan,
                            rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=16), prompts_per_step=8,
                            lr=2e-3, entropy_coef=0.02, seed=0, run_dir=os.path.join("runs", "demo"))
    print(f"cluster + {plan.world_size} workers ready in {time.perf_counter() - t0:.1f} s")
    try:
        t1 = time.perf_counter()
        df = trainer.fit(steps=steps)
        wall = time.perf_counter() - t1
        print("\n step  reward  rolling(10)  entropy  s/step")
        roll = df["reward/mean"].rolling(10, min_periods=1).mean()
        for i in list(range(0, len(df), max(1, len(df) // 10))) + [len(df) - 1]:
            r = df.iloc[i]
            print(f"{int(r['step']):5d}  {r['reward/mean']:.3f}   {roll.iloc[i]:.3f}       "
                  f"{r['entropy']:.2f}    {r['timing/step']:.2f}")
        k = min(10, len(df) // 2)
        first, last = df["reward/mean"].head(k).mean(), df["reward/mean"].tail(k).mean()
        print(f"\nmean reward, first {k} steps: {first:.3f}  ->  last {k} steps: {last:.3f} "
              f"({last / max(first, 1e-9):.1f}x); {len(df) / wall:.2f} steps/s; weight sync "
              f"{df['sync/seconds'].median() * 1e3:.0f} ms/step ({df['sync/bytes'].iloc[-1] / 2**20:.1f} MiB)")
        print("samples from the last step:")
        for _, s in trainer.samples(last=1).head(4).iterrows():
            print(f"  {s['prompt']!r} -> {s['completion']!r}  reward {s['reward']:.3f}")
        print(f"metrics, config and plots in {trainer.run_dir}/")
    finally:
        trainer.close()
    return 0
