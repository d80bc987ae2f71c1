"""Full weights from sharded ones: the gather under ``ParallelModel.iter_full_weights`` and the re-layout.

FSDP2's dim-0 shards are gathered a bucket at a time (one exchange per bucket of about ``GATHER_BUCKET_BYTES``),
every other layout (TP's ``Shard(1)``, 2D dp x tp) by DTensor's ``full_tensor``, one collective per parameter.
``full_tensors`` yields each full tensor with the bytes this rank received for it.

>>> import torch
>>> [(t.tolist(), got) for t, got in full_tensors([torch.ones(2)])]   # a plain tensor: nothing to gather
[([1.0, 1.0], 0)]
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# iter_full_weights gathers FSDP-sharded (dim-0) weights in buckets of about this many gathered bytes, one
# exchange per bucket instead of one all-gather per parameter (272 on SmolLM2-135M). Measured there at dp=2 on
# gloo (2 cores, a busy machine): 64 MiB gathered in 0.39-0.51 s, 16-32 MiB and 128 MiB 0.40-0.60 s, one per
# parameter 0.74-0.81 s. 0 turns bucketing off (one full_tensor per parameter, as before).
GATHER_BUCKET_BYTES = 64 * 2**20

def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (a DTensor gathered: a collective on its mesh; a plain tensor itself)."""
    return t.full_tensor() if isinstance(t, DTensor) else t

def dim0_shard(p: torch.Tensor) -> tuple[dist.ProcessGroup, int, int] | None:
    """``(group, its size, this rank's index in it)`` when ``p`` is split along dim 0 over one mesh dim of
    size > 1 and replicated over the others (FSDP2's ``Shard(0)``, HSDP's ``(Replicate(), Shard(0))``);
    None for any other layout (TP's Shard(1), 2D dp x tp, plain tensors), which ``full_tensor`` gathers."""
    if not isinstance(p, DTensor) or p.dim() == 0:
        return None
    split = [i for i, pl in enumerate(p.placements) if not pl.is_replicate()]
    if len(split) != 1:
        return None
    i = split[0]
    # exactly Shard (not _StridedShard, whose rows interleave) and a group that really splits the rows
    if type(p.placements[i]) is not Shard or p.placements[i].dim != 0 or p.device_mesh.size(i) == 1:
        return None
    mesh = p.device_mesh
    return mesh.get_group(i), mesh.size(i), mesh.get_local_rank(i)


