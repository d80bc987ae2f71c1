"""Checkpoints that explain themselves, and a trained model out as a plain Hugging Face folder.

A ``Trainer.save`` folder::

    trainer.json        step, metrics, model, plan, rollout, config; "format" and "rlkit_version"
    model_config.json   the HF config of the model the run started from (what the shards are shaped by)
    actor/              torch.distributed.checkpoint shards (.metadata, __<rank>_0.distcp) and
                        extra_rank<r>.pt (step and RNG state) of every rank
    critic/             the same for a critic (PPO)

``Trainer.load`` reads it through the checks here, in the driver, before a worker starts: the folder and
its files exist, ``trainer.json`` is whole JSON in a format this rlkit reads, the saved config is the
model's, every shard file is present and as long as its index says, and the shards' tensor shapes are
the model's. Each failure is a ``CheckpointError`` naming the file and what to do. Nothing here writes
into the checkpoint being read.

``write_pretrained`` turns full HF-named weights (``RLWorker.full_weights``) into the folder
``AutoModelForCausalLM.from_pretrained`` and vLLM load: the model built on the meta device, the weights
assigned, transformers' own ``save_pretrained`` writing it (tied embeddings once), plus the generation
config and the tokenizer with its chat template; atomically.

>>> import json, tempfile, pathlib
>>> ckpt = pathlib.Path(tempfile.mkdtemp())
>>> _ = (ckpt / "trainer.json").write_text('{"step": 3, "rows": [')     # cut short by a crash
>>> read_state(ckpt)
Traceback (most recent call last):
...
rlkit.errors.CheckpointError: .../trainer.json is not valid JSON (... the file has 21 bytes): it was cut short or damaged, e.g. by a crash while the checkpoint was copied. Copy the checkpoint again from where trainer.save wrote it, or load an earlier checkpoint
>>> _ = (ckpt / "trainer.json").write_text(json.dumps({"format": FORMAT + 1, "rlkit_version": "9.0"}))
>>> read_state(ckpt)
Traceback (most recent call last):
...
rlkit.errors.CheckpointError: ...trainer.json is checkpoint format 2, written by rlkit 9.0; this rlkit (...) reads formats up to 1: load it with rlkit 9.0 or newer (pip install -U rlkit)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlkit import atomic
from rlkit.errors import CheckpointError

FORMAT = 1  # the checkpoint format this rlkit writes; it reads this one and older (0: before the field)
TRAINER_FILE = "trainer.json"
MODEL_CONFIG_FILE = "model_config.json"
REQUIRED = ("step", "rows", "model", "algorithm", "plan", "rollout", "config")
# the config fields that decide a model's tensors: a checkpoint of another value is another model's
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
_RECOPY = "Copy the checkpoint again from where trainer.save wrote it, or load an earlier checkpoint"


def stamp() -> dict[str, Any]:
    """What ``trainer.json`` records about its writer: the checkpoint ``format`` and ``rlkit_version``.

    >>> stamp()["format"]
    1
    """
    from rlkit import __version__

    return {"format": FORMAT, "rlkit_version": __version__}


def write_model_config(folder: str | os.PathLike, model_path: str) -> None:
    """The run's model config into ``folder/model_config.json`` (what ``check_model`` compares).

    >>> import tempfile, pathlib
    >>> from rlkit.models import tiny_lm
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_model_config(d, tiny_lm("qwen2"))
    >>> json.loads((d / "model_config.json").read_text())["model_type"]
    'qwen2'
    """
    from transformers import AutoConfig

    atomic.write_text(Path(folder) / MODEL_CONFIG_FILE, AutoConfig.from_pretrained(model_path).to_json_string())


# ---- reading, in the driver ----------------------------------------------------------------------
def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """``trainer.json`` of the checkpoint folder ``path``, checked: the folder and file exist, it is whole
    JSON, in a format this rlkit reads (older checkpoints without the field are format 0), with every
    field ``Trainer.load`` needs. Otherwise a ``CheckpointError`` naming the file and the fix."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist; pass the folder that "
                              f"trainer.save(...) returned")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint folder; pass the folder that trainer.save(...) "
                              f"returned (it holds {TRAINER_FILE} and actor/)")
    file = path / TRAINER_FILE
    if not file.is_file():
        names = sorted(p.name for p in path.iterdir())
        if "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names):
            hint = ("it is a model folder (config.json and weights), not a training checkpoint: start a run "
                    f"from it with rlkit.Trainer(model={str(path)!r}, ...)")
        else:
            hint = (f"it holds {names[:8] or 'nothing'}: it is not a trainer.save checkpoint, or a copy of one "
                    f"that was cut short. {_RECOPY}")
        raise CheckpointError(f"{file} is missing; {hint}")
    data = file.read_bytes()
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f"{e.msg}: line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise CheckpointError(f"{file} is not valid JSON ({where}; the file has {len(data)} bytes): it was cut "
                              f"short or damaged, e.g. by a crash while the checkpoint was copied. {_RECOPY}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a {type(state).__name__}, not the object trainer.save writes; "
                              f"{_RECOPY}")
    fmt, version = state.get("format", 0), state.get("rlkit_version", "an unknown version")
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 0:
        raise CheckpointError(f"{file} has format={fmt!r}, not a checkpoint format number; {_RECOPY}")
    if fmt > FORMAT:
        from rlkit import __version__

        raise CheckpointError(f"{file} is checkpoint format {fmt}, written by rlkit {version}; this rlkit "
                              f"({__version__}) reads formats up to {FORMAT}: load it with rlkit {version} or "
                              f"newer (pip install -U rlkit)")
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise CheckpointError(f"{file} lacks {missing}: it is not a whole trainer.json (written by rlkit "
                              f"{version}, format {fmt}). {_RECOPY}")
    return state


