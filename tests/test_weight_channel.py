"""The weight channel of split placement (rlkit.workers.weight_channel) between real processes over gloo:
what the receivers get is bit-exactly what the sender had when ``send`` returned, across dtypes, buckets,
chained sends and reused buffers."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from rlkit.workers.weight_channel import WeightChannel, buckets


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed", torch.randn(301, 17, generator=g)), ("norm", torch.randn(17, generator=g)),
            ("half", torch.randn(9, 5, generator=g).to(torch.bfloat16)), ("big", torch.randn(64, 1024, generator=g))]


def _receiver(rank: int, size: int, address, metas, out) -> None:
    channel = WeightChannel.join(*address, rank=rank, size=size, timeout_s=60)
    for meta in metas:  # the second receive writes the first one's buffers again
        out.put((rank, {name: t.clone() for name, t in channel.receive(meta)}))


@pytest.mark.timeout(120)
def test_receivers_get_what_the_sender_had_when_send_returned():
    ctx = mp.get_context("spawn")
    size = 3  # the sender and two rollout workers
    store, address = WeightChannel.host(receivers=size - 1, timeout_s=60)
    metas = [[(n, tuple(t.shape), t.dtype) for n, t in _weights(v)] for v in (1, 2)]
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(r, size, address, metas, out)) for r in range(1, size)]
    for p in procs:
        p.start()
    try:
        channel = WeightChannel.join("", 0, rank=0, size=size, timeout_s=60, store=store)
        live = _weights(1)
        assert channel.send(live) == metas[0]
        for _, t in live:  # what the optimizer does next: the copy was taken when send returned
            t.mul_(0)
        channel.send(_weights(2))  # chained behind the first; its receivers are still taking that one
        channel.wait()
        got = [out.get(timeout=60) for _ in range(2 * (size - 1))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for version in (1, 2):
        want = dict(_weights(version))
        received = [state for _, state in got if torch.equal(state["norm"], want["norm"])]
        assert len(received) == size - 1, version
        for state in received:
            assert list(state) == list(want)
            for name, t in want.items():
                assert state[name].dtype == t.dtype and torch.equal(state[name], t), (version, name)


def test_buckets_keep_one_dtype_and_a_size_bound():
    meta = [(n, tuple(t.shape), t.dtype) for n, t in _weights(0)]
    # embed (20 KB) + norm fit in 32 KB; the bf16 tensor starts its own; big (256 KB) is alone
    assert buckets(meta, bucket_bytes=32 * 1024) == [[0, 1], [2], [3]]
    assert buckets(meta, bucket_bytes=1 << 30) == [[0, 1], [2], [3]]
    assert buckets(meta, bucket_bytes=1) == [[0], [1], [2], [3]]
