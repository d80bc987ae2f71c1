"""Throughput estimates: training step time and tokens/s of a plan, and rollout decode speed.

A roofline-style model, good enough to rank plans, not to promise numbers:

    step = compute / (1 - bubble) + exposed communication

* compute: training FLOPs of the step (3 x forward: 6N + attention; 4 x forward = 8N with activation
  recompute, from ``ModelSpec.flops_per_token``) spread over all GPUs at ``peak x mfu``.
  ``mfu`` here is the fraction of peak the matmul kernels reach while busy; the *achieved* MFU
  (model FLOPs without recompute / (step time x peak x GPUs)) comes out lower.
* bubble: pipeline fill and drain, ``bubble_fraction(pp, micro_batches, vpp)``.
* communication (from ``rlkit.plan.comm.estimate_communication``):
  - TP all-reduces / all-gathers sit on the critical path between layers: fully exposed.
  - DP gradient reduce(-scatter) and FSDP all-gathers run under the backward / next layer's compute:
    ``dp_overlap`` (default 0.75) of their time is hidden, but never more than the compute time.
  - PP point-to-point sends: exposed (they are small).

Rollout (decode) is memory-bandwidth bound: each new token of a batch reads all weights plus the
KV cache once, so ``estimate_generation`` divides bytes read by HBM bandwidth.

>>> from rlkit.plan import ParallelPlan
>>> r = estimate_throughput(ParallelPlan(dp=8), "qwen2.5-7b", seq_len=4096, global_batch=64, gpu="H100")
>>> 0.2 < r["achieved_mfu"] < 0.4
True
"""

from __future__ import annotations

from typing import Any

from rlkit.errors import PlanError

# Dense (no sparsity) BF16 tensor-core peak and HBM bandwidth per GPU, from the vendors' datasheets:
# NVIDIA A100 datasheet (2021), H100 datasheet (2023, SXM5 / PCIe), H200 product brief (2024),
# Blackwell B200 (HGX B200 spec, dense), L40S datasheet; AMD Instinct MI300X datasheet.
GPUS: dict[str, dict[str, float]] = {
    "A100-40GB": {"bf16_flops": 312e12, "hbm_bw": 1.555e12, "memory": 40e9},
    "A100": {"bf16_flops": 312e12, "hbm_bw": 2.039e12, "memory": 80e9},
    "H100-PCIe": {"bf16_flops": 756e12, "hbm_bw": 2.0e12, "memory": 80e9},
    "H100": {"bf16_flops": 989e12, "hbm_bw": 3.35e12, "memory": 80e9},
    "H200": {"bf16_flops": 989e12, "hbm_bw": 4.8e12, "memory": 141e9},
    "B200": {"bf16_flops": 2250e12, "hbm_bw": 8.0e12, "memory": 180e9},
    "L40S": {"bf16_flops": 362e12, "hbm_bw": 0.864e12, "memory": 48e9},
    "MI300X": {"bf16_flops": 1307e12, "hbm_bw": 5.3e12, "memory": 192e9},
}

# Per-GPU one-direction bandwidth, bytes/s: NVLink 4 (H100) 900 GB/s both ways -> 450; one 400 Gb/s
# InfiniBand NDR NIC per GPU -> 50 GB/s; PCIe 4.0 x16 ~32 GB/s; 100 GbE shared by 8 GPUs -> ~1.6 GB/s.
NETWORKS: dict[str, dict[str, float]] = {
    "nvlink+ib": {"intra_node_bw": 450e9, "inter_node_bw": 50e9},
    "nvlink+ethernet": {"intra_node_bw": 450e9, "inter_node_bw": 12.5e9},
    "pcie+ib": {"intra_node_bw": 32e9, "inter_node_bw": 25e9},
    "pcie+ethernet": {"intra_node_bw": 32e9, "inter_node_bw": 1.6e9},
}