def check_model(path: str | os.PathLike, state: dict[str, Any], model_path: str) -> None:
    """The checkpoint belongs to ``model_path`` (``trainer.json``'s model, resolved): its saved config has
    the model's architecture and sizes. Older checkpoints (format 0) have no saved config to compare;
    their shards' shapes are checked by ``check_shards``."""
    from transformers import AutoConfig

    path = Path(path).absolute()
    file = path / MODEL_CONFIG_FILE
    if not file.is_file():
        if state.get("format", 0) >= 1:
            raise CheckpointError(f"{file} is missing (format {state['format']} checkpoints carry the config of "
                                  f"the model they were trained from); {_RECOPY}")
        return
    try:
        saved = json.loads(file.read_text())
        assert isinstance(saved, dict)
    except (UnicodeDecodeError, json.JSONDecodeError, AssertionError):
        raise CheckpointError(f"{file} is not a whole JSON config: it was cut short or damaged. {_RECOPY}") from None
    now = AutoConfig.from_pretrained(model_path).to_dict()
    diff = {k: (saved.get(k), now.get(k)) for k in SHAPE_FIELDS
            if (k == "model_type" or (k in saved and k in now)) and saved.get(k) != now.get(k)}
    if diff:
        said = ", ".join(f"{k} {a!r} in the checkpoint, {b!r} in the model" for k, (a, b) in diff.items())
        raise CheckpointError(f"{file} describes another model than {path / TRAINER_FILE} names "
                              f"({model_path}): {said}. Load this checkpoint with the model it was trained from "
                              f"(if the folder {model_path} was rebuilt or replaced, restore it), or load a "
                              f"checkpoint of {model_path}")


