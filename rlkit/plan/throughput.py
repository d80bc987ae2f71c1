"""Throughput estimates: training step time and tokens/s of a plan, and rollout decode speed.

A roofline-style model with kernel efficiencies calibrated on published measured runs:

    step = compute / (1 - bubble) + TP communication + exposed DP communication + PP communication

* **compute**: per token, the matmul FLOPs (``2 x`` matmul params forward) and the attention core
  FLOPs (``4 x layers x seq x q_dim`` forward), each x3 for forward + backward, plus one more forward
  of both with ``recompute="full"`` and of the attention core only with ``"selective"``. Matmuls run
  at ``peak x gemm_efficiency(gpu) x N/(N + 400) x M/(M + 128)``: N = hidden/tp (the narrow side of
  a TP-split GEMM), M = tokens per micro-batch. Narrow or short GEMMs leave tensor cores idle (tile
  and wave quantisation), which is why published runs get *more* efficient as models grow. The
  attention core (flash kernels) runs at 0.7 x the matmul efficiency.
* **bubble**: pipeline fill and drain, ``(p - 1) / (v m + p - 1)`` per flush.
* **communication** (bytes from ``rlkit.plan.comm.estimate_communication``) at 0.8 x the links'
  peak bandwidth, NCCL's typical bus bandwidth:
  - TP all-reduces (or SP all-gather + reduce-scatter) sit between layers: exposed.
  - DP all-gathers and reduce-scatters are prefetched / issued per layer under the forward and
    backward compute (FSDP2, Megatron's overlapped grad reduce): exposed only beyond the compute
    time, and at least one layer's share (the last reduce cannot hide).
  - PP sends: exposed (with sequence parallelism each TP rank sends a 1/tp slice).
  - EP all-to-alls (mixture-of-experts models with ``ep > 1``: dispatch and combine, forward and
    backward): the experts wait for them, so exposed; the experts' gradient all-reduce over the
    expert-DP ranks is DP communication (overlapped like the rest).
* **mixture of experts**: FLOPs from the *active* parameters (router, top-k and shared experts;
  ``ModelSpec.flops_per_token``); the expert GEMMs are taken at the dense GEMMs' efficiency (their
  token count per expert, ``tokens x k / E``, is smaller: an optimistic bound).

**Calibration** (``CALIBRATION``; the test ``tests/test_plan_search.py`` holds the table): each published
run is marked ``role="fit"`` or ``role="validation"``, and the fitted constants come from the fit rows
only (``fit_calibration`` re-derives them): the matmul plateau of each GPU family (A100 0.813 from
Korthikanti et al. 2022 Table 5's 22B, 175B and 530B runs; H100 0.573 from torchtitan's Llama 3.1 8B
FSDP run, 500 W, eager kernels) and ``GEMM_HALF_N`` (440). The validation row, Korthikanti's 1T run
(the largest hidden/tp and the deepest pipeline, non-interleaved), is predicted, never fitted.
``GEMM_HALF_M`` (128 tokens, one row tile of the tensor-core GEMM kernels), the attention factor (0.7),
the NCCL factor (0.8) and the kernel traffic are priors, not fitted here (a free fit of ``GEMM_HALF_M`` on
the fit rows runs to 0: three of the four sit at 2048 tokens per micro-batch). Errors: fit rows mean
|error| 0.8%, worst 1.6% (in-sample; the H100 row is one row for one constant, so ~0 by construction);
validation row -1.0% (held out). GPUs without a published anchor (B200, H20, MI300X, L40S) take the plateau of
their generation's peer.
Pass ``mfu=`` to replace the calibrated efficiency by one flat fraction of peak for every kernel.

Rollout (decode) is memory-bandwidth bound: each new token of a batch reads all weights plus the
KV cache once, so ``estimate_generation`` divides bytes read by HBM bandwidth.

>>> from rlkit.plan import ParallelPlan
>>> r = estimate_throughput(ParallelPlan(dp=8), "llama-3-8b", seq_len=8192, global_batch=16, micro_batch=2,
...                         gpu="H100", recompute="selective")
>>> round(r["tokens_per_s_per_gpu"], -2), round(r["achieved_mfu"], 2)   # 700 W SXM, fused kernels
(7100.0, 0.42)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlkit.errors import PlanError

# Dense (no sparsity) BF16 tensor-core peak and HBM bandwidth per GPU, from the vendors' datasheets:
# NVIDIA A100 datasheet (2021), H100 datasheet (2023, SXM5 / PCIe), H200 product brief (2024),
# Blackwell B200 (HGX B200 spec, dense), L40S datasheet; AMD Instinct MI300X datasheet.
# "gemm_efficiency": the fraction of that peak large bf16 matmuls sustain inside a training step,
# fitted on CALIBRATION's role="fit" rows only (``fit_calibration``): Ampere (Megatron, Korthikanti
# 2022) and Hopper (torchtitan 2024). Blackwell, CDNA3 and Ada have no anchor here and take the value
# of their generation's peer.
GEMM_PLATEAU = {"A100": 0.813, "H100": 0.573}   # = fit_calibration()["A100"], ["H100"]
GPUS: dict[str, dict[str, float]] = {
    "A100-40GB": {"bf16_flops": 312e12, "hbm_bw": 1.555e12, "memory": 40e9, "gemm_efficiency": GEMM_PLATEAU["A100"]},
    "A100": {"bf16_flops": 312e12, "hbm_bw": 2.039e12, "memory": 80e9, "gemm_efficiency": GEMM_PLATEAU["A100"]},
    "H100-PCIe": {"bf16_flops": 756e12, "hbm_bw": 2.0e12, "memory": 80e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
    "H100": {"bf16_flops": 989e12, "hbm_bw": 3.35e12, "memory": 80e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
    "H200": {"bf16_flops": 989e12, "hbm_bw": 4.8e12, "memory": 141e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
    "B200": {"bf16_flops": 2250e12, "hbm_bw": 8.0e12, "memory": 180e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
    # H20 (Hopper, export part; verl's async runs): 148 TFLOP/s dense BF16, 4.0 TB/s HBM3, 96 GB, NVIDIA's
    # figures as third-party spec pages list them (e.g. willitrunai.com/gpus/h20-96gb)
    "H20": {"bf16_flops": 148e12, "hbm_bw": 4.0e12, "memory": 96e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
    "L40S": {"bf16_flops": 362e12, "hbm_bw": 0.864e12, "memory": 48e9, "gemm_efficiency": GEMM_PLATEAU["A100"]},
    "MI300X": {"bf16_flops": 1307e12, "hbm_bw": 5.3e12, "memory": 192e9, "gemm_efficiency": GEMM_PLATEAU["H100"]},
}
GEMM_HALF_N = 440    # hidden/tp at which a TP-split matmul reaches half its plateau (= fit_calibration())
GEMM_HALF_M = 128    # tokens per micro-batch at which it does (a prior: one 128-row GEMM tile; not fitted)
ATTENTION_EFFICIENCY = 0.7   # flash-attention kernels relative to the matmul efficiency (a prior)
# Memory-bound (non-matmul) traffic per token and decoder layer, forward + backward, in bytes, as
# (coefficient of hidden for norms and residual adds, replicated over TP unless sequence parallel;
#  of q_dim + kv_dim for RoPE, of intermediate for the gated activation; both split over TP).
# "eager": PyTorch ops one by one (RMSNorm upcast to fp32 in ~6 kernels, RoPE in ~5, SiLU x up in 2,
# each reading and writing its tensors, backward about twice the forward); "fused": Megatron's fused
# kernels or torch.compile (one read and one write per fused op). Counted by hand from the op graphs.
KERNEL_TRAFFIC: dict[str, tuple[int, int, int]] = {"eager": (258, 72, 30), "fused": (24, 12, 16)}
NCCL_EFFICIENCY = 0.8        # achieved bus bandwidth / link peak (a prior: NCCL's typical bus bandwidth)

# Per-GPU one-direction bandwidth, bytes/s: NVLink 4 (H100) 900 GB/s both ways -> 450; one 400 Gb/s
# InfiniBand NDR NIC per GPU -> 50 GB/s; PCIe 4.0 x16 ~32 GB/s; 100 GbE shared by 8 GPUs -> ~1.6 GB/s.
NETWORKS: dict[str, dict[str, float]] = {
    "nvlink+ib": {"intra_node_bw": 450e9, "inter_node_bw": 50e9},
    "nvlink+ethernet": {"intra_node_bw": 450e9, "inter_node_bw": 12.5e9},
    "pcie+ib": {"intra_node_bw": 32e9, "inter_node_bw": 25e9},
    "pcie+ethernet": {"intra_node_bw": 32e9, "inter_node_bw": 1.6e9},
    # DGX A100 (Selene, where Korthikanti et al. measured): NVLink3 600 GB/s both ways -> 300, and
    # 8 x HDR 200 Gb/s NICs per node -> 25 GB/s per GPU
    "nvlink3+ib-hdr": {"intra_node_bw": 300e9, "inter_node_bw": 25e9},
}


def gpu_info(gpu: str | dict) -> dict[str, float]:
    """A preset from ``GPUS`` by name (case-insensitive), or a dict with bf16_flops and hbm_bw
    (and optionally gemm_efficiency, default Hopper's plateau, and gemm_half_n, default ``GEMM_HALF_N``)."""
    if isinstance(gpu, dict):
        missing = {"bf16_flops", "hbm_bw"} - set(gpu)
        if missing:
            raise PlanError(f"gpu dict lacks {sorted(missing)}; give peak bf16 FLOP/s and HBM bytes/s, "
                            f"e.g. {{'bf16_flops': 989e12, 'hbm_bw': 3.35e12}}")
        return {"gemm_efficiency": GPUS["H100"]["gemm_efficiency"], **gpu}
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
                devices_per_node: int, intra_node_bw: float, inter_node_bw: float, recompute: str,
                sequence_parallel: bool) -> dict[str, float]:
    """Seconds per step of TP, DP, PP and EP communication at the links' peak, summed per dimension."""
    from rlkit.plan.comm import estimate_communication

    rows = estimate_communication(plan, spec, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                                  precision=precision, devices_per_node=devices_per_node,
                                  intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw, recompute=recompute,
                                  sequence_parallel=sequence_parallel, _rows_only=True)
    out = {"tp": 0.0, "dp": 0.0, "pp": 0.0, "ep": 0.0}
    for r in rows:
        out[r["dim"]] += r["time_s"]
    return out


