"""A lean decode loop for Llama-family decoders (Llama, Qwen2, Mistral), run on the HF module's own weights.

``model.generate`` spends most of a small model's decode step in Python: mask building, cache
objects, rotary and generate's own bookkeeping, for every one of the ``max_new_tokens`` steps. This
loop does the same math with the work moved out of the step (gpt-fast style):

- the left-padded prompt batch is prefilled once, then one token per step;
- the KV cache is preallocated, ``(B, kv_heads, P + R, head_dim)`` per layer, written in place (keys stored
  transposed, so a step's scores read them without a copy);
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
>>> new, logprobs = decode(model, ids, mask, max_new_tokens=4, pick=lambda x: x.argmax(-1), end_ids=[],
...                        pad_id=0)
>>> new.shape, logprobs.shape, bool((logprobs <= 0).all())
(torch.Size([2, 4]), torch.Size([2, 4]), True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)  # their language model, with M-RoPE positions
ATTENTION = ("eager", "sdpa")  # the HF attention implementations this loop reproduces


def text_model(model: nn.Module) -> nn.Module:
    """The causal LM a vision-language model holds (``rlkit.models.vision.causal_view``), else ``model``."""
    if getattr(model.config, "vision_config", None) is None or not hasattr(model.model, "language_model"):
        return model
    from rlkit.models.vision import causal_view

    return causal_view(model)


def unsupported(model: nn.Module, total_len: int | None = None) -> str | None:
    """Why ``decode`` cannot stand in for ``model.generate`` on ``model`` (``None``: it can).

    ``total_len`` (prompt width + new tokens) decides whether a sliding window would be active; with
    ``None`` any sliding window counts as active.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> unsupported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    "GPT2LMHeadModel is not one of ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'MistralForCausalLM', 'Qwen2_5_VLForConditionalGeneration')"
    """
    name = type(model).__name__
    if name not in ARCHITECTURES + VISION_ARCHITECTURES:
        return f"{name} is not one of {ARCHITECTURES + VISION_ARCHITECTURES}"
    model = text_model(model)  # a vision-language model: its language model decodes (the tower runs once)
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
    if type(model).__name__ in ("Qwen2ForCausalLM", "CausalView"):
        return window if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) else None
    return window


class _Layer(NamedTuple):
    """One decoder layer's tensors, read from its modules when a call starts (references, not copies):
    module attribute lookups cost more than the tiny ops of a small model's decode step."""

    ln1: tuple[torch.Tensor, float]
    q: tuple[torch.Tensor, torch.Tensor | None]
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    ln2: tuple[torch.Tensor, float]
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        lin = lambda m: (m.weight, m.bias)  # noqa: E731
        norm = lambda m: (m.weight, m.variance_epsilon)  # noqa: E731
        return cls(norm(layer.input_layernorm), lin(attn.q_proj), lin(attn.k_proj), lin(attn.v_proj),
                   lin(attn.o_proj), norm(layer.post_attention_layernorm), lin(mlp.gate_proj), lin(mlp.up_proj),
                   lin(mlp.down_proj), mlp.act_fn)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm (float32 statistics, weight applied in the input dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``:
    the sign lives in ``signed_sin = cat(-sin1, sin2)`` and ``roll`` swaps the halves (bit-identical,
    fewer ops)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
           eager: bool) -> torch.Tensor:
    """Attention of ``q`` (B, H, T, d) over ``k, v`` (B, H, S, d); ``bias`` (B, 1, T or 1, S) is 0 where a key
    is seen, -inf where not (what SDPA makes of a boolean mask). Computed the way HF's eager implementation
    does it (float32 softmax), or with SDPA when ``eager`` is False.

    The decode loop passes ``eager=True`` for its one-token steps whatever the model's implementation: a
    handful of queries over the cache cost SDPA's CPU kernel twice the two small matmuls (490 against 230 us a
    layer at 32 rows, bf16, one thread), and the result is the eager math the trainer's forward recomputes
    (rlkit.parallel runs HF's eager attention)."""
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale + bias
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def key_bias(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``seen``, -inf elsewhere: the additive form of a boolean attention mask, made once per call."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, float("-inf"))


class _Step:
    """Forward passes over new tokens with a preallocated KV cache, for one ``decode`` call."""

    def __init__(self, model: nn.Module, batch: int, length: int, valid: torch.Tensor, positions: torch.Tensor,
                 alloc: Callable[..., torch.Tensor] = torch.empty):
        self.layers = [_Layer.of(layer) for layer in model.model.layers]
        self.embed, self.norm = model.model.embed_tokens.weight, (model.model.norm.weight,
                                                                   model.model.norm.variance_epsilon)
        self.head = (model.lm_head.weight, model.lm_head.bias)  # the embedding itself when tied
        attn = model.model.layers[0].self_attn
        self.head_dim, self.groups, self.scale = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.eager = (getattr(model.config, "_attn_implementation", None) or "eager") == "eager"
        shape, like = (batch, self.kv_heads, length, self.head_dim), dict(dtype=self.embed.dtype,
                                                                          device=self.embed.device)
        # torch.zeros where some slots are never written (a cached history's padding): masked keys must be finite.
        # Keys are stored (B, kv_heads, head_dim, length) and seen through a transposed view: the scores' matmul
        # then reads K^T of the first ``end`` slots in place (a one-token step copied it every layer: 6% of decode)
        k_shape = (batch, self.kv_heads, self.head_dim, length)
        self.cache = [(alloc(k_shape, **like).transpose(2, 3), alloc(shape, **like)) for _ in self.layers]
        # rotary for every position of the call at once: (B, 1, L, d), broadcast over heads
        cos, sin = model.model.rotary_emb(self.embed[:1], positions)
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
        # (B, 1, 1, L): keys that exist (prompt padding does not), 0 / -inf
        self.bias = key_bias(valid[:, None, None, :], self.embed.dtype)

    def __call__(self, ids: torch.Tensor, start: int, bias: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, V) float32 of the last of ``ids`` (B, T), which sit at cache slots start..start+T-1;
        ``bias`` (B, 1, T, start+T) says which keys each new token sees (``key_bias``). ``x``: the tokens'
        input embeddings when they are not the table's (a prompt's images in place of its image tokens)."""
        B, T = ids.shape
        end, d = start + T, self.head_dim
        cos, sin = self.cos[:, :, start:end], self.sin[:, :, start:end]
        # heads as (B, heads, T, d); one new token: (B, kv_heads, groups, d), the query heads of a KV
        # head along the query axis, so attention reads the cache without repeating K/V (HF's pack_gqa)
        q_shape = (B, self.kv_heads, self.groups, d) if T == 1 else (B, T, -1, d)
        kv_shape = (B, self.kv_heads, 1, d) if T == 1 else (B, T, -1, d)
        heads = (lambda t, shape: t.view(shape)) if T == 1 else (lambda t, shape: t.view(shape).transpose(1, 2))
        x = F.embedding(ids, self.embed) if x is None else x
        for w, (k_cache, v_cache) in zip(self.layers, self.cache):
            h = rms_norm(x, *w.ln1)
            k_cache[:, :, start:end] = rotate(heads(F.linear(h, *w.k), kv_shape), cos, sin)
            v_cache[:, :, start:end] = heads(F.linear(h, *w.v), kv_shape)
            q = rotate(heads(F.linear(h, *w.q), q_shape), cos, sin)
            k, v = k_cache[:, :, :end], v_cache[:, :, :end]
            if T > 1 and self.groups > 1:
                k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            o = attend(q, k, v, bias, self.scale, self.eager or T == 1)  # one token: eager math (see attend)
            o = o.reshape(B, 1, -1) if T == 1 else o.transpose(1, 2).reshape(B, T, -1)
            x = x + F.linear(o, *w.o)
            h = rms_norm(x, *w.ln2)
            x = x + F.linear(w.act(F.linear(h, *w.gate)) * F.linear(h, *w.up), *w.down)
        return F.linear(rms_norm(x[:, -1], *self.norm), *self.head).float()  # generate's logits: float32


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


def distinct_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first index of each distinct row of ``rows`` (B, W), in order, and for each row the position of
    its distinct row in that list: ``rows[first][copies]`` is ``rows``.

    >>> first, copies = distinct_rows(torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2]]))
    >>> first.tolist(), copies.tolist()
    ([0, 2], [0, 0, 1, 0])
    """
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    B = rows.shape[0]
    first = torch.full((B,), B, dtype=torch.long, device=rows.device).scatter_reduce_(
        0, inverse, torch.arange(B, device=rows.device), "amin")
    first = first[first < B].sort().values  # by first appearance
    rank = torch.empty_like(first)
    rank[inverse[first]] = torch.arange(len(first), device=rows.device)
    return first, rank[inverse]


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Raw ``logits`` as float32, divided by ``temperature`` (not at 1: ``x / 1.0`` is ``x``, a pass saved).

    >>> scaled(torch.tensor([[2.0, 4.0]]), 2.0).tolist(), scaled(torch.tensor([[2.0]]), 1.0).tolist()
    ([[1.0, 2.0]], [[2.0]])
    """
    return logits.float() if temperature == 1.0 else logits.float() / temperature


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log-probs (B,) of ``tokens`` (B,) under ``softmax(logits / temperature)`` of raw logits (B, V): rlkit's
    convention, the number the actor recomputes."""
    return F.log_softmax(scaled(logits, temperature), dim=-1).gather(1, tokens[:, None])[:, 0]


