"""Checkpoints and trained models on remote storage: ``trainer.save("s3://bucket/run")``, ``Trainer.load`` and
``save_pretrained`` to any fsspec URL (``s3://`` with ``pip install 'rlkit[remote]'``).

The workers never see the URL: the driver stages the ordinary local save in a temp folder (``rlkit.checkpoint``,
unchanged), uploads it, and for a load downloads it and runs the local load with all its checks. The staging
folder is ``$RLKIT_STAGING_DIR`` or the system's temp folder; on a multi-node cluster it must be a folder every
node sees, as a local checkpoint path must be.

Atomic without a rename (object stores have none): a ``save`` uploads into a fresh version prefix
``<url>/v-<step>-<id>/`` and, only when every file is up, writes the small object ``<url>/CURRENT`` (one PUT,
atomic on S3) naming it and every file's size; older versions are deleted after. A save cut short leaves
``CURRENT`` naming the last good version. One writer per URL at a time.

Before anything is staged the URL is checked in the driver: a protocol fsspec does not know, missing
credentials, an endpoint that does not answer or a bucket that does not exist is a ``CheckpointError`` with
the fix. Default credentials and endpoint: fsspec's and botocore's own (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``; checked with s3fs 2026.9 / aiobotocore 3.10),
or ``storage_options`` passed to fsspec.

>>> import tempfile, pathlib
>>> src = pathlib.Path(tempfile.mkdtemp())
>>> _ = (src / "trainer.json").write_text("{}")
>>> url = save_version("memory://doc/run", lambda d: __import__("shutil").copytree(src, d), step=3)
>>> with downloaded_version(url) as local:
...     sorted(p.name for p in local.iterdir())
['trainer.json']
>>> is_remote("s3://bucket/run"), is_remote("runs/ckpt"), is_remote("file:///tmp/ckpt")
(True, False, False)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlkit.errors import CheckpointError, TrainerError

POINTER = "CURRENT"  # the object naming the complete version of a checkpoint URL; written last
_S3_FIX = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and AWS_ENDPOINT_URL for an "
           "S3-compatible server that is not AWS (MinIO, Ceph, moto); or pass storage_options={'key': ..., "
           "'secret': ..., 'endpoint_url': ...}")


def is_remote(path: Any) -> bool:
    """A URL with a protocol other than ``file://`` (a local path, ``file://`` included, is not).

    >>> is_remote("memory://x"), is_remote("/tmp/x")
    (True, False)
    """
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local_path(path: Any) -> Any:
    """``path`` without a ``file://`` prefix (anything else as it is).

    >>> local_path("file:///tmp/ckpt")
    '/tmp/ckpt'
    """
    return path[len("file://"):] if isinstance(path, str) and path.startswith("file://") else path


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path on it)`` for ``url``, checked in the driver: the protocol is known and its
    implementation installed, the credentials are there and the store answers (an S3 bucket exists).
    Each failure is a ``CheckpointError`` with the fix.

    >>> filesystem("nosuchproto://x")
    Traceback (most recent call last):
    ...
    rlkit.errors.CheckpointError: nosuchproto://x: fsspec knows no protocol 'nosuchproto' ... or save to a local path
    """
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **{"skip_instance_cache": True, **(storage_options or {})})
    except ImportError as e:  # fsspec knows the protocol, its package is not installed
        raise CheckpointError(f"{url}: {e} (pip install 'rlkit[remote]' for s3://), or save to a local path") from None
    except ValueError as e:
        if "protocol" not in str(e).lower():
            raise CheckpointError(f"{url}: {e}") from None
        raise CheckpointError(f"{url}: fsspec knows no protocol {protocol!r} (it knows e.g. s3://, gs://, az://, "
                              f"hf://, memory://): fix the URL, install the fsspec implementation of that store "
                              f"(pip install s3fs for s3://), or save to a local path") from None
    root = root.rstrip("/")
    _ask(url, protocol, fs.exists, root)  # credentials and the endpoint, before anything is staged
    if protocol in ("s3", "s3a"):
        bucket = root.split("/", 1)[0]
        if not _ask(url, protocol, fs.exists, bucket):
            raise CheckpointError(f"{url}: the bucket {bucket!r} does not exist (endpoint: "
                                  f"{_endpoint(fs) or 'AWS'}): create it (aws s3 mb s3://{bucket}) or fix the URL")
    return fs, root