def gemm_efficiency(gpu: str | dict, hidden_per_rank: float, tokens_per_micro_batch: float) -> float:
    """Fraction of ``gpu``'s bf16 peak a training step's matmuls sustain, for GEMMs whose narrow side is
    ``hidden_per_rank`` (hidden / tp) over ``tokens_per_micro_batch`` rows (see the module docstring).

    >>> round(gemm_efficiency("A100", 768, 8192), 3), round(gemm_efficiency("A100", 3200, 2048), 3)
    (0.509, 0.673)
    """
    info = gpu_info(gpu)
    e, half_n = info["gemm_efficiency"], info.get("gemm_half_n", GEMM_HALF_N)
    n, m = hidden_per_rank, tokens_per_micro_batch
    return e * n / (n + half_n) * m / (m + GEMM_HALF_M)


def estimate_throughput(plan: Any, model: Any, *, seq_len: int = 4096, global_batch: int | None = None,
                        micro_batch: int = 1, gpu: str | dict = "H100", mfu: float | None = None,
                        devices_per_node: int | None = None, intra_node_bw: float | None = None,
                        inter_node_bw: float | None = None, network: str = "nvlink+ib",
                        recompute: str | None = None, activation_checkpointing: bool | None = None,
                        sequence_parallel: bool = False, precision: str = "bf16-mixed",
                        kernels: str = "fused", token_budget: int | None = None, image_tokens: int = 0,
                        freeze_vision_tower: bool = False) -> dict[str, Any]:
    """Step time and tokens/s of a training step of ``plan`` on ``model`` (the model in the module
    docstring).

    Args:
        plan: a ``ParallelPlan``. model: anything ``as_spec`` takes.
        seq_len: tokens per sequence. micro_batch: sequences per micro-batch.
        global_batch: sequences per step (default dp x micro_batches x micro_batch); a multiple of that
            runs several pipeline flushes per step (gradient accumulation), each with its bubble.
        gpu: a ``GPUS`` preset or a dict. mfu: ``None`` (calibrated kernel efficiency) or one flat
            fraction of peak for every kernel.
        devices_per_node: GPUs per node (default: the plan's, else 8).
        intra_node_bw, inter_node_bw: bytes/s per GPU; default from the ``network`` preset.
        recompute: "none" | "selective" (attention core recomputed: +1 forward of it) | "full" (+1
            forward of everything); ``activation_checkpointing=True`` is an alias for "full".
        sequence_parallel: SP with TP (same TP bytes; PP sends a 1/tp slice; norms split over TP).
        kernels: "fused" (Megatron, torch.compile: the default GPU stack) or "eager" (PyTorch op by
            op): the memory-bound traffic of norms, RoPE and activations (``KERNEL_TRAFFIC``), timed
            at the GPU's HBM bandwidth.
        token_budget: padding-free micro-batches of up to this many tokens (``rlkit.parallel.packing``,
            ``TrainerConfig.micro_batch_tokens``); replaces ``micro_batch`` (leave it 1). A micro-batch
            then holds ``token_budget // seq_len`` sequences of ``seq_len`` (``seq_len``: the row width,
            the longest sequence), and a DP rank's ``n = global_batch / dp`` sequences run as
            ``m = max(plan.n_micro_batches, ceil(n / rows))`` micro-batches in one pipeline flush (a
            multiple of pp under interleaved 1F1B), the packer's count: the bubble is that of ``m``,
            the GEMMs are ``n x seq_len / m`` tokens tall, and FSDP gathers once per micro-batch. Each
            micro-batch is costed at ``ceil(n / m)`` sequences, which is what a pipeline runs (its
            micro-batches have equal shapes, the short ones padded with empty rows) and, without
            one, less than a sequence per micro-batch above the real work; tokens/s and MFU count
            the ``global_batch x seq_len`` real tokens. ``global_batch`` defaults to
            ``dp x n_micro_batches x rows``. Returns also ``micro_batches`` (m) and ``micro_batch``.
        image_tokens: a vision-language model's image tokens per sequence, part of ``seq_len`` (the language
            model runs them as text). The vision tower runs ``ModelSpec.vision_flops`` per sequence (its image
            tokens as one image), forward and backward (x3), or forward only with ``freeze_vision_tower``
            (nothing in it needs a gradient), on the first pipeline stage, whole on each TP rank (it is not
            split): ``vision_s`` a step, at the GEMM efficiency of its width over its patches per micro-batch
            (its attention core at the same; its elementwise traffic is not counted), stretched by the bubble
            like the rest of the first stage's compute.

    Returns a dict: flops_per_token (executed, recompute included), compute_s, gemm_efficiency,
    bubble, bubble_s, tp_comm_s, dp_comm_s, dp_exposed_s, pp_comm_s, ep_comm_s, step_s, tokens_per_step,
    pipeline_flushes, tokens_per_s, tokens_per_s_per_gpu, achieved_mfu (model FLOPs, 3 x forward
    without recompute, over step time x peak x GPUs, as Megatron and torchtitan report it; a vision tower's
    once per sequence), vision_s, vision_flops_per_step (the tower's model FLOPs, all sequences).

    >>> from rlkit.plan import ParallelPlan
    >>> r = estimate_throughput(ParallelPlan(tp=8, pp=4, dp=2, micro_batches=16, devices_per_node=8),
    ...                         "llama-2-70b", seq_len=4096, global_batch=512)
    >>> round(r["bubble"], 3)
    0.158

    A token budget of 8192 at 4096 tokens per sequence packs 2 sequences per micro-batch: the same
    step as ``micro_batch=2``; halving the budget doubles the micro-batches, so the bubble shrinks:

    >>> from dataclasses import replace
    >>> plan = ParallelPlan(tp=8, pp=4, dp=2, micro_batches=4, devices_per_node=8)
    >>> kw = dict(seq_len=4096, global_batch=512)
    >>> padded = estimate_throughput(replace(plan, micro_batches=128), "llama-2-70b", micro_batch=2, **kw)
    >>> packed = estimate_throughput(plan, "llama-2-70b", token_budget=8192, **kw)
    >>> packed["micro_batches"], packed["step_s"] == padded["step_s"]
    (128, True)
    >>> estimate_throughput(plan, "llama-2-70b", token_budget=4096, **kw)["bubble"] < packed["bubble"]
    True

    Qwen2.5-VL-7B on 8 H100s, a 448 x 448 image (256 tokens) in each 1024-token sequence; a frozen tower
    runs forward only:

    >>> kw = dict(seq_len=1024, global_batch=64, image_tokens=256)
    >>> trained = estimate_throughput(ParallelPlan(dp=8), "qwen2.5-vl-7b", **kw)
    >>> frozen = estimate_throughput(ParallelPlan(dp=8), "qwen2.5-vl-7b", freeze_vision_tower=True, **kw)
    >>> round(trained["vision_s"] / frozen["vision_s"], 2), trained["step_s"] > frozen["step_s"]
    (3.0, True)
    """
    from rlkit.plan.spec import as_spec
    from rlkit.plan.units import check_vision, recompute_mode

    if token_budget is not None:
        return _packed_throughput(plan, model, token_budget, seq_len=seq_len, global_batch=global_batch,
                                  micro_batch=micro_batch, gpu=gpu, mfu=mfu, devices_per_node=devices_per_node,
                                  intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw, network=network,
                                  recompute=recompute, activation_checkpointing=activation_checkpointing,
                                  sequence_parallel=sequence_parallel, precision=precision, kernels=kernels,
                                  image_tokens=image_tokens, freeze_vision_tower=freeze_vision_tower)
    spec = as_spec(model)
    recompute = recompute_mode(recompute, activation_checkpointing)
    if mfu is not None and (isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1):
        raise PlanError(f"mfu={mfu!r} must be in (0, 1] (or None for the calibrated efficiency); "
                        f"0.3-0.5 is typical for large-model training")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise PlanError(f"seq_len={seq_len!r} must be a positive integer (tokens per sequence)")
    check_vision(spec, seq_len, image_tokens, freeze_vision_tower)
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
    fwd = spec.flops_per_token(seq_len)
    matmul = spec.flops_per_token(0)
    attention = fwd - matmul
    # forward + backward = 3 forwards; recompute runs one more forward of what it drops
    matmul_runs = 3 + (recompute == "full")
    attention_runs = 3 + (recompute != "none")
    if mfu is not None:
        e_matmul = e_attention = mfu
    else:
        e_matmul = gemm_efficiency(info, spec.hidden_size / plan.tp, micro_batch * seq_len)
        e_attention = e_matmul * ATTENTION_EFFICIENCY
    if kernels not in KERNEL_TRAFFIC:
        raise PlanError(f"kernels={kernels!r} must be one of {list(KERNEL_TRAFFIC)}")
    peak_total = plan.world_size * info["bf16_flops"]
    compute = tokens * (matmul_runs * matmul / e_matmul + attention_runs * attention / e_attention) / peak_total
    elementwise = 0.0
    if mfu is None:  # a flat mfu already stands for every kernel
        c_h, c_qkv, c_i = KERNEL_TRAFFIC[kernels]
        width = spec.intermediate_size
        if spec.is_moe:  # the MLP width a token runs through, averaged over the layers (experts: whole per TP rank)
            n_sparse = len(spec.sparse_layers)
            moe_width = (spec.num_experts_per_tok + spec.n_shared_experts) * spec.moe_intermediate_size * plan.tp
            width = ((spec.num_layers - n_sparse) * width + n_sparse * moe_width) / spec.num_layers
        per_layer = (c_h * spec.hidden_size / (plan.tp if sequence_parallel else 1)
                     + (c_qkv * (spec.q_dim + spec.kv_dim) + c_i * width) / plan.tp)
        # every rank of a TP group streams its share for all the tokens its DP replica runs
        elementwise = tokens / plan.dp * spec.num_layers / plan.pp * per_layer / info["hbm_bw"]
        compute += elementwise
    # a vision tower: on the first stage, each TP rank runs it whole for its replica's sequences
    vision_fwd = spec.vision_flops(image_tokens)
    vision_runs = 1 if freeze_vision_tower else 3
    vision = 0.0
    if vision_fwd:
        e_vision = mfu if mfu is not None else gemm_efficiency(
            info, spec.vision_hidden_size, micro_batch * spec.image_patches(image_tokens))
        vision = global_batch / plan.dp * vision_runs * vision_fwd / (e_vision * info["bf16_flops"])
    bubble = plan.bubble_fraction()
    busy = (compute + vision) / (1 - bubble)  # fill and drain stretch the compute phase

    comm = _comm_times(plan, spec, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                       precision=precision, devices_per_node=per_node, intra_node_bw=intra, inter_node_bw=inter,
                       recompute=recompute, sequence_parallel=sequence_parallel)
    comm = {k: v / NCCL_EFFICIENCY for k, v in comm.items()}
    # DP collectives run per layer under forward and backward compute; the last one cannot hide
    layers_here = max(1, -(-spec.num_layers // plan.pp))
    dp_exposed = max(comm["dp"] - compute - vision, comm["dp"] / layers_here) if comm["dp"] else 0.0
    step = busy + comm["tp"] + dp_exposed + comm["pp"] + comm["ep"]
    vision_model_flops = global_batch * vision_runs * vision_fwd
    return {
        "flops_per_token": matmul_runs * matmul + attention_runs * attention,
        "compute_s": compute,
        "gemm_efficiency": e_matmul,
        "elementwise_s": elementwise,
        "bubble": bubble,
        "bubble_s": busy - compute - vision,
        "tp_comm_s": comm["tp"],
        "dp_comm_s": comm["dp"],
        "dp_exposed_s": dp_exposed,
        "pp_comm_s": comm["pp"],
        "ep_comm_s": comm["ep"],
        "step_s": step,
        "tokens_per_step": tokens,
        "pipeline_flushes": flushes,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / plan.world_size,
        # model FLOPs only (6N + attention): recompute is work the model did not need
        "achieved_mfu": (tokens * 3 * fwd + vision_model_flops) / (step * peak_total),
        "vision_s": vision,
        "vision_flops_per_step": vision_model_flops,
    }


def _packed_throughput(plan: Any, model: Any, token_budget: int, *, seq_len: int, global_batch: int | None,
                       micro_batch: int, **kw: Any) -> dict[str, Any]:
    """``estimate_throughput`` with padding-free micro-batches of ``token_budget`` tokens: the plan with
    the packer's micro-batch count, each of ``ceil(n / m)`` sequences (see ``token_budget`` there)."""
    import dataclasses

    from rlkit.plan.memory import budget_rows
    from rlkit.plan.units import positive_int

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise PlanError(f"seq_len={seq_len!r} must be a positive integer (tokens per sequence)")
    rows = budget_rows(token_budget, seq_len, micro_batch)
    if global_batch is None:
        global_batch = plan.dp * plan.n_micro_batches * rows
    positive_int("global_batch", global_batch)
    if global_batch % plan.dp:
        raise PlanError(f"global_batch={global_batch} does not split over dp={plan.dp}; use a multiple of {plan.dp}")
    n = global_batch // plan.dp
    m = max(plan.n_micro_batches, -(-n // rows))
    if plan.pipeline_schedule == "interleaved-1f1b":
        m = -(-m // plan.pp) * plan.pp
    b = -(-n // m)
    packed = dataclasses.replace(plan, micro_batches=m) if m != plan.n_micro_batches else plan
    out = estimate_throughput(packed, model, seq_len=seq_len, global_batch=plan.dp * m * b, micro_batch=b, **kw)
    run = out["tokens_per_step"]
    tokens = global_batch * seq_len  # the real tokens: costed rows beyond them are empty
    out.update(tokens_per_step=tokens, tokens_per_s=tokens / out["step_s"],
               tokens_per_s_per_gpu=tokens / out["step_s"] / plan.world_size,
               achieved_mfu=out["achieved_mfu"] * tokens / run, micro_batches=m, micro_batch=b)
    return out


# ---- calibration: published measured runs ------------------------------------------------------
# Each row: what the run was, the plan and settings that reproduce it, and what it measured.
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 5:
# GPT models (MHA, 4h GELU MLP, vocab 51200, tied embeddings) on DGX A100 (Selene), seq 2048, TP +
# SP + selective recompute; 175B and 530B interleave 3 stages per GPU. MFU as reported (model FLOPs).
# torchtitan, docs/performance.md (2024-12), Table 1: Llama 3.1 8B, FSDP on 8 H100 (96 GB HBM2e,
# 2.4 TB/s, 500 W), local batch 2, seq 8192, selective AC, no torch.compile: 5,762 tokens/s/GPU.
# Its peak lies between the H100 SXM (989 TFLOP/s) and NVL (835) parts: the mean, 912, is used.
# role: "fit" rows set the fitted constants (``fit_calibration`` reads only them); the "validation" row is
# held out: predicted with those constants, never used to choose them. Held out: Korthikanti's 1T run,
# the largest hidden/tp (3200) and deepest pipeline (PP64, non-interleaved: an 11% bubble) of the set,
# the planner's question (predict a bigger run from smaller ones). The torchtitan row is the only H100
# anchor, so it cannot be held out. family: the GEMM_PLATEAU the row calibrates.
CALIBRATION: list[dict[str, Any]] = [
    dict(run="torchtitan Llama 3.1 8B, FSDP, 8 x H100", role="fit", family="H100", model="llama-3-8b", plan=dict(dp=8),
         seq_len=8192, micro_batch=2, global_batch=16, recompute="selective", sequence_parallel=False, kernels="eager",
         gpu={"bf16_flops": 912e12, "hbm_bw": 2.4e12}, network="nvlink+ib",
         metric="tokens_per_s_per_gpu", published=5762.0),
    dict(run="Korthikanti 22B, TP8, 8 x A100", role="fit", family="A100", model=("gpt", 64, 6144, 48), plan=dict(tp=8),
         seq_len=2048, micro_batch=4, global_batch=4, recompute="selective", sequence_parallel=True,
         gpu="A100", network="nvlink3+ib-hdr", metric="achieved_mfu", published=0.415),
    dict(run="Korthikanti 175B, TP8 PP8 (3 stages each), 64 x A100", role="fit", family="A100", model=("gpt", 96, 12288, 96),
         plan=dict(tp=8, pp=8, vpp=3, micro_batches=64), seq_len=2048, micro_batch=1, global_batch=64,
         recompute="selective", sequence_parallel=True, gpu="A100", network="nvlink3+ib-hdr",
         metric="achieved_mfu", published=0.514),
    dict(run="Korthikanti 530B, TP8 PP35 (3 stages each), 280 x A100", role="fit", family="A100", model=("gpt", 128, 20480, 105),
         plan=dict(tp=8, pp=35, vpp=3, micro_batches=280), seq_len=2048, micro_batch=1, global_batch=280,
         recompute="selective", sequence_parallel=True, gpu="A100", network="nvlink3+ib-hdr",
         metric="achieved_mfu", published=0.560),
    dict(run="Korthikanti 1T, TP8 PP64, 512 x A100", role="validation", family="A100", model=("gpt", 160, 25600, 128),
         plan=dict(tp=8, pp=64, micro_batches=512), seq_len=2048, micro_batch=1, global_batch=512,
         recompute="selective", sequence_parallel=True, gpu="A100", network="nvlink3+ib-hdr",
         metric="achieved_mfu", published=0.563),
]


def gpt_spec(heads: int, hidden: int, layers: int, vocab: int = 51200) -> Any:
    """A GPT-style ModelSpec (multi-head attention, tied embeddings). GPT's 4h GELU MLP has the same
    matmul FLOPs and parameters as a gated MLP of width 8h/3, which is how ``ModelSpec`` counts it
    (rounded to a multiple of 8 so TP up to 8 divides it).

    >>> round(gpt_spec(96, 12288, 96).num_params / 1e9, 1)   # GPT-3 175B
    174.6
    """
    from rlkit.plan.spec import ModelSpec

    return ModelSpec(name=f"gpt-{heads}x{hidden}x{layers}", model_type="gpt", vocab_size=vocab, hidden_size=hidden,
                     intermediate_size=8 * round(hidden / 3), num_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=heads, head_dim=hidden // heads, tie_word_embeddings=True,
                     max_position_embeddings=2048)


def _calibration_run(c: dict[str, Any], gpu: str | dict | None = None) -> dict[str, Any]:
    """``estimate_throughput`` of one ``CALIBRATION`` row (on ``gpu`` instead of the row's, if given)."""
    from rlkit.plan.topology import ParallelPlan

    model = gpt_spec(*c["model"][1:]) if isinstance(c["model"], tuple) else c["model"]
    plan = ParallelPlan(devices_per_node=8, **c["plan"])
    return estimate_throughput(plan, model, seq_len=c["seq_len"], micro_batch=c["micro_batch"],
                               global_batch=c["global_batch"], gpu=c["gpu"] if gpu is None else gpu,
                               network=c["network"], recompute=c["recompute"],
                               sequence_parallel=c["sequence_parallel"], kernels=c.get("kernels", "fused"))


def calibration_table() -> Any:
    """The throughput model against the published runs of ``CALIBRATION``: one row each with its role
    ("fit": used to fit the constants; "validation": held out), the metric, the published and predicted
    values and the relative error. Report the two roles apart: the fit rows' error is in-sample.

    >>> df = calibration_table()
    >>> df.groupby("role")["rel_err"].apply(lambda e: round(e.abs().mean(), 3)).to_dict()
    {'fit': 0.008, 'validation': 0.01}
    """
    import pandas as pd

    rows = []
    for c in CALIBRATION:
        r = _calibration_run(c)
        pred = r[c["metric"]]
        rows.append(dict(run=c["run"], role=c["role"], metric=c["metric"], published=c["published"], predicted=pred,
                         rel_err=(pred - c["published"]) / c["published"], bubble=r["bubble"],
                         gemm_efficiency=r["gemm_efficiency"], tp_comm_share=r["tp_comm_s"] / r["step_s"]))
    return pd.DataFrame(rows)


def _golden_min(f: Any, lo: float, hi: float, tol: float) -> float:
    """The minimiser of a unimodal ``f`` on [lo, hi] (golden-section search)."""
    g = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_calibration(rows: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Re-derive the fitted constants from the ``role="fit"`` rows of ``rows`` (default ``CALIBRATION``)
    only; validation rows are not read. Least squares on the relative errors: for a ``GEMM_HALF_N``
    candidate, each family's plateau (``GEMM_PLATEAU``) minimises its fit rows' squared errors;
    ``GEMM_HALF_N`` minimises the total (a grid from 50 to 3200, then golden-section on log scale).
    Then rounded: ``GEMM_HALF_N`` to 10, the plateaus re-fitted at that value and rounded to 3 decimals.
    ``GEMM_HALF_M``, ``ATTENTION_EFFICIENCY``, ``NCCL_EFFICIENCY`` and ``KERNEL_TRAFFIC`` stay as they are.

    >>> fit_calibration() == {"gemm_half_n": GEMM_HALF_N, **GEMM_PLATEAU}   # the module's constants
    True
    """
    import math

    fit = [c for c in (CALIBRATION if rows is None else rows) if c["role"] == "fit"]
    families = sorted({c["family"] for c in fit})

    def sq_err(c: dict[str, Any], plateau: float, half_n: float) -> float:
        base = GPUS[c["gpu"]] if isinstance(c["gpu"], str) else c["gpu"]
        r = _calibration_run(c, gpu={**base, "gemm_efficiency": plateau, "gemm_half_n": half_n})
        return (r[c["metric"]] / c["published"] - 1) ** 2

    def plateau(family: str, half_n: float) -> float:
        mine = [c for c in fit if c["family"] == family]
        return _golden_min(lambda e: sum(sq_err(c, e, half_n) for c in mine), 0.05, 1.0, 1e-6)

    def plateaus(half_n: float) -> dict[str, float]:
        return {f: plateau(f, half_n) for f in families}

    def total(half_n: float) -> float:
        p = plateaus(half_n)
        return sum(sq_err(c, p[c["family"]], half_n) for c in fit)

    grid = [50.0 * 2 ** (k / 2) for k in range(13)]   # 50 ... 3200
    k = min(range(len(grid)), key=lambda i: total(grid[i]))
    lo, hi = math.log(grid[max(k - 1, 0)]), math.log(grid[min(k + 1, len(grid) - 1)])
    half_n = float(round(math.exp(_golden_min(lambda x: total(math.exp(x)), lo, hi, 1e-4)), -1))
    return {"gemm_half_n": half_n, **{f: round(e, 3) for f, e in plateaus(half_n).items()}}


def estimate_generation(model: Any, *, gpu: str | dict = "H100", tp: int = 1, batch: int = 64,
                        prompt_len: int = 512, response_len: int = 512, dtype_bytes: int = 2,
                        bw_efficiency: float = 0.8, mfu: float = 0.4) -> dict[str, Any]:
    """Decode throughput of one rollout engine replica (``tp`` GPUs), for sampling RL rollouts.

    Each decode step produces one token for each of ``batch`` sequences and reads every language-model weight once
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
    weight_bytes = spec.language_params * dtype_bytes / tp  # a vision tower runs at prefill, not per new token
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


ADAMW_BYTES = 28  # per parameter and optimizer step: fp32 weight, grad, m, v read; weight, m, v written


def rl_step_work(model: Any, *, samples: int, prompt_len: float, response_len: float, n: int = 1,
                 decode_steps: int | None = None, epochs: int = 1, dtype_bytes: int = 2
                 ) -> dict[str, tuple[float, float]]:
    """What each phase of one RL step must do, counted from its real tokens: ``{phase: (FLOPs, bytes)}``,
    the bytes being what must move at least (weights streamed by decode, AdamW's state).

    ``samples`` sequences of ``prompt_len`` + ``response_len`` tokens on average, ``n`` samples per prompt.
    A token's forward is ``ModelSpec.flops_per_token`` at the mean context without the vocab head, which
    is counted where it runs:

    - **generate**: each distinct prompt prefilled once (its ``n`` samples share it; the head on its last
      token only), then a forward and the head per new token. Every weight (``dtype_bytes`` each) is read
      once per decode step, ``decode_steps`` of them (default ``response_len``: a batch decodes as long as
      its longest answer).
    - **old_logprobs** (``epochs > 1``: a second pass needs the log-probs before the first): one forward over
      every token, the head on response tokens only (rlkit scores those alone).
    - **update**: forward + backward (three forwards) per epoch, and AdamW's ``ADAMW_BYTES`` per parameter.

    ``phase_floors`` turns this into the least seconds a machine can take for each phase
    (``bench/roofline_phases.py`` holds each phase's measured seconds against them).

    >>> w = rl_step_work("qwen2.5-7b", samples=32, prompt_len=512, response_len=512, n=8)
    >>> f"{w['generate'][1] / 1e12:.1f} TB"          # 512 decode steps, each reading ~15 GB of bf16 weights
    '7.8 TB'
    """
    from rlkit.plan.spec import as_spec

    spec = as_spec(model)
    for name, value in (("samples", samples), ("n", n), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    for name, value in (("prompt_len", prompt_len), ("response_len", response_len)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise PlanError(f"{name}={value!r} must be a number of tokens >= 0")
    head = 2 * spec.hidden_size * spec.vocab_size
    fwd = spec.flops_per_token(int(prompt_len + response_len)) - head  # a token's forward without the head
    prompts, new = samples / n, samples * response_len
    once = fwd * samples * (prompt_len + response_len) + head * new  # a scoring forward
    steps = response_len if decode_steps is None else decode_steps
    work = {"generate": (fwd * prompts * prompt_len + head * prompts + (fwd + head) * new,
                         steps * spec.language_params * dtype_bytes)}
    if epochs > 1:
        work["old_logprobs"] = (once, 0.0)
    work["update"] = (3 * once * epochs, ADAMW_BYTES * spec.num_params * epochs)
    return work


def phase_floors(work: dict[str, tuple[float, float]], *, flops_per_s: float, bytes_per_s: float) -> dict[str, float]:
    """The least seconds each phase of ``rl_step_work`` can take at a matmul peak and a memory bandwidth:
    generate the longer of its FLOPs and its weight reads (they overlap: a decode step streams the weights
    into its matmuls), the others the sum (AdamW's bytes move after the backward).

    >>> w = rl_step_work("qwen2.5-7b", samples=32, prompt_len=512, response_len=512, n=8)
    >>> gpu = GPUS["H100"]                  # decode at batch 32 waits on memory there: 2.33 s of reads, 0.27 of math
    >>> {k: round(v, 2) for k, v in phase_floors(w, flops_per_s=gpu["bf16_flops"], bytes_per_s=gpu["hbm_bw"]).items()}
    {'generate': 2.33, 'update': 1.46}
    """
    return {phase: max(f / flops_per_s, b / bytes_per_s) if phase == "generate" else f / flops_per_s + b / bytes_per_s
            for phase, (f, b) in work.items()}


OLD_LOGPROB_IN = ("off_policy", "sync", "all")   # which loops pay the separate pi_old scoring pass


def _seconds(name: str, value: Any) -> float:
    """``value`` as seconds: a finite number >= 0, else a PlanError naming it."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
        raise PlanError(f"{name}={value!r} must be a finite number of seconds >= 0")
    return float(value)


def estimate_rl_step(generate_s: float, update_s: float, sync_s: float = 0.0, *, devices: int = 1,
                     rollout_devices: int | None = None, scaling: float = 1.0, old_logprob_s: float = 0.0,
                     old_logprob_in: str = "off_policy", tail_s: float = 0.0,
                     staleness: int | None = None, lengths: Sequence[Sequence[int]] | None = None
                     ) -> dict[str, float]:
    """Step time of one RL step three (or four) ways, from its phase times on all ``devices`` (measured, or
    from ``predict_rl_step``): ``generate_s`` (sampling the step's batch), ``update_s`` (scoring and training
    on it), ``sync_s`` (moving the new weights to the engines).

    * ``colocated_sync``: both phases on every device in turn (the HybridEngine): ``G + U + S``.
    * ``split_sync``: rollout on ``rollout_devices`` of them, training on the rest, taking turns:
      ``G_r + U_t + S``, each phase slower by its share of the devices to the power ``scaling`` (1: a
      phase's time is inversely proportional to its devices; 0: it cannot use more than one share).
    * ``split_one_step_off``: the same split, overlapped (``off_policy_steps=1``): ``max(G_r, U_t + O_t + S)``,
      the sync sitting on the trainer's side (it gathers; the engines load between their generations).
    * ``fully_async`` (only with ``staleness=k``): streaming generation with partial rollouts (verl's
      fully async trainer, AReaL): the engines never wait for a batch's longest response, since the next
      prompts fill the freed slots and a response cut by a sync carries on under the new weights. The
      tail stops costing time until a response must finish within ``k`` policy versions:
      ``max(W_r, U_t + O_t + S, T / k)``, ``T = tail_s``, ``W_r`` the parallel part of ``G_r``.

    The long tail: ``tail_s`` (a part of ``generate_s``) is the time the batch waits for its longest
    responses after the rest finished, decoded one token at a time whatever the devices: it does not
    shrink on more devices nor grow on fewer, so ``G_r = (G - T) x (devices / rollout_devices)^scaling + T``.
    ``predict_rl_step`` estimates it from the longest response's length.

    Or give the length distribution: ``lengths``, the response lengths of some batches (one list per
    batch; e.g. a run's, or drawn from the distribution you expect). Decoding the batch in lockstep
    takes as many steps as its longest response, each about as long (memory-bound decode does not speed
    up as the batch thins), while slots refilled with the next prompts (continuous batching, streaming)
    would spend the mean: so ``tail_s = generate_s x (1 - mean(mean_b) / mean(max_b))`` over the batches
    ``b``, and the returned ``tail_share`` says how much of generation that is.

    The pi_old pass: ``old_logprob_s`` (seconds on all devices, scaled like ``update_s``) is a separate
    scoring pass for pi_old before the update, and ``old_logprob_in`` says which loops pay it:

    * ``"off_policy"`` (default): only one-step-off and fully async. With one optimizer step per batch the
      synchronous update needs no pi_old (the ratio is 1), while the off-policy correction (TIS/MIS
      weights pi_old / mu) needs pi_old of the trainer's weights before the update: a scoring pass of its
      own unless the update's first forward supplies it. rlkit took that pass before 9ac7e94 (the
      bench_async.py measurements); it now takes pi_old from the update's forward when
      ``TrainerConfig.fused_offpolicy()`` (correction on, ``epochs = minibatches = 1``, no KL in the
      reward): pass ``old_logprob_s=0`` for that.
    * ``"all"``: every loop (``epochs > 1`` or ``minibatches > 1``: PPO's ratio needs pi_old before the
      first optimizer step; or a KL penalty in the reward; verl's one-step-off recipe, 16 PPO
      mini-batches a step).
    * ``"sync"``: the synchronous loops only (verl's fully async trainer takes pi_old from the rollout's
      log-probs, ``use_rollout_log_probs``, and skips the pass its colocated baseline pays).

    Returns the step times (``colocated_sync_s``, ``split_sync_s``, ``split_one_step_off_s`` and, with
    ``staleness``, ``fully_async_s``) and speed ratios (> 1: the async loop is faster):
    ``one_step_off_vs_split_sync``, ``one_step_off_vs_colocated`` (and ``fully_async_vs_colocated``). With
    linear scaling, no tail and the best split, one-step-off cannot beat the colocated loop by more than
    the sync it hides: overlap wins where a phase cannot use every device.

    >>> r = estimate_rl_step(10.0, 10.0, devices=2, rollout_devices=1, scaling=1.0)
    >>> r["colocated_sync_s"], r["split_sync_s"], r["split_one_step_off_s"]
    (20.0, 40.0, 20.0)
    >>> round(estimate_rl_step(10.0, 10.0, devices=2, rollout_devices=1, scaling=0.0)["one_step_off_vs_colocated"], 2)
    2.0

    A pi_old pass of 3 s (6 s on the trainer's half) lengthens only the one-step-off trainer's side,
    ``max(2 x 4, 2 x 9 + 2 x 3 + 2)``. A 3 s tail of a 4 s generation makes it ``1 x 2 + 3`` on half the
    devices; streaming hides the tail down to ``3 / k``:

    >>> r = estimate_rl_step(4.0, 9.0, 2.0, devices=2, rollout_devices=1, old_logprob_s=3.0)
    >>> r["colocated_sync_s"], r["split_sync_s"], r["split_one_step_off_s"]
    (15.0, 28.0, 26.0)
    >>> estimate_rl_step(4.0, 1.0, devices=2, rollout_devices=1, tail_s=3.0, staleness=1)["fully_async_s"]
    3.0

    Batches of nine 8-token answers and one 64-token answer: lockstep decodes 64 steps for a mean of 13.6:

    >>> r = estimate_rl_step(4.0, 0.5, devices=2, rollout_devices=1, lengths=[[8] * 9 + [64]], staleness=2)
    >>> round(r["tail_share"], 3), round(r["fully_async_s"], 3)
    (0.787, 1.7)
    """
    generate_s, update_s, sync_s = (_seconds(n, v) for n, v in
                                    (("generate_s", generate_s), ("update_s", update_s), ("sync_s", sync_s)))
    old_logprob_s, tail_s = _seconds("old_logprob_s", old_logprob_s), _seconds("tail_s", tail_s)
    if lengths is not None:
        if tail_s:
            raise PlanError(f"give tail_s={tail_s!r} or lengths, not both: lengths sets the tail")
        tail_s = generate_s * tail_share(lengths)
    if tail_s > generate_s:
        raise PlanError(f"tail_s={tail_s!r} is part of generate_s={generate_s!r}: it cannot be longer")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 <= scaling < float("inf"):
        raise PlanError(f"scaling={scaling!r} must be a finite number >= 0 (1: linear in the devices; 0: flat)")
    if old_logprob_in not in OLD_LOGPROB_IN:
        raise PlanError(f"old_logprob_in={old_logprob_in!r} must be one of {list(OLD_LOGPROB_IN)}")
    if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1):
        raise PlanError(f"staleness={staleness!r} must be a positive integer (policy versions a response may span)"
                        f" or None")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices={devices!r} must be a positive integer")
    rollout_devices = max(1, devices // 2) if rollout_devices is None else rollout_devices
    if isinstance(rollout_devices, bool) or not isinstance(rollout_devices, int) or not 0 < rollout_devices < devices:
        raise PlanError(f"rollout_devices={rollout_devices!r} must leave devices to train on: 1..{devices - 1} of "
                        f"devices={devices} (split placement needs at least 2 devices)")
    train_devices = devices - rollout_devices
    work = (generate_s - tail_s) * (devices / rollout_devices) ** scaling
    g = work + tail_s
    u = update_s * (devices / train_devices) ** scaling
    o = old_logprob_s * (devices / train_devices) ** scaling
    o_sync, o_off = (o if old_logprob_in in ("sync", "all") else 0.0), (o if old_logprob_in != "sync" else 0.0)
    colocated = generate_s + update_s + sync_s + (old_logprob_s if old_logprob_in in ("sync", "all") else 0.0)
    split_sync = g + u + o_sync + sync_s
    off = max(g, u + o_off + sync_s)
    out = {"colocated_sync_s": colocated, "split_sync_s": split_sync, "split_one_step_off_s": off,
           "one_step_off_vs_split_sync": split_sync / off, "one_step_off_vs_colocated": colocated / off}
    if staleness is not None:
        full = max(work, u + o_off + sync_s, tail_s / staleness)
        out.update(fully_async_s=full, fully_async_vs_colocated=colocated / full,
                   fully_async_vs_one_step_off=off / full)
    if lengths is not None:
        out["tail_share"] = tail_s / generate_s if generate_s else 0.0
    return out


def tail_share(lengths: Sequence[Sequence[int]]) -> float:
    """The share of lockstep generation that is tail, from the response lengths of some batches (one list
    each): ``1 - mean(batch means) / mean(batch maxima)`` (``estimate_rl_step``'s ``lengths``).

    >>> tail_share([[8, 8, 8, 8]]), tail_share([[8, 8, 8, 40], [8, 8, 8, 8]])
    (0.0, 0.5)
    """
    batches = [list(b) if isinstance(b, (list, tuple)) else [] for b in lengths]
    if not batches or any(not b for b in batches) or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for b in batches for x in b):
        raise PlanError(f"lengths must be batches (lists) of response lengths, positive integers, e.g. "
                        f"[[8, 8, 64], [8, 12, 8]]; got {str(lengths)[:80]}")
    mean = sum(sum(b) / len(b) for b in batches) / len(batches)
    top = sum(max(b) for b in batches) / len(batches)
    return 1.0 - mean / top


def predict_rl_step(model: Any, *, gpu: str | dict = "H100", devices: int, rollout_devices: int | None = None,
                    batch: int, prompt_len: int = 512, response_len: int = 512, max_response_len: int | None = None,
                    rollout_tp: int = 1, token_budget: int | None = None, minibatches: int = 1,
                    recompute: str = "none", old_logprob: str = "none", sync_s: float = 0.0, scaling: float = 1.0,
                    staleness: int | None = None, network: str = "nvlink+ib", devices_per_node: int = 8,
                    decode_mfu: float = 0.4, mfu: float | None = None) -> dict[str, Any]:
    """``estimate_rl_step`` of ``model`` with its phase times estimated on all ``devices`` of ``gpu``:
    ``batch`` responses a step (prompts x samples per prompt), ``prompt_len`` tokens of prompt and
    ``response_len`` of response on average.

    * generation (``estimate_generation``): ``devices // rollout_tp`` engines of ``rollout_tp`` GPUs, each
      decoding ``ceil(batch / engines)`` responses of the mean length at ``decode_mfu``; plus, when
      ``max_response_len`` is longer, the tail: the longest response decoding alone from the mean length
      to its end at one sequence's latency (``estimate_generation(batch=1)``). One response left alone is
      the least tail a batch with such a response can have: a lower bound.
    * update (``estimate_throughput``): FSDP over all devices (``ParallelPlan(dp=devices)``), ``batch``
      sequences of ``prompt_len + response_len`` tokens in ``minibatches`` optimizer steps (PPO
      mini-batches: each gathers the weights and reduces the gradients again), in padding-free
      micro-batches of ``token_budget`` tokens (``None``: one sequence each); ``recompute`` as there
      (verl's ``enable_gradient_checkpointing`` is ``"full"``). The optimizer's own time is left out.
    * pi_old (``old_logprob``): "none", or which loops pay a separate scoring pass (``old_logprob_in`` of
      ``estimate_rl_step``: "off_policy", "sync", "all"), costed as a third of one pass of forward and
      backward over the whole batch without recompute (a forward: a third of the FLOPs).

    ``sync_s``, ``scaling`` and ``staleness`` go to ``estimate_rl_step`` as they are. Returns its dict with
    the phases: ``generate_s`` (the tail included), ``tail_s``, ``update_s``, ``old_logprob_s``.

    >>> r = predict_rl_step("qwen2.5-7b", gpu="H100", devices=16, rollout_devices=8, batch=1024,
    ...                     prompt_len=256, response_len=1024, max_response_len=8192, token_budget=16384,
    ...                     old_logprob="off_policy")
    >>> {k: round(r[k]) for k in ("generate_s", "tail_s", "update_s", "old_logprob_s")}
    {'generate_s': 48, 'tail_s': 41, 'update_s': 8, 'old_logprob_s': 3}

    The 41 s tail (7168 tokens after the mean at ~5.7 ms each) does not halve with the devices, so the
    split's generation, ``2 x 7 + 41``, is the one-step-off step:

    >>> {k: round(r[k]) for k in ("colocated_sync_s", "split_sync_s", "split_one_step_off_s")}
    {'colocated_sync_s': 56, 'split_sync_s': 71, 'split_one_step_off_s': 55}
    """
    from rlkit.plan.topology import ParallelPlan

    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices={devices!r} must be a positive integer")
    if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1 or devices % rollout_tp:
        raise PlanError(f"rollout_tp={rollout_tp!r} must be a positive integer dividing devices={devices}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"batch={batch!r} must be a positive integer (responses per step)")
    if isinstance(minibatches, bool) or not isinstance(minibatches, int) or minibatches < 1 or batch % minibatches:
        raise PlanError(f"minibatches={minibatches!r} must be a positive integer dividing batch={batch}")
    if old_logprob != "none" and old_logprob not in OLD_LOGPROB_IN:
        raise PlanError(f"old_logprob={old_logprob!r} must be 'none' or one of {list(OLD_LOGPROB_IN)}")
    longest = response_len if max_response_len is None else max_response_len
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < response_len:
        raise PlanError(f"max_response_len={max_response_len!r} must be an integer >= response_len={response_len!r}")
    engines = devices // rollout_tp
    gen = estimate_generation(model, gpu=gpu, tp=rollout_tp, batch=-(-batch // engines), prompt_len=prompt_len,
                              response_len=response_len, mfu=decode_mfu)["seconds_per_rollout_batch"]
    tail = 0.0
    if longest > response_len:
        alone = estimate_generation(model, gpu=gpu, tp=rollout_tp, batch=1, prompt_len=prompt_len,
                                    response_len=longest, mfu=decode_mfu)["step_s"]
        tail = (longest - response_len) * alone
    plan = ParallelPlan(dp=devices, devices_per_node=min(devices, devices_per_node))
    kw = dict(seq_len=prompt_len + response_len, gpu=gpu, network=network, mfu=mfu, token_budget=token_budget)
    update = minibatches * estimate_throughput(plan, model, recompute=recompute, global_batch=batch // minibatches,
                                               **kw)["step_s"]
    forward = 0.0
    if old_logprob != "none":
        forward = estimate_throughput(plan, model, recompute="none", global_batch=batch, **kw)["step_s"] / 3
    phases = {"generate_s": gen + tail, "tail_s": tail, "update_s": update, "old_logprob_s": forward}
    step = estimate_rl_step(gen + tail, update, sync_s, devices=devices, rollout_devices=rollout_devices,
                            scaling=scaling, old_logprob_s=forward,
                            old_logprob_in="off_policy" if old_logprob == "none" else old_logprob,
                            tail_s=tail, staleness=staleness)
    return {**phases, **step}
