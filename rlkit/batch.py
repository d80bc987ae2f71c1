"""Batch: the samples of an RL step as every role reads them, one typed field per column.

The engines fill the sequence fields (``rlkit.workers.layout.SequenceLayout.pack``), ``Trainer.estimate``
adds what the update needs, the workers read what their pass needs. Every field but the two meta ones
holds one row per sample; a field a batch does not have is None. A new kind of data (routing choices,
per-token versions, images) is one line below, and every operation carries it.

The operations the loop needs are the batch's own (and, for the plain dicts / tensors / lists a hand-written
dataflow sends through a worker group, this module's functions of the same name): ``take`` rows,
``split`` into equal parts (DP slices, minibatches, micro-batches), ``pad`` to a multiple of rows,
``cat`` parts, ``to`` a device. It pickles as a dataclass (Ray sends it as it is).

>>> import torch
>>> b = Batch(input_ids=torch.arange(10).view(5, 2), attention_mask=torch.ones(5, 2, dtype=torch.long),
...           response_mask=torch.ones(5, 1), uid=[0, 0, 1, 1, 2])
>>> padded, n = b.pad(2)                     # 5 rows -> 6, the last row repeated
>>> [len(part) for part in padded.split(2)]
[3, 3]
>>> Batch.cat(padded.split(2)).take(range(n)).uid
[0, 0, 1, 1, 2]
>>> b.take([4, 0]).input_ids.tolist(), "advantages" in b
([[8, 9], [0, 1]], False)

Why a dataclass of our own and not tensordict's ``@tensorclass`` (tensordict 0.15.3, ``nocast=True``): its
per-row Python fields do not stay what the loop reads. A list of ints (``uid``) becomes a tensor, lists of
strings or dicts (``completion``, ``episode``) a ``LinkedList``, and a dict of per-row lists (``columns``) is
not cut by rows at all: ``batch[1].columns`` is the whole dict, a silent wrong cut. Measured on this
2-core CPU (``bench/bench_batch.py``: 64 samples x 128 columns, 9 tensor and 2 list fields), it also costs
more: 1.3x to split in 4 or take 16 rows, 2.1x to concatenate, 1.4x to pickle (2.44 against 1.77 ms a
round trip, once per Ray hop), 8x to read a field (0.8 against 0.1 us).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Fields that are one value per batch (copied to every part; the first part's when joined), not per row.
META = ("timing", "timing_tools")
# Fields that Trainer.estimate adds.
ESTIMATED = ("ref_logprobs", "old_logprobs", "behaviour_logprobs", "values", "advantages", "returns")


@dataclass
class Batch:
    """One row per sample; see the module docstring. ``P`` / ``R``: the run's prompt / response columns.

    The sequences (``SequenceLayout``: ``[prompt, left-padded to P | response, right-padded to R]``):

    Attributes:
        input_ids: ``[B, P + R]`` token ids.
        attention_mask: ``[B, P + R]``, 1 on real tokens.
        response_mask: ``[B, R]`` float, 1 on the response's tokens (a scoring pass needs only the two above).
        rollout_logprobs: ``[B, R]`` the engine's log-probs of the tokens it sampled.
        loss_mask: ``[B, R]`` the response tokens that carry loss (multi-turn: not the tool outputs); None:
            ``response_mask``.
        policy_version: ``[B]`` the actor step whose weights sampled each sample (streaming: its oldest token's).
        token_version: ``[B, R]`` streaming (``rlkit.stream``): the actor step whose weights sampled each token.
        gen_window: ``[B, 2]`` float64, when the generating call ran (seconds since the epoch).
        routing: ``[B, P + R, layers, k]`` int16, mixture of experts: the experts the engine chose for each token in
            each layer, -1 where none was recorded (``Rollout(record_routing=True)``; replayed by the actor's
            forwards under ``TrainerConfig(routing_replay=True)``).
        pixel_values, image_grid_thw: a vision-language model's images, one tensor per sample: its prompt's images'
            patches ``(patches, C*T*P*P)`` and grids ``(images, 3)``, as the processor made them (``(0, ...)``: none).
        ref_logprobs, old_logprobs, values, advantages, returns: ``[B, R]``, added by ``Trainer.estimate``.
        behaviour_logprobs: ``[B, R]`` the engine's log-probs, for the update's importance weights.
        uid: each sample's prompt (its index in the step's prompts).
        row: each sample's dataset row.
        completion: the text (multi-turn: the conversation's messages).
        finish_reason: ``"stop"`` / ``"length"`` / ...
        episode: multi-turn: each episode's turns, tool calls and rewards (``rlkit.agent``).
        columns: the prompt rows' columns, one list per column (what reward functions get).
        timing, timing_tools: meta, the engines' and the tools' seconds for the whole batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    routing: torch.Tensor | None = None
    pixel_values: list[torch.Tensor] | None = None
    image_grid_thw: list[torch.Tensor] | None = None
    token_version: torch.Tensor | None = None
    gen_window: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    uid: list[int] | None = None
    row: list[Any] | None = None
    completion: list[Any] | None = None
    finish_reason: list[str] | None = None
    episode: list[dict[str, Any]] | None = None
    columns: dict[str, list[Any]] | None = None
    timing: float | None = None
    timing_tools: float | None = None

    @classmethod
    def of(cls, data: Batch | Mapping[str, Any]) -> Batch:
        """``data`` as a Batch: a Batch as it is, or a dict of its fields (a hand-written dataflow's).

        >>> Batch.of({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}).fields()
        ['input_ids', 'attention_mask']
        """
        if isinstance(data, Batch):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(f"expected a Batch or a dict of its fields, got a {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Batch has no field(s) {unknown}; its fields: {[f.name for f in dataclasses.fields(cls)]} "
                             f"(a new kind of data is one line in rlkit/batch.py)")
        missing = [k for k in ("input_ids", "attention_mask") if k not in data]
        if missing:
            raise ValueError(f"a Batch needs {missing}; got {sorted(data)}")
        return cls(**data)

    # ---- rows --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def take(self, index: Sequence[int] | torch.Tensor) -> Batch:
        """The rows ``index``, in that order."""
        return self._map(lambda x: take(x, index))

    def split(self, n: int) -> list[Batch]:
        """``n`` equal consecutive parts (a ValueError naming ``pad`` when ``n`` does not divide the rows)."""
        return [self._map(lambda x, i=i, k=k: x[i * k:(i + 1) * k]) for i, k in _parts(len(self), n)]

    def pad(self, multiple: int) -> tuple[Batch, int]:
        """Rows to a multiple of ``multiple``, by repeating the last row (valid model input; drop them from
        results with ``take(range(n))``); returns ``(batch, n)``, ``n`` the rows before."""
        n = len(self)
        extra = _extra_rows(n, multiple)
        return (self, n) if extra == 0 else (self._map(lambda x: _repeat_last(x, extra)), n)

    def truncate(self, n: int) -> Batch:
        """The first ``n`` rows (what ``pad`` added, dropped)."""
        return self if n == len(self) else self._map(lambda x: x[:n])

    @classmethod
    def cat(cls, parts: Sequence[Batch]) -> Batch:
        """The parts' rows one after another (meta: the first part's)."""
        first = parts[0]
        return dataclasses.replace(first, **{name: cat([getattr(p, name) for p in parts])
                                             for name in first.fields() if name not in META})

    def to(self, device: torch.device | str) -> Batch:
        """The tensors on ``device``."""
        return self._map(lambda x: x.to(device) if torch.is_tensor(x) else x)

    # ---- fields ------------------------------------------------------------------------------------
    def fields(self) -> list[str]:
        """The names of the fields this batch has (not None)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def replace(self, **fields: Any) -> Batch:
        """A copy with ``fields`` set (the others shared)."""
        return dataclasses.replace(self, **fields)

    def tensors_only(self) -> Batch:
        """The same rows without the per-sample Python fields (text, episodes, columns): what the scoring
        passes and the updates read, without sending the text to every worker."""
        return dataclasses.replace(self, uid=None, row=None, completion=None, finish_reason=None, episode=None,
                                   columns=None)

    def generated(self) -> Batch:
        """The batch as the engines gave it: what ``Trainer.estimate`` added left out."""
        return dataclasses.replace(self, **dict.fromkeys(ESTIMATED))

    @property
    def loss_tokens(self) -> torch.Tensor:
        """The response tokens that carry loss: ``loss_mask``, else ``response_mask``."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    # The mapping view: the training backends take any dict of tensors (``batch["input_ids"]``,
    # ``batch.items()``); a Batch passes as one, with its fields that are set.
    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name, None) if isinstance(name, str) else None
        if value is None:
            raise KeyError(f"{name!r}: this Batch has {self.fields()}")
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and getattr(self, name, None) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = getattr(self, name, None)
        return default if value is None else value

    def keys(self) -> list[str]:
        return self.fields()

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((name, getattr(self, name)) for name in self.fields())

    def _map(self, fn: Any) -> Batch:
        """``fn`` on every per-row field that is set (meta and unset fields kept)."""
        return dataclasses.replace(self, **{name: _map(getattr(self, name), fn) for name in self.fields()
                                            if name not in META})

    def __repr__(self) -> str:
        shapes = {n: tuple(v.shape) if torch.is_tensor(v) else f"{type(v).__name__}[{len(v)}]"
                  for n, v in self.items() if n not in META}
        return f"Batch({len(self)} rows: " + ", ".join(f"{n}={s}" for n, s in shapes.items()) + ")"