def model_shapes(model_path: str, head: str = "lm", lora: Any = None) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of ``model_path``'s model (built on the meta device, nothing
    read or stored); a critic (``head="value"``) has no lm_head. ``lora``: with peft's LoRA layers in
    (the names a LoRA run's shards hold, ``rlkit.parallel.lora``).

    >>> from rlkit.models import tiny_lm
    >>> model_shapes(tiny_lm("qwen2", size="test"))["model.embed_tokens.weight"]
    (512, 64)
    """
    from rlkit.parallel.loading import empty_model

    hf = empty_model(model_path)
    if lora is not None:
        from rlkit.parallel.lora import as_lora_config, inject

        inject(hf, as_lora_config(lora), seed=0)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters(remove_duplicate=False)}
    return {n: s for n, s in shapes.items() if not (head == "value" and n.startswith("lm_head."))}


def check_shards(folder: str | os.PathLike, world_size: int | None = None,
                 shapes: dict[str, tuple[int, ...]] | None = None, model: str | None = None) -> None:
    """A role's shard folder (``actor/``, ``critic/``) is whole: its index (``.metadata``) reads, every file
    it points into exists and is as long as it says, each of the ``world_size`` ranks has its
    ``extra_rank<r>.pt``, and (given ``shapes``, e.g. ``model_shapes(model)``) its tensors have the model's
    names and shapes. Reads headers and sizes only; writes nothing."""
    folder = Path(folder).absolute()
    role = folder.name
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is missing: the {role}'s weights and optimizer state are not in the "
                              f"checkpoint. {_RECOPY}")
    index = folder / ".metadata"
    if not index.is_file():
        raise CheckpointError(f"{index} is missing: the index of the {role}'s shards. {_RECOPY}")
    try:
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{index} cannot be read ({type(e).__name__}: {_first_line(e)}): the index of the "
                              f"{role}'s shards is cut short or damaged. {_RECOPY}") from None
    ends: dict[str, int] = {}
    for info in getattr(meta, "storage_data", {}).values():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if isinstance(name, str) and isinstance(offset, int) and isinstance(length, int):
            ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: a shard of the {role}'s weights and optimizer state. "
                                  f"{_RECOPY}")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"{file} is truncated: {size:,} bytes where its index (.metadata) needs "
                                  f"{end:,}; the copy was cut short. {_RECOPY}")
    for r in range(world_size or 0):
        file = folder / f"extra_rank{r}.pt"
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: rank {r}'s step and RNG state (the plan in trainer.json has "
                                  f"{world_size} rank{'s' if world_size > 1 else ''}; a checkpoint of a plan with "
                                  f"fewer ranks, or an incomplete copy). {_RECOPY}")
        if not _whole_zip(file):
            raise CheckpointError(f"{file} is truncated or damaged (rank {r}'s step and RNG state). {_RECOPY}")
    if shapes is not None:
        _check_shapes(folder, meta, shapes, model)


def _check_shapes(folder: Path, meta: Any, shapes: dict[str, tuple[int, ...]], model: str | None) -> None:
    saved = {k[len("model."):]: tuple(v.size) for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and hasattr(v, "size") and not k.startswith("model.value_head.")}
    differ = [(n, saved[n], shapes[n]) for n in sorted(saved) if n in shapes and saved[n] != shapes[n]]
    extra, lacking = sorted(set(saved) - set(shapes)), sorted(set(shapes) - set(saved))
    if not (differ or extra or lacking):
        return
    parts = [f"{n} is {list(a)} in the checkpoint and {list(b)} in the model" for n, a, b in differ[:2]]
    if extra:
        parts.append(f"the checkpoint has {len(extra)} tensor(s) the model lacks, e.g. {extra[0]}")
    if lacking:
        parts.append(f"the model has {len(lacking)} tensor(s) the checkpoint lacks, e.g. {lacking[0]}")
    raise CheckpointError(f"{folder} holds the {folder.name} of another model than trainer.json's "
                          f"({model}): {'; '.join(parts)}. Load this checkpoint with the model it was trained "
                          f"from (\"model\" in trainer.json), or load a checkpoint of this model")


def saved_backend(state: dict[str, Any]) -> str:
    """The name of the training backend a checkpoint's ``trainer.json`` state was saved by ("torch" when unset).

    >>> saved_backend({"config": {"backend": {"name": "deepspeed", "zero_stage": 3}}}), saved_backend({"config": {}})
    ('deepspeed', 'torch')
    """
    backend = (state.get("config") or {}).get("backend") or "torch"
    return backend.get("name") if isinstance(backend, dict) else backend


def check_checkpoint(path: str | os.PathLike, state: dict[str, Any], model_path: str, world_size: int,
                     roles: Iterable[tuple[str, str]] = (("actor", "lm"),)) -> None:
    """Everything the driver can check before workers start: ``check_model``, then ``check_shards`` with
    the model's shapes for each ``(role folder, head)`` (the actor's with the run's LoRA layers, if any)."""
    path = Path(path).absolute()
    check_model(path, state, model_path)
    lora = (state.get("config") or {}).get("lora")
    if saved_backend(state) != "torch":
        # Megatron-Core's and DeepSpeed's files are their own format: each backend's load names a missing one
        for role, _head in roles:
            if not (path / role).is_dir():
                raise CheckpointError(f"{path / role} is missing: the {role}'s weights and optimizer state. {_RECOPY}")
        return
    for role, head in roles:
        shapes = model_shapes(model_path, head, lora if role == "actor" else None)
        check_shards(path / role, world_size, shapes, model_path)


def verified_state(path: str | os.PathLike) -> tuple[dict[str, Any], Any]:
    """``(trainer.json's state, its ParallelPlan)`` of the checkpoint at ``path``, after every check the
    driver can make before a worker starts (``read_state``, the plan, model and algorithm it names, then
    ``check_checkpoint`` for the actor and, when the algorithm has one, the critic)."""
    from rlkit.algos import get_algorithm
    from rlkit.hub import resolve_checkpoint
    from rlkit.plan.topology import ParallelPlan

    path = Path(path)
    state = read_state(path)
    try:
        plan = ParallelPlan(**state["plan"])
        model = resolve_checkpoint(state["model"])
        needs_critic = get_algorithm(state["algorithm"]).needs_critic
    except (TypeError, ValueError) as e:  # a plan, model or algorithm that is not there any more
        raise CheckpointError(f"{path / 'trainer.json'}: {e}") from None
    roles = [("actor", "lm")] + ([("critic", "value")] if needs_critic else [])
    check_checkpoint(path, state, model, plan.world_size, roles)
    return state, plan


def load_plan(path: str | os.PathLike, state: dict[str, Any], saved: Any, plan: Any) -> Any:
    """The plan ``Trainer.load`` builds its workers with: ``saved`` (trainer.json's) unless ``plan`` is given.
    Another layout than the saved one is resharded on load (``ParallelModel.load``), which the torch
    backend's files allow and Megatron-Core's and DeepSpeed's (their own formats) do not: refused here."""
    from rlkit.plan.topology import ParallelPlan

    if plan is None:
        return saved
    if not isinstance(plan, ParallelPlan):
        raise CheckpointError(f"Trainer.load(..., plan={plan!r}): plan must be an rlkit.ParallelPlan, e.g. "
                              f"plan=rlkit.ParallelPlan(tp=2)")
    name = saved_backend(state)
    if name != "torch" and plan.layout() != saved.layout():
        raise CheckpointError(f"{Path(path) / 'trainer.json'} was saved by the {name} backend under "
                              f"{saved.describe()}; its files are {name}'s own format, which rlkit reshards only "
                              f"for the torch backend: load it under the same plan (leave plan= out), or save "
                              f"from a run with backend='torch'")
    return plan


def damage_report(folder: str | os.PathLike, error: BaseException) -> CheckpointError:
    """A ``CheckpointError`` for ``error`` raised while a rank read the shard folder ``folder`` (torch's
    ``CheckpointException``, an ``OSError``): the damaged file when ``check_shards`` finds one, else the
    folder and the first failure."""
    try:
        check_shards(folder)
    except CheckpointError as found:
        return found
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (first, _tb) = next(iter(failures.items()))
        what = f"rank {rank}: {type(first).__name__}: {_first_line(first)}"
    else:
        what = f"{type(error).__name__}: {_first_line(error)}"
    return CheckpointError(f"{Path(folder).absolute()} could not be read ({what}); the checkpoint is damaged or "
                           f"was saved from another model or plan than trainer.json names. {_RECOPY}")


def worker_failure(path: str | os.PathLike, error: Exception) -> CheckpointError:
    """The ``CheckpointError`` for a worker group's failure while loading ``path`` (a ``WorkerError``
    carrying the rank's message), without the remote traceback."""
    text = str(error).split("\n--- remote traceback ---")[0]
    found = re.search(r"CheckpointError: (.*) \(in '[^']*'\)", text, re.S)
    if found:
        return CheckpointError(found.group(1))
    return CheckpointError(f"the workers could not load checkpoint {Path(path).absolute()}: {text}. {_RECOPY}")


def _whole_zip(file: Path) -> bool:
    try:
        with zipfile.ZipFile(file) as z:
            return z.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def _first_line(e: BaseException) -> str:
    """The first sentence of ``e``'s message (torch's go on for lines)."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0][:300] if text else ""


# ---- a trained model out -------------------------------------------------------------------------
AHEAD_FILE = "ahead.pt"  # a checkpoint's batches generated ahead and not yet trained (off_policy_steps > 0)


def write_trainer(path: str | os.PathLike, workers: Any, state: dict[str, Any], model_path: str, *,
                  lora: Any = None, ahead: Any = None) -> str:
    """A ``Trainer.save`` folder at ``path``, atomically (a temp folder renamed into place): the workers'
    shards, ``model_config.json``, the batches generated ahead (``ahead``, asynchronous RL: kept for an
    exact resume), with ``lora`` the adapters in peft's format too (``adapter/``), and ``trainer.json``
    (``state`` stamped with the format and rlkit's version). Returns the path."""
    path = Path(path).absolute()
    with atomic.folder(path) as tmp:
        workers.save(str(tmp))
        write_model_config(tmp, model_path)
        if ahead is not None:
            torch.save(ahead, tmp / AHEAD_FILE)
        if lora is not None:  # PeftModel.from_pretrained(base, path / "adapter")
            write_adapter(tmp / "adapter", workers.adapter_weights(), lora, model_path)
        (tmp / "trainer.json").write_text(json.dumps({**state, **stamp()}, default=str))
    return str(path)


def read_ahead(path: str | os.PathLike) -> Any:
    """The batches a checkpoint kept generated ahead (None when it has none)."""
    file = Path(path) / AHEAD_FILE
    return torch.load(file, weights_only=False) if file.exists() else None


def multi_turn_of(state: dict[str, Any], path: str | os.PathLike, tools: Any, environment: Any) -> Any:
    """The ``MultiTurn`` bounds a multi-turn run saved (None for a single-turn run); its tools and
    environment are code, so the caller must pass them again."""
    saved = state.get("multi_turn")
    if saved is None:
        return None
    from rlkit.agent import MultiTurn
    from rlkit.errors import TrainerError

    if tools is None and environment is None:
        raise TrainerError(f"the checkpoint {path} trained multi-turn episodes with tools {saved['tools']} and "
                           f"environment {saved['environment']}; pass them again: Trainer.load(path, dataset, "
                           f"tools=[...], environment=...)")
    return MultiTurn(**saved["settings"])


def pretrained_target(path: str | os.PathLike, model_path: str) -> Path:
    """Where ``write_pretrained`` may write: not the model the run started from, not a file, and not a
    folder holding anything but an earlier HF model folder (which it replaces whole)."""
    path = Path(path).expanduser().absolute()
    if Path(model_path).exists() and path.exists() and path.resolve() == Path(model_path).resolve():
        raise CheckpointError(f"{path} is the model this Trainer started from (and its workers read); pass "
                              f"another folder for the trained model")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file; pass a folder for the trained model")
    if path.is_dir():
        names = sorted(p.name for p in path.iterdir())
        if names and not _is_model_folder(path):
            raise CheckpointError(f"{path} already holds other files ({names[:6]}); the trained model replaces its "
                                  f"folder whole, so pass a new or empty folder (or one an earlier "
                                  f"save_pretrained wrote)")
    return path


def _is_model_folder(path: Path) -> bool:
    """An HF model folder (what save_pretrained writes): a model config.json and safetensors weights, and
    nothing of a training run (a run folder has a config.json of its own)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (isinstance(config, dict) and "model_type" in config and any(path.glob("*.safetensors"))
            and not (path / TRAINER_FILE).exists() and not (path / "metrics.jsonl").exists())


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def write_pretrained(path: str | os.PathLike, weights: dict[str, torch.Tensor], model_path: str,
                     tokenizer: Any = None, dtype: str | torch.dtype | None = None) -> str:
    """Write full HF-named ``weights`` of ``model_path``'s architecture as a Hugging Face checkpoint folder
    (config, safetensors, generation config, tokenizer and chat template), atomically; returns the path.

    The model is built on the meta device and the weights assigned to it (no second copy), then
    transformers' own ``save_pretrained`` writes it (a tied lm_head once). ``dtype``: cast floating-point
    weights (default: as given, the trainer's fp32). A vision-language model's folder also gets the model's
    processor files (image processor, chat template).

    >>> import tempfile, pathlib
    >>> from transformers import AutoModelForCausalLM
    >>> from rlkit.models import tiny_lm
    >>> src = tiny_lm("qwen2", size="test")
    >>> weights = AutoModelForCausalLM.from_pretrained(src).state_dict()
    >>> out = write_pretrained(pathlib.Path(tempfile.mkdtemp()) / "model", weights, src)
    >>> AutoModelForCausalLM.from_pretrained(out).num_parameters() == sum(w.numel() for w in weights.values())
    True
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = pretrained_target(path, model_path)
    if dtype is not None:
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CheckpointError(f"dtype={dtype!r} is not a floating-point torch dtype; use e.g. 'bfloat16'")
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    from rlkit.models.vision import is_vision_language, module_name

    config = AutoConfig.from_pretrained(model_path)
    vl = is_vision_language(config)
    with torch.device("meta"):
        if vl:  # a vision-language model: the checkpoint's names as the loaded module names them
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_config(config)
            weights = {module_name(k): v for k, v in weights.items()}
        else:
            model = AutoModelForCausalLM.from_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings()
    out_name = next((n for n, m in model.named_modules() if m is out_emb), None)
    result = model.load_state_dict(weights, strict=False, assign=True)
    allowed = {f"{out_name}.weight"} if tied and out_name is not None else set()
    if result.unexpected_keys or set(result.missing_keys) - allowed:
        raise CheckpointError(f"the trained weights do not fit {model_path}'s model: missing "
                              f"{sorted(set(result.missing_keys) - allowed)[:3]}, unexpected "
                              f"{sorted(result.unexpected_keys)[:3]}")
    if tied:
        model.tie_weights()
    empty = [n for n, t in model.state_dict().items() if t.is_meta]
    if empty:
        raise CheckpointError(f"{model_path}'s model has tensors the trainer does not hold ({empty[:3]}); "
                              f"save it with transformers instead")
    model.config.dtype = next(iter(weights.values())).dtype
    try:
        model.generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: the one from_config derived from the model config
        pass
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per shard written: rlkit's calls stay quiet
    try:
        with atomic.folder(path) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            for name in PROCESSOR_FILES if vl else ():  # the image processor and template, as the model had them
                if (Path(model_path) / name).is_file():
                    shutil.copyfile(Path(model_path) / name, Path(tmp) / name)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return str(path)


def write_adapter(path: str | os.PathLike, adapters: dict[str, torch.Tensor], lora: Any, model_path: str) -> str:
    """Write LoRA ``adapters`` (``RLWorker.adapter_weights``' names) in peft's own format, atomically:
    ``adapter_config.json`` (the run's ``LoraConfig``, base model ``model_path``) and
    ``adapter_model.safetensors``. ``PeftModel.from_pretrained(base, path)`` loads it. Returns the path.

    >>> import tempfile, pathlib
    >>> from peft import LoraConfig, PeftModel
    >>> from transformers import AutoModelForCausalLM
    >>> from rlkit.models import tiny_lm
    >>> src = tiny_lm("qwen2", size="test"); a = torch.ones(2, 64)
    >>> names = [f"model.layers.{i}.self_attn.q_proj.lora_{x}.default.weight" for i in range(2) for x in "AB"]
    >>> ad = {n: torch.ones(2, 64) if "lora_A" in n else torch.zeros(64, 2) for n in names}
    >>> out = write_adapter(pathlib.Path(tempfile.mkdtemp()) / "adapter", ad, LoraConfig(r=2, target_modules=["q_proj"]), src)
    >>> m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), out)
    >>> float(m.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight.sum())
    128.0
    """
    import copy

    from safetensors.torch import save_file

    from rlkit.parallel.lora import peft_name

    config = copy.deepcopy(lora)
    config.base_model_name_or_path = str(model_path)
    config.inference_mode = True
    with atomic.folder(path) as tmp:
        config.save_pretrained(str(tmp))
        save_file({peft_name(k): v.contiguous() for k, v in adapters.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
    return str(path)


__all__ = ["FORMAT", "check_checkpoint", "check_model", "check_shards", "damage_report", "model_shapes",
           "pretrained_target", "read_state", "stamp", "worker_failure", "write_adapter", "write_model_config",
           "write_pretrained"]
