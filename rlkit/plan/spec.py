"""ModelSpec: the shapes and exact parameter counts of a decoder-only LM, from its HF config.

Counts come from the architecture (Llama / Qwen2 / Qwen3 / Mistral-style: GQA attention, gated MLP,
RMSNorm), not from instantiating the model, so a 72B model is sized in microseconds. Tied input
and output embeddings are counted once (``shared/PLATFORM.md``: meta-device counting does not tie).

Mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V3) are counted layer by layer: a sparse layer
holds a router (``E x H``), ``E`` routed experts of ``3 x H x moe_intermediate_size`` each and, for
DeepSeek, ``n_shared_experts`` always-on experts of the same width, in place of the dense MLP; the dense
layers (``mlp_only_layers`` / ``decoder_sparse_step`` for Qwen, ``first_k_dense_replace`` /
``moe_layer_freq`` for DeepSeek) keep the dense MLP. ``active_params`` counts what one token runs
(top-k experts + shared experts + everything else). DeepSeek's multi-head latent attention (MLA) is
counted exactly from its ranks (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``); its multi-token-prediction module (``num_nextn_predict_layers``)
is not counted, as the published 671B leaves it out.

Vision-language models (Qwen2.5-VL: an HF config with ``vision_config`` and ``text_config``, or the
released flat ``config.json`` with ``vision_config`` beside the language model's fields) are the language
model above plus a vision tower, counted from transformers' ``Qwen2_5_VisionTransformerPretrainedModel``: a
Conv3d patch embedding without bias (``in_channels x temporal_patch_size x patch_size^2 -> hidden``),
``depth`` blocks (two RMSNorms, ``qkv`` and ``proj`` with biases, a gated MLP with biases) and a merger
(an RMSNorm, then ``Linear(hidden m^2, hidden m^2) -> GELU -> Linear(hidden m^2, out_hidden)``, ``m`` the
spatial merge size). ``num_params`` is both; ``language_params`` and ``vision_params`` each part.

>>> vl = ModelSpec.from_name("qwen2.5-vl-7b")
>>> vl.num_params, vl.vision_params, vl.language_params == ModelSpec.from_name("qwen2.5-7b").num_params
(8292166656, 676550144, True)

>>> q = ModelSpec.from_name("qwen3-30b-a3b")
>>> f"{q.num_params / 1e9:.2f}B total, {q.active_params / 1e9:.2f}B active"
'30.53B total, 3.35B active'
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlkit.errors import PlanError

CONFIG_DIR = Path(__file__).parent / "configs"
# model types whose q/k/v projections carry a bias although their config has no attention_bias field (the
# vision-language Qwens' language models are Qwen2's: their flat configs and transformers' text_config names)
_QKV_BIAS_TYPES = {"qwen2", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"}
# vision towers the planner counts: Qwen2.5-VL's (the released config.json names it "qwen2_5_vl",
# transformers 5's Qwen2_5_VLVisionConfig "qwen2_5_vl_vision")
VISION_TOWERS = ("qwen2_5_vl", "qwen2_5_vl_vision")
# transformers' Qwen2_5_VLVisionConfig defaults (configuration_qwen2_5_vl.py), which the released configs rely
# on: Qwen2.5-VL-7B-Instruct's config.json names only hidden_size 1280, in_chans and spatial_patch_size
_QWEN2_5_VL_VISION = dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                          out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31))
# model types with a per-head RMSNorm on q and k (q_norm, k_norm)
_QK_NORM_TYPES = {"qwen3", "qwen3_moe"}


def _dense_layers(cfg: dict, layers: int, experts: int) -> tuple[int, ...]:
    """The layers of an MoE config that keep a dense MLP, by transformers' rules: Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step`` (layer i is sparse when ``(i + 1) % step == 0``),
    DeepSeek's ``first_k_dense_replace`` and ``moe_layer_freq`` (sparse when ``i >= k and i % freq == 0``);
    Mixtral's are all sparse. A dense config: none (``ModelSpec.sparse_layers`` is empty).

    >>> _dense_layers({"first_k_dense_replace": 3}, 6, 8), _dense_layers({"decoder_sparse_step": 2}, 4, 8)
    ((0, 1, 2), (0, 2))
    """
    if not experts:
        return ()
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    first_k = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return tuple(i for i in range(layers)
                 if i in only or (i + 1) % step or i < first_k or i % freq)


def _vision_fields(vision: Any, outer_type: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a vision tower from its config (a dict or an HF config): a Qwen2.5-VL
    tower's missing fields take transformers' defaults (as ``Qwen2_5_VLVisionConfig`` does when it loads the
    released ``config.json``); another kind of tower keeps what its config names, and counting it raises.

    >>> f = _vision_fields({"hidden_size": 1280, "in_chans": 3, "spatial_patch_size": 14}, "qwen2_5_vl")
    >>> f["vision_depth"], f["vision_hidden_size"], f["vision_out_hidden_size"], f["vision_fullatt_blocks"]
    (32, 1280, 3584, (7, 15, 23, 31))
    """
    v = vision.to_dict() if hasattr(vision, "to_dict") else dict(vision)
    kind = str(v.get("model_type") or outer_type or "unknown")
    if kind in VISION_TOWERS:
        v = {**_QWEN2_5_VL_VISION, **{k: x for k, x in v.items() if x is not None}}

    def get(*keys: str, default: int = 0) -> int:
        return int(next((v[k] for k in keys if v.get(k) is not None), default))

    return dict(vision_model_type=kind, vision_depth=get("depth"), vision_hidden_size=get("hidden_size", "embed_dim"),
                vision_intermediate_size=get("intermediate_size"), vision_num_heads=get("num_heads"),
                vision_in_channels=get("in_channels", "in_chans", default=3),
                vision_patch_size=get("patch_size", "spatial_patch_size", default=14),
                vision_temporal_patch_size=get("temporal_patch_size", default=2),
                vision_merge_size=get("spatial_merge_size", default=2), vision_out_hidden_size=get("out_hidden_size"),
                vision_window_size=get("window_size"),
                vision_fullatt_blocks=tuple(int(i) for i in v.get("fullatt_block_indexes") or ()))


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
    #: mixture of experts (0: dense): routed experts per MoE layer, experts each token goes to, their width
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    #: always-on experts of each sparse layer (DeepSeek), each ``moe_intermediate_size`` wide
    n_shared_experts: int = 0
    #: the decoder layers that keep a dense MLP in an MoE model (all of them in a dense model)
    dense_layers: tuple[int, ...] = ()
    #: Qwen3's per-head RMSNorm on q and k (``q_norm``, ``k_norm``: head_dim each)
    qk_norm: bool = False
    #: DeepSeek's multi-head latent attention (kv_lora_rank 0: ordinary GQA attention)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: a vision-language model's vision tower ("" and 0: none), Qwen2.5-VL's (``VISION_TOWERS``), on the first
    #: pipeline stage: its config's model_type, depth (blocks), width, MLP width, heads, input channels, patch
    #: side (px), frames per patch, merge size (m x m patches become one image token), output width (the
    #: language model's hidden size), attention window (px) and the blocks that attend over the whole image
    vision_model_type: str = ""
    vision_depth: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_num_heads: int = 0
    vision_in_channels: int = 3
    vision_patch_size: int = 14
    vision_temporal_patch_size: int = 2
    vision_merge_size: int = 2
    vision_out_hidden_size: int = 0
    vision_window_size: int = 0
    vision_fullatt_blocks: tuple[int, ...] = ()

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
        """From an HF ``PretrainedConfig`` or its dict (``config.json``). A vision-language config (one with
        ``vision_config``): the language model from ``text_config`` (or the top level, as the released flat
        ``config.json`` has it) and the vision tower from ``vision_config``.

        >>> from rlkit.models.vision import vl_config
        >>> s = ModelSpec.from_config(vl_config())
        >>> s.hidden_size, s.vision_depth, s.vision_hidden_size, s.vision_out_hidden_size
        (64, 2, 32, 64)
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        outer = cfg
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {"tie_word_embeddings": outer.get("tie_word_embeddings", False), **cfg["text_config"]}
        vision = outer.get("vision_config")
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if k not in cfg]
        if missing:
            raise PlanError(f"model config lacks {missing}; rlkit sizes decoder-only LMs with "
                            f"hidden_size, num_attention_heads and num_hidden_layers")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        model_type = cfg.get("model_type", "unknown")
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        mla = int(cfg.get("kv_lora_rank") or 0)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        tower = _vision_fields(vision, str(outer.get("model_type") or "")) if vision else {}
        if tower and not tower["vision_out_hidden_size"]:
            tower["vision_out_hidden_size"] = hidden
        if mla:  # q and k heads are nope + rope wide (transformers' DeepseekV3Config sets head_dim to the rope part)
            head_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
        return cls(
            name=name or cfg.get("_name_or_path") or model_type,
            model_type=model_type,
            vocab_size=int(cfg.get("vocab_size", 32000)),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type in _QKV_BIAS_TYPES,
            o_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            # Qwen-MoE's name, Mixtral's, DeepSeek's; Mixtral's experts are intermediate_size wide
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size") or 4 * hidden
                                                                           if experts else 0)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0) if experts else 0,
            dense_layers=_dense_layers(cfg, layers, experts),
            qk_norm=model_type in _QK_NORM_TYPES,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0) if mla else 0,
            kv_lora_rank=mla,
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0) if mla else 0,
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if mla else 0,
            v_head_dim=int(cfg.get("v_head_dim") or 0) if mla else 0,
            **tower,
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
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def attention_params(self) -> int:
        """One layer's attention: q/k/v/o (biases, Qwen3's q/k norms), or MLA's low-rank projections
        (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
        ``kv_b_proj``, ``o_proj``)."""
        h = self.hidden_size
        if self.is_mla:
            a, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * qk) if self.q_lora_rank else h * a * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + a * self.v_head_dim * h
        n = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            n += h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def _attention_norm_params(self) -> int:
        if self.is_mla:
            return self.q_lora_rank + self.kv_lora_rank
        return 2 * self.head_dim if self.qk_norm else 0

    @property
    def mlp_params(self) -> int:
        """One dense gated MLP (a dense layer's; also the dense layers of an MoE model)."""
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)

    # ---- mixture of experts ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the decoder layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.is_moe:
            return ()
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    def is_sparse(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def expert_params(self) -> int:
        """One routed expert: a gated MLP ``moe_intermediate_size`` wide."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.num_experts * self.hidden_size

    @property
    def shared_expert_params(self) -> int:
        """A sparse layer's always-on shared experts (DeepSeek), together."""
        return self.n_shared_experts * self.expert_params

    @property
    def moe_params(self) -> int:
        """A sparse layer's MLP: router + all routed experts + shared experts."""
        return self.router_params + self.num_experts * self.expert_params + self.shared_expert_params

    @property
    def moe_active_params(self) -> int:
        """What one token runs of a sparse layer's MLP: router + top-k experts + shared experts."""
        return self.router_params + self.num_experts_per_tok * self.expert_params + self.shared_expert_params

    def layer_params_at(self, layer: int, active: bool = False) -> int:
        """Decoder layer ``layer``: attention + its MLP (dense, or router and experts) + two RMSNorms;
        ``active``: only the experts one token runs."""
        mlp = (self.moe_active_params if active else self.moe_params) if self.is_sparse(layer) else self.mlp_params
        return self.attention_params + mlp + 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention + gated MLP + two RMSNorms (an MoE model's sparse layer: router and
        all experts in place of the MLP; ``layer_params_at`` gives each layer's)."""
        sparse = self.sparse_layers
        return self.layer_params_at(sparse[0] if sparse else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """lm_head weights (0 when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def language_params(self) -> int:
        """The language model's unique parameters (tied weights once): embedding, decoder layers, final norm,
        lm_head. A text model's ``num_params``."""
        if not self.is_moe:
            layers = self.num_layers * self.layer_params
        else:
            layers = sum(self.layer_params_at(i) for i in range(self.num_layers))
        return self.embedding_params + layers + self.hidden_size + self.head_params

    @property
    def num_params(self) -> int:
        """Unique parameters (tied weights once): the language model's and a vision tower's."""
        return self.language_params + self.vision_params

    # ---- vision tower (vision-language models) -----------------------------------------------
    @property
    def is_vision_language(self) -> bool:
        """The model has a vision tower (``vision_model_type`` set)."""
        return bool(self.vision_model_type)

    def _check_vision(self) -> None:
        if self.vision_model_type not in VISION_TOWERS:
            raise PlanError(f"{self.name}: a vision tower of type {self.vision_model_type!r} is not modelled by the "
                            f"planner (it counts Qwen2.5-VL's, model_type in {list(VISION_TOWERS)})")

    @property
    def vision_patch_dim(self) -> int:
        """Values of one patch: ``in_channels x temporal_patch_size x patch_size^2`` (1176 for Qwen2.5-VL)."""
        return self.vision_in_channels * self.vision_temporal_patch_size * self.vision_patch_size ** 2

    @property
    def vision_patch_embed_params(self) -> int:
        """The Conv3d patch embedding (no bias): ``hidden x patch_dim``."""
        return self.vision_hidden_size * self.vision_patch_dim

    @property
    def vision_block_params(self) -> int:
        """One vision block: two RMSNorms (weights), ``qkv`` (h -> 3h) and ``proj`` (h -> h) with biases, the
        gated MLP (``gate_proj`` and ``up_proj`` h -> i, ``down_proj`` i -> h) with biases."""
        h, i = self.vision_hidden_size, self.vision_intermediate_size
        return 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * i + 2 * i + h)

    @property
    def vision_merger_params(self) -> int:
        """The patch merger: an RMSNorm (h), ``Linear(h m^2, h m^2)`` and ``Linear(h m^2, out_hidden)`` with biases."""
        h, w, out = self.vision_hidden_size, self.vision_hidden_size * self.vision_merge_size ** 2, \
            self.vision_out_hidden_size
        return h + (w * w + w) + (w * out + out)

    @property
    def vision_params(self) -> int:
        """The vision tower's parameters: patch embedding + ``vision_depth`` blocks + merger (0: no tower).

        >>> from rlkit.models.vision import vl_config
        >>> ModelSpec.from_config(vl_config()).vision_params     # = model.model.visual's parameters
        83616
        """
        if not self.is_vision_language:
            return 0
        self._check_vision()
        return self.vision_patch_embed_params + self.vision_depth * self.vision_block_params + self.vision_merger_params

    def image_patches(self, image_tokens: int) -> int:
        """Patches the vision tower runs for ``image_tokens`` image tokens: ``merge^2`` each (one frame: a
        still image is its ``temporal_patch_size`` copies, one patch deep)."""
        return image_tokens * self.vision_merge_size ** 2

    def vision_window_patches(self) -> int:
        """Patches in one attention window of the windowed blocks: ``(window_size / patch_size)^2``."""
        return (self.vision_window_size // self.vision_patch_size) ** 2 if self.vision_window_size else 0

    def vision_flops(self, image_tokens: int) -> int:
        """Forward FLOPs of the vision tower on one image of ``image_tokens`` tokens (``P = image_patches``):
        2 x its matmul parameters per patch (the merger's per merged token) plus, per block, the attention core
        ``4 x span x hidden`` per patch (QK^T and AV), ``span`` = the patches a patch attends to: the whole
        image in the full-attention blocks, a window (``vision_window_patches``, at most ``P``) in the others.

        >>> q = ModelSpec.from_name("qwen2.5-vl-7b")
        >>> f"{q.vision_flops(256) / 1e12:.2f} TFLOP"      # a 448 x 448 image: 1024 patches
        '1.35 TFLOP'
        """
        if not self.is_vision_language or not image_tokens:
            return 0
        self._check_vision()
        h, i, m2, out = (self.vision_hidden_size, self.vision_intermediate_size, self.vision_merge_size ** 2,
                         self.vision_out_hidden_size)
        p = self.image_patches(image_tokens)
        matmul = p * (self.vision_patch_dim * h + self.vision_depth * (4 * h * h + 3 * h * i)) \
            + image_tokens * ((m2 * h) ** 2 + m2 * h * out)
        full = sum(1 for b in self.vision_fullatt_blocks if 0 <= b < self.vision_depth)
        window = min(p, self.vision_window_patches() or p)
        spans = full * p + (self.vision_depth - full) * window
        return 2 * matmul + 4 * p * h * spans

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: ``num_params`` less the routed experts it is not sent to
        (embedding and lm_head included, as Mixtral's 12.9B and Qwen3's A3B/A22B count them; DeepSeek's
        published 37B leaves the 0.9B input embedding out). A dense model: ``num_params``.

        >>> m = ModelSpec.from_name("mixtral-8x7b")
        >>> round(m.num_params / 1e9, 1), round(m.active_params / 1e9, 1)
        (46.7, 12.9)
        """
        return self.num_params - len(self.sparse_layers) * (self.num_experts - self.num_experts_per_tok) * \
            self.expert_params

    def stage_params(self, plan: Any = None, split: list[int] | None = None) -> list[int]:
        """Parameters held by each pipeline rank (all its virtual stages) of ``plan``.

        The first stage holds the embedding (and a vision tower); the last holds the final norm and lm_head. With tied
        embeddings and pp > 1 the last stage keeps its own copy of the embedding matrix for the
        output projection (as Megatron does), so the stages add up to more than ``num_params``.
        """
        from rlkit.plan.topology import ParallelPlan

        plan = plan or ParallelPlan()
        stages = plan.stage_layers(self.num_layers, split)
        out = [0] * plan.pp
        for s, layers in enumerate(stages):
            out[s % plan.pp] += (sum(self.layer_params_at(i) for i in layers) if self.is_moe
                                 else len(layers) * self.layer_params)
        out[0] += self.embedding_params + self.vision_params  # the vision tower runs before the first layer
        out[-1] += self.hidden_size + (self.vocab_size * self.hidden_size if (self.tie_word_embeddings and plan.pp > 1)
                                       else self.head_params)
        return out

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp: int = 1) -> int:
        """KV-cache bytes per token per TP rank: 2 (K and V) x layers x kv_heads x head_dim x dtype / tp.
        MLA caches its compressed latent instead, ``kv_lora_rank + qk_rope_head_dim`` per layer, whole on
        every TP rank (vLLM's MLA cache)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.num_layers * self.kv_dim * dtype_bytes // tp

    def flops_per_token(self, seq_len: int = 0) -> int:
        """Forward FLOPs per token of the language model: 2 x (non-embedding matmul params + lm_head) +
        attention scores (a vision tower's are ``vision_flops``, per image).

        Attention adds 2 x 2 x layers x seq_len x q_dim (QK^T and AV) at average context seq_len
        (Kaplan et al. 2020, 'Scaling Laws', Table 1; Chinchilla appendix F uses the same terms).
        An MoE model counts its *active* matmul parameters (the router, the top-k experts, the shared
        experts); MLA's QK^T runs at ``heads x (qk_nope + qk_rope)`` and AV at ``heads x v_head_dim``.

        >>> q = ModelSpec.from_name("qwen3-30b-a3b")
        >>> q.flops_per_token() < 2 * q.active_params < q.num_params
        True
        """
        if not self.is_moe and not self.is_mla:
            matmul = self.num_layers * (self.attention_params + self.mlp_params) + self.vocab_size * self.hidden_size
            return 2 * matmul + 4 * self.num_layers * seq_len * self.q_dim
        attn = self.attention_params - self._attention_norm_params
        matmul = sum(attn + self.layer_params_at(i, active=True) - self.attention_params - 2 * self.hidden_size
                     for i in range(self.num_layers)) + self.vocab_size * self.hidden_size
        a = self.num_attention_heads
        score_dims = (a * (self.qk_nope_head_dim + self.qk_rope_head_dim) + a * self.v_head_dim if self.is_mla
                      else 2 * self.q_dim)
        return 2 * matmul + 2 * self.num_layers * seq_len * score_dims

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self):
        """Parameter counts by part, as a DataFrame."""
        import pandas as pd

        n_sparse = len(self.sparse_layers)
        layers = [("decoder layer", self.layer_params, self.num_layers)] if not self.is_moe else [
            ("decoder layer (dense MLP)", self.layer_params_at(self.dense_layers[0]) if self.dense_layers else 0,
             self.num_layers - n_sparse),
            ("decoder layer (MoE)", self.layer_params_at(self.sparse_layers[0]) if n_sparse else 0, n_sparse)]
        rows = [("embedding", self.embedding_params, 1), *layers,
                ("final norm", self.hidden_size, 1), ("lm_head", self.head_params, 1)]
        if self.is_vision_language:
            self._check_vision()
            rows += [("vision patch embed", self.vision_patch_embed_params, 1),
                     ("vision block", self.vision_block_params, self.vision_depth),
                     ("vision merger", self.vision_merger_params, 1)]
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


# ---- LoRA adapters ---------------------------------------------------------------------------------
#: what ``lora=<int r>`` targets (rlkit's shorthand, as ``rlkit.parallel.lora.as_lora_config``): the
#: attention and MLP projections of every decoder layer
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LINEAR_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# LoraConfig fields that change which parameters train; rlkit trains plain LoRA only (the runtime's
# check_lora refuses them too), so the planner refuses rather than count them wrong
_UNMODELLED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "lora_bias": False,
               "target_parameters": None, "layer_replication": None}


@dataclass(frozen=True)
class LoraSpec:
    """The part of a LoRA config that sizes the adapters: rank ``r`` and which linear layers get one.

    ``coerce`` reads a peft ``LoraConfig`` by its attributes (``r``, ``target_modules``, ``lora_alpha``,
    ``lora_dropout``, ``layers_to_transform``, ``layers_pattern``, ``exclude_modules``), a dict of them,
    or an int ``r`` (rlkit's shorthand: ``lora_alpha = 2r``, the seven projections of ``LORA_TARGETS``).
    ``target_modules`` follows peft's matching against the HF module names
    (``model.layers.{i}.self_attn.q_proj``, ``model.layers.{i}.mlp.down_proj``): a list of names matches
    a module whose name ends with one, a string is a full-match regex, ``"all-linear"`` is every linear
    layer of the decoder layers (peft leaves the lm_head out).

    >>> lo = LoraSpec.coerce(16)
    >>> lo.r, lo.lora_alpha, lo.target_modules[:2]
    (16, 32, ('q_proj', 'k_proj'))
    >>> LoraSpec.coerce({"r": 8, "target_modules": ["v_proj", "q_proj"]}).layer_targets(as_spec("llama-2-7b"))[0]
    ('q_proj', 'v_proj')
    """

    r: int
    target_modules: tuple[str, ...] | str
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None

    @classmethod
    def coerce(cls, lora: Any) -> LoraSpec | None:
        """``lora`` as a LoraSpec (None stays None); a ``PlanError`` naming the value when it is not a
        positive rank, names no target, or asks for what rlkit does not train (DoRA, trained biases,
        ``modules_to_save``, per-layer ranks)."""
        if lora is None or isinstance(lora, cls):
            return lora
        if isinstance(lora, bool):
            raise PlanError(f"lora={lora!r} must be None, an int rank (e.g. lora=16) or a peft LoraConfig")
        if isinstance(lora, int):
            _check_rank(lora)
            return cls(r=lora, target_modules=LORA_TARGETS, lora_alpha=2 * lora)
        get = lora.get if isinstance(lora, dict) else (lambda k, d=None: getattr(lora, k, d))
        if get("r") is None:
            raise PlanError(f"lora={lora!r} must be None, an int rank (e.g. lora=16) or a peft LoraConfig "
                            f"(something with r and target_modules)")
        _check_rank(get("r"))
        for field, default in _UNMODELLED.items():
            value = get(field, default)
            if value != default and not (default in ({}, None) and not value):
                raise PlanError(f"LoRA {field}={value!r} is not modelled by the planner (rlkit trains plain LoRA "
                                f"adapters); leave {field} at its default ({default!r})")
        dropout = get("lora_dropout", 0.0) or 0.0
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise PlanError(f"LoRA lora_dropout={dropout!r} must be a fraction in [0, 1)")
        targets = _names(get("target_modules"), "target_modules")
        if not targets:
            raise PlanError(f"LoRA target_modules={get('target_modules')!r} names no layer; name some of the "
                            f"decoder layers' linear layers, e.g. {list(LORA_TARGETS)} or 'all-linear'")
        if isinstance(targets, str) and targets.lower() == "all-linear":
            targets = "all-linear"
        layers = get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        layers = tuple(layers) if layers else None
        if layers is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise PlanError(f"LoRA layers_to_transform={get('layers_to_transform')!r} must be layer indices (ints >= 0)")
        pattern = get("layers_pattern")
        pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern) if pattern else None
        return cls(r=get("r"), target_modules=targets, lora_alpha=get("lora_alpha"), lora_dropout=float(dropout),
                   layers_to_transform=layers, layers_pattern=pattern,
                   exclude_modules=_names(get("exclude_modules"), "exclude_modules") or None)

    def layer_targets(self, spec: ModelSpec) -> tuple[tuple[str, ...], ...]:
        """Per decoder layer, the short names of its linear layers that get adapters (in
        ``LORA_TARGETS`` order); a ``PlanError`` naming the targets when they match no linear layer
        or the embedding / lm_head (which rlkit does not adapt)."""
        return _layer_targets(spec, self)

    def tensors(self, spec: ModelSpec, targets: tuple[str, ...]) -> tuple[tuple[str, int, int, int | None], ...]:
        """The adapter tensors of one decoder layer whose ``targets`` are adapted, as
        ``rlkit.plan.sharding`` lists tensors ``(name, dim0, dim1, tp_dim)``: ``lora_A`` (r, in) and
        ``lora_B`` (out, r) per target. Under TP an adapter splits with its base layer: a column-parallel
        base (q/k/v/gate/up) gets ``lora_B`` split on its rows and ``lora_A`` replicated, a row-parallel
        one (o/down) ``lora_A`` split on its columns and ``lora_B`` replicated.

        >>> LoraSpec.coerce(8).tensors(as_spec("llama-2-7b"), ("q_proj", "o_proj"))
        (('q_proj.lora_A', 8, 4096, None), ('q_proj.lora_B', 4096, 8, 0), ('o_proj.lora_A', 8, 4096, 1), ('o_proj.lora_B', 4096, 8, None))
        """
        return _adapter_tensors(spec, targets, self.r)

    def params(self, spec: ModelSpec) -> int:
        """Adapter parameters of the whole model: ``r x (in + out)`` per adapted linear layer."""
        return sum(d0 * d1 for targets in self.layer_targets(spec)
                   for _name, d0, d1, _td in self.tensors(spec, targets))


def _check_rank(r: Any) -> None:
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise PlanError(f"LoRA r={r!r} must be a positive int (the adapters' rank, e.g. 8, 16 or 64)")


def _names(value: Any, field: str) -> tuple[str, ...] | str | None:
    if value is None or isinstance(value, str):
        return value
    try:
        names = tuple(sorted(value, key=lambda n: (LORA_TARGETS.index(n) if n in LORA_TARGETS else 99, n)))
    except TypeError:
        raise PlanError(f"LoRA {field}={value!r} must be a list of module names or a regex string") from None
    if not all(isinstance(n, str) for n in names):
        raise PlanError(f"LoRA {field}={value!r} must be a list of module names or a regex string")
    return names


def _show(names: tuple[str, ...] | str) -> str:
    return repr(names if isinstance(names, str) else list(names))


def _matches(names: tuple[str, ...] | str, key: str) -> bool:
    """peft's ``check_target_module_exists`` for one module name ``key``."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return key in names or any(key.endswith("." + n) for n in names)


def _layer_index(lo: LoraSpec, key: str) -> int | None:
    patterns = lo.layers_pattern or ("",)
    for pattern in patterns:
        m = re.match(rf"(?:^|.*?\.){re.escape(pattern)}\.(?P<idx>\d+)\." if pattern else r".*?\.[^.]*\.(?P<idx>\d+)\.",
                     key)
        if m is not None:
            return int(m["idx"])
    return None


@lru_cache(maxsize=256)
def _layer_targets(spec: ModelSpec, lo: LoraSpec) -> tuple[tuple[str, ...], ...]:
    linears = list(LORA_TARGETS)
    targets = lo.target_modules
    outside = []
    if targets != "all-linear":
        outside = [key for key in ("model.embed_tokens", "lm_head") if _matches(targets, key)
                   and not (lo.exclude_modules and _matches(lo.exclude_modules, key))]
    if outside:
        raise PlanError(f"LoRA target_modules={_show(targets)} targets {outside}: LoRA on the embedding or lm_head is "
                        f"not supported (they are vocab-sharded under TP); target the decoder layers' {linears}")
    out = []
    for i in range(spec.num_layers):
        hit = []
        for name in linears:
            key = f"model.layers.{i}.{_LINEAR_PARENT[name]}.{name}"
            if lo.exclude_modules and _matches(lo.exclude_modules, key):
                continue
            # peft's check_target_module_exists: layers_to_transform filters only the suffix matches of
            # a list (not a regex, not "all-linear", which peft turns into exact names)
            if (targets == "all-linear" or isinstance(targets, str) and re.fullmatch(targets, key)
                    or not isinstance(targets, str) and key in targets):
                hit.append(name)
            elif (not isinstance(targets, str) and any(key.endswith("." + n) for n in targets)
                  and (lo.layers_to_transform is None or _layer_index(lo, key) in lo.layers_to_transform)):
                hit.append(name)
        out.append(tuple(hit))
    if not any(out):
        where = f" in layers {list(lo.layers_to_transform)}" if lo.layers_to_transform is not None else ""
        raise PlanError(f"LoRA target_modules={_show(targets)}{where} matches no linear layer of {spec.name} "
                        f"({spec.num_layers} layers); its decoder layers' linear layers are {sorted(linears)}")
    return tuple(out)


@lru_cache(maxsize=256)
def _adapter_tensors(spec: ModelSpec, targets: tuple[str, ...], r: int) -> tuple[tuple[str, int, int, int | None], ...]:
    from rlkit.plan.sharding import layer_tensors

    out = []
    for name, d0, d1, tp_dim in layer_tensors(spec):
        if name in targets:  # a weight (out, in); biases are "<name>.bias"
            out += [(f"{name}.lora_A", r, d1, 1 if tp_dim == 1 else None),
                    (f"{name}.lora_B", d0, r, 0 if tp_dim == 0 else None)]
    return tuple(out)


def lora_params(model: Any, lora: Any) -> int:
    """Trainable adapter parameters of ``model`` (anything ``as_spec`` takes) under ``lora`` (a peft
    ``LoraConfig``, an int rank, a dict or a :class:`LoraSpec`): ``r x (in_features + out_features)``
    for each adapted linear layer (``lora_A`` is r x in, ``lora_B`` out x r), as peft builds them.

    Adapter size against the model's (rank 16 on all seven projections of Qwen2.5-7B):

    >>> n = lora_params("qwen2.5-7b", 16)
    >>> n, f"{n / as_spec('qwen2.5-7b').num_params:.2%}"
    (40370176, '0.53%')
    >>> lora_params("llama-2-7b", {"r": 8, "target_modules": ["q_proj", "v_proj"]})
    4194304
    >>> lora_params("llama-2-7b", 0)
    Traceback (most recent call last):
    ...
    rlkit.errors.PlanError: LoRA r=0 must be a positive int (the adapters' rank, e.g. 8, 16 or 64)
    """
    lo = LoraSpec.coerce(lora)
    if lo is None:
        raise PlanError("lora=None has no adapters; pass a LoraConfig or an int rank (e.g. lora=16)")
    return lo.params(as_spec(model))