def _chunk_rows(n: int, world: int) -> list[int]:
    """Rows of a dim-0 size ``n`` on each of ``world`` ranks, split like ``torch.chunk`` (as DTensor's
    Shard and FSDP2 split): ``ceil(n / world)`` each until they run out, so the last ranks may hold fewer or none."""
    c = -(-n // world)
    return [max(0, min(c, n - q * c)) for q in range(world)]


def _rowstorage_bytes(p: torch.Tensor) -> int:
    return math.prod(p.shape[1:]) * p.element_size()


def _gather_runs(params: list[torch.Tensor], limit: int) -> Iterator[tuple[tuple | None, list[torch.Tensor]]]:
    """``params`` cut, in order, into buckets ``(shard info, params)``: consecutive dim-0-sharded ones on one
    group, dtype and device, up to ``limit`` gathered bytes (padding included; a larger one goes alone),
    and ``(None, [p])`` for every other layout. Every rank of a group cuts the same way (shapes only)."""
    run: list[torch.Tensor] = []
    key, info, size = None, None, 0
    for p in params:
        this = dim0_shard(p) if limit > 0 else None
        k = None if this is None else (this[0].group_name, p.dtype, p.device)
        nbytes = 0 if this is None else _chunk_rows(p.shape[0], this[1])[0] * this[1] * _rowstorage_bytes(p)
        if run and (k != key or size + nbytes > limit):
            yield info, run
            run, size = [], 0
        if this is None:
            yield None, [p]
            continue
        run.append(p)
        key, info, size = k, this, size + nbytes
    if run:
        yield info, run


def full_tensors(params: list[torch.Tensor], limit: int | None = None) -> Iterator[tuple[torch.Tensor, int]]:
    """``(full tensor, bytes this rank received for it)`` for each of ``params``, in order: FSDP-sharded
    ones a bucket at a time (``_gather_bucket``), the rest by ``full_tensor`` (a collective each); buckets of
    about ``limit`` gathered bytes (default ``GATHER_BUCKET_BYTES``, read at the call)."""
    limit = GATHER_BUCKET_BYTES if limit is None else limit
    scratch = _Scratch()
    for info, run in _gather_runs(params, limit):
        if info is None:
            t = full(run[0].detach())
            yield t, t.nbytes - local(run[0]).nbytes
        else:
            yield from _gather_bucket(run, *info, scratch)


class _Scratch:
    """The one buffer a gather's buckets reuse: a fresh large CPU allocation is mapped anew and faulted
    in page by page, every bucket (the full tensors handed out are copies, so reusing it is safe)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self.buf is None or self.buf.numel() < nbytes or self.buf.device != device:
            self.buf = None  # the old one goes first: never two buffers at once
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buf[:nbytes].view(dtype)


def _gather_bucket(params: list[torch.Tensor], group: dist.ProcessGroup, world: int, rank: int,
                   scratch: _Scratch) -> Iterator[tuple[torch.Tensor, int]]:
    """One exchange for a bucket of dim-0-sharded ``params``; yields each full tensor (a fresh copy).

    Every rank lays its shards out flat in its own region of one buffer, each in a slot of the per-rank
    chunk size (padding after a short or empty shard), so the regions line up; after the exchange a full
    tensor is its rows from every rank's region, concatenated (``scratch`` holds the buffer)."""
    rows = [_chunk_rows(p.shape[0], world) for p in params]
    inner = [math.prod(p.shape[1:]) for p in params]
    slots = [r[0] * k for r, k in zip(rows, inner)]
    offsets = [sum(slots[:i]) for i in range(len(slots))]
    region = sum(slots)
    shards = [local(p.detach()) for p in params]
    buf = scratch.take(world * region, params[0].dtype, shards[0].device)
    own = buf[rank * region:(rank + 1) * region]
    for p, shard, r, off in zip(params, shards, rows, offsets):
        if shard.shape[0] != r[rank]:  # a layout other than torch.chunk's: the views below would be wrong
            raise RuntimeError(f"a dim-0 shard of {tuple(p.shape)} holds {shard.shape[0]} rows on rank {rank} of "
                               f"{world}; torch.chunk's split gives {r[rank]}")
        own[off:off + shard.numel()].view(shard.shape).copy_(shard)
    _exchange(buf, region, group, world, rank)
    for p, shard, r, k, off in zip(params, shards, rows, inner, offsets):
        parts = [buf[q * region + off:q * region + off + n * k].view(n, *p.shape[1:])
                 for q, n in enumerate(r) if n > 0]
        t = torch.cat(parts)  # a copy: the caller may keep it after the buffer is gone
        yield t, t.nbytes - shard.nbytes


def _exchange(buf: torch.Tensor, region: int, group: dist.ProcessGroup, world: int, rank: int) -> None:
    """Fill each rank's ``region``-long slice of ``buf`` from that rank (this rank's own is filled)."""
    if buf.device.type == "cpu":
        # CPU tensors go over gloo, whose broadcast moves 1.0-1.5 GB/s between 2 local ranks against 0.35-0.5
        # for its all-gather (16-128 MiB buckets, measured here): one broadcast from each rank of its region.
        for q in range(world):
            dist.broadcast(buf[q * region:(q + 1) * region], src=dist.get_global_rank(group, q), group=group)
        return
    # NCCL and the like: one in-place all-gather (FSDP2's own); all_gather_single is its newer name
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(buf, buf[rank * region:(rank + 1) * region], group=group)

def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
