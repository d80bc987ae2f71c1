"""Each phase of a real GRPO step against this machine's roofline (issue 43).

    .venv/bin/python bench/roofline_phases.py --steps 3                          # 2 threads, 2 epochs
    .venv/bin/python bench/roofline_phases.py --steps 4 --threads 1 --epochs 1   # bench_task_vs_trl's work
    .venv/bin/python bench/roofline_phases.py --precision fp32
    .venv/bin/python bench/roofline_phases.py --steps 4 --threads 1 --epochs 1 --plot bench/roofline.png

The work: SmolLM2-135M-Instruct on reasoning-gym's ``basic_arithmetic`` in a chat, 4 questions x 8 samples x
48 tokens, GRPO (``--epochs 2``: a second pass over the batch, so an old-log-prob pass), the HF engine. What each
phase must do is counted from the step's batch (its real tokens) by the planner's ``rl_step_work``
(``rlkit.plan.throughput``): prefill once per distinct prompt and a forward per new token for generate, which
also reads every weight once a decode step; one forward for old_logprobs; three forwards per epoch and AdamW's
28 bytes a parameter for the update; the vocab head where it runs.

The floor of a phase is the least time this machine can take for it (``phase_floors``): its FLOPs at the bf16 (or
fp32) matmul peak and its bytes at the copy bandwidth, the longer of the two for generate, their sum for the
others. Both roofs are measured in this run
(``bench/roofline.py``'s tables) at the same thread count. "of roofline" is floor / measured. "planner floor"
is the planner's generation model (``rlkit.plan.throughput.estimate_generation``) on the same roofs at full
efficiency (``mfu=1``, ``bw_efficiency=1``): decode steps only, each the larger of its bytes (weights and the
KV cache) and its FLOPs; prefill is not in it.

``--plot PNG`` draws the roofline: the measured roof (``min(peak, intensity x bandwidth)``) over arithmetic
intensity (FLOPs per byte that must move), and each phase where it ran (its median GFLOP/s at its intensity).
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
from rlkit.plan.throughput import estimate_generation, phase_floors, rl_step_work  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--plot", default=None, help="draw the roofline and each phase on it into this PNG")
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
            batch = tr.estimate(batch)
            row = tr.update(batch)
            t = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing/")}
            work = rl_step_work(spec, samples=len(s), prompt_len=prompt_tokens / len(s), n=n,
                                response_len=new_tokens / len(s), decode_steps=decode_steps, epochs=a.epochs,
                                dtype_bytes=weight_bytes // spec.num_params)  # phase: (FLOPs, bytes that must move)
            # the planner's generation model on this machine's roofs at full efficiency: its decode steps only
            planner = estimate_generation(spec, gpu={"bf16_flops": roof, "hbm_bw": bandwidth}, batch=len(s),
                                          prompt_len=round(prompt_tokens / len(s)), response_len=decode_steps,
                                          dtype_bytes=weight_bytes // spec.num_params, bw_efficiency=1.0, mfu=1.0)
            floors = phase_floors(work, flops_per_s=roof, bytes_per_s=bandwidth)
            for phase, (flops, nbytes) in work.items():
                if not t.get(phase):
                    continue
                floor = floors[phase]
                rows.append({"phase": phase, "seconds": t[phase], "GFLOP": flops / 1e9, "GB": nbytes / 1e9,
                             "GFLOP/s": flops / t[phase] / 1e9, "floor s": floor, "of roofline": floor / t[phase],
                             "planner floor s": planner["seconds_per_rollout_batch"] if phase == "generate"
                             else float("nan")})
    df = pd.DataFrame(rows)
    print(f"roof: {roof / 1e9:.0f} GFLOP/s ({a.precision}), {bandwidth / 1e9:.1f} GB/s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, epochs {a.epochs}")
    table = df.groupby("phase", sort=False).agg(statistics.median)
    print(table.round(3).to_string())
    if a.plot:
        plot(table, roof, bandwidth, f"{a.precision}, {torch.get_num_threads()} thread(s), epochs {a.epochs}", a.plot)


def plot(table: pd.DataFrame, roof: float, bandwidth: float, title: str, path: str) -> None:
    """The roofline (GFLOP/s against FLOPs per byte) and each phase's median on it, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    intensity = table["GFLOP"] / table["GB"].where(table["GB"] > 0)  # FLOPs per byte (a phase with no byte
    ridge = roof / bandwidth  # floor sits at the ridge's right, compute-bound)
    intensity = intensity.fillna(ridge * 30)
    xs = [min(ridge / 30, intensity.min() / 2), ridge, max(ridge * 30, intensity.max() * 2)]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [min(roof, x * bandwidth) / 1e9 for x in xs], color="black", lw=1.5,
            label=f"roof: {roof / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s")
    for (phase, row), x in zip(table.iterrows(), intensity):
        ax.scatter([x], [row["GFLOP/s"]], s=40, zorder=3)
        ax.annotate(f"{phase}: {row['of roofline']:.0%} of its floor", (x, row["GFLOP/s"]),
                    textcoords="offset points", xytext=(6, -12), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="FLOPs per byte that must move", ylabel="GFLOP/s",
           title=f"A GRPO step's phases on this machine's roofline ({title})")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"roofline plot: {path}")


if __name__ == "__main__":
    main()
