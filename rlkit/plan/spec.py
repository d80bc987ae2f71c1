"""ModelSpec: the shapes and exact parameter counts of a decoder-only LM, from its HF config.

Counts come from the architecture (Llama / Qwen2 / Mistral-style: GQA attention, gated MLP,
RMSNorm), not from instantiating the model, so a 72B model is sized in microseconds. Tied input
and output embeddings are counted once (``shared/PLATFORM.md``: meta-device counting does not tie).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlkit.errors import PlanError

CONFIG_DIR = Path(__file__).parent / "configs"
# model types whose q/k/v projections carry a bias although their config has no attention_bias field
_QKV_BIAS_TYPES = {"qwen2"}


def bundled_models() -> list[str]:
    """Names of the model configs that ship with rlkit (``ModelSpec.from_name`` takes them)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a causal LM.

    >>> spec = ModelSpec.from_name("qwen2.5-0.5b")
    >>> spec.num_params
    494032768
    >>> spec.layer_params
    14912384
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> ModelSpec:
        """A bundled config by name (see ``bundled_models()``)."""
        path = CONFIG_DIR / f"{name.lower()}.json"
        if not path.exists():
            raise PlanError(f"no bundled model named {name!r}; bundled: {', '.join(bundled_models())}; "
                            f"or pass a local path, an HF config or a hub id")
        return cls.from_config(json.loads(path.read_text()), name=name.lower())

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelSpec:
        """From an HF ``PretrainedConfig`` or its dict (``config.json``)."""
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = cfg["text_config"]
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if k not in cfg]
        if missing:
            raise PlanError(f"model config lacks {missing}; rlkit sizes decoder-only LMs with "
                            f"hidden_size, num_attention_heads and num_hidden_layers")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        model_type = cfg.get("model_type", "unknown")
        return cls(
            name=name or cfg.get("_name_or_path") or model_type,
            model_type=model_type,
            vocab_size=int(cfg.get("vocab_size", 32000)),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type in _QKV_BIAS_TYPES,
            o_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_pretrained(cls, path_or_id: str) -> ModelSpec:
        """From a local checkpoint folder (its ``config.json``) or a hub id (when the hub is reachable)."""
        from rlkit.hub import ModelRefError, resolve_model

        try:
            ref = resolve_model(path_or_id)  # fails fast offline, names a missing path
        except ModelRefError as e:
            raise PlanError(f"{e}; or use a bundled config by name: {', '.join(bundled_models())}") from None
        p = Path(ref)
        if p.is_dir():
            return cls.from_config(json.loads((p / "config.json").read_text()), name=p.name)
        try:
            from transformers import AutoConfig

            return cls.from_config(AutoConfig.from_pretrained(ref), name=ref)
        except Exception as e:  # a bad hub id, a network error mid-download, ...
            raise PlanError(f"cannot read a model config from {path_or_id!r} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200]}); pass a bundled name ({', '.join(bundled_models())}), "
                            f"a local folder with config.json, or an HF config") from None

    # ---- counts ------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        h = self.hidden_size
        n = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            n += h
        return n

    @property
    def mlp_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention + gated MLP + two RMSNorms."""
        return self.attention_params + self.mlp_params + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """lm_head weights (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Unique parameters (tied weights once)."""
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.head_params

    def stage_params(self, plan: Any = None, split: list[int] | None = None) -> list[int]:
        """Parameters held by each pipeline rank (all its virtual stages) of ``plan``.

        The first stage holds the embedding; the last holds the final norm and lm_head. With tied
        embeddings and pp > 1 the last stage keeps its own copy of the embedding matrix for the
        output projection (as Megatron does), so the stages add up to more than ``num_params``.
        """
        from rlkit.plan.topology import ParallelPlan

        plan = plan or ParallelPlan()
        stages = plan.stage_layers(self.num_layers, split)
        out = [0] * plan.pp
        for s, layers in enumerate(stages):
            out[s % plan.pp] += len(layers) * self.layer_params
        out[0] += self.embedding_params
        out[-1] += self.hidden_size + (self.vocab_size * self.hidden_size if (self.tie_word_embeddings and plan.pp > 1)
                                       else self.head_params)
        return out

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV-cache bytes per token per TP rank: 2 (K and V) x layers x kv_heads x head_dim x dtype / tp."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes // tp

    def flops_per_token(self, seq_len: int = 0) -> int:
        """Forward FLOPs per token: 2 x (non-embedding matmul params + lm_head) + attention scores.

        Attention adds 2 x 2 x layers x seq_len x q_dim (QK^T and AV) at average context seq_len
        (Kaplan et al. 2020, 'Scaling Laws', Table 1; Chinchilla appendix F uses the same terms).
        """
        matmul = self.num_layers * (self.attention_params + self.mlp_params) + self.vocab_size * self.hidden_size
        return 2 * matmul + 4 * self.num_layers * seq_len * self.q_dim

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self):
        """Parameter counts by part, as a DataFrame."""
        import pandas as pd

        rows = [("embedding", self.embedding_params, 1), ("decoder layer", self.layer_params, self.num_layers),
                ("final norm", self.hidden_size, 1), ("lm_head", self.head_params, 1)]
        df = pd.DataFrame(rows, columns=["part", "params_each", "count"])
        df["params"] = df.params_each * df["count"]
        return df


@lru_cache(maxsize=64)
def _spec_from_str(s: str) -> ModelSpec:
    if (CONFIG_DIR / f"{s.lower()}.json").exists():
        return ModelSpec.from_name(s)
    return ModelSpec.from_pretrained(s)


def as_spec(model: Any) -> ModelSpec:
    """Accept a ModelSpec, a bundled name, a local path, a hub id, an HF config (object or dict) or an
    HF model (its ``.config``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, os.PathLike)):
        return _spec_from_str(str(model))
    if isinstance(model, dict) or hasattr(model, "to_dict"):
        return ModelSpec.from_config(model)
    if hasattr(model, "config"):
        return ModelSpec.from_config(model.config)
    raise PlanError(f"cannot read a model from {type(model).__name__}; pass a ModelSpec, a bundled name "
                    f"({', '.join(bundled_models())}), a path, an HF config or model")
