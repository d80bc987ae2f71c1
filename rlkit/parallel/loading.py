"""Sharded loading: each rank builds its stages on the meta device and reads only what it keeps.

Loading an HF model whole on every rank and then keeping a slice costs a full copy per rank (140 GB of
host memory per rank at 70B). Here the model is built from its config on the meta device (no storage),
split into this rank's pipeline stages, TP- and FSDP-sharded while still empty, then materialized
(``to_empty``) and filled one parameter at a time from the checkpoint files: a full tensor is read,
this rank's shard is cut from it locally (``distribute_tensor(..., src_data_rank=None)``: no
communication) and the full tensor is dropped. Peak memory: this rank's shards plus the largest single
tensor, plus fixed overhead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from rlkit.errors import PlanError
from rlkit.parallel.lora import hf_name


class CheckpointReader:
    """Tensors of a local HF checkpoint folder by name, one at a time (safetensors, sharded or not;
    ``pytorch_model.bin`` as a fallback).

    >>> from rlkit.models import tiny_lm
    >>> reader = CheckpointReader(tiny_lm("qwen2"))
    >>> reader.get("model.norm.weight").shape
    torch.Size([64])
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: self.folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif any(self.folder.glob("*.safetensors")):
            from safetensors import safe_open

            self.files = {}
            for path in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), path))
        elif (self.folder / "pytorch_model.bin").exists():
            self._bin = torch.load(self.folder / "pytorch_model.bin", map_location="cpu", mmap=True, weights_only=True)
            self.files = dict.fromkeys(self._bin, self.folder / "pytorch_model.bin")
        else:
            raise PlanError(f"no weights in {str(self.folder)!r} (model.safetensors, an index, or pytorch_model.bin)")

    def __contains__(self, name: str) -> bool:
        return name in self.files or bool(self._per_expert(name))

    def _per_expert(self, name: str) -> list[list[str]]:
        """A fused expert tensor (``...mlp.experts.gate_up_proj`` ``(E, 2I, H)`` or ``.down_proj`` ``(E, H, I)``,
        what transformers' MoE modules hold) that the checkpoint stores one expert at a time, as
        transformers saves it (``...mlp.experts.3.gate_proj.weight``): the stored names, per expert, to
        concatenate (gate then up) and stack. Empty for any other name."""
        prefix, _, what = name.rpartition(".")
        if name in self.files or not prefix.endswith(".mlp.experts") or what not in ("gate_up_proj", "down_proj"):
            return []
        parts = ("gate_proj", "up_proj") if what == "gate_up_proj" else ("down_proj",)
        out, e = [], 0
        while f"{prefix}.{e}.{parts[0]}.weight" in self.files:
            out.append([f"{prefix}.{e}.{part}.weight" for part in parts])
            e += 1
        return out

    def numel(self, name: str) -> int:
        """Elements of tensor ``name``, from the file's header (nothing read)."""
        if self._per_expert(name):
            return sum(self.numel(n) for names in self._per_expert(name) for n in names)
        if hasattr(self, "_bin"):
            return self._bin[name].numel()
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return math.prod(f.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (CPU). The file is opened per read, so its mapping (and the pages it
        touched) go away with the returned tensor's neighbours."""
        experts = self._per_expert(name)
        if experts:
            return torch.stack([torch.cat([self.get(n) for n in names]) for names in experts])
        if name not in self.files:
            raise PlanError(f"checkpoint {str(self.folder)!r} has no tensor {name!r} (it has e.g. "
                            f"{sorted(self.files)[:3]}); is it a checkpoint of this architecture?")
        if hasattr(self, "_bin"):
            return self._bin[name]
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


def can_load_sharded(model: Any) -> bool:
    """True for a local checkpoint folder with weights (hub ids and modules load whole)."""
    from rlkit.hub import WEIGHT_FILES

    p = Path(str(model))
    return not isinstance(model, nn.Module) and p.is_dir() and (
        any(p.glob("*.safetensors")) or any((p / name).exists() for name in WEIGHT_FILES))


def empty_model(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF causal LM of ``path``'s config on the meta device: every parameter shaped, none stored.

    transformers does not tie embeddings of a model built on meta, so a tied config is tied here. A
    vision-language model comes back as ``rlkit.models.vision.causal_view`` (the checkpoint's names).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlkit.models.vision import causal_view, is_vision_language

    config = AutoConfig.from_pretrained(str(path))
    config.use_cache = False
    vl = is_vision_language(config)
    with torch.device("meta"):
        hf = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_config(
            config, attn_implementation="eager", dtype=dtype)
    if vl:
        hf = causal_view(hf)
    if getattr(config, "tie_word_embeddings", False):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf


def materialize(stages: list[nn.Module], reader: CheckpointReader, device: torch.device, config: Any,
                extra: dict[str, torch.Tensor] | None = None) -> int:
    """Give meta ``stages`` storage on ``device`` and fill every parameter from ``reader`` (or ``extra``:
    full tensors by name, e.g. a freshly initialized value head). Returns the elements this rank holds.

    A tied lm_head absent from the checkpoint reads the embedding. Rotary inverse frequencies (a buffer
    computed at construction, not stored) are rebuilt from the config.
    """
    extra = extra or {}
    held = 0
    for st in stages:
        # rotary modules (the language model's, a vision tower's) hold computed buffers: built again
        rotaries = [(n, m) for n, m in st.named_modules() if hasattr(m, "inv_freq") and n]
        st.to_empty(device=device)
        for name, rotary in rotaries:
            parent, _, attr = name.rpartition(".")
            with torch.device(device):
                setattr(st.get_submodule(parent), attr, type(rotary)(config=getattr(rotary, "config", config)))
        for name, p in st.named_parameters():
            source = hf_name(name)  # a LoRA layer's frozen base reads the HF tensor it wraps
            if name not in extra and name not in reader and name == "lm_head.weight":
                source = "model.embed_tokens.weight"  # tied: the checkpoint stores the matrix once
            with torch.no_grad():
                full = (extra[name] if name in extra else reader.get(source)).to(device=device, dtype=p.dtype)
                if tuple(full.shape) != tuple(p.shape):
                    raise PlanError(f"checkpoint tensor {source!r} has shape {tuple(full.shape)} but the model "
                                    f"built from config.json expects {tuple(p.shape)}")
                if isinstance(p, DTensor):
                    mine = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p.to_local().copy_(mine)
                else:
                    p.copy_(full)
                held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                del full
    return held


__all__ = ["CheckpointReader", "can_load_sharded", "empty_model", "materialize"]
