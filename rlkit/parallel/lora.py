"""LoRA on peft: adapters injected into the HF model before it is split into stages, so every layout
(FSDP2, DTensor TP, pipelining and their mix) trains them like any other parameter.

* **Injection** is peft's own (``inject_adapter_in_model``): each targeted ``nn.Linear`` becomes a peft
  ``lora.Linear`` holding ``base_layer`` (frozen) and ``lora_A`` / ``lora_B``. Parameter names gain
  ``.base_layer`` and ``.lora_{A,B}.default``; ``hf_name`` maps them back to the HF names.
* **Initialization** is peft's default scheme (A: Kaiming-uniform, B: zeros, so the adapted model starts
  as the base) drawn from a generator seeded per run (``init_adapters``): a rank that builds its layers on
  the meta device and one that builds the whole model draw the same adapters.
* **TP** (``tp_styles``) splits an adapter the way its base layer is split. A column-parallel base
  (q/k/v/gate/up: output features sharded) gets a column-parallel ``lora_B`` and a replicated ``lora_A``:
  ``B[rows_r] @ (A x)`` is exactly rank r's rows of ``B A x``, and the all-reduce of ``A x``'s gradient that
  ColwiseParallel puts on ``lora_B``'s input sums the ranks' parts. A row-parallel base (o/down: input
  features sharded) gets a row-parallel ``lora_A`` (its partial sums all-reduced) and a replicated
  ``lora_B``.
* **The reference** is the same model with its adapters switched off (``adapters_disabled``): no second
  copy, as TRL and verl do.
* **Merged weights** ``W + scaling * B @ A`` (``merge``) are what full-weight consumers read: checkpoints in
  HF format and the 3D-HybridEngine's generation layout. The engines of the default layout take the
  adapters alone and merge them into the base they loaded (``rlkit.rollout.base.RolloutEngine.load_lora``).

>>> from peft import LoraConfig
>>> from rlkit.models import tiny_lm, load
>>> hf, _ = load(tiny_lm("qwen2"))
>>> cfg = check_lora(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), hf)
>>> hf = inject(hf, cfg, seed=0)
>>> sorted({hf_name(n) for n, p in hf.named_parameters() if p.requires_grad})[:2]
['model.layers.0.self_attn.q_proj.lora_A.default.weight', 'model.layers.0.self_attn.q_proj.lora_B.default.weight']
>>> scaling(cfg)
2.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from contextlib import contextmanager
from fnmatch import fnmatch
from typing import Any

import torch
import torch.nn as nn

from rlkit.errors import PlanError

ADAPTER = "default"  # peft's adapter name; rlkit trains one adapter per model
_LORA_PARAM = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


def as_lora_config(lora: Any):
    """A peft ``LoraConfig`` from what a user passes as ``lora=``: a ``LoraConfig`` (TRL's ``peft_config``),
    or an int ``r`` (rlkit's shorthand: ``lora_alpha = 2 r``, the attention and MLP projections,
    ``lora_dropout=0``), or None (no LoRA).

    >>> cfg = as_lora_config(16); (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)[:2])
    (16, 32, ['down_proj', 'gate_proj'])
    """
    if lora is None:
        return None
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    if isinstance(lora, dict):  # as a saved Trainer config holds it (lora_to_dict)
        import dataclasses

        fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
        return LoraConfig(**{k: v for k, v in lora.items() if k in fields})
    if isinstance(lora, int) and not isinstance(lora, bool):
        _check_rank(lora)
        return LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    raise PlanError(f"lora={lora!r} must be a peft LoraConfig (e.g. LoraConfig(r=16, lora_alpha=32, "
                    f"target_modules=['q_proj', 'v_proj'])) or an int rank (e.g. lora=16)")


def lora_to_dict(cfg) -> dict[str, Any] | None:
    """A ``LoraConfig`` as JSON-able values (sets as sorted lists), which ``as_lora_config`` reads back.

    >>> from peft import LoraConfig
    >>> as_lora_config(lora_to_dict(LoraConfig(r=4, target_modules=["v_proj", "q_proj"]))).target_modules == {"q_proj", "v_proj"}
    True
    """
    if cfg is None:
        return None
    out = {}
    for k, v in cfg.to_dict().items():
        out[k] = sorted(v) if isinstance(v, set) else v
    return out


def _check_rank(r: Any) -> None:
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise PlanError(f"LoRA r={r!r} must be a positive int (e.g. 8, 16 or 64: the adapters' rank)")


def linear_names(model_or_config: Any) -> list[str]:
    """The short names of the model's ``nn.Linear`` layers inside its decoder layers (what
    ``target_modules`` may name), e.g. ``['down_proj', 'gate_proj', ..., 'v_proj']``."""
    model = _meta_model(model_or_config)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}
    return sorted(names)


def _meta_model(model_or_config: Any) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from rlkit.models.vision import causal_view, is_vision_language

    with torch.device("meta"):
        if is_vision_language(model_or_config):
            return causal_view(AutoModelForImageTextToText.from_config(model_or_config))
        return AutoModelForCausalLM.from_config(model_or_config)


def check_lora(lora: Any, model_or_config: Any, *, tp: int = 1, head: str = "lm"):
    """Validate ``lora`` against the model before anything is built; returns the ``LoraConfig``.

    Raises ``PlanError`` naming the value and the fix for: ``r`` not a positive int, target modules that
    match nothing (naming the model's linear layers), the lm_head or embedding as targets, options rlkit
    does not train (DoRA, trained biases, ``modules_to_save``, per-layer rank or alpha patterns, other
    initializations), dropout with ``tp > 1``, and a value head.
    """
    cfg = as_lora_config(lora)
    if cfg is None:
        return None
    _check_rank(cfg.r)
    if head != "lm":
        raise PlanError("LoRA on a value head (a critic) is not supported: the critic trains its full weights; "
                        "pass lora= for the actor only")
    unsupported = {"use_dora": (cfg.use_dora, False), "bias": (cfg.bias, "none"),
                   "modules_to_save": (cfg.modules_to_save, None), "rank_pattern": (cfg.rank_pattern or {}, {}),
                   "alpha_pattern": (cfg.alpha_pattern or {}, {}), "init_lora_weights": (cfg.init_lora_weights, True),
                   "lora_bias": (cfg.lora_bias, False), "target_parameters": (cfg.target_parameters, None),
                   "layer_replication": (cfg.layer_replication, None)}
    for field, (value, default) in unsupported.items():
        if value != default:
            raise PlanError(f"LoraConfig({field}={value!r}) is not supported by rlkit's LoRA training yet; leave "
                            f"{field} at its default ({default!r})")
    if cfg.lora_dropout and tp > 1:
        raise PlanError(f"LoraConfig(lora_dropout={cfg.lora_dropout}) with tp={tp}: the TP ranks would draw "
                        f"different dropout masks for the same replicated input; use lora_dropout=0.0 (usual in RL)")
    model = _meta_model(model_or_config)
    if getattr(model, "visual", None) is not None:  # a vision-language model: adapters on its language model only
        if cfg.exclude_modules not in (None, VISION_TOWER):
            raise PlanError(f"LoraConfig(exclude_modules={cfg.exclude_modules!r}) with a vision-language model is "
                            f"not supported yet: rlkit keeps the adapters off the vision tower itself; leave "
                            f"exclude_modules at None")
        cfg = dataclasses.replace(cfg, exclude_modules=VISION_TOWER)
    linears = linear_names(model)
    targets = cfg.target_modules
    if targets is None or (isinstance(targets, (list, set, tuple)) and not targets):
        raise PlanError(f"LoraConfig has no target_modules; name some of the model's linear layers: {linears}")
    if targets == "all-linear":
        return cfg
    matched = [n for n in _targeted(model, targets) if not re.fullmatch(VISION_TOWER, n)]
    if not matched:
        raise PlanError(f"LoraConfig(target_modules={_show(targets)}) matches no linear layer of this model; "
                        f"its decoder layers' linear layers are {linears}")
    outside = sorted({n for n in matched if ".layers." not in n})
    if outside:
        raise PlanError(f"LoraConfig(target_modules={_show(targets)}) targets {outside}: LoRA on the embedding or "
                        f"lm_head is not supported (they are vocab-sharded under TP); target the decoder "
                        f"layers' {linears}")
    return cfg


VISION_TOWER = r"visual(\..*)?"  # a vision-language model's tower (rlkit.models.vision.causal_view): no adapters


def _show(targets: Any) -> str:
    return repr(sorted(targets)) if isinstance(targets, (set, list, tuple)) else repr(targets)


def _targeted(model: nn.Module, targets: Any) -> list[str]:
    """Module names peft would wrap: a string is a full-match regex, a list matches a name's last parts."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        if isinstance(targets, str):
            hit = re.fullmatch(targets, name) is not None
        else:
            hit = any(name == t or name.endswith("." + t) for t in targets)
        if hit:
            out.append(name)
    return out


def scaling(cfg) -> float:
    """The adapters' scale, as peft computes it: ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA)."""
    return cfg.lora_alpha / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)