def images_of(batch: Batch | Mapping[str, Any]) -> dict[str, Any]:
    """A vision-language model's ``pixel_values=`` / ``image_grid_thw=`` keywords for a batch (a ``Batch`` or a dict
    of its fields); none for a text batch.

    >>> images_of({"input_ids": torch.zeros(1, 2)}), list(images_of({"pixel_values": [torch.zeros(4, 6)],
    ...                                                            "image_grid_thw": [torch.ones(1, 3)]}))
    ({}, ['pixel_values', 'image_grid_thw'])
    """
    return {k: batch[k] for k in ("pixel_values", "image_grid_thw") if batch.get(k) is not None}


# ---- the same operations on plain data: a dict of columns, a tensor / array, a list ---------------------
def is_column(x: Any) -> bool:
    """Per-row data (cut along dim 0) rather than meta: a list / tuple, a tensor / array of one dim or more."""
    if isinstance(x, (list, tuple)):
        return True
    shape = getattr(x, "shape", None)  # torch.Tensor / np.ndarray; 0-d ones are meta (a scalar)
    return shape is not None and len(shape) > 0


def rows(batch: Any) -> int:
    """Rows in a batch: a ``Batch``, a dict of columns (nested dicts too) or a column; every column must have
    the same number.

    >>> rows({"x": torch.zeros(3, 2), "s": ["a", "b", "c"], "t": 0.5})
    3
    """
    if isinstance(batch, Batch):
        return len(batch)
    if isinstance(batch, Mapping):
        sizes = {}
        for key, value in batch.items():
            if isinstance(value, (Mapping, Batch)):
                sizes[key] = rows(value)
            elif is_column(value):
                sizes[key] = len(value)
        if not sizes:
            raise ValueError(f"batch has no per-sample columns (keys {list(batch)}); give tensors or lists "
                             f"with one row per sample")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch columns have different lengths {sizes}; every column needs one row "
                             f"per sample")
        return next(iter(sizes.values()))
    if is_column(batch):
        return len(batch)
    raise ValueError(f"cannot split a {type(batch).__name__} by rows; pass a Batch, a dict of tensors/lists, a "
                     f"tensor or a list")


