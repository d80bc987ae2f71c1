"""Each phase of a real GRPO step against this machine's roofline (issue 43).

    .venv/bin/python bench/roofline_phases.py --steps 3                          # 2 threads, 2 epochs
    .venv/bin/python bench/roofline_phases.py --steps 4 --threads 1 --epochs 1   # bench_task_vs_trl's work
    .venv/bin/python bench/roofline_phases.py --precision fp32

The work: SmolLM2-135M-Instruct on reasoning-gym's ``basic_arithmetic`` in a chat, 4 questions x 8 samples x
48 tokens, GRPO (``--epochs 2``: a second pass over the batch, so an old-log-prob pass), the HF engine. What each
phase must do is counted from the step's batch (its real tokens) with ``ModelSpec.flops_per_token`` at the
step's mean context; the vocab head counts on the response's tokens only (rlkit scores those alone; generation
computes a head per new token).

- **generate:** prefill (each distinct prompt once: its n samples share it) and decode (a forward per new
  token). Decode also reads every weight once a step (a batch shares the read): its floor is the larger of
  the FLOPs at the peak and ``steps x weight bytes`` at the bandwidth.
- **old_logprobs:** one forward over prompt + response tokens.
- **update:** forward + backward (3 forwards' FLOPs) per epoch, plus AdamW's bytes once per optimizer step
  (fp32 weight, grad and two moments read, weight and moments written: 28 bytes a parameter).

The floor of a phase is the least time this machine can take for it: its FLOPs at the bf16 (or fp32) matmul
peak, or its bytes at the copy bandwidth, whichever is longer. Both roofs are measured in this run
(``bench/roofline.py``'s tables) at the same thread count. "of roofline" is floor / measured. "planner floor"
is the planner's generation model (``rlkit.plan.throughput.estimate_generation``) on the same roofs at full
efficiency (``mfu=1``, ``bw_efficiency=1``): decode steps only, each the larger of its bytes (weights and the
KV cache) and its FLOPs; prefill is not in it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).parent))
from roofline import matmul_table, memory_table  # noqa: E402

import rlkit  # noqa: E402
from rlkit.plan import ModelSpec  # noqa: E402
from rlkit.plan.throughput import estimate_generation  # noqa: E402

ADAMW_BYTES = 28  # per parameter and optimizer step: fp32 weight, grad, m, v read; weight, m, v written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    peaks = matmul_table(4096, 32, 5)
    roof = {"bf16-mixed": peaks["bfloat16 GFLOP/s"].max(), "fp32": peaks["float32 GFLOP/s"].max()}[a.precision] * 1e9
    bandwidth = memory_table(256, 5)["copy GB/s (read + write)"].max() * 1e9
    path = rlkit.models.pretrained("smollm2-135m-instruct")
    spec = ModelSpec.from_pretrained(path)
    task = rlkit.tasks.reasoning_gym("basic_arithmetic", chat=True, test_fraction=0.3, min_terms=2, max_terms=2,
                                     min_digits=1, max_digits=1)
    n = 8
    weight_bytes = spec.num_params * (2 if a.precision == "bf16-mixed" else 4)  # what a decode step reads
    tr = rlkit.Trainer(model=path, dataset=task, reward=rlkit.MathAnswer(), prompts_per_step=4, epochs=a.epochs,
                       seed=0, rollout=rlkit.Rollout(engine="hf", n=n, max_new_tokens=48,
                                                     dtype="bfloat16" if a.precision == "bf16-mixed" else "float32"),
                       lr=3e-5, precision=a.precision, run_dir="runs/roofline-phases")
    rows = []
    with tr:
        for _ in range(a.steps):
            batch = tr.generate()
            s = batch.samples
            prompt_tokens = int(s.attention_mask.sum() - s.response_mask.sum())
            new_tokens = int(s.response_mask.sum())
            decode_steps = int(s.response_mask.sum(-1).max())  # the batch decodes as long as its longest answer
            context = int(s.attention_mask.sum(-1).float().mean())
            head = 2 * spec.hidden_size * spec.vocab_size
            fwd = spec.flops_per_token(context) - head  # a token's forward without the vocab head
            once = fwd * (prompt_tokens + new_tokens) + head * new_tokens  # a scoring forward
            batch = tr.estimate(batch)
            row = tr.update(batch)
            t = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing/")}
            work = {  # phase: (FLOPs, bytes that must move at least)
                "generate": ((fwd + head) * (prompt_tokens / n + new_tokens), decode_steps * weight_bytes),
                "old_logprobs": (once, 0.0),
                "update": (3 * once * a.epochs, ADAMW_BYTES * spec.num_params * a.epochs)}
            # the planner's generation model on this machine's roofs at full efficiency: its decode steps only
            planner = estimate_generation(spec, gpu={"bf16_flops": roof, "hbm_bw": bandwidth}, batch=len(s),
                                          prompt_len=round(prompt_tokens / len(s)), response_len=decode_steps,
                                          dtype_bytes=weight_bytes // spec.num_params, bw_efficiency=1.0, mfu=1.0)
            for phase, (flops, nbytes) in work.items():
                if not t.get(phase):
                    continue
                # decode's weight reads bound it alone (max); AdamW's bytes follow the backward (sum)
                floor = max(flops / roof, nbytes / bandwidth) if phase == "generate" else \
                    flops / roof + nbytes / bandwidth
                rows.append({"phase": phase, "seconds": t[phase], "GFLOP": flops / 1e9, "GB": nbytes / 1e9,
                             "GFLOP/s": flops / t[phase] / 1e9, "floor s": floor, "of roofline": floor / t[phase],
                             "planner floor s": planner["seconds_per_rollout_batch"] if phase == "generate"
                             else float("nan")})
    df = pd.DataFrame(rows)
    print(f"roof: {roof / 1e9:.0f} GFLOP/s ({a.precision}), {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, epochs {a.epochs}")
    print(df.groupby("phase", sort=False).agg(statistics.median).round(3).to_string())


if __name__ == "__main__":
    main()
