"""Atomic writes: readers (and a crash) see the old file or folder, or the new one, never half of one.

Everything rlkit saves goes through here: metrics and config files, checkpoints, converted and built
models. A file or folder is written under a temporary name beside its destination (same filesystem,
so the final ``os.replace`` / ``os.rename`` is atomic) and moved into place only when complete.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_text(d / "metrics.jsonl", '{"step": 1}\\n')
>>> with folder(d / "ckpt") as tmp:
...     _ = (tmp / "weights.txt").write_text("w")
>>> sorted(p.name for p in d.iterdir()), (d / "ckpt" / "weights.txt").read_text()
(['ckpt', 'metrics.jsonl'], 'w')
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


def temp_path(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh hidden name beside ``path`` (``.<name>.<kind>-<id>``): same folder, same filesystem."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:8]}")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temp file and ``os.replace``."""
    write_bytes(path, text.encode("utf-8"))


def move_into_place(tmp: str | os.PathLike, path: str | os.PathLike,
                    keep_existing: Callable[[Path], bool] | None = None) -> None:
    """Rename the complete folder ``tmp`` to ``path``.

    An existing ``path`` is replaced: it is renamed aside first (one rename), then removed, so at every
    moment ``path`` is the old folder or the new one. With ``keep_existing``, an existing ``path`` for
    which it returns True (e.g. complete, written by a concurrent process) is kept and ``tmp`` removed.
    """
    tmp, path = Path(tmp), Path(path)
    if path.exists():
        if keep_existing is not None and keep_existing(path):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        aside = temp_path(path, "old")
        with contextlib.suppress(FileNotFoundError):  # gone meanwhile: nothing to move aside
            os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, path)
    except OSError:  # a concurrent writer put its folder there first
        if keep_existing is None or not keep_existing(path):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def folder(path: str | os.PathLike, keep_existing: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield an empty temp folder beside ``path``; when the block ends without an error it becomes
    ``path`` (see ``move_into_place``), otherwise it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
        move_into_place(tmp, path, keep_existing)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["folder", "move_into_place", "temp_path", "write_bytes", "write_text"]
