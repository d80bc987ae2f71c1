"""Split, pad and concatenate batches for data-parallel dispatch.

A batch is a dict whose values are per-sample columns (torch tensors / numpy arrays along dim 0,
lists or tuples) or meta (anything else: strings, numbers, None), which is copied to every chunk.
Results coming back may also be a bare tensor, array or list. Nested dicts work the same way.

>>> import torch
>>> b = {"input_ids": torch.arange(10).view(5, 2), "prompt": list("abcde"), "temperature": 1.0}
>>> padded, n = pad_batch(b, 2)                   # 5 rows -> 6, the last row repeated
>>> [batch_size(c) for c in split_batch(padded, 2)]
[3, 3]
>>> out = concat_batches(split_batch(padded, 2))
>>> truncate_batch(out, n)["prompt"]
['a', 'b', 'c', 'd', 'e']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _is_column(x: Any) -> bool:
    """Per-sample data (sliced along dim 0) rather than meta."""
    if isinstance(x, (list, tuple)):
        return True
    shape = getattr(x, "shape", None)  # torch.Tensor / np.ndarray; 0-d ones are meta (a scalar)
    return shape is not None and len(shape) > 0


def batch_size(batch: Any) -> int:
    """Rows in a batch; every column must have the same number."""
    if isinstance(batch, Mapping):
        sizes = {}
        for key, value in batch.items():
            if isinstance(value, Mapping):
                sizes[key] = batch_size(value)
            elif _is_column(value):
                sizes[key] = len(value)
        if not sizes:
            raise ValueError(f"batch has no per-sample columns (keys {list(batch)}); give tensors or lists "
                             f"with one row per sample")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch columns have different lengths {sizes}; every column needs one row "
                             f"per sample")
        return next(iter(sizes.values()))
    if _is_column(batch):
        return len(batch)
    raise ValueError(f"cannot split a {type(batch).__name__} by rows; pass a dict of tensors/lists, a "
                     f"tensor or a list")


def _map(batch: Any, fn) -> Any:
    if isinstance(batch, Mapping):
        return {k: _map(v, fn) for k, v in batch.items()}
    return fn(batch) if _is_column(batch) else batch


def _take(x: Any, start: int, stop: int) -> Any:
    return x[start:stop]


def split_batch(batch: Any, n: int) -> list[Any]:
    """``n`` equal contiguous chunks (pad first if the size does not divide)."""
    size = batch_size(batch)
    if size % n:
        raise ValueError(f"batch of {size} rows does not split into {n} equal chunks; pad_batch(batch, {n}) first")
    k = size // n
    return [_map(batch, lambda x, i=i: _take(x, i * k, (i + 1) * k)) for i in range(n)]


def _repeat_last(x: Any, extra: int) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(list(x) + [x[-1]] * extra)
    import numpy as np

    if isinstance(x, np.ndarray):
        return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])
    import torch

    return torch.cat([x, x[-1:].expand(extra, *x.shape[1:])])


def pad_batch(batch: Any, multiple: int) -> tuple[Any, int]:
    """Pad to a multiple of ``multiple`` rows by repeating the last row; returns (batch, original size).

    Repeating a real row (instead of zeros) keeps padded rows valid model input; drop them from the
    results with ``truncate_batch(result, original_size)``."""
    size = batch_size(batch)
    if size == 0:
        raise ValueError("cannot pad an empty batch; give at least one row")
    extra = -size % multiple
    if extra == 0:
        return batch, size
    return _map(batch, lambda x: _repeat_last(x, extra)), size


def truncate_batch(batch: Any, n: int) -> Any:
    """The first ``n`` rows."""
    return _map(batch, lambda x: x[:n])


def concat_batches(parts: list[Any]) -> Any:
    """Concatenate chunks along rows (dicts key by key; meta is taken from the first chunk)."""
    first = parts[0]
    if isinstance(first, Mapping):
        return {k: concat_batches([p[k] for p in parts]) for k in first}
    if not _is_column(first):
        return first
    if isinstance(first, (list, tuple)):
        return type(first)(x for p in parts for x in p)
    import numpy as np

    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(list(parts))


def take_rows(batch: Any, index: list[int]) -> Any:
    """The rows ``index`` of a batch, in that order (meta copied).

    >>> take_rows({"x": [10, 11, 12], "t": 0.5}, [2, 0])
    {'x': [12, 10], 't': 0.5}
    """
    def take(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(x[i] for i in index)
        return x[list(index)]

    return _map(batch, take)


def is_batch_like(x: Any) -> bool:
    """True when ``x`` has rows that ``concat_batches`` can join (used to gather per-sample results)."""
    try:
        batch_size(x)
        return True
    except ValueError:
        return False
