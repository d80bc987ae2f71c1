"""Joining the world's process group, and failing fast when one rank fails: what every rank runs first.

The groups inside the world (meshes, pipeline ends, generation groups) are built in ``groups.py``.
Nothing here assumes torchrun: ``init_distributed`` only reads the standard env variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), which torchrun sets and which a Ray
worker group can set itself before calling it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlkit.errors import WorkerError

ERROR_KEY = "rlkit/error"
ACK_KEY = "rlkit/error_acks"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound then released; fine for tests on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 120.0, backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by the env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Always sets a timeout, so a dead peer turns into an error instead of a hang. gloo on CPU, NCCL
    when CUDA is present. Returns ``(rank, world_size)``; a no-op if already initialised.

    >>> import os; os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
    ...                              MASTER_PORT=str(free_port()))
    >>> init_distributed(timeout_s=30)
    (0, 1)
    >>> dist.destroy_process_group()
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed needs env {missing}; run under torchrun "
                           f"(torchrun --nproc-per-node N -m rlkit.parallel ...) or set them yourself")
    # Several ranks share few cores here: one thread each unless the launcher asked otherwise.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


# ---- failing fast ---------------------------------------------------------------------------------
@contextmanager
def propagate_errors(timeout_s: float = 10.0) -> Iterator[None]:
    """Turn an exception on one rank into a ``WorkerError`` naming that rank on every rank, promptly.

    The failing rank writes its rank and traceback to the process group's TCPStore, then tears the
    process groups down: peers blocked in a collective get "connection closed" at once (instead of
    waiting out the group timeout), read the store and raise ``WorkerError(rank=<failing rank>)``.
    The process group is unusable afterwards.

    >>> with propagate_errors():                              # doctest: +SKIP
    ...     model.train_step(batch, loss_fn)
    """
    try:
        yield
    except WorkerError:
        raise
    except Exception as exc:
        if not dist.is_initialized():
            raise
        rank = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()
        # Who failed first? If a peer already published, this error is the fallout of its failure.
        origin = None
        try:
            if store.check([ERROR_KEY]):
                origin = json.loads(store.get(ERROR_KEY))
        except Exception:  # the store may be gone with a dead rank 0
            origin = None
        if origin is None and _looks_like_peer_loss(exc):
            # A lost peer is usually the fallout of its own failure: let that report land first.
            try:
                store.wait([ERROR_KEY], datetime.timedelta(seconds=timeout_s))
                origin = json.loads(store.get(ERROR_KEY))
            except Exception:
                origin = None
        if origin is None:
            tb = traceback.format_exc()
            origin = {"rank": rank, "message": f"{type(exc).__name__}: {exc}", "traceback": tb}
            try:
                store.set(ERROR_KEY, json.dumps(origin))
            except Exception:
                pass
        world = dist.get_world_size()
        try:
            dist.destroy_process_group()  # peers blocked in a collective see "connection closed" now
        except Exception:
            pass
        _ack_and_linger(store, rank, world, timeout_s)
        raise WorkerError(origin["message"], rank=origin["rank"], node=socket.gethostname(),
                          remote_traceback=origin.get("traceback")) from exc


def _ack_and_linger(store: Any, rank: int, world: int, timeout_s: float) -> None:
    """Rank 0 hosts the TCPStore: it waits (at most ``timeout_s``) until every other rank has read
    the error report before its process may exit and take the store down."""
    try:
        if rank != 0:
            store.add(ACK_KEY, 1)
            return
        deadline = time.monotonic() + timeout_s
        while store.add(ACK_KEY, 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone (rank 0 died): nothing left to wait for
        pass


def _looks_like_peer_loss(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out", "broken pipe"))
