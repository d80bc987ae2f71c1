"""A lean decode loop for Llama-family decoders (Llama, Qwen2, Mistral), run on the HF module's own weights.

``model.generate`` spends most of a small model's decode step in Python: mask building, cache
objects, rotary and generate's own bookkeeping, for every one of the ``max_new_tokens`` steps. This
loop does the same math with the work moved out of the step (gpt-fast style):

- the left-padded prompt batch is prefilled once, then one token per step;
- the KV cache is preallocated, ``(B, kv_heads, P + R, head_dim)`` per layer, written in place;
- the attention mask (padding + causal), the position ids (from the padding, as generate counts them)
  and rotary cos/sin (the model's own ``rotary_emb``) are computed once per call for every position.

Weights are read from the modules (``layer.self_attn.q_proj.weight`` ...) at each call and never
copied, so ``HFEngine.load_weights`` (in-place copies) and the hybrid engine's Parameter swaps are
seen by the next call. ``unsupported(model)`` names what this loop cannot match (other architectures,
scaled rope, an active sliding window, DTensor weights, hooks ...); ``HFEngine`` then uses ``generate``.

>>> import torch
>>> from rlkit.models import tiny_lm, load
>>> model, _ = load(tiny_lm("qwen2", size="test"))
>>> unsupported(model) is None
True
>>> ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
>>> new, logits = decode(model, ids, mask, max_new_tokens=4, pick=lambda x: x.argmax(-1), end_ids=[],
...                      pad_id=0)
>>> new.shape, len(logits), logits[0].dtype
(torch.Size([2, 4]), 4, torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ATTENTION = ("eager", "sdpa")  # the HF attention implementations this loop reproduces


def unsupported(model: nn.Module, total_len: int | None = None) -> str | None:
    """Why ``decode`` cannot stand in for ``model.generate`` on ``model`` (``None``: it can).

    ``total_len`` (prompt width + new tokens) decides whether a sliding window would be active; with
    ``None`` any sliding window counts as active.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    "GPT2LMHeadModel is not one of ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'MistralForCausalLM')"
    """
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {ARCHITECTURES}"
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ATTENTION:
        return f"attn_implementation={impl!r} (the lean loop reproduces {ATTENTION})"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp={cfg.pretraining_tp}"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) != "default" or rotary.attention_scaling != 1.0:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} (only the default rope is reproduced)"
    layers = list(model.model.layers)
    head_dim = layers[0].self_attn.head_dim if layers else 0
    if rotary.inv_freq.numel() * 2 != head_dim:
        return f"partial rotary ({rotary.inv_freq.numel() * 2} of {head_dim} head dims)"
    window = _sliding_window(model)
    if window is not None and (total_len is None or total_len > window):
        return f"sliding window {window} is active for {total_len} positions"
    for mod_name, mod in model.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or hasattr(mod, "_hf_hook"):
            return f"module {mod_name or type(mod).__name__!r} has forward hooks the lean loop would skip"
        for attr, p in mod.named_parameters(recurse=False):
            if hasattr(p, "full_tensor") or hasattr(p, "device_mesh"):
                return f"{mod_name}.{attr} is a DTensor (sharded weights: generate runs the sharded modules)"
            if p.is_meta:
                return f"{mod_name}.{attr} is on the meta device (no weights installed)"
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        for part in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                     mlp.down_proj):
            if type(part) is not nn.Linear:  # LoRA / quantized wrappers compute something else
                return f"layer {i} has a {type(part).__name__}, not an nn.Linear"
    if type(model.lm_head) is not nn.Linear or type(model.model.embed_tokens) is not nn.Embedding:
        return f"lm_head / embed_tokens are {type(model.lm_head).__name__} / {type(model.model.embed_tokens).__name__}"
    return None


def supports(model: nn.Module, total_len: int | None = None) -> bool:
    """``unsupported(model, total_len) is None``."""
    return unsupported(model, total_len) is None


def _sliding_window(model: nn.Module) -> int | None:
    """The sliding window any layer uses, as HF decides it (Qwen2: per layer type; Mistral: config)."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    if type(model).__name__ == "Qwen2ForCausalLM":
        return window if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) else None
    return window


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm (float32 statistics, weight applied in the input dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           eager: bool) -> torch.Tensor:
    """Attention of ``q`` (B, Hq, T, d) over ``k, v`` (B, Hq, S, d) with a boolean ``mask`` (B, 1, T, S),
    the way the model's own implementation computes it (eager: float32 softmax; else SDPA)."""
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class _Step:
    """One forward over new tokens with a preallocated KV cache; built once per ``decode`` call from the
    model's modules (references, not copies)."""

    def __init__(self, model: nn.Module, batch: int, length: int, valid: torch.Tensor, positions: torch.Tensor):
        self.model, self.layers = model, list(model.model.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.groups, self.scale = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.eager = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
        weight = model.model.embed_tokens.weight
        shape = (batch, self.kv_heads, length, self.head_dim)
        self.cache = [(torch.empty(shape, dtype=weight.dtype, device=weight.device),
                       torch.empty(shape, dtype=weight.dtype, device=weight.device)) for _ in self.layers]
        # rotary for every position of the call at once: (B, 1, L, d), broadcast over heads
        cos, sin = model.model.rotary_emb(weight[:1], positions)
        self.cos, self.sin = cos[:, None], sin[:, None]
        self.valid = valid[:, None, None, :]  # (B, 1, 1, L): which keys exist (prompt padding is not)

    def __call__(self, ids: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) float32 of the last of ``ids`` (B, T), which sit at cache slots start..start+T-1;
        ``mask`` (B, 1, T, start+T) says which keys each new token sees."""
        B, T = ids.shape
        end = start + T
        cos, sin = self.cos[:, :, start:end], self.sin[:, :, start:end]
        x = F.embedding(ids, self.model.model.embed_tokens.weight)
        for layer, (k_cache, v_cache) in zip(self.layers, self.cache):
            attn = layer.self_attn
            h = rms_norm(x, layer.input_layernorm)
            q = linear(h, attn.q_proj).view(B, T, -1, self.head_dim).transpose(1, 2)
            k = linear(h, attn.k_proj).view(B, T, -1, self.head_dim).transpose(1, 2)
            k_cache[:, :, start:end] = rotate(k, cos, sin)
            v_cache[:, :, start:end] = linear(h, attn.v_proj).view(B, T, -1, self.head_dim).transpose(1, 2)
            o = self._attention(rotate(q, cos, sin), k_cache[:, :, :end], v_cache[:, :, :end], mask)
            x = x + linear(o.transpose(1, 2).reshape(B, T, -1), attn.o_proj)
            h = rms_norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            x = x + linear(mlp.act_fn(linear(h, mlp.gate_proj)) * linear(h, mlp.up_proj), mlp.down_proj)
        h = rms_norm(x[:, -1], self.model.model.norm)
        return linear(h, self.model.lm_head).float()  # generate's logits are float32 copies

    def _attention(self, q, k, v, mask):
        B, H, T, d = q.shape
        if self.groups == 1:
            return attend(q, k, v, mask, self.scale, self.eager)
        if T == 1:  # one query: fold the query heads of a KV head into the query axis (no repeat of K/V)
            o = attend(q.reshape(B, self.kv_heads, self.groups, d), k, v, mask, self.scale, self.eager)
            return o.reshape(B, H, 1, d)
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        return attend(q, k, v, mask, self.scale, self.eager)


def positions_and_keys(attention_mask: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (B, P + R) and key validity (B, P + R) for a left-padded prompt batch.

    Positions count real tokens as generate does (``cumsum - 1``, pads at 0); generated tokens follow.

    >>> pos, valid = positions_and_keys(torch.tensor([[0, 1, 1], [1, 1, 1]]), 2)
    >>> pos.tolist(), valid.int().tolist()
    ([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]], [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    """
    mask = attention_mask.long()
    prompt_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    steps = torch.arange(1, max_new_tokens + 1, device=mask.device)
    positions = torch.cat([prompt_pos, prompt_pos[:, -1:] + steps], dim=1)
    valid = torch.cat([mask.bool(), torch.ones_like(mask[:, :1], dtype=torch.bool).expand(-1, max_new_tokens)],
                      dim=1)
    return positions, valid


@torch.no_grad()
def decode(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           pick: Callable[[torch.Tensor], torch.Tensor], end_ids: Sequence[int], pad_id: int,
           stop: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """New tokens (B, T <= max_new_tokens) and the raw float32 logits of each step, as ``generate`` returns
    them (``sequences[:, P:]``, ``logits``) for a left-padded batch.

    ``pick(logits) -> tokens`` chooses each step's tokens (argmax, or the engine's seeded sampler).
    A row ends at a token of ``end_ids`` or when ``stop(new_tokens_so_far)`` is True for it; ended
    rows get ``pad_id`` from then on, and the loop stops once every row has ended (as generate does).
    The model must pass ``unsupported(model, P + max_new_tokens) is None``.
    """
    device = model.model.embed_tokens.weight.device
    ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    B, P = ids.shape
    positions, valid = positions_and_keys(attention_mask, max_new_tokens)
    step = _Step(model, B, P + max_new_tokens, valid, positions)
    # prefill: causal over the prompt, padding keys hidden; every slot sees itself, so the outputs at
    # pad slots stay finite (no real token ever reads them)
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    mask = (causal & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)
    logits = step(ids, 0, mask[:, None])
    ends = torch.tensor(list(end_ids), dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    tokens, all_logits = [], []
    for t in range(max_new_tokens):
        all_logits.append(logits)
        nxt = torch.where(unfinished, pick(logits), pad_id)
        tokens.append(nxt)
        if len(ends):
            unfinished &= ~torch.isin(nxt, ends)
        if stop is not None:
            unfinished &= ~stop(torch.stack(tokens, dim=1))
        if t + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        logits = step(nxt[:, None], P + t, step.valid[:, :, :, :P + t + 1])
    return torch.stack(tokens, dim=1), all_logits
