"""`rlkit demo`: the README's main job. A short GRPO run on the embedded default (local Ray, CPU, a
tiny model built locally), printing the reward as it rises.

Task: ``rlkit.tasks.repeat`` ("ccc" -> answer with as many 'c' as possible in 16 characters). A
random-init model scores ~0.03; reward is dense, so RL alone moves it within a minute or two.
"""

from __future__ import annotations

import os
import time
from typing import Any


def main(quick: bool = False, steps: int | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    import rlkit
    from rlkit.doctor import main as doctor
    from rlkit.widgets.live import readable

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
        for _, s in trainer.samples(last=1, ids=True).head(4).iterrows():  # stray bytes shown as token ids
            print(f"  {s['prompt']!r} -> {readable(s['completion'], s['completion_ids'])}  reward {s['reward']:.3f}")
        print(f"metrics, config and plots in {trainer.run_dir}/")
    finally:
        trainer.close()
    return 0


# ---- the real model: GRPO on SmolLM2-135M-Instruct, measured on held-out questions -----------------------
REAL_MODEL = "smollm2-135m-instruct"


def real_model_run(model: str = REAL_MODEL, steps: int = 20, eval_every: int = 5, eval_samples: int = 4,
                   digits: int = 1, lr: float = 2e-5, dp: int = 2, prompts_per_step: int = 4, n: int = 8,
                   seed: int = 0, view: str = "auto",
                   run_dir: str | None = None, log=print, lora: Any = None) -> dict:
    """GRPO on chat arithmetic with a real pretrained model, scored on held-out questions as it trains.

    The task is ``rlkit.tasks.ChatArithmetic(digits=digits, test_fraction=0.3)`` ("What is 3 + 5? Answer
    with just the number.", reward 0.6 right answer + 0.4 bare-number reply); for one digit that is 75
    training and 25 held-out questions. Before training and every ``eval_every`` steps the policy answers
    every held-out question greedily, and ``eval_samples`` times each sampled at temperature 1. Each step
trains on ``prompts_per_step`` questions sampled ``n`` times (about 27 s a step on 2 CPU cores at dp=2).
    ``lora``: train LoRA adapters instead (``TrainerConfig.lora``: a peft ``LoraConfig`` or a rank).
    Returns ``{"curve": DataFrame (one row per evaluation), "metrics": the training metrics DataFrame,
    "before": ..., "after": ... (the first and last curve rows as dicts), "samples": ...}``.

    >>> out = real_model_run(steps=2, eval_every=2)              # doctest: +SKIP
    >>> list(out["curve"].columns)[:3]                           # doctest: +SKIP
    ['step', 'greedy/reward', 'greedy/exact']
    """
    import pandas as pd

    import rlkit

    path = rlkit.models.pretrained(model)
    task = rlkit.tasks.ChatArithmetic(digits=digits, test_fraction=0.3)
    held_out = list({r["question"]: r for r in task(n=20 * 10**digits, split="test")}.values())  # each once
    plan = rlkit.ParallelPlan(dp=dp)
    t0 = time.perf_counter()
    trainer = rlkit.Trainer(model=path, dataset=task, algorithm="grpo", plan=plan,
                            rollout=rlkit.Rollout(engine="hf", n=n, max_new_tokens=task.max_new_tokens),
                            prompts_per_step=prompts_per_step, lr=lr, seed=seed, lora=lora,
                            run_dir=run_dir or os.path.join("runs", f"real-{model}"))
    log(f"{model} on {plan.world_size} worker(s) ({plan.describe()}) ready in {time.perf_counter() - t0:.1f} s")
    curve = []

    def evaluate() -> None:
        t = time.perf_counter()
        greedy = trainer.evaluate(held_out, n=len(held_out), greedy=True)
        sampled = trainer.evaluate(held_out * eval_samples, n=len(held_out) * eval_samples, greedy=False)
        m = trainer.metrics
        done = m.iloc[-eval_every:] if len(m) else None
        curve.append({"step": trainer.step, "greedy/reward": greedy["reward"], "greedy/exact": greedy["exact"],
                      "sampled/reward": sampled["reward"], "sampled/exact": sampled["exact"],
                      "train/reward": done["reward/mean"].mean() if done is not None else float("nan"),
                      "s/step": done["timing/step"].median() if done is not None else float("nan"),
                      "eval s": time.perf_counter() - t})
        r = curve[-1]
        log(f"step {r['step']:3d}  held-out greedy reward {r['greedy/reward']:.3f} exact {r['greedy/exact']:.3f}  "
            f"sampled reward {r['sampled/reward']:.3f} exact {r['sampled/exact']:.3f}")

    try:
        evaluate()
        while trainer.step < steps:
            trainer.fit(steps=min(eval_every, steps - trainer.step), view=view)
            evaluate()
        samples = trainer.samples(last=1, ids=True)
        metrics = trainer.metrics
    finally:
        trainer.close()
    curve = pd.DataFrame(curve)
    return {"curve": curve, "metrics": metrics, "before": curve.iloc[0].to_dict(), "after": curve.iloc[-1].to_dict(),
            "samples": samples}


def real_model_main(model: str = REAL_MODEL, steps: int | None = None, quick: bool = False) -> int:
    """`rlkit demo --model NAME`: ``real_model_run`` with its numbers printed (``--quick``: 4 steps)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    import rlkit

    if model not in rlkit.models.available():
        rlkit.models.pretrained(model)  # a folder or hub id resolves; anything else raises, naming the choices
    torch.set_num_threads(1)
    steps = steps or (4 if quick else 20)
    every = min(steps, 2 if quick else 5)
    print(f"== {model}: GRPO on chat arithmetic ('What is 3 + 5? Answer with just the number.'), {steps} steps ==")
    t0 = time.perf_counter()
    out = real_model_run(model, steps=steps, eval_every=every, eval_samples=1 if quick else 4)
    wall = time.perf_counter() - t0
    b, a = out["before"], out["after"]
    print(f"\nheld-out questions, greedy: reward {b['greedy/reward']:.3f} -> {a['greedy/reward']:.3f}, exact "
          f"{b['greedy/exact']:.3f} -> {a['greedy/exact']:.3f}; sampled: reward {b['sampled/reward']:.3f} -> "
          f"{a['sampled/reward']:.3f}")
    print(f"{steps} steps in {wall / 60:.1f} min ({out['metrics']['timing/step'].median():.1f} s/step median)")
    print("samples from the last step:")
    from rlkit.widgets.live import readable

    for _, s in out["samples"].head(4).iterrows():
        print(f"  {readable(s['completion'], s.get('completion_ids'))}  reward {s['reward']:.2f}")
    return 0
