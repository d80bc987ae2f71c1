"""The training backends' shared kit: what the torch runtime (``rlkit.parallel.model``), Megatron-Core and
DeepSpeed (``rlkit.backends``) all use, so that each computes the same step from the same batch.

* the loss and weight functions a step takes (``LossFn``, ``WeightFn``) and the training ``PRECISIONS``;
* ``load_hf``: the HF model every backend starts from;
* the batch cut, with the checks and errors of a plan: ``dp_slice`` (a DP rank's part), ``micro_batches``,
  ``split_rows``, ``take_rows``, ``batch_rows``, on ``rlkit.batch``'s row operations (a ``Batch`` or a dict);
* the step's arithmetic: ``loss_scales`` (micro-batch weights over DP), ``clip_grads``;
* ``rng_state`` / ``restore_rng_state`` for an exact resume;
* ``TrainingModel``: the interface each backend's model offers the workers (``missing_members`` names any gap).

>>> import torch
>>> batch = {"input_ids": torch.arange(8)[:, None]}
>>> [mb["input_ids"].flatten().tolist() for mb in micro_batches(dp_slice(batch, 1, 2), 2)]
[[4, 5], [6, 7]]
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from rlkit.batch import split, take
from rlkit.errors import PlanError

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]
# A micro-batch's weight in the step's objective (e.g. its loss tokens): see ParallelModel.forward_backward
WeightFn = Callable[[dict[str, torch.Tensor]], float]

# Training precisions: the autocast dtype of the stages' forward (and so backward); None is plain fp32.
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16-mixed": torch.bfloat16}


def load_hf(model: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An HF causal LM from a path / hub id, or the module itself (eager attention, no KV cache). A
    vision-language checkpoint (or module) comes back as ``rlkit.models.vision.causal_view``: its language model
    as a causal LM, its vision tower beside it, under the checkpoint's names."""
    from rlkit.models.vision import causal_view, is_vision_language

    if isinstance(model, nn.Module):
        return causal_view(model) if is_vision_language(model.config) else model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vl = is_vision_language(AutoConfig.from_pretrained(str(model)))
    auto = AutoModelForImageTextToText if vl else AutoModelForCausalLM
    hf = auto.from_pretrained(str(model), dtype=dtype, attn_implementation="eager")
    hf.config.use_cache = False
    return causal_view(hf) if vl else hf


def loss_scales(weights: list[float], dp_size: int, dp_group: Any, device: torch.device) -> list[float]:
    """Each micro-batch's factor in the step's objective ``sum(w * loss) / sum(w)`` over the micro-batches of every
    DP rank, times ``dp_size``: every backend averages gradients over DP, and the factor undoes it. A collective
    over ``dp_group`` when ``dp_size > 1``.

    >>> loss_scales([1.0, 3.0], 1, None, torch.device("cpu"))
    [0.25, 0.75]
    """
    total = torch.tensor(sum(weights), dtype=torch.float64, device=device)
    if dp_size > 1:  # every rank of a DP group holds the same micro-batches: one sum over the groups
        dist.all_reduce(total, group=dp_group)
    tw = total.item()
    return [w * dp_size / tw if tw > 0 else 0.0 for w in weights]


def clip_grads(params: Iterable[torch.Tensor], norm: float, max_norm: float | None) -> None:
    """Scale the gradients of ``params`` by ``max_norm / norm`` when their global ``norm`` exceeds it (None: off)."""
    if max_norm is None or norm <= max_norm:
        return
    coef = max_norm / (norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def dp_slice(batch: dict[str, Any], dp_rank: int, dp_size: int) -> dict[str, Any]:
    """DP rank ``dp_rank``'s slice of a global batch (its rows cut along dim 0; meta kept): every backend's
    ``shard_batch``.

    >>> dp_slice({"input_ids": torch.arange(4)[:, None], "n": 1}, 1, 2)["input_ids"].tolist()
    [[2], [3]]
    """
    n = batch_rows(batch)
    if n % dp_size:
        raise PlanError(f"global batch of {n} sequences is not divisible by dp={dp_size}; use a multiple of {dp_size}")
    return split(batch, dp_size)[dp_rank]


def micro_batches(batch: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """A rank's batch cut into ``m`` equal micro-batches (a ``PlanError`` naming the fix when ``m`` does not
    divide it).

    >>> [mb["input_ids"].tolist() for mb in micro_batches({"input_ids": torch.arange(4)[:, None]}, 2)]
    [[[0], [1]], [[2], [3]]]
    """
    n = batch_rows(batch)
    if n % m:
        raise PlanError(f"this rank's batch of {n} sequences does not split into micro_batches={m}; "
                        f"use a per-DP-rank batch that is a multiple of {m} (global: dp*{m}*k)")
    return split(batch, m)


def rng_state() -> dict[str, Any]:
    """This process's random states (torch, Python, CUDA), which a checkpoint keeps per rank for an exact resume."""
    return {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``rng_state`` returned."""
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    if state["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def split_rows(batch: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """``batch`` in ``m`` consecutive equal parts (``rlkit.batch.split``); ``m`` divides it."""
    return split(batch, m)


def take_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The samples ``rows`` of a batch (``rlkit.batch.take``, on the batch's device)."""
    return take(batch, rows)


def batch_rows(batch: dict[str, Any]) -> int:
    """The number of sequences in ``batch`` (rows of its ``input_ids``)."""
    if "input_ids" not in batch:
        raise PlanError(f"batch needs 'input_ids'; got keys {sorted(batch)}")
    return int(batch["input_ids"].shape[0])


@runtime_checkable
class TrainingModel(Protocol):
    """One rank's share of a model under a backend, as the workers use it: ``rlkit.parallel.ParallelModel``
    (torch), ``rlkit.backends.megatron.MegatronModel`` and ``rlkit.backends.deepspeed.DeepSpeedModel``. Each
    backend's check script reports ``missing_members`` of the model it built, and the tests assert it is empty.

    >>> len(missing_members(object())), missing_members(object())[:2]
    (14, ['full_state_dict', 'iter_full_weights'])
    """

    optimizer: Any                       # the torch optimizer (its state is the checkpoint's and memory()'s)
    params: list[torch.Tensor]           # this rank's trainable tensors (local shards)
    lora: Any                            # the LoRA config trained, or None
    last_transfer: dict[str, float]      # bytes and seconds of the last iter_full_weights

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]: ...

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]: ...

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn, weight_fn: WeightFn | None = None
                   ) -> dict[str, float]: ...

    def set_scoring(self, *, first_column: int = 1, entropy_grad: bool = True) -> None: ...

    def set_packing(self, padding_free: bool = True, token_budget: int | None = None) -> None: ...

    def iter_full_weights(self, to: Any = "all", *, adapters_only: bool = False
                          ) -> Iterator[tuple[str, torch.Tensor | None]]: ...

    def full_state_dict(self, to: str | int = 0) -> dict[str, torch.Tensor]: ...

    def save(self, path: str | os.PathLike) -> str: ...

    def load(self, path: str | os.PathLike) -> None: ...

    def memory(self, batch: dict[str, Any] | None = None) -> Any: ...


def missing_members(model: Any) -> list[str]:
    """The ``TrainingModel`` members ``model`` lacks, sorted (empty for every backend's model)."""
    members = set(TrainingModel.__annotations__) | {n for n, v in vars(TrainingModel).items()
                                                    if callable(v) and not n.startswith("_")}
    return sorted(n for n in members if not hasattr(model, n))
