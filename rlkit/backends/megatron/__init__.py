"""The Megatron-Core training backend: ``MegatronModel`` (``ParallelModel``'s interface over Megatron-Core's
GPTModel with its TP, 1F1B PP and DDP), the HF <-> Megatron weight conversion (``convert``) and the CPU shim
(``shim``). Megatron is imported when a model is built, not when this package is.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # MegatronModel on first use: importing the package (e.g. for convert) does not import megatron.core
    if name == "MegatronModel":
        from rlkit.backends.megatron.model import MegatronModel

        return MegatronModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MegatronModel"]
