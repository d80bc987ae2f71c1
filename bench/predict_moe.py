"""The planner on mixture-of-experts models: DeepSeek-V3's published training run as a held-out check of the
step-time model, and what it predicts for Qwen3-30B-A3B on 16 and 64 GPUs.

    .venv/bin/python bench/predict_moe.py

The throughput model's kernel efficiencies are fitted on dense Megatron runs (``rlkit.plan.throughput
.calibration_table``); nothing here was fitted to DeepSeek-V3. Its technical report (arXiv 2412.19437,
sections 3.1-3.3): 2048 H800 GPUs (8 per node, NVLink 160 GB/s, InfiniBand 50 GB/s per GPU), PP16 x EP64
(over 8 nodes) with ZeRO-1 DP, 4K-token sequences, a batch of 15360 sequences for most of training, and
2664K GPU-hours for 14.8T tokens: 180K H800 GPU-hours per trillion tokens. It trains in FP8 and overlaps
the all-to-alls with computation (DualPipe); the model here counts bf16 GEMMs and exposed all-to-alls.
"""

from __future__ import annotations

import pandas as pd

from rlkit.plan import ParallelPlan, estimate_throughput, search_plans

H800 = {"bf16_flops": 989e12, "hbm_bw": 3.35e12, "memory": 80e9}  # an H100 with NVLink cut to 400 GB/s


def deepseek_v3() -> dict:
    plan = ParallelPlan(dp=128, pp=16, ep=64, dp_shard="shard_grad_op", micro_batches=15360 // 128,
                        devices_per_node=8)
    r = estimate_throughput(plan, "deepseek-v3", seq_len=4096, global_batch=15360, gpu=H800, intra_node_bw=160e9,
                            inter_node_bw=50e9)
    hours = 2048 * 1e12 / r["tokens_per_s"] / 3600
    hidden = r["step_s"] - r["ep_comm_s"]  # if the all-to-alls were all hidden, as DualPipe aims
    return {"step_s": r["step_s"], "compute_s": r["compute_s"], "ep_comm_s": r["ep_comm_s"], "bubble_s": r["bubble_s"],
            "gpu_hours_per_T": hours, "published": 180e3, "ratio": hours / 180e3,
            "gpu_hours_per_T_a2a_hidden": hours * hidden / r["step_s"]}


def main() -> None:
    ds = deepseek_v3()
    print("DeepSeek-V3, held out:", {k: round(v, 3) if isinstance(v, float) else v for k, v in ds.items()})
    for gpus in (16, 64):
        df = search_plans("qwen3-30b-a3b", gpus=gpus, gpu_memory="80GB", seq_len=4096, global_batch=512)
        best = df[df.fits].head(1).iloc[0]
        best_ep = df[df.fits & (df.ep > 1)].head(1)
        rows = [best] + ([best_ep.iloc[0]] if len(best_ep) else [])
        print(f"\nQwen3-30B-A3B on {gpus} H100, 4K tokens, 512 sequences a step: the best plan, and the best with EP")
        print(pd.DataFrame([{k: r[k] for k in ("dp", "tp", "pp", "ep", "dp_shard", "memory_gib", "tokens_per_s",
                                                 "step_s", "achieved_mfu")} for r in rows]).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
