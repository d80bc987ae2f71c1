"""WeightChannel: the actor's weights from its rank 0 straight to the rollout workers (split placement), in
flat buckets over a process group of their own, instead of through the driver and Ray's object store.

The channel's rank 0 is the actor's rank 0 (the sender; it hosts the rendezvous store), the rollout workers
are ranks 1..n. A sync is one broadcast per bucket (tensors of one dtype, up to ``BUCKET_BYTES``, packed
end to end), so a model moves in a few large messages, not one per tensor. The sender copies the gathered
weights into its buckets and broadcasts them from a thread of its own: ``send`` returns at once and the
actor trains on while each rollout worker takes the weights when its queue reaches ``receive`` (between
generations). Sends run in order, each after the one before it (a chain of threads), so a second sync
never waits in the caller.

The group is gloo on CPU tensors (the gathered weights are on CPU); every wait is bounded by the
channel's timeout, and a send that failed is raised by the next ``send`` (or ``wait``). Both ends pipeline:
the sender broadcasts a bucket while it copies the next, a receiver takes one while the next arrives.

>>> meta = [("a", (4, 4), torch.float32), ("b", (2,), torch.float32), ("c", (3,), torch.bfloat16)]
>>> buckets(meta, bucket_bytes=64)
[[0], [1], [2]]
>>> buckets(meta, bucket_bytes=1 << 20)
[[0, 1], [2]]
"""

from __future__ import annotations

import datetime
import math
import queue
import threading
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 2**20  # a few large messages per model: gloo moves large ones at its full bandwidth
Meta = list[tuple[str, tuple[int, ...], torch.dtype]]


def buckets(meta: Meta, bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """``meta``'s indices in buckets: consecutive tensors of one dtype, at most ``bucket_bytes`` each (a
    larger tensor is a bucket of its own). Sender and receivers compute the same buckets from the same meta."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = math.prod(shape) * dt.itemsize
        if not out or dt != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += nbytes
    return out


class WeightChannel:
    """One end of the channel (``WeightChannel.host`` on the sender, ``join`` on each receiver).

    >>> store, address = WeightChannel.host(receivers=1)  # on the actor's rank 0      # doctest: +SKIP
    >>> channel = WeightChannel.join(*address, rank=1, size=2)  # on a rollout worker  # doctest: +SKIP
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self._sending: threading.Thread | None = None
        self._error: BaseException | None = None
        # bucket buffers kept for the next sync (a model's worth on each end, like a second copy of the weights)
        self._sent: list[torch.Tensor] = []
        self._received: list[torch.Tensor] = []

    # ---- setting up ------------------------------------------------------------------------------
    @staticmethod
    def host(receivers: int, timeout_s: float = 600.0) -> tuple[dist.TCPStore, tuple[str, int]]:
        """The sender's rendezvous store (kept alive by the caller) and its address for the receivers."""
        from ray.util import get_node_ip_address

        ip = get_node_ip_address()
        store = dist.TCPStore(ip, 0, receivers + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store, (ip, store.port)

    @classmethod
    def join(cls, ip: str, port: int, *, rank: int, size: int, timeout_s: float = 600.0,
             store: dist.TCPStore | None = None) -> WeightChannel:
        """This process's end of the channel: ``rank`` 0 (the sender, with the ``store`` it hosts) or 1..size-1.
        A collective: every end joins at once (the caller runs the sides concurrently)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(ip, port, size, is_master=False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore("rlkit-weights", store), rank, size, timeout)
        channel = cls(group, timeout_s)
        channel._store = store  # the store must outlive the group
        return channel

    # ---- moving weights --------------------------------------------------------------------------
    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> Meta:
        """Copy ``named`` into buckets now and broadcast them from a thread (after any send before it), each
        bucket as soon as it is copied; returns the meta a receiver needs (names, shapes, dtypes) once every
        tensor is copied (the caller may change them then). Raises a failed earlier send's error."""
        self._raise_failed()
        tensors = list(named)
        meta: Meta = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
        plan = buckets(meta)
        copied: queue.Queue = queue.Queue()
        before = self._sending
        # the buffers of a send that has gone are written again: fresh memory costs page faults, more than the copy
        spare = self._sent if before is None or not before.is_alive() else []
        used: list[torch.Tensor] = []

        def run() -> None:
            try:
                if before is not None:
                    before.join()
                for _ in plan:
                    self._broadcast(copied.get(timeout=self.timeout_s))
                self._sent = used
            except BaseException as e:  # raised by the next send or close, in the caller's thread
                self._error = e

        self._sent = []
        self._sending = threading.Thread(target=run, name="rlkit-weight-send", daemon=True)
        self._sending.start()
        for k, bucket in enumerate(plan):  # the copy of one bucket overlaps the broadcast of the one before
            parts = [tensors[i][1].reshape(-1) for i in bucket]
            buffer = _buffer(spare, k, sum(p.numel() for p in parts), parts[0].dtype)
            torch.cat(parts, out=buffer)
            used.append(buffer)
            copied.put(buffer)
        return meta

    def receive(self, meta: Meta) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's tensors, bucket by bucket, as views into each received bucket, valid until the next
        ``receive`` (which writes the same buffers again: copy what you keep). A thread receives the next
        bucket while the caller takes this one's tensors."""
        plan = buckets(meta)
        arrived: queue.Queue = queue.Queue()
        spare, self._received = self._received, []  # the last receive's buffers (its caller is done with them)

        def run() -> None:
            try:
                for k, bucket in enumerate(plan):
                    buffer = _buffer(spare, k, sum(math.prod(meta[i][1]) for i in bucket), meta[bucket[0]][2])
                    self._received.append(buffer)
                    self._broadcast(buffer)
                    arrived.put(buffer)
            except BaseException as e:
                arrived.put(e)

        threading.Thread(target=run, name="rlkit-weight-receive", daemon=True).start()
        for bucket in plan:
            buffer = arrived.get(timeout=self.timeout_s)
            if isinstance(buffer, BaseException):
                raise RuntimeError(f"rlkit: receiving the actor's weights failed: {buffer}") from buffer
            offset = 0
            for i in bucket:
                name, shape, _ = meta[i]
                n = math.prod(shape)
                yield name, buffer[offset:offset + n].view(shape)
                offset += n

    def _broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.group.broadcast([buffer], options).wait()

    def wait(self) -> None:
        """Until the sends so far have gone (bounded by the timeout); raises a failed send's error."""
        if self._sending is not None:
            self._sending.join(self.timeout_s)
            if self._sending.is_alive():
                raise TimeoutError(f"rlkit: the weight channel's send did not finish in {self.timeout_s:.0f} s "
                                   f"(a rollout worker never took the weights)")
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rlkit: sending the actor's weights to the rollout workers failed (a rollout worker "
                               f"died, or stopped taking weights): {error}") from error


def _buffer(spare: list[torch.Tensor], k: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Bucket ``k``'s buffer: the spare one of an earlier sync when it fits, else a new one."""
    if k < len(spare) and spare[k].numel() == numel and spare[k].dtype == dtype:
        return spare[k]
    return torch.empty(numel, dtype=dtype)


__all__ = ["BUCKET_BYTES", "WeightChannel", "buckets"]
