"""Megatron-Core on a CPU-only torch: the few CUDA calls it makes on the paths rlkit uses, redirected.

Checked on megatron-core 0.16.1 (torch 2.13, CPU, gloo). Megatron assumes a GPU in a handful of places
that rlkit's paths reach even with ``use_cpu_initialization=True``:

* ``torch.cuda.current_device()`` as a ``device=`` argument (DDP's grad buffers, the pipeline's p2p shape
  exchange): on a CPU build it raises; here it returns ``"cpu"``.
* ``torch.cuda.synchronize()`` after the pipeline's batched p2p: a no-op here.
* ``device="cuda"`` written out (the schedules' ``total_num_tokens``) and ``weight.data.cuda()`` (the tied
  embedding's copy on the last pipeline stage): ``cpu_devices()``, a ``TorchFunctionMode`` entered only
  around Megatron's schedule calls and model construction (it costs a Python call per torch op, so it is
  never left on).

``install()`` patches only when CUDA is unavailable, once per process (idempotent); with a GPU Megatron
runs unpatched. Another Megatron version may move these call sites: re-check before bumping the pin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CHECKED_ON = "0.16.1"
_installed = False


def needed() -> bool:
    """Whether this process needs the shim (no usable CUDA).

    >>> needed() == (not torch.cuda.is_available())
    True
    """
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch ``torch.cuda.current_device`` and ``torch.cuda.synchronize`` for a CPU-only process.
    Returns whether the shim is active; a second call changes nothing."""
    global _installed
    if _installed or not needed():
        return _installed
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _installed = True
    return True


def installed() -> bool:
    """Whether ``install`` patched this process."""
    return _installed


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda..."`` to the CPU and makes ``Tensor.cuda()`` a no-op."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_devices() -> Iterator[None]:
    """Within: Megatron's hard-coded CUDA tensors land on the CPU (nothing changes when CUDA is there)."""
    if not _installed:
        yield
        return
    with _CudaToCpu():
        yield


__all__ = ["CHECKED_ON", "cpu_devices", "install", "installed", "needed"]