def inject(hf: nn.Module, cfg, seed: int) -> nn.Module:
    """Wrap ``hf``'s targeted layers with peft's LoRA layers (only the adapters train) and give the
    adapters ``init_adapters``' values; on a meta-device model the values come at materialization."""
    from peft import inject_adapter_in_model

    meta = next(iter(hf.parameters())).is_meta
    inject_adapter_in_model(cfg, hf, low_cpu_mem_usage=meta)
    if not meta:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if is_lora(name):
                    p.copy_(init_adapters({name: tuple(p.shape)}, seed)[name])
    return hf


def init_adapters(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Each adapter's initial value by name: ``lora_A`` Kaiming-uniform as ``nn.Linear`` (peft's default),
    ``lora_B`` zeros. Each tensor has its own generator, seeded from the run's seed and the name, so the
    values do not depend on which ranks build which layers.

    >>> t = init_adapters({"x.lora_A.default.weight": (2, 3), "x.lora_B.default.weight": (3, 2)}, seed=0)
    >>> bool(t["x.lora_B.default.weight"].eq(0).all()), tuple(t["x.lora_A.default.weight"].shape)
    (True, (2, 3))
    """
    out = {}
    for name, shape in shapes.items():
        t = torch.zeros(shape)
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        out[name] = t
    return out


def _stable_hash(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def is_lora(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...q_proj.lora_A.default.weight``)."""
    return _LORA_PARAM.search(name) is not None