def gpu_info(gpu: str | dict) -> dict[str, float]:
    """A preset from ``GPUS`` by name (case-insensitive), or a dict with bf16_flops and hbm_bw."""
    if isinstance(gpu, dict):
        missing = {"bf16_flops", "hbm_bw"} - set(gpu)
        if missing:
            raise PlanError(f"gpu dict lacks {sorted(missing)}; give peak bf16 FLOP/s and HBM bytes/s, "
                            f"e.g. {{'bf16_flops': 989e12, 'hbm_bw': 3.35e12}}")
        return dict(gpu)
    for name, info in GPUS.items():
        if str(gpu).lower() == name.lower():
            return dict(info)
    raise PlanError(f"gpu={gpu!r} is not a preset; choose one of {list(GPUS)} or pass a dict "
                    f"{{'bf16_flops': ..., 'hbm_bw': ...}}")


def network_info(network: str) -> dict[str, float]:
    """Bandwidths of a network preset from ``NETWORKS``."""
    if network not in NETWORKS:
        raise PlanError(f"network={network!r} is not a preset; choose one of {list(NETWORKS)} or pass "
                        f"intra_node_bw= / inter_node_bw= in bytes/s")
    return dict(NETWORKS[network])


def _comm_times(plan: Any, spec: Any, *, seq_len: int, micro_batch: int, global_batch: int, precision: str,
                devices_per_node: int, intra_node_bw: float, inter_node_bw: float) -> dict[str, float]:
    """Seconds per step of TP, DP and PP communication, summed per dimension."""
    from rlkit.plan.comm import estimate_communication

    df = estimate_communication(plan, spec, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                                precision=precision, devices_per_node=devices_per_node,
                                intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw)
    out = {"tp": 0.0, "dp": 0.0, "pp": 0.0}
    if len(df):
        for dim, t in df.groupby("dim")["time_s"].sum().items():
            out[str(dim)] = out.get(str(dim), 0.0) + float(t)
    return out


