"""`rlkit doctor`: the install self-check.

Prints the versions of rlkit and its stack, the devices, and which distributed backends work;
exits non-zero with a message naming what is broken and how to fix it.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass

REQUIRED = ("torch", "transformers", "ray", "accelerate", "pandas", "ipywidgets", "matplotlib", "tqdm")
OPTIONAL = ("vllm", "peft", "megatron.core", "deepspeed")  # the engine, LoRA, the training backends


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    required: bool = True


def _version(module: str) -> Check:
    required = module in REQUIRED
    name = module.split(".")[0]  # "megatron" for megatron.core
    try:
        with warnings.catch_warnings():  # a library's import-time advice (no Apex, ...) is not a finding
            warnings.simplefilter("ignore")
            mod = importlib.import_module(module)
    except Exception as e:  # a broken install raises more than ImportError
        detail = "not installed" if isinstance(e, ModuleNotFoundError) and e.name in (module, name) else (
            f"import failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return Check(name, False, detail, required)
    return Check(name, True, getattr(mod, "__version__", "unknown"), required)


def _devices() -> list[Check]:
    import torch
    import torch.distributed as dist

    out = []
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out.append(Check("devices", True, f"{len(names)} CUDA GPU(s): {', '.join(names)}", False))
    else:
        out.append(Check("devices", True, f"CPU only: {os.cpu_count()} cores (no CUDA)", False))
    out.append(Check("gloo", dist.is_gloo_available(), "available" if dist.is_gloo_available() else
                     "missing: torch was built without gloo; reinstall torch"))
    nccl = dist.is_nccl_available() and torch.cuda.is_available()
    out.append(Check("nccl", nccl, "available" if nccl else "not available (needs CUDA GPUs)", False))
    return out


def run_checks(modules: tuple[str, ...] = ("rlkit", *REQUIRED, *OPTIONAL)) -> list[Check]:
    """All checks; the ones with ``required and not ok`` are failures."""
    checks = []
    for module in modules:
        if module == "rlkit":
            import rlkit

            checks.append(Check("rlkit", True, rlkit.__version__))
        else:
            checks.append(_version(module))
    if all(c.ok for c in checks if c.name == "torch"):
        checks.extend(_devices())
    return checks


def main(modules: tuple[str, ...] | None = None) -> int:
    """Print the report; return 0 when everything required works, 1 otherwise.

    >>> main(("rlkit",))  # doctest: +ELLIPSIS
    rlkit  ok   ...
    0
    """
    checks = run_checks(modules) if modules else run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok " if c.ok else ("FAIL" if c.required else "-- ")
        print(f"{c.name:<{width}}  {mark:<4} {c.detail}")
    failed = [c for c in checks if c.required and not c.ok]
    if failed:
        names = ", ".join(f"{c.name} ({c.detail})" for c in failed)
        print(f"\nrlkit doctor: broken: {names}.\nFix: run `make setup` in the rlkit checkout (or "
              f"`pip install -e .` with torch installed first), then `rlkit doctor` again.", file=sys.stderr)
        return 1
    return 0
