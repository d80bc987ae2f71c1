"""Persistent training state per rank under each training backend (``rlkit.backends``): weights, gradients and
optimizer state, the bytes a plan's ranks hold between steps.

* ``"torch"``: ``estimate_memory``'s columns (FSDP2 x DTensor TP x PP, torch's padding).
* ``"deepspeed"`` (ZeRO stage z over DP, Rajbhandari et al. 2019, "ZeRO", Sec. 5): with Psi the parameters of a
  pipeline stage and N_d = dp, stage 0 holds (w + g + K) Psi, stage 1 (w + g) Psi + K Psi / N_d, stage 2
  w Psi + (g + K) Psi / N_d, stage 3 (w + g + K) Psi / N_d. K is the optimizer's bytes per parameter: DeepSpeed's
  ZeRO optimizer keeps an fp32 master copy of its partition beside Adam's two moments, K = 4 + 8 = 12, even
  when the weights are fp32 (the paper's K = 12); stage 0 hands the step to the torch optimizer, K = 8 (fp32
  weights are their own master). Partitions are ``ceil(Psi / N_d)`` (DeepSpeed pads its flat buffers).
* ``"megatron"``: Megatron-Core's layout. TP splits every linear layer of a decoder layer (the fused QKV and its
  bias, the projection, the fused gate/up and down) and the vocabulary of the embedding and output layer;
  RMSNorm weights are replicated. The vocabulary is padded to a multiple of ``vocab_multiple x tp`` (rlkit's
  ``MegatronModel`` pads to a multiple of tp, ``vocab_multiple=1``; Megatron-LM's scripts use 128). PP splits
  the layers as the plan does; a tied output layer is a second copy on the last stage (pp > 1). DP replicates
  (DDP); gradients live in DDP's fp32 buffer (Psi x 4). The optimizer holds Adam's moments (8 B/param), plus
  the fp32 master weights (4) when the weights are 16-bit; its distributed optimizer (``distributed_optimizer=
  True``: ZeRO-1, GPU-only in Megatron-Core 0.16.1, plannable here) divides that by N_d.

Activations follow the same formulas on every backend (``estimate_memory``): only persistent state differs.

>>> from rlkit.plan import ParallelPlan
>>> from rlkit.plan.spec import as_spec
>>> psi = as_spec("llama-2-7b").num_params
>>> [round(float(backend_memory(ParallelPlan(dp=4), "llama-2-7b", "deepspeed", zero_stage=s,
...                             precision="bf16-mixed").total[0]) / psi, 2) for s in (0, 1, 2, 3)]   # bytes/param
[16.0, 7.0, 5.5, 4.0]
"""

from __future__ import annotations

import math
from typing import Any

from rlkit.errors import PlanError
from rlkit.plan.spec import as_spec
from rlkit.plan.topology import ParallelPlan

# DeepSpeed's ZeRO stage for each of the plan's DP sharding modes (ZeRO-1 has no FSDP twin: ask for it by name)
ZERO_OF_SHARDING = {"replicate": 0, "shard_grad_op": 2, "full_shard": 3}
# bytes per parameter of the stored weights and gradients under each training precision
WEIGHT_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}


def backend_memory(plan: ParallelPlan, model: Any, backend: str = "torch", *, zero_stage: int | None = None,
                   precision: str = "fp32", distributed_optimizer: bool = False, vocab_multiple: int = 1,
                   **torch_kw: Any):
    """Per-rank bytes of ``weights``, ``grads``, ``optimizer`` and their ``total`` under ``backend`` (AdamW).

    ``zero_stage``: DeepSpeed's (None: from ``plan.dp_shard`` as ``rlkit.backends.resolve`` does).
    ``precision``: "fp32" (what CPU runs measure) or "bf16-mixed" (DeepSpeed: 16-bit weights and gradients,
    fp32 master in the optimizer; Megatron: fp32 master weights in the optimizer). ``torch_kw`` go to
    ``estimate_memory`` for backend="torch".

    >>> df = backend_memory(ParallelPlan(dp=2, dp_shard="replicate"), "qwen2.5-0.5b", "deepspeed", zero_stage=1)
    >>> int(df.optimizer[0]) == math.ceil(494032768 / 2) * 12
    True
    """
    import pandas as pd

    if precision not in WEIGHT_BYTES:
        raise PlanError(f"precision={precision!r}: choose one of {tuple(WEIGHT_BYTES)}")
    if backend == "torch":
        from rlkit.plan.memory import estimate_memory

        df = estimate_memory(plan, model, precision=precision, **torch_kw)[["rank", "weights", "grads", "optimizer"]]
        return df.assign(total=df.weights + df.grads + df.optimizer)
    spec = as_spec(model)
    wb = WEIGHT_BYTES[precision]
    rows = []
    if backend == "deepspeed":
        stage = ZERO_OF_SHARDING.get(plan.dp_shard) if zero_stage is None else zero_stage
        if stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage={zero_stage!r} with dp_shard={plan.dp_shard!r}: name a ZeRO stage 0-3")
        if plan.tp > 1:
            raise PlanError(f"backend='deepspeed' has no tensor parallelism (tp={plan.tp}); plan it with tp=1")
        per_stage = spec.stage_params(plan)
        for rank in range(plan.world_size):
            psi = per_stage[plan.coords(rank)["pp"]]
            part = math.ceil(psi / plan.dp)
            k = 8 if stage == 0 and precision == "fp32" else 12
            rows.append({"rank": rank, "weights": (part if stage == 3 else psi) * wb,
                         "grads": (part if stage >= 2 else psi) * wb,
                         "optimizer": (part if stage >= 1 else psi) * k})
    elif backend == "megatron":
        for rank in range(plan.world_size):
            psi = _megatron_rank_params(spec, plan, plan.coords(rank)["pp"], vocab_multiple)
            k = 8 if precision == "fp32" else 12
            rows.append({"rank": rank, "weights": psi * wb, "grads": psi * 4,
                         "optimizer": (math.ceil(psi / plan.dp) if distributed_optimizer else psi) * k})
    else:
        raise PlanError(f"backend={backend!r}: choose one of 'torch', 'megatron', 'deepspeed'")
    df = pd.DataFrame(rows)
    return df.assign(total=df.weights + df.grads + df.optimizer)


def padded_vocab(vocab: int, tp: int, multiple: int = 1) -> int:
    """Megatron's padded vocabulary: the next multiple of ``multiple x tp`` (``make_vocab_size_divisible_by``).

    >>> padded_vocab(49155, 2), padded_vocab(49155, 2, multiple=128)
    (49156, 49408)
    """
    step = multiple * tp
    return math.ceil(vocab / step) * step


def _megatron_rank_params(spec: Any, plan: ParallelPlan, pp_rank: int, vocab_multiple: int) -> int:
    tp, h = plan.tp, spec.hidden_size
    norms = 2 * h  # input and pre-MLP RMSNorm: replicated over TP
    layer = (spec.layer_params - norms) // tp + norms
    stages = plan.stage_layers(spec.num_layers)
    n = sum(len(layers) for s, layers in enumerate(stages) if s % plan.pp == pp_rank) * layer
    vocab_rows = padded_vocab(spec.vocab_size, tp, vocab_multiple) // tp
    if pp_rank == 0:
        n += vocab_rows * h
    if pp_rank == plan.pp - 1:
        n += h  # final norm
        if not spec.tie_word_embeddings or plan.pp > 1:
            n += vocab_rows * h
    return n


__all__ = ["ZERO_OF_SHARDING", "backend_memory", "padded_vocab"]