def _ask(url: str, protocol: str, call: Callable, *args: Any) -> Any:
    """``call(*args)`` on the store, its credential and connection failures said as ``CheckpointError``s."""
    try:
        return call(*args)
    except Exception as e:
        kind = type(e).__name__
        if "Credentials" in kind:  # botocore's NoCredentialsError, google-auth's DefaultCredentialsError
            fix = _S3_FIX if protocol in ("s3", "s3a") else f"configure the credentials the {protocol}:// " \
                                                             f"filesystem reads, or pass them in storage_options"
            raise CheckpointError(f"{url}: no credentials found for {protocol}:// ({kind}): {fix}") from None
        if "EndpointConnection" in kind or isinstance(e, ConnectionError):
            raise CheckpointError(f"{url}: the store does not answer ({e}): check AWS_ENDPOINT_URL or "
                                  f"storage_options' endpoint_url, and that the server runs") from None
        if isinstance(e, PermissionError):
            raise CheckpointError(f"{url}: access denied ({e}): check the credentials ({_S3_FIX}) and that they "
                                  f"may read and write this bucket") from None
        raise


def _endpoint(fs: Any) -> str | None:
    return getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") \
        or os.environ.get("AWS_ENDPOINT_URL")


@contextlib.contextmanager
def staging() -> Iterator[Path]:
    """A fresh local folder to stage an upload or a download in (``$RLKIT_STAGING_DIR`` or the system's temp
    folder), removed when the block ends.

    >>> with staging() as d:
    ...     d.is_dir()
    True
    """
    base = os.environ.get("RLKIT_STAGING_DIR") or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="rlkit-staging-", dir=base))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _bar(total: int, desc: str) -> Any:
    from tqdm.auto import tqdm

    shown = sys.stderr.isatty() or getattr(sys.modules.get("IPython") and sys.modules["IPython"].get_ipython(),
                                           "kernel", None) is not None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not shown, leave=False)


def _callback(bar: Any) -> Any:
    from fsspec.callbacks import Callback

    class ToBar(Callback):  # every file's bytes into one bar
        def set_size(self, size: int) -> None:
            pass

        def relative_update(self, inc: int = 1) -> None:
            bar.update(inc)

    return ToBar()


def upload(folder: Path, fs: Any, root: str, names: list[str], desc: str) -> None:
    """Upload ``names`` (relative to ``folder``) to ``root`` on ``fs`` in that order, with one progress bar."""
    with _bar(sum((folder / n).stat().st_size for n in names), desc) as bar:
        callback = _callback(bar)
        for name in names:
            fs.put_file(str(folder / name), f"{root}/{name}", callback=callback)


def save_version(url: str, write: Callable[[Path], Any], step: int = 0,
                 storage_options: dict[str, Any] | None = None) -> str:
    """Stage ``write(folder)`` locally, upload it as a new version of ``url`` and point ``url/CURRENT`` at it
    (the module docstring), then delete the older versions. Returns ``url``. An upload that fails deletes its
    own partial version and raises a ``CheckpointError``; ``CURRENT`` still names the last good one.

    >>> trainer.save("s3://bucket/run")                                         # doctest: +SKIP
    's3://bucket/run'
    """
    fs, root = filesystem(url, storage_options)  # every check before anything is written
    version = f"v-{step:08d}-{uuid.uuid4().hex[:8]}"
    with staging() as stage:
        write(stage / "ckpt")
        local = stage / "ckpt"
        files = _files(local)
        try:
            upload(local, fs, f"{root}/{version}", list(files), f"upload {url}")
            pointer = {"version": version, "step": step, "files": files}
            fs.pipe_file(f"{root}/{POINTER}", json.dumps(pointer, indent=1).encode())  # the commit: one PUT
        except Exception as e:
            with contextlib.suppress(Exception):
                fs.rm(f"{root}/{version}", recursive=True)
            raise CheckpointError(f"the upload to {url} failed ({type(e).__name__}: {e}); the checkpoint there is "
                                  f"unchanged ({url}/{POINTER} names the last complete save): save again") from e
    for old in fs.ls(root, detail=False):
        name = old.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("v-") and name != version:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(old, recursive=True)
    return url