def is_batch_like(x: Any) -> bool:
    """True when ``x`` has rows that ``cat`` can join (how a worker group gathers per-sample results)."""
    try:
        rows(x)
        return True
    except ValueError:
        return False


def take(batch: Any, index: Sequence[int] | torch.Tensor) -> Any:
    """The rows ``index`` of a batch, in that order (meta copied).

    >>> take({"x": [10, 11, 12], "t": 0.5}, [2, 0])
    {'x': [12, 10], 't': 0.5}
    """
    if isinstance(batch, Batch):
        return batch.take(index)
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch[int(i)] for i in index)
    if isinstance(batch, Mapping):
        return _map(batch, lambda x: take(x, index))
    if torch.is_tensor(batch):
        return batch[torch.as_tensor(index, dtype=torch.long, device=batch.device)]
    if is_column(batch):
        return batch[list(index)]
    return batch


def split(batch: Any, n: int) -> list[Any]:
    """``n`` equal consecutive parts (pad first when ``n`` does not divide the rows)."""
    if isinstance(batch, Batch):
        return batch.split(n)
    return [_map(batch, lambda x, i=i, k=k: x[i * k:(i + 1) * k]) for i, k in _parts(rows(batch), n)]


def pad(batch: Any, multiple: int) -> tuple[Any, int]:
    """Rows to a multiple of ``multiple``, repeating the last row; returns ``(batch, rows before)``."""
    if isinstance(batch, Batch):
        return batch.pad(multiple)
    n = rows(batch)
    extra = _extra_rows(n, multiple)
    return (batch, n) if extra == 0 else (_map(batch, lambda x: _repeat_last(x, extra)), n)


def truncate(batch: Any, n: int) -> Any:
    """The first ``n`` rows."""
    return _map(batch, lambda x: x[:n])


def cat(parts: Sequence[Any]) -> Any:
    """The parts' rows one after another (dicts key by key; meta from the first part)."""
    first = parts[0]
    if isinstance(first, Batch):
        return Batch.cat(parts)
    if isinstance(first, Mapping):
        return {k: cat([p[k] for p in parts]) for k in first}
    if not is_column(first):
        return first
    if isinstance(first, (list, tuple)):
        return type(first)(x for p in parts for x in p)
    if torch.is_tensor(first):
        return torch.cat(list(parts))
    import numpy as np

    return np.concatenate(parts)


def _map(x: Any, fn: Any) -> Any:
    if isinstance(x, Batch):
        return x._map(fn)
    if isinstance(x, Mapping):
        return {k: _map(v, fn) for k, v in x.items()}
    return fn(x) if is_column(x) else x


def _parts(n: int, k: int) -> Iterable[tuple[int, int]]:
    if k <= 0 or n % k:
        raise ValueError(f"a batch of {n} rows does not split into {k} equal parts; pad it to a multiple of {k} "
                         f"first (pad(batch, {k}))")
    return ((i, n // k) for i in range(k))


def _extra_rows(n: int, multiple: int) -> int:
    if n == 0:
        raise ValueError("cannot pad an empty batch; give at least one row")
    return -n % multiple


def _repeat_last(x: Any, extra: int) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(list(x) + [x[-1]] * extra)
    if torch.is_tensor(x):
        return torch.cat([x, x[-1:].expand(extra, *x.shape[1:])])
    import numpy as np

    return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])


__all__ = ["ESTIMATED", "META", "Batch", "cat", "is_batch_like", "is_column", "pad", "rows", "split", "take", "truncate"]
