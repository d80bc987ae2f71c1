"""Each phase of a real GRPO step against this machine's roofline (issue 43).

    .venv/bin/python bench/roofline_phases.py --steps 3              # SmolLM2-135M-Instruct, bf16-mixed
    .venv/bin/python bench/roofline_phases.py --precision fp32

The work: SmolLM2-135M-Instruct on reasoning-gym's ``basic_arithmetic`` in a chat, 4 questions x 8 samples x
48 tokens, GRPO with 2 epochs (an old-log-prob pass), the HF engine. The real tokens of each step come from
its batch; ``ModelSpec.flops_per_token`` gives a forward's FLOPs per token at the step's mean context, the vocab
head counted on the response's tokens only (rlkit scores those alone; generation's heads are the same count).

- **generate:** prefill (the prompts' tokens, one forward each) plus decode (a forward per sampled token),
  against the FLOP roof. Decode also has a bandwidth bound: each decode step reads every weight once (a
  batch shares the read) at the measured copy bandwidth.
- **old_logprobs:** one forward over prompt + response tokens.
- **update:** forward + backward, 3 forwards' FLOPs, per epoch.

The roofs come from ``bench/roofline.py`` (run beside it): bf16 and fp32 matmul peak, memory bandwidth.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    a = p.parse_args()
    peaks = matmul_table(4096, 32, 5)
    roof = {"bf16-mixed": peaks["bfloat16 GFLOP/s"].max(), "fp32": peaks["float32 GFLOP/s"].max()}[a.precision] * 1e9
    bandwidth = memory_table(256, 5)["copy GB/s (read + write)"].max() * 1e9
    path = rlkit.models.pretrained("smollm2-135m-instruct")
    spec = ModelSpec.from_pretrained(path)
    task = rlkit.tasks.reasoning_gym("basic_arithmetic", chat=True, test_fraction=0.3, min_terms=2, max_terms=2,
                                     min_digits=1, max_digits=1)
    weight_bytes = spec.num_params * (2 if a.precision == "bf16-mixed" else 4)  # what a decode step reads
    tr = rlkit.Trainer(model=path, dataset=task, reward=rlkit.MathAnswer(), prompts_per_step=4, epochs=2, seed=0,
                       rollout=rlkit.Rollout(engine="hf", n=8, max_new_tokens=48,
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
            head = 2 * spec.hidden_size * spec.vocab_size  # the vocab head runs on the response's tokens only
            fwd = spec.flops_per_token(context) - head
            tokens = prompt_tokens + new_tokens
            batch = tr.estimate(batch)
            row = tr.update(batch)
            t = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing/")}
            once = fwd * tokens + head * new_tokens
            flops = {"generate": once, "old_logprobs": once, "update": 3 * once * tr.config.epochs}
            for phase, f in flops.items():
                if t.get(phase):
                    rows.append({"phase": phase, "seconds": t[phase], "GFLOP": f / 1e9, "GFLOP/s": f / t[phase] / 1e9,
                                 "of FLOP roof": f / t[phase] / roof})
            if t.get("generate"):
                bound = decode_steps * weight_bytes / bandwidth
                rows.append({"phase": "decode, bandwidth bound", "seconds": t["generate"], "GFLOP": float("nan"),
                             "GFLOP/s": float("nan"), "of FLOP roof": float("nan"), "bound_s": bound,
                             "of bandwidth bound": bound / t["generate"]})
    df = pd.DataFrame(rows)
    print(f"roof: {roof / 1e9:.0f} GFLOP/s ({a.precision}), {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(df.groupby("phase", sort=False).agg(statistics.median).round(3).to_string())


if __name__ == "__main__":
    main()
