"""Padding-free micro-batches: pay for real tokens only.

A batch of the run's layout pads every row to the longest prompt and the longest response. Here the
real tokens of each row (a *sequence*) are taken out and packed, several to a row, into rows as wide
as the longest sequence or twice that, whichever leaves less padding (first-fit decreasing). Inside a
packed row ``segments`` numbers the sequences (1, 2, ...; 0 is the unused tail), which the stage turns
into block-diagonal attention and positions that restart per sequence (``rlkit.parallel.stage``), so each
sequence is computed exactly as alone.

Micro-batches hold whole rows, up to ``token_budget`` tokens each (rows x width, padding included),
so the activation memory of one micro-batch is bounded by the budget whatever the responses' lengths.
A model's per-token outputs come back to the batch's own columns with ``unpack``: losses and metrics
read the layout they always read.

Under a pipeline every micro-batch of a call has the same shape (the schedule's p2p buffers are fixed):
the rows are dealt evenly and short micro-batches get empty rows.

>>> import torch
>>> ids = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 3, 0, 0], [0, 0, 4, 2, 0]])
>>> am = (ids > 0).long()
>>> [mb] = pack(ids, am, token_budget=None, n_micro=1)
>>> mb.input_ids.tolist(), mb.segments.tolist()
([[5, 6, 7], [8, 9, 3], [4, 2, 0]], [[1, 1, 1], [1, 1, 1], [1, 1, 0]])
>>> [mb] = pack(torch.tensor([[5, 6, 0, 0], [7, 8, 9, 1], [2, 0, 0, 0]]),
...             torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]), token_budget=None, n_micro=1)
>>> mb.input_ids.tolist(), mb.segments.tolist(), mb.rows.tolist()
([[7, 8, 9, 1], [5, 6, 2, 0]], [[1, 1, 1, 1], [1, 1, 2, 0]], [1, 0, 2])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlkit.errors import PlanError
from rlkit.parallel.stage import IGNORE


@dataclass(frozen=True)
class PackedMicroBatch:
    """Rows of packed sequences, and where each of their tokens sits in the original batch.

    ``rows``: the batch rows whose sequences are here (the micro-batch's samples, in this order);
    ``input_ids`` / ``segments`` / ``labels``: (r, width), ``labels`` being the token where it is scored
    and ``IGNORE`` elsewhere; ``src`` / ``dst``: flat positions of every real token in the packed rows and
    in the micro-batch's own (len(rows), S) slice of the batch.
    """

    rows: torch.Tensor
    input_ids: torch.Tensor
    segments: torch.Tensor
    labels: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    seq_len: int  # S, the batch's width

    @property
    def tokens(self) -> int:
        """Real tokens in this micro-batch."""
        return int(self.src.numel())

    def pack(self, per_token: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """A per-token input of the micro-batch's rows, ``(len(rows), S, ...)``, laid out as the packed rows,
        ``(r, width, ...)``; ``fill`` where no real token sits (``unpack``'s inverse).

        >>> mb = pack(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), token_budget=None, n_micro=1)[0]
        >>> mb.pack(torch.tensor([[[9], [1], [2]]]), fill=-1).tolist()
        [[[1], [2]]]
        """
        rest = per_token.shape[2:]
        flat = per_token.reshape(-1, *rest)[self.dst]
        out = torch.full((self.input_ids.numel(), *rest), fill, dtype=per_token.dtype, device=per_token.device)
        return out.index_copy(0, self.src, flat).view(*self.input_ids.shape, *rest)

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """A model's (r, width) per-token output laid back into (len(rows), S); columns without a real
        token are 0. Differentiable (a gradient flows back to the packed positions).

        >>> mb = pack(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), token_budget=None, n_micro=1)[0]
        >>> mb.unpack(torch.tensor([[1., 2.]])).tolist()
        [[0.0, 1.0, 2.0]]
        """
        flat = per_token.reshape(-1)[self.src]
        out = torch.zeros(len(self.rows) * self.seq_len, dtype=per_token.dtype, device=per_token.device)
        return out.index_copy(0, self.dst, flat).view(len(self.rows), self.seq_len)


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices packed into bins of ``width`` tokens, longest first, each into the first bin
    with room (within 11/9 of the fewest bins possible).

    >>> first_fit_decreasing([3, 4, 1, 2], width=4)
    [[1], [0, 2], [3]]
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if j is None:
            bins.append([i])
            room.append(width - lengths[i])
        else:
            bins[j].append(i)
            room[j] -= lengths[i]
    return bins


def row_width(lengths: list[int], token_budget: int | None = None, round_to: int = 1) -> tuple[int, list[list[int]]]:
    """The packed rows' width and the sequences of each row: as wide as the longest sequence, or twice that
    when it leaves less padding (the short ones then fill the gaps; no wider, since eager attention computes
    a row's whole width x width scores), never wider than ``token_budget``; rounded up to ``round_to``.

    >>> row_width([5, 5, 5])[0], row_width([6, 4, 4, 4, 4])[0]
    (5, 12)
    """
    longest = max(1, max(lengths, default=1))
    if token_budget is not None and token_budget < longest:
        micro_batch_count(1, longest, token_budget, 1)  # raises, naming the budget and the longest sequence
    best: tuple[int, list[list[int]]] | None = None
    for want in (longest, 2 * longest):
        width = -(-want // round_to) * round_to
        width = width if token_budget is None else max(longest, min(width, token_budget))
        bins = first_fit_decreasing(lengths, width)
        if best is None or len(bins) * width < len(best[1]) * best[0]:
            best = (width, bins)
    return best


def micro_batch_count(n_rows: int, width: int, token_budget: int | None, n_micro: int) -> int:
    """How many micro-batches hold ``n_rows`` packed rows of ``width``: ``n_micro`` (the plan's), or more
    when the rows do not fit in ``token_budget`` tokens each.

    >>> micro_batch_count(10, width=100, token_budget=300, n_micro=1), micro_batch_count(10, 100, None, 2)
    (4, 2)
    """
    if token_budget is None:
        return n_micro
    if token_budget < width:
        raise PlanError(f"micro_batch_tokens={token_budget} is smaller than the longest sequence ({width} "
                        f"tokens); use micro_batch_tokens >= {width}")
    return max(n_micro, math.ceil(n_rows / (token_budget // width)))


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, token_budget: int | None, n_micro: int,
         score_from: int = 1, equal_shapes: bool = False, keep_empty: bool = False,
         round_to: int = 1) -> list[PackedMicroBatch]:
    """The batch's sequences packed into at least ``n_micro`` micro-batches (see the module docstring).

    ``attention_mask`` marks each row's real tokens (1) and padding (0); ``score_from``: columns before it
    are not scored (``labels`` = ``IGNORE``), nor is each sequence's first token (nothing predicts it);
    ``equal_shapes``: every micro-batch (r, width), as a pipeline needs. A micro-batch left without a
    sequence is dropped, or with ``keep_empty`` (FSDP: every DP rank runs as many forwards) kept as one
    empty row. ``round_to``: the rows' width rounded up to a multiple of it (at most the batch's): a pipeline
    learns each new shape once, so fewer distinct shapes cost fewer warm-ups.
    """
    real = attention_mask.bool()
    lengths = real.sum(-1).tolist()
    B, S = input_ids.shape
    width, bins = row_width(lengths, token_budget, round_to)
    m = micro_batch_count(len(bins), width, token_budget, n_micro)
    per = max(1, math.ceil(len(bins) / m))  # rows of a micro-batch under equal shapes
    starts = [j * len(bins) // m for j in range(m + 1)]  # rows dealt evenly: sizes differ by one at most
    column = torch.arange(S, device=input_ids.device)
    out = []
    for j in range(m):
        chunk = bins[starts[j]:starts[j + 1]]
        if not chunk and not (equal_shapes or keep_empty):
            continue
        r = per if equal_shapes else max(len(chunk), 1)
        ids = torch.zeros(r, width, dtype=input_ids.dtype, device=input_ids.device)
        seg = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE)
        rows, src, dst = [], [], []
        for k, seqs in enumerate(chunk):
            at = 0
            for s_no, i in enumerate(seqs, start=1):
                cols = column[real[i]]
                n = cols.numel()
                ids[k, at:at + n] = input_ids[i, cols]
                seg[k, at:at + n] = s_no
                scored = cols >= max(score_from, 1)
                scored[:1] = False  # a sequence's first token has no prediction (an empty row has none)
                labels[k, at:at + n] = torch.where(scored, input_ids[i, cols], IGNORE)
                src.append(k * width + at + torch.arange(n, device=ids.device))
                dst.append(len(rows) * S + cols)
                rows.append(i)
                at += n
        cat = (lambda xs: torch.cat(xs)) if src else (lambda xs: torch.zeros(0, dtype=torch.long))
        out.append(PackedMicroBatch(torch.tensor(rows, dtype=torch.long), ids, seg, labels, cat(src), cat(dst), S))
    return out


def balanced_order(lengths: list[int], dp: int, minibatches: int = 1) -> list[int]:
    """A reordering of a step's samples so that each DP rank's chunk (and each of its minibatches) holds
    about the same number of tokens, not just the same number of rows.

    Rank ``d`` takes rows ``[d*c, (d+1)*c)`` of the reordered batch and splits them into ``minibatches``;
    the samples of each minibatch stay those of today's order (only which rank holds them changes), so an
    update trains on the same minibatches. Longest first, each to the rank with the fewest tokens so far
    that has room (greedy LPT with equal counts).

    >>> order = balanced_order([9, 8, 1, 1, 7, 2, 2, 1], dp=2)
    >>> order, [sum([9, 8, 1, 1, 7, 2, 2, 1][i] for i in order[h * 4:(h + 1) * 4]) for h in (0, 1)]
    ([0, 2, 5, 6, 1, 3, 4, 7], [14, 17])
    """
    n = len(lengths)
    if dp <= 1 or n % (dp * minibatches):
        return list(range(n))
    c = n // dp
    s = c // minibatches
    order = [0] * n
    for i in range(minibatches):
        members = [d * c + i * s + j for d in range(dp) for j in range(s)]
        load, slots = [0] * dp, [[] for _ in range(dp)]
        for row in sorted(members, key=lambda r: (-lengths[r], r)):
            d = min((d for d in range(dp) if len(slots[d]) < s), key=lambda d: (load[d], d))
            slots[d].append(row)
            load[d] += lengths[row]
        for d in range(dp):
            for j, row in enumerate(sorted(slots[d])):
                order[d * c + i * s + j] = row
    return order


__all__ = ["PackedMicroBatch", "balanced_order", "first_fit_decreasing", "micro_batch_count", "pack", "row_width"]