def hf_name(name: str) -> str:
    """The HF name of a parameter of an injected model: ``.base_layer`` dropped (adapters keep theirs).

    >>> hf_name("model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    """
    return name.replace(".base_layer.", ".")


def module_of(name: str) -> str:
    """The targeted module of an adapter or base-layer parameter name (``model.layers.0.self_attn.q_proj``)."""
    m = _LORA_PARAM.search(name)
    if m is not None:
        return name[:m.start()]
    return name.split(".base_layer.")[0]


def peft_name(name: str) -> str:
    """An adapter's key in peft's saved format (``adapter_model.safetensors``): the ``PeftModel`` prefix and
    no adapter name.

    >>> peft_name("model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    """
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * B @ A`` in fp32, returned in ``base``'s dtype (a new tensor)."""
    delta = (b.float() @ a.float()) * scale
    return (base.float() + delta.to(base.device)).to(base.dtype)


def lora_layers(modules: Any) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for mod in modules for m in mod.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def adapters_disabled(modules: Any):
    """Run ``modules`` as the base model (adapters off), e.g. for reference log-probs; restored after."""
    layers = lora_layers(modules)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def tp_styles(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A ``parallelize_module`` plan for a module with LoRA layers: each pattern of ``plan`` that lands on a
    peft LoRA layer is rewritten to its ``base_layer`` (the style as given) and the adapter split with it
    (see the module docstring): column-wise base -> ``lora_B`` column-wise, ``lora_A`` replicated; row-wise
    base -> ``lora_A`` row-wise, ``lora_B`` replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    lora_modules = {n for n, m in module.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    if not lora_modules:
        return plan
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [n for n in lora_modules if fnmatch(n, pattern)]
        if not hits:
            out[pattern] = style
            continue
        for name in _expand(module, pattern):
            if name not in lora_modules:
                out[name] = style
            elif isinstance(style, ColwiseParallel):
                out[f"{name}.base_layer"] = style
                out[f"{name}.lora_B.{ADAPTER}"] = ColwiseParallel()
            elif isinstance(style, RowwiseParallel):
                out[f"{name}.base_layer"] = style
                out[f"{name}.lora_A.{ADAPTER}"] = RowwiseParallel()
            else:
                raise PlanError(f"LoRA on {name} under TP style {type(style).__name__} is not supported; "
                                f"leave it out of target_modules or use tp=1")
    return out


def _expand(module: nn.Module, pattern: str) -> list[str]:
    return [n for n, _ in module.named_modules() if fnmatch(n, pattern) and n.count(".") == pattern.count(".")]


__all__ = ["ADAPTER", "adapters_disabled", "as_lora_config", "check_lora", "hf_name", "init_adapters", "inject",
           "is_lora", "linear_names", "lora_to_dict", "merge", "module_of", "peft_name", "scaling", "tp_styles"]