def estimate_throughput(plan: Any, model: Any, *, seq_len: int = 4096, global_batch: int | None = None,
                        micro_batch: int = 1, gpu: str | dict = "H100", mfu: float = 0.4,
                        devices_per_node: int | None = None, intra_node_bw: float | None = None,
                        inter_node_bw: float | None = None, network: str = "nvlink+ib",
                        activation_checkpointing: bool = False, precision: str = "bf16-mixed",
                        dp_overlap: float = 0.75) -> dict[str, Any]:
    """Step time and tokens/s of a training step of ``plan`` on ``model``.

    Args:
        plan: a ``ParallelPlan``. model: anything ``as_spec`` takes.
        seq_len: tokens per sequence. micro_batch: sequences per micro-batch.
        global_batch: sequences per step (default dp x micro_batches x micro_batch); a multiple of that
            runs several pipeline flushes per step (gradient accumulation), each with its bubble.
        gpu: a ``GPUS`` preset or a dict. mfu: fraction of peak the kernels reach while busy.
        devices_per_node: GPUs per node (default: the plan's, else 8).
        intra_node_bw, inter_node_bw: bytes/s per GPU; default from the ``network`` preset.
        activation_checkpointing: recompute the forward in backward (8N instead of 6N FLOPs/token).
        dp_overlap: fraction of DP communication hidden behind compute (capped by compute time).

    Returns a dict: flops_per_token, compute_s, bubble, bubble_s, tp_comm_s, dp_comm_s, dp_exposed_s,
    pp_comm_s, step_s, tokens_per_step, tokens_per_s, tokens_per_s_per_gpu, achieved_mfu.

    >>> from rlkit.plan import ParallelPlan
    >>> r = estimate_throughput(ParallelPlan(tp=8, pp=4, dp=2, micro_batches=16, devices_per_node=8),
    ...                         "llama-2-70b", seq_len=4096, global_batch=512)
    >>> round(r["bubble"], 3)
    0.158
    """
    from rlkit.plan.spec import as_spec

    spec = as_spec(model)
    if not 0 < mfu <= 1:
        raise PlanError(f"mfu={mfu!r} must be in (0, 1]; 0.3-0.5 is typical for large-model training")
    if not 0 <= dp_overlap <= 1:
        raise PlanError(f"dp_overlap={dp_overlap!r} must be in [0, 1]")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise PlanError(f"seq_len={seq_len!r} must be a positive integer (tokens per sequence)")
    info = gpu_info(gpu)
    net = network_info(network)
    intra = intra_node_bw or net["intra_node_bw"]
    inter = inter_node_bw or net["inter_node_bw"]
    per_node = devices_per_node or plan.devices_per_node or 8
    m = plan.n_micro_batches
    if global_batch is None:
        global_batch = plan.dp * m * micro_batch
    plan.validate(batch=global_batch)
    flushes, rest = divmod(global_batch // plan.dp, m * micro_batch)
    if rest:
        raise PlanError(f"global_batch={global_batch} does not split into dp={plan.dp} x micro_batches={m} x "
                        f"micro_batch={micro_batch}; use a multiple of {plan.dp * m * micro_batch}")

    tokens = global_batch * seq_len
    # training = forward + backward (2 x forward); recompute adds one more forward
    fwd = spec.flops_per_token(seq_len)
    flops_per_token = fwd * (4 if activation_checkpointing else 3)
    compute = tokens * flops_per_token / (plan.world_size * info["bf16_flops"] * mfu)
    bubble = plan.bubble_fraction()
    busy = compute / (1 - bubble)  # fill and drain stretch the compute phase

    comm = _comm_times(plan, spec, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                       precision=precision, devices_per_node=per_node, intra_node_bw=intra, inter_node_bw=inter)
    backward = compute * (2 / 3)  # DP reduces gradients while later layers' backward still runs
    dp_exposed = comm["dp"] - min(dp_overlap * comm["dp"], backward)
    step = busy + comm["tp"] + dp_exposed + comm["pp"]
    return {
        "flops_per_token": flops_per_token,
        "compute_s": compute,
        "bubble": bubble,
        "bubble_s": busy - compute,
        "tp_comm_s": comm["tp"],
        "dp_comm_s": comm["dp"],
        "dp_exposed_s": dp_exposed,
        "pp_comm_s": comm["pp"],
        "step_s": step,
        "tokens_per_step": tokens,
        "pipeline_flushes": flushes,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / plan.world_size,
        # model FLOPs only (6N + attention): recompute is work the model did not need
        "achieved_mfu": tokens * 3 * fwd / (step * plan.world_size * info["bf16_flops"]),
    }


def estimate_generation(model: Any, *, gpu: str | dict = "H100", tp: int = 1, batch: int = 64,
                        prompt_len: int = 512, response_len: int = 512, dtype_bytes: int = 2,
                        bw_efficiency: float = 0.8, mfu: float = 0.4) -> dict[str, Any]:
    """Decode throughput of one rollout engine replica (``tp`` GPUs), for sampling RL rollouts.

    Each decode step produces one token for each of ``batch`` sequences and reads every weight once
    plus each sequence's KV cache (average context prompt_len + response_len / 2), split over tp GPUs.
    Time per step is the larger of bytes / (HBM bandwidth x bw_efficiency) and the matmul FLOPs at
    ``peak x mfu`` (large batches turn compute bound). Prefill is ignored (it is compute bound and short).

    >>> r = estimate_generation("qwen2.5-7b", gpu="H100", batch=1)
    >>> round(r["tokens_per_s"])   # ~15 GB of weights per token at 2.7 TB/s
    175
    """
    from rlkit.plan.spec import as_spec

    spec = as_spec(model)
    info = gpu_info(gpu)
    for name, value in (("tp", tp), ("batch", batch), ("prompt_len", prompt_len), ("response_len", response_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name.endswith("len") else 1):
            raise PlanError(f"{name}={value!r} must be a positive integer")
    context = prompt_len + response_len / 2
    weight_bytes = spec.num_params * dtype_bytes / tp
    kv_bytes = batch * context * spec.kv_bytes_per_token(dtype_bytes) / tp
    t_memory = (weight_bytes + kv_bytes) / (info["hbm_bw"] * bw_efficiency)
    t_compute = batch * spec.flops_per_token(int(context)) / (tp * info["bf16_flops"] * mfu)
    step = max(t_memory, t_compute)
    return {
        "weight_bytes_per_gpu": weight_bytes,
        "kv_bytes_per_gpu": kv_bytes,
        "step_s": step,
        "bound": "memory" if t_memory >= t_compute else "compute",
        "tokens_per_s": batch / step,
        "tokens_per_s_per_gpu": batch / step / tp,
        "seconds_per_rollout_batch": step * response_len,
    }