@torch.no_grad()
def decode(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
           pick: Callable[[torch.Tensor], torch.Tensor], end_ids: Sequence[int], pad_id: int,
           stop: Callable[[torch.Tensor], torch.Tensor] | None = None, temperature: float = 1.0,
           images: Sequence[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens (B, T <= max_new_tokens) for a left-padded batch, as ``generate`` returns them
    (``sequences[:, P:]``), and their log-probs (B, T) float32 (``token_logprobs`` at ``temperature``).

    ``pick(logits) -> tokens`` chooses each step's tokens from the raw float32 logits (B, V) (argmax, or
    the engine's seeded sampler). A row ends at a token of ``end_ids`` or when ``stop(new_tokens_so_far)``
    is True for it; ended rows get ``pad_id`` from then on, and the loop stops once every row has ended
    (as generate does). Only one step's logits are alive at a time. The model must pass
    ``unsupported(model, P + max_new_tokens) is None``.

    A vision-language model (``VISION_ARCHITECTURES``) decodes with its language model; ``images[i]``: row i's
    prompt images (an object with ``pixel_values`` and ``image_grid_thw``, e.g. an ``ImagePrompt``) or None.
    The tower runs once, its output takes the image tokens' place in the prefill, and positions are M-RoPE's
    (``rlkit.models.vision.mrope_positions``; new tokens on from each row's largest, as ``generate`` counts).
    """
    model = text_model(model)
    device = model.model.embed_tokens.weight.device
    ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    B, P = ids.shape
    positions, valid = positions_and_keys(attention_mask, max_new_tokens)
    image_id = getattr(model, "image_token_id", None)
    if image_id is not None:  # M-RoPE: (3, B, P + R), and which prompt tokens each row's images fill
        positions, slots = _vision_positions(model, ids, attention_mask, images, max_new_tokens)
    step = _Step(model, B, P + max_new_tokens, valid, positions)
    # prefill: causal over the prompt, padding keys hidden; every slot sees itself, so the outputs at
    # pad slots stay finite (no real token ever reads them)
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    mask = (causal & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)
    # rows alike: the same tokens and, with images, the same images (a prompt's n samples share its object)
    same_images = [] if images is None else [[next(j for j, q in enumerate(images) if q is p)] for p in images]
    first, copies = distinct_rows(torch.cat([ids, attention_mask, torch.tensor(same_images, dtype=torch.long,
                                                                               device=device).view(B, -1)], 1))
    x = None if image_id is None else _embed_images(model, ids, slots, images)
    if len(first) == B:
        logits = step(ids, 0, key_bias(mask[:, None], step.embed.dtype), x)
    else:  # n samples of one prompt: its prompt is prefilled once, and its keys and values copied to each
        once = _Step(model, len(first), P, valid[first, :P], positions[..., first, :P])
        logits = once(ids[first], 0, key_bias(mask[first, None], step.embed.dtype),
                      None if x is None else x[first])[copies]
        for (k, v), (k_once, v_once) in zip(step.cache, once.cache):
            k[:, :, :P], v[:, :, :P] = k_once[copies], v_once[copies]
    return _sample(step, logits, P, max_new_tokens, pick, end_ids, pad_id, stop, temperature)


def _vision_positions(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, images: Sequence[Any] | None,
                      max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision-language model's positions for ``decode``: the prompt's M-RoPE positions (3, B, P), then each
    row's new tokens on from its largest prompt position (all three axes alike), and the image tokens' slots."""
    from rlkit.models.vision import image_token_mask, mrope_positions

    grids = [None if p is None else p.image_grid_thw for p in images] if images is not None else [None] * len(ids)
    prompt = mrope_positions(ids, mask, grids, model.image_token_id, model.merge)
    steps = torch.arange(1, max_new_tokens + 1, device=ids.device)
    new = prompt.amax(dim=(0, 2))[:, None] + steps  # (B, R)
    return torch.cat([prompt, new[None].expand(3, -1, -1)], 2), image_token_mask(ids, grids, model.image_token_id,
                                                                           model.merge)


def _embed_images(model: nn.Module, ids: torch.Tensor, slots: torch.Tensor, images: Sequence[Any] | None
                  ) -> torch.Tensor:
    """The prompt's input embeddings with the vision tower's output (images of every row, in order) in the
    image tokens' place."""
    x = F.embedding(ids, model.model.embed_tokens.weight)
    given = [p for p in images or [] if p is not None]
    if not given or not bool(slots.any()):
        return x
    visual = model.visual
    pixels = torch.cat([p.pixel_values for p in given]).to(device=x.device, dtype=visual.patch_embed.proj.weight.dtype)
    feats = visual(pixels, grid_thw=torch.cat([p.image_grid_thw for p in given]).to(x.device)).pooler_output
    return x.masked_scatter(slots[..., None], feats.to(x.dtype))


def _sample(step: _Step, logits: torch.Tensor, slot: int, max_new_tokens: int,
            pick: Callable[[torch.Tensor], torch.Tensor], end_ids: Sequence[int], pad_id: int,
            stop: Callable[[torch.Tensor], torch.Tensor] | None, temperature: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling loop of ``decode`` from the first new token's ``logits``: each drawn token is fed at cache
    ``slot``, ``slot + 1`` ... (the last one drawn is never fed)."""
    B, device = logits.shape[0], logits.device
    ends = torch.tensor(list(end_ids), dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        nxt = torch.where(unfinished, pick(logits), pad_id)
        tokens.append(nxt)
        logprobs.append(token_logprobs(logits, nxt, temperature))
        if len(ends):
            unfinished &= ~torch.isin(nxt, ends)
        if stop is not None:
            unfinished &= ~stop(torch.stack(tokens, dim=1))
        if t + 1 == max_new_tokens or not bool(unfinished.any()):
            break
        logits = step(nxt[:, None], slot + t, step.bias[..., :slot + t + 1])
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


KV = list[tuple[torch.Tensor, torch.Tensor]]  # one sequence's keys and values per layer, each (kv_heads, S, head_dim)


@torch.no_grad()
def decode_continued(model: nn.Module, prefixes: list[list[int]], past: list[KV | None], max_new_tokens: int,
                     pick: Callable[[torch.Tensor], torch.Tensor], end_ids: Sequence[int], pad_id: int,
                     stop: Callable[[torch.Tensor], torch.Tensor] | None = None, temperature: float = 1.0
                     ) -> tuple[torch.Tensor, torch.Tensor, list[KV]]:
    """``decode`` of token-id ``prefixes`` that reuses their keys and values from an earlier call (streaming:
    a sample continued chunk after chunk under the same weights prefills nothing again).

    ``past[i]``: the keys and values of prefix i's first tokens (all but the last at most: what the previous
    call returned for it, or that plus tokens added since, such as a tool's reply), or None (prefilled here). Returns the new tokens (B, T) and log-probs (B, T), as ``decode``, and
    per row the keys and values of every token it fed: the prefix and the new tokens but the last, so the
    next call's prefix (this one plus the new tokens) has ``past`` over all but its last token.

    The history (each prefix but its last token) is laid out left-padded to one width; rows without ``past``
    are prefilled over it in their own batch, then every row feeds its last token and samples as ``decode``
    does. A token's keys and values depend on its position id only (real tokens counted, padding not), so a
    row's may come from a call with other rows and padding; recomputed they match to float rounding.

    >>> from rlkit.models import tiny_lm, load
    >>> model, _ = load(tiny_lm("qwen2", size="test"))
    >>> greedy = lambda x: x.argmax(-1)
    >>> whole, _ = decode(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), 6, greedy, [], 0)
    >>> first, _, kv = decode_continued(model, [[5, 6, 7]], [None], 3, greedy, [], 0)
    >>> kv[0][0][0].shape[1]                        # keys of the 3 prompt tokens and 2 of 3 new ones
    5
    >>> rest, _, _ = decode_continued(model, [[5, 6, 7] + first[0].tolist()], kv, 3, greedy, [], 0)
    >>> torch.equal(torch.cat([first, rest], 1), whole)
    True
    """
    device = model.model.embed_tokens.weight.device
    B, lengths = len(prefixes), [len(p) for p in prefixes]
    if min(lengths) < 1:
        raise ValueError("decode_continued: every prefix needs at least one token")
    W = max(lengths) - 1  # history width: all but the last token, left-padded
    ids = torch.full((B, W + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((B, W + 1), dtype=torch.long)
    for i, p in enumerate(prefixes):
        ids[i, W + 1 - len(p):], mask[i, W + 1 - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    positions, valid = positions_and_keys(mask, max_new_tokens)
    step = _Step(model, B, W + 1 + max_new_tokens, valid, positions, alloc=torch.zeros)
    have = [0 if kv is None else kv[0][0].shape[1] for kv in past]  # history tokens whose keys are kept
    for i, kv in enumerate(past):  # the kept history, right-aligned from slot W - (len - 1)
        if kv is not None:
            if have[i] > lengths[i] - 1:
                raise ValueError(f"decode_continued: past of row {i} holds {have[i]} tokens; its prefix has "
                                 f"{lengths[i]} (past covers at most all but the last)")
            at = W - (lengths[i] - 1)
            for (k_cache, v_cache), (k, v) in zip(step.cache, kv):
                k_cache[i, :, at:at + have[i]], v_cache[i, :, at:at + have[i]] = k, v
    gap = [i for i in range(B) if have[i] < lengths[i] - 1]  # rows with history tokens to prefill
    if gap:  # their history's last T slots prefilled in a batch of their own (causal, padding hidden) over what
        # is kept; a row whose prefill starts later recomputes a few kept slots (equal to float rounding)
        T = max(lengths[i] - 1 - have[i] for i in gap)
        # rows with the same history and nothing kept (n samples of one prompt) are prefilled once
        alike = torch.tensor([[-1 if have[i] == 0 else i] for i in gap], device=device)
        first, copies = distinct_rows(torch.cat([ids[gap], mask[gap], alike], 1))
        rows = torch.tensor(gap, device=device)[first]
        sub = _Step(model, len(rows), W, valid[rows, :W], positions[rows, :W], alloc=torch.zeros)  # history slots only
        for (k_cache, v_cache), (k_sub, v_sub) in zip(step.cache, sub.cache):
            k_sub[:, :, :W - T], v_sub[:, :, :W - T] = k_cache[rows, :, :W - T], v_cache[rows, :, :W - T]
        seen = valid[rows][:, None, :W] & torch.ones(T, W, dtype=torch.bool, device=device).tril(W - T)
        seen |= _diagonal(T, W, device)
        sub(ids[rows, W - T:W], W - T, key_bias(seen[:, None], sub.embed.dtype))
        into = torch.tensor(gap, device=device)
        for (k_cache, v_cache), (k_sub, v_sub) in zip(step.cache, sub.cache):
            k_cache[into, :, W - T:W], v_cache[into, :, W - T:W] = k_sub[copies, :, W - T:W], v_sub[copies, :, W - T:W]
    logits = step(ids[:, W:], W, step.bias[..., :W + 1])  # every row's last prefix token
    new, logprobs = _sample(step, logits, W + 1, max_new_tokens, pick, end_ids, pad_id, stop, temperature)
    fed = W + new.shape[1]  # slots written: the history, the last prefix token and the new tokens but the last
    kv_rows = [[(k[i, :, W + 1 - n:fed].clone(), v[i, :, W + 1 - n:fed].clone()) for k, v in step.cache]
               for i, n in enumerate(lengths)]
    return new, logprobs, kv_rows


def _diagonal(T: int, W: int, device: torch.device) -> torch.Tensor:
    """(T, W) True where query t (slot W - T + t) meets its own key: every slot sees itself, so the outputs
    at padding slots stay finite (as ``decode``'s prefill does)."""
    return torch.eye(T, dtype=torch.bool, device=device) if T == W else torch.cat(
        [torch.zeros(T, W - T, dtype=torch.bool, device=device), torch.eye(T, dtype=torch.bool, device=device)], 1)