def read_pointer(fs: Any, root: str, url: str) -> dict[str, Any]:
    """``url/CURRENT``: the version a load reads, with its files' sizes; a ``CheckpointError`` when absent."""
    try:
        data = fs.cat_file(f"{root}/{POINTER}")
    except FileNotFoundError:
        held = [p.rsplit("/", 1)[-1] for p in fs.find(root)][:6]
        raise CheckpointError(f"no rlkit checkpoint at {url}: {url}/{POINTER} is missing, so nothing was saved there "
                              f"or the save was interrupted before it finished (it holds {held or 'nothing'}); "
                              f"pass the URL that trainer.save(...) returned") from None
    try:
        pointer = json.loads(data)
        assert isinstance(pointer.get("version"), str) and isinstance(pointer.get("files"), dict)
    except (ValueError, AssertionError, AttributeError):
        raise CheckpointError(f"{url}/{POINTER} is not the pointer trainer.save writes ({len(data)} bytes): it was "
                              f"damaged or written by something else; save the checkpoint again") from None
    return pointer


@contextlib.contextmanager
def downloaded_version(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """The version ``url/CURRENT`` names, downloaded into a local staging folder for the block (removed
    after). A ``CheckpointError`` raised in the block names the remote files, not the staging folder."""
    fs, root = filesystem(url, storage_options)
    pointer = read_pointer(fs, root, url)
    where = f"{url.rstrip('/')}/{pointer['version']}"
    with staging() as stage:
        local = stage / "ckpt"
        with _bar(sum(pointer["files"].values()), f"download {url}") as bar:
            callback = _callback(bar)
            for name, size in pointer["files"].items():
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                try:
                    fs.get_file(f"{root}/{pointer['version']}/{name}", str(local / name), callback=callback)
                except FileNotFoundError:
                    raise CheckpointError(f"{where}/{name} is missing, though {url}/{POINTER} names it: the version "
                                          f"was deleted or damaged on the store; save the checkpoint again") from None
                if (local / name).stat().st_size != size:
                    raise CheckpointError(f"{where}/{name} has {(local / name).stat().st_size:,} bytes where "
                                          f"{url}/{POINTER} says {size:,}: damaged on the store; save again")
        try:
            yield local
        except (CheckpointError, TrainerError) as e:  # the checks' messages name the files on the store
            raise type(e)(str(e).replace(str(local), where)) from None


def folder_target(url: str, storage_options: dict[str, Any] | None = None,
                  marker: str = "config.json") -> tuple[Any, str, list[str]]:
    """Where ``save_folder`` may write ``url``: an empty prefix or one an earlier save of this kind wrote (its
    ``marker`` file there, no checkpoint), never a ``trainer.save`` checkpoint. Returns ``(fs, root, old files)``."""
    fs, root = filesystem(url, storage_options)
    old = [p[len(root) + 1:] for p in fs.find(root)]
    if POINTER in old or any(n.endswith("trainer.json") for n in old):
        raise CheckpointError(f"{url} holds a trainer.save checkpoint; pass another URL for the model")
    if old and marker not in old:
        raise CheckpointError(f"{url} already holds other files ({old[:6]}); the model replaces its folder whole, "
                              f"so pass a new URL (or one an earlier save of the model wrote)")
    return fs, root, old


def save_folder(target: tuple[Any, str, list[str]], url: str, write: Callable[[Path], Any],
                marker: str = "config.json") -> str:
    """Stage ``write(folder)`` (a Hugging Face folder) and upload it to ``target`` (``folder_target``) as the
    plain folder readers expect, ``marker`` last. While it uploads, ``marker`` is absent: an earlier model
    there loses it first; so a reader that finds ``url/config.json`` finds the whole folder. Returns ``url``.

    >>> trainer.save_pretrained("s3://bucket/final")                            # doctest: +SKIP
    's3://bucket/final'
    """
    fs, root, old = target
    with staging() as stage:
        write(stage / "model")
        local = stage / "model"
        names = [n for n in _files(local) if n != marker]
        if marker in old:
            fs.rm_file(f"{root}/{marker}")
        upload(local, fs, root, names, f"upload {url}")
        for stale in sorted(set(old) - set(names) - {marker}):  # an earlier model's files this one lacks
            fs.rm_file(f"{root}/{stale}")
        upload(local, fs, root, [marker], f"upload {url}")  # last: the folder is whole from here on
    return url


__all__ = ["POINTER", "downloaded_version", "filesystem", "folder_target", "is_remote", "local_path", "read_pointer",
           "save_folder", "save_version", "staging", "upload"]
