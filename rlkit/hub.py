"""Model references, resolved in the driver: a local checkpoint folder or a hub id that can be loaded.

Everything that takes a model (``Trainer``, ``RewardModel``, ``ParallelPlan.validate``, ``recommend``,
``rlkit train``) checks it here first, so a typo fails in the cell that made it, with the path and the
fix, instead of as huggingface_hub's ``Repo id must be in the form ...`` inside a worker, or after
half a minute of retries against a hub that cannot be reached.

Offline is detected once per process and fast: ``HF_HUB_OFFLINE=1`` says so, otherwise one TCP connect
to the hub endpoint with a short timeout decides. A hub id already in the local HF cache resolves
either way (transformers loads it from there).

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> resolve_model(folder / "nope")
Traceback (most recent call last):
...
rlkit.hub.ModelRefError: model path ... does not exist; pass a folder with config.json (rlkit.models.tiny_lm(...) builds one) or a hub id like 'org/name'
>>> _ = (folder / "config.json").write_text("{}")
>>> resolve_model(folder) == str(folder)
True
"""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rlkit.errors import RlkitError

PROBE_TIMEOUT_S = 2.0  # one TCP connect to the hub; a firewalled machine answers no faster than this
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class ModelRefError(RlkitError, ValueError):
    """A model reference that cannot load: a missing path, a folder without config.json, a hub id offline."""


def hub_offline() -> bool:
    """True when the HF hub cannot be reached: ``HF_HUB_OFFLINE`` is set, or a short connect fails."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return not _hub_reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


@functools.lru_cache(maxsize=4)
def _hub_reachable(endpoint: str) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:  # no DNS, refused, timed out
        return False


def _cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_model(ref: Any, what: str = "model") -> str:
    """``ref`` as a string that ``from_pretrained`` can load, or a ``ModelRefError`` naming it and the fix.

    Accepts a folder with ``config.json`` (``~`` expanded) or a hub id (``org/name``) that is in the local
    cache or reachable online. ``what`` names the argument in messages ("model", "reward model", ...).
    """
    if not isinstance(ref, (str, os.PathLike)) or not str(ref).strip():
        raise ModelRefError(f"{what}={ref!r} is not a model reference; pass a checkpoint folder with config.json "
                            f"or a hub id like 'org/name'")
    text = str(ref)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelRefError(f"{what} path {text!r} is a file; pass the checkpoint folder that holds "
                                f"config.json (and the weights and tokenizer)")
        if not (path / "config.json").is_file():
            found = sorted(p.name for p in path.iterdir())[:8]
            raise ModelRefError(f"{what} folder {text!r} has no config.json (it holds {found or 'nothing'}); "
                                f"pass a checkpoint folder saved by save_pretrained")
        return str(path)
    looks_like_path = text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text
    if looks_like_path or not _HUB_ID.match(text):
        raise ModelRefError(f"{what} path {text!r} does not exist; pass a folder with config.json "
                            f"(rlkit.models.tiny_lm(...) builds one) or a hub id like 'org/name'")
    if _cached(text):
        return text
    if hub_offline():
        why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") else "the hub cannot be reached"
        raise ModelRefError(f"{what}={text!r} is not a local folder and not in the HF cache, and {why}; download "
                            f"it where there is network (huggingface-cli download {text}) and pass its folder, "
                            f"or build a local one with rlkit.models.tiny_lm(...)")
    return text


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def check_checkpoint(ref: str, what: str = "model", tokenizer: bool = True) -> None:
    """A local checkpoint folder (a resolved ``ref``) holds weights and, if asked, a tokenizer.

    Hub ids are not listed (that needs the network); ``from_pretrained`` reports their gaps. Without
    this, a folder with only config.json gets as far as the workers, and transformers builds an empty
    one-token tokenizer from it without a word.
    """
    path = Path(ref)
    if not path.is_dir():
        return
    names = {p.name for p in path.iterdir()}
    if not names & set(WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        raise ModelRefError(f"{what} folder {ref!r} has no weights (none of {list(WEIGHT_FILES)}); save the model "
                            f"there with model.save_pretrained(folder)")
    if tokenizer and not names & set(TOKENIZER_FILES):
        raise ModelRefError(f"{what} folder {ref!r} has no tokenizer (none of {list(TOKENIZER_FILES)}); save it "
                            f"there with tokenizer.save_pretrained(folder)")


def resolve_checkpoint(ref: Any, what: str = "model", tokenizer: bool = True) -> str:
    """``resolve_model`` and, for a local folder, ``check_checkpoint``: a reference that can load whole."""
    ref = resolve_model(ref, what)
    check_checkpoint(ref, what, tokenizer)
    return ref


__all__ = ["ModelRefError", "check_checkpoint", "hub_offline", "resolve_checkpoint", "resolve_model"]
