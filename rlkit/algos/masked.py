"""Masked reductions shared by the estimators and losses.

Every function takes a ``mask`` (bool, int or float; 1 = real response token) of the same shape as the
data. Padding is removed with ``torch.where`` rather than multiplied by 0, so NaN or inf in padding
(common: log-probs of pad tokens) neither leaks into the result nor into the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_shapes(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the tensor whose shape differs from ``mask``'s [batch, response_len]."""
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but response_mask has {tuple(mask.shape)}; "
                             f"both must be [batch, response_len]")


def as_bool(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (accepts bool, 0/1 ints or floats)."""
    return mask if mask.dtype == torch.bool else mask != 0


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Upcast half precision so sums and variances over a batch stay exact enough; keep float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the tokens where ``mask`` is set (all dims, or one ``dim``)."""
    x = torch.where(as_bool(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the masked tokens; an empty mask gives 0 (not NaN).

    >>> import torch
    >>> masked_mean(torch.tensor([[1., 2., 99.]]), torch.tensor([[1, 1, 0]]))
    tensor(1.5000)
    """
    m = as_bool(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked tokens of the whole batch; padding becomes 0.

    The variance is the unbiased one (Bessel's correction), as verl's ``masked_whiten``; with fewer
    than two tokens it falls back to the biased one (0), so the result is 0 rather than NaN.

    >>> import torch
    >>> masked_whiten(torch.tensor([[1., 3., 7.]]), torch.tensor([[1, 1, 0]]))
    tensor([[-0.7071,  0.7071,  0.0000]])
    """
    m = as_bool(mask)
    mean = masked_mean(x, m)
    n = m.sum().to(x.dtype)
    var = masked_sum((x - mean) ** 2, m) / (n - 1).clamp(min=1)
    return torch.where(m, (x - mean) * torch.rsqrt(var + eps), torch.zeros((), dtype=x.dtype, device=x.device))


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put one score per sequence ([batch]) on its last real token ([batch, response_len]).

    This is where an outcome reward belongs: on the token that ends the response. A row without any
    real token gets nothing.

    >>> import torch
    >>> last_token_rewards(torch.tensor([2., 5.]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    tensor([[0., 2., 0.],
            [5., 0., 0.]])
    """
    m = as_bool(mask)
    if scores.dim() != 1 or scores.shape[0] != m.shape[0]:
        raise ValueError(f"scores must be [batch]={m.shape[0]} (one per sequence), got shape {tuple(scores.shape)}")
    T = m.shape[1]
    last = T - 1 - m.flip(-1).to(torch.int8).argmax(-1)            # index of the last 1 in each row
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(m.shape[0], device=m.device), last] = scores
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def sequence_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One score per sequence: ``rewards`` as is when [batch], summed over real tokens when [batch, T]."""
    if rewards.dim() == 2:
        check_shapes(mask, token_rewards=rewards)
        return masked_sum(rewards, mask, dim=-1)
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [batch]={mask.shape[0]} or [batch, response_len]={tuple(mask.shape)}, "
                         f"got shape {tuple(rewards.shape)}")
    return rewards


def group_index(group_ids: Sequence[Any] | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
    """Dense group numbers 0..G-1 from any per-sample ids (ints, strings, uuids, a tensor, a numpy array)."""
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.reshape(-1)
        if ids.shape[0] != batch:
            raise ValueError(f"group_ids has {ids.shape[0]} entries but the batch has {batch} samples")
        return torch.unique(ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch} samples")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long, device=device)


def group_stats(scores: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size), vectorised with index_add."""
    G = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, group, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    sq = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return mean[group], std[group], count[group]
