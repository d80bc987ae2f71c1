"""Any data in: a dataset given in whatever form, read into rows (a ``list[dict]``) in the driver.

``read_rows`` takes rows (a list of dicts, a pandas DataFrame), a ``datasets.Dataset`` or
``DatasetDict``, a path to a JSONL / JSON / CSV / Parquet file (read with ``datasets.load_dataset``), a
folder saved by ``Dataset.save_to_disk``, or a Hugging Face dataset name. Anything else, a missing
file or a hub name while offline fails at once with a ``TrainerError`` that names the value and the fix.
Prompts are checked later, by ``rlkit.inputs.rows_of``.

>>> import pandas as pd
>>> pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": [2, 4]}).to_json("rows.jsonl", orient="records", lines=True)
>>> read_rows("rows.jsonl")
[{'prompt': '1+1=', 'answer': 2}, {'prompt': '2+2=', 'answer': 4}]
>>> read_rows("rows2.jsonl")
Traceback (most recent call last):
...
rlkit.errors.TrainerError: dataset file 'rows2.jsonl' does not exist; check the path (relative paths start at ...)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlkit.errors import TrainerError

# file suffix -> the datasets builder that reads it
FILE_KINDS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
TRAIN_SPLIT = "train"
HELDOUT_SPLITS = ("test", "validation")  # a held-out split, in the order looked for
SPLITS = ("train", "heldout")
ACCEPTED = ("rows (a list of dicts, a pandas DataFrame), a datasets.Dataset or DatasetDict, a path to a "
            ".jsonl/.json/.csv/.parquet file, or a task from rlkit.tasks")


def read_rows(dataset: Any, split: str = "train") -> list[dict[str, Any]]:
    """The rows of ``dataset``, in order, each a plain dict (its columns).

    ``split="train"`` reads a DatasetDict's ``"train"`` split (a TrainerError names the splits there are
    if it has none); ``split="heldout"`` reads its ``"test"`` or else ``"validation"`` split, and the same
    rows as ``"train"`` when it has neither (a file, a list, a DataFrame have one split: themselves).

    >>> read_rows([{"prompt": "hi", "answer": 1}])
    [{'prompt': 'hi', 'answer': 1}]
    >>> read_rows({"test": [{"prompt": "a"}]})
    Traceback (most recent call last):
    ...
    rlkit.errors.TrainerError: dataset has splits ['test'] and no 'train' split; pass the split to train on, e.g. dataset=dataset['test']
    """
    if split not in SPLITS:
        raise TrainerError(f"split={split!r}: choose one of {list(SPLITS)}")
    if isinstance(dataset, (str, os.PathLike)):
        dataset = _load(dataset)
    if isinstance(dataset, Mapping):
        dataset = _pick_split(dataset, split)
    if hasattr(dataset, "column_names") and hasattr(dataset, "to_list"):  # a datasets.Dataset
        return dataset.to_list()
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # a pandas DataFrame
        return dataset.to_dict("records")
    if isinstance(dataset, (bytes, bytearray)) or not hasattr(dataset, "__iter__"):
        raise TrainerError(f"dataset={_short(dataset)} ({type(dataset).__name__}) is not a dataset; give "
                           f"{ACCEPTED}")
    rows = []
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            raise TrainerError(f"dataset row {i} is a {type(row).__name__} ({_short(row)}), not a dict; each row "
                               f"is a dict of columns, e.g. {{'prompt': '2+2=', 'answer': '4'}}")
        rows.append(dict(row))
    return rows


def heldout_split(dataset: Any) -> str | None:
    """The name of ``dataset``'s held-out split (``"test"``, else ``"validation"``) if it is a
    DatasetDict (or a dict of splits) that has one, else None. Reads no file and no hub.

    >>> heldout_split({"train": [], "validation": []}), heldout_split([{"prompt": "a"}])
    ('validation', None)
    """
    if not isinstance(dataset, Mapping):
        return None
    return next((s for s in HELDOUT_SPLITS if s in dataset), None)


def _is_split(value: Any) -> bool:
    """A split of a DatasetDict (a ``datasets.Dataset``) or of a plain dict of splits (a list of dicts)."""
    return hasattr(value, "column_names") or (isinstance(value, (list, tuple))
                                              and all(isinstance(r, Mapping) for r in value))


def _pick_split(dataset: Mapping, split: str) -> Any:
    if not all(_is_split(v) for v in dataset.values()):
        raise TrainerError(f"dataset is a dict with keys {list(dataset)[:8]}, not rows; give a list of dicts "
                           f"(one per row), a DatasetDict of splits, or datasets.Dataset.from_dict(...) of "
                           f"columns")
    if split == "heldout" and heldout_split(dataset) is not None:
        return dataset[heldout_split(dataset)]
    if TRAIN_SPLIT not in dataset:
        splits = list(dataset)
        raise TrainerError(f"dataset has splits {splits} and no 'train' split; pass the split to train on, e.g. "
                           f"dataset=dataset[{splits[0]!r}]" if splits else
                           "dataset is a DatasetDict with no splits; give rows with a 'prompt'")
    return dataset[TRAIN_SPLIT]


def _load(ref: str | os.PathLike) -> Any:
    """A path read with ``datasets`` (a file by its suffix, a save_to_disk folder), or a hub dataset name."""
    text = str(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
            found = sorted(p.name for p in path.iterdir())[:8]
            raise TrainerError(f"dataset folder {text!r} is not a saved dataset (it holds {found or 'nothing'}); "
                               f"pass a .jsonl/.json/.csv/.parquet file, or a folder saved by "
                               f"Dataset.save_to_disk")
        with _quiet_datasets() as datasets:
            return datasets.load_from_disk(str(path))
    kind = FILE_KINDS.get(path.suffix.lower())
    if path.is_file():
        if kind is None:
            raise TrainerError(f"dataset file {text!r} has suffix {path.suffix!r}, which rlkit does not read; "
                               f"use one of {sorted(FILE_KINDS)} (JSON lines, JSON, CSV, Parquet)")
        with _quiet_datasets() as datasets:
            try:
                return datasets.load_dataset(kind, data_files=str(path), split=TRAIN_SPLIT)
            except Exception as e:  # malformed file: datasets' error, first line, with the path
                raise TrainerError(f"cannot read dataset file {text!r} as {kind} ({type(e).__name__}: "
                                   f"{_first_line(e)}); check that it is valid {kind.upper()} with one row per "
                                   f"record") from None
    if kind is not None or _looks_like_path(text):
        raise TrainerError(f"dataset file {text!r} does not exist; check the path (relative paths start at "
                           f"{os.getcwd()!r})")
    return _load_hub(text)


def _looks_like_path(text: str) -> bool:
    """A string that can only be a path, not a hub dataset name (``name`` or ``org/name``)."""
    return (not text.strip() or text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1
            or any(c.isspace() for c in text) or Path(text).suffix.lower() in (".txt", ".gz", ".arrow"))


def _load_hub(name: str) -> Any:
    """A hub dataset by name; offline (``HF_HUB_OFFLINE`` set, or one short connect to the hub fails, as
    ``rlkit.hub`` decides for models) it fails at once instead of waiting on datasets' network retries."""
    from rlkit.hub import hub_offline

    local = ("download it where there is network (e.g. datasets.load_dataset(name).to_json('rows.jsonl')) "
             "and pass the .jsonl/.parquet path")
    if hub_offline():
        why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") else "the hub cannot be reached"
        raise TrainerError(f"dataset={name!r} is not an existing file, and it cannot be loaded as a Hugging Face "
                           f"dataset name because {why}; {local}")
    with _quiet_datasets() as datasets:
        try:
            return datasets.load_dataset(name)
        except Exception as e:
            raise TrainerError(f"dataset={name!r} is not an existing file, and loading it as a Hugging Face "
                               f"dataset failed ({type(e).__name__}: {_first_line(e)}); {local}") from None


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[Any]:
    """``datasets`` with its progress bars and info logs off (restored afterwards): a notebook cell that
    reads a file shows no "Generating train split" bar."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars, verbosity = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity_error()
    try:
        yield datasets
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["FILE_KINDS", "HELDOUT_SPLITS", "heldout_split", "read_rows"]
