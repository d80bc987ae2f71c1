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

A mixture-of-experts model (Megatron's ``MoELayer``, the alltoall token dispatcher) needs three more, in
``install_moe()`` (the same checks, probed in shared/probes/backends/mcore_moe.py):

* ``moe_utils.te_general_gemm``: imported only with Transformer Engine, yet the router's gating function reads
  it (a NameError without TE): defined as None, so its ``torch.mm`` fallback is taken.
* ``torch.cuda.Stream`` / ``current_stream`` / ``stream``: the alltoall dispatcher creates a side stream for its
  device-to-host copies of the split sizes: a stand-in whose waits and events do nothing.
* The dispatcher's split sizes go to ``all_to_all_single`` as numpy arrays through
  ``maybe_move_tensor_to_cpu``, which converts CUDA tensors only: CPU tensors are converted too.

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


class _Event:
    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Stream:
    """``torch.cuda.Stream`` on a CPU: one implicit stream, every wait and event a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


_moe_installed = False


def install_moe() -> bool:
    """``install()`` plus the MoE layer's patches (see the module's docstring); imports Megatron's MoE modules.
    Returns whether the shim is active; a second call changes nothing."""
    global _moe_installed
    if not install():
        return False
    if _moe_installed:
        return True
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu
    _moe_installed = True
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


__all__ = ["CHECKED_ON", "cpu_devices", "install", "install_moe", "installed", "needed"]
