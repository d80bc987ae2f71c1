"""A pipeline stage: a slice of an HF causal LM that keeps the HF parameter names.

Every layout (pp=1 included) runs through ``Stage``: with pp=1 there is one stage holding the
whole model. Decoder layers live in a ``ModuleDict`` keyed by their *global* index, so a stage's
parameter names are exactly the HF names (``model.layers.7.mlp.up_proj.weight``) on every rank:
state dicts, checkpoints and gradient comparisons need no renaming.

HF decoder layers are called directly, so the stage supplies what ``LlamaModel.forward`` would:
rotary ``position_embeddings``, position ids that skip left padding, and an explicit 4D additive
mask (causal AND not padding) - eager attention without a mask is not causal.

The ``attention_mask`` a stage takes may hold *segment ids* instead of 0/1: several sequences packed
into one row (``rlkit.parallel.packing``), token ``t`` belonging to sequence ``attention_mask[t]`` (0:
padding). Positions restart at each sequence and the mask is block-diagonal, so no token attends across
a sequence boundary: each sequence gets exactly the hidden states it would get alone. A 0/1 mask is the
one-sequence-per-row case, computed exactly as before. Labels of ``IGNORE`` (-100, HF's convention) are
not scored: a packed row scores its response tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlkit.algos.losses import entropy_from_logprobs
from rlkit.errors import PlanError
from rlkit.plan.topology import ParallelPlan

IGNORE = -100  # a label that is not scored (HF's ignore_index)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over each sequence's real tokens; padding gets 0 (it is masked anyway).

    With segment ids (packed rows) positions restart at every sequence:

    >>> position_ids_from_mask(torch.tensor([[0, 1, 1, 1]])).tolist()
    [[0, 0, 1, 2]]
    >>> position_ids_from_mask(torch.tensor([[1, 1, 1, 2, 2, 0]])).tolist()
    [[0, 1, 2, 0, 1, 0]]
    """
    real = attention_mask != 0
    count = real.long().cumsum(-1)
    if not bool((attention_mask > 1).any()):
        return (count - 1).clamp(min=0)  # one sequence per row
    # packed: count from each sequence's first token (the count before it, carried forward by cummax)
    starts = real & (attention_mask != F.pad(attention_mask, (1, 0))[:, :-1])
    before = torch.where(starts, count - 1, torch.zeros_like(count)).cummax(-1).values
    return torch.where(real, count - before - 1, torch.zeros_like(count))


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, S, S) additive mask: 0 where query i may attend key j (j <= i, j is a real token, and with
    segment ids both belong to the same sequence: block-diagonal).

    Fully masked rows (queries on left padding) get a uniform softmax rather than NaN, since the
    fill value is finfo.min, not -inf; those positions are ignored downstream.

    >>> causal_padding_mask(torch.tensor([[0, 1, 1]]), torch.float32)[0, 0].eq(0).int().tolist()
    [[0, 0, 0], [0, 1, 0], [0, 1, 1]]
    >>> causal_padding_mask(torch.tensor([[1, 1, 2]]), torch.float32)[0, 0].eq(0).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    s = attention_mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    if bool((attention_mask > 1).any()):  # packed rows: a query sees its own sequence only
        allowed &= attention_mask[:, :, None] == attention_mask[:, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def token_logprobs(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int = 1024, *,
                   first: int = 1, entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(labels[t] | <t) and entropy, both (B, S) with column 0 = 0 (no prediction).

    The vocab-sized logits exist for ``chunk`` positions at a time (fp32 for the softmax), so
    inference never holds (B, S, V) at once. Only columns ``>= first`` are scored (the others are 0):
    RL reads the response's columns only, and the prompt's would cost the vocab head for nothing.
    ``entropy_grad=False`` computes the entropy without autograd (a metric, not a loss term).
    Labels of ``IGNORE`` mark columns not to score (``first`` is then not used): a packed row's prompts.

    >>> head = nn.Linear(4, 10); h = torch.randn(2, 5, 4); ids = torch.randint(0, 10, (2, 5))
    >>> lp, ent = token_logprobs(head, h, ids, chunk=2)
    >>> ref = head(h[:, :-1]).log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    >>> bool(torch.allclose(lp[:, 1:], ref, atol=1e-6)), tuple(ent.shape)
    (True, (2, 5))
    >>> lp3, _ = token_logprobs(head, h, ids, first=3)
    >>> bool(torch.equal(lp3[:, :3], torch.zeros(2, 3))), bool(torch.allclose(lp3[:, 3:], lp[:, 3:]))
    (True, True)
    >>> lp_sel, _ = token_logprobs(head, h, torch.where(torch.arange(5) >= 3, ids, IGNORE))
    >>> bool(torch.allclose(lp_sel, lp3, atol=1e-6))
    True
    """
    if bool((labels < 0).any()):
        return _selected_logprobs(head, hidden, labels, chunk, entropy_grad)
    first = max(1, first)
    h, target = hidden[:, first - 1:-1], labels[:, first:]
    lps, ents = [], []
    for i in range(0, h.shape[1], chunk):
        logp = head(h[:, i:i + chunk]).float().log_softmax(-1)
        lps.append(logp.gather(-1, target[:, i:i + chunk, None]).squeeze(-1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ents.append(entropy_from_logprobs(logp))
    zero = torch.zeros(hidden.shape[0], min(first, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    return torch.cat([zero, *lps], 1), torch.cat([zero, *ents], 1)


def _selected_logprobs(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                       entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of the columns whose label is not ``IGNORE`` (a packed row's response tokens):
    the vocab head runs on those positions only, ``chunk`` at a time; every other column is 0."""
    scored = labels[:, 1:] >= 0
    h, target = hidden[:, :-1][scored], labels[:, 1:][scored]
    lps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        logp = head(h[i:i + chunk]).float().log_softmax(-1)
        lps.append(logp.gather(-1, target[i:i + chunk, None]).squeeze(-1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ents.append(entropy_from_logprobs(logp))
    zero = torch.zeros(labels.shape[0], 1, dtype=torch.float32, device=hidden.device)
    blank = torch.zeros(scored.shape, dtype=torch.float32, device=hidden.device)
    if lps:
        lp, ent = torch.cat(lps), torch.cat(ents)
    else:  # nothing to score (an empty row): zeros that still reach the head, so every rank's backward (FSDP's
        # gradient reduction, TP's collectives) runs over the same parameters
        lp = ent = blank[scored] + head(hidden[:, :1]).float().sum() * 0.0
    return torch.cat([zero, blank.masked_scatter(scored, lp)], 1), torch.cat([zero, blank.masked_scatter(scored, ent)], 1)


class Stage(nn.Module):
    """Decoder layers ``layers`` of ``hf_model`` (+ embedding if first, + norm and head if last).

    ``forward(x, attention_mask, labels)``: ``x`` is input_ids on the first stage, hidden states
    after. The last stage returns ``(logprobs, entropy)`` (head="lm") or ``values`` (head="value"),
    each (B, S) fp32, so a pipeline's last stage can evaluate an RL loss on its own.

    >>> from rlkit.models import tiny_lm, load
    >>> hf, _ = load(tiny_lm("llama"))
    >>> st = Stage(hf, range(4), first=True, last=True)
    >>> ids = torch.randint(0, 100, (2, 6)); am = torch.ones_like(ids)
    >>> lp, ent = st(ids, attention_mask=am, labels=ids)
    >>> ref = hf(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    >>> bool(torch.allclose(lp[:, 1:], ref, atol=1e-5))
    True
    """

    def __init__(self, hf_model: nn.Module, layers: Any, *, first: bool, last: bool, head: str = "lm",
                 value_head: nn.Module | None = None, logprob_chunk: int = 1024):
        super().__init__()
        self.first, self.last, self.head, self.logprob_chunk = first, last, head, logprob_chunk
        self.ac = False  # activation checkpointing per decoder layer (see apply.apply_ac)
        self.score_from, self.entropy_grad = 1, True  # what token_logprobs scores (ParallelModel.set_scoring)
        self.compute_dtype: torch.dtype | None = None  # bf16: matmuls under autocast, weights stay fp32
        self.moes: list = []  # the stage's mixture-of-experts layers (rlkit.parallel.moe.apply_moe)
        body = hf_model.model
        # a vision-language model (rlkit.models.vision.causal_view): the tower runs on the first stage, its
        # outputs take the place of the image tokens' embeddings
        self.visual = getattr(hf_model, "visual", None) if first else None
        self.image_token_id = getattr(hf_model, "image_token_id", None)
        self.model = nn.Module()
        self.model.embed_tokens = body.embed_tokens if first else None
        self.model.layers = nn.ModuleDict({str(i): body.layers[i] for i in layers})
        self.model.rotary_emb = body.rotary_emb
        self.model.norm = body.norm if last else None
        if last and head == "lm":
            self.lm_head = hf_model.lm_head
        elif last and head == "value":
            self.value_head = value_head

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                routing: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None):
        """``routing`` (mixture of experts, optional): ``(B, S, layers, k)`` experts recorded by the engine for
        each token, which the MoE layers replay or compare against (``rlkit.parallel.moe``).

        Vision-language models: ``pixel_values`` (patches, C*T*P*P) and ``image_grid_thw`` (images, 3) of the
        micro-batch's images in token order, or per row as a pipeline cuts them (``unpad_images``), and
        ``image_mask`` (B, S), the tokens they fill (first stage), and ``position_ids`` (B, 3, S), the multimodal
        rotary positions (``rlkit.models.vision.mrope_positions``; every stage)."""
        dtype = self.compute_dtype
        with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return self._forward(x, attention_mask, labels, routing, pixel_values, image_grid_thw, position_ids,
                                 image_mask)

    def _forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                 routing: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 image_mask: torch.Tensor | None = None):
        h = self.model.embed_tokens(x) if self.first else x
        if self.first and pixel_values is not None:
            pixel_values, image_grid_thw = unpad_images(pixel_values, image_grid_thw)
            if len(image_grid_thw):  # (a pipeline's micro-batch may hold no image)
                h = self._with_images(h, pixel_values, image_grid_thw, image_mask)
        pos = position_ids_from_mask(attention_mask)
        mask = causal_padding_mask(attention_mask, h.dtype)
        pe = self.model.rotary_emb(h, position_ids=pos if position_ids is None else position_ids.transpose(0, 1))
        for moe in self.moes:  # which tokens are real (the router's losses and load count those only), and
            moe.tokens = attention_mask.reshape(-1) != 0  # the engine's choices for them, if recorded
            moe.recorded = None if routing is None else routing[:, :, moe.layer].reshape(-1, routing.shape[-1])
        for layer in self.model.layers.values():
            if self.ac and torch.is_grad_enabled():
                h = checkpoint(run_layer, layer, h, mask, pos, pe, use_reentrant=False)
            else:
                h = run_layer(layer, h, mask, pos, pe)
        if not self.last:
            return h
        h = self.model.norm(h)
        if self.head == "value":
            return self.value_head(h).squeeze(-1).float()
        return token_logprobs(self.lm_head, h, labels, self.logprob_chunk, first=self.score_from,
                              entropy_grad=self.entropy_grad)

    def _with_images(self, h: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
        """The embeddings ``h`` with the vision tower's output in place of the image tokens' (``slots``), in order."""
        if self.visual is None:
            raise PlanError("images were given to a model without a vision tower")
        feats = self.visual(pixel_values.to(self.visual.patch_embed.proj.weight.dtype),
                            grid_thw=image_grid_thw).pooler_output
        if int(slots.sum()) != feats.shape[0]:
            raise PlanError(f"{int(slots.sum())} image tokens in the micro-batch but its images make "
                            f"{feats.shape[0]}: each sample's pixel_values and image_grid_thw must match its tokens")
        return h.masked_scatter(slots[..., None], feats.to(h.dtype))


def unpad_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's images as the vision tower takes them, ``(patches, D)`` and ``(images, 3)`` in row order,
    from the per-row form a pipeline schedule cuts along dim 0: each row's patches padded to ``(B, P, D)`` and
    its grids to ``(B, K, 3)`` with zero rows (``ParallelModel._images(..., per_row=True)``). The joined form
    passes through.

    >>> pv = torch.arange(5.)[None, :, None].repeat(2, 1, 1); grids = torch.tensor([[[1, 2, 2]], [[0, 0, 0]]])
    >>> [t.flatten().tolist() for t in unpad_images(pv, grids)]
    [[0.0, 1.0, 2.0, 3.0], [1, 2, 2]]
    """
    if pixel_values.dim() == 2:
        return pixel_values, image_grid_thw
    patches = image_grid_thw.prod(-1).sum(-1)  # each row's
    keep = torch.arange(pixel_values.shape[1], device=pixel_values.device)[None] < patches[:, None]
    return pixel_values[keep], image_grid_thw[image_grid_thw.prod(-1) > 0]


def run_layer(layer: nn.Module, h, mask, pos, pe):
    """One HF decoder layer on hidden states ``h`` (explicit 4D ``mask``, position ids and rotary embeddings),
    its hidden states out, whatever the transformers version returns (a tensor or a tuple)."""
    out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return out[0] if isinstance(out, tuple) else out


def split_stages(hf_model: nn.Module, plan: ParallelPlan, pp_rank: int, *, head: str = "lm",
                 value_head: nn.Module | None = None, split: list[int] | None = None,
                 logprob_chunk: int = 1024) -> tuple[list[int], list[Stage]]:
    """This pipeline rank's (virtual) stages: ``(stage_ids, modules)``.

    Virtual stage ``s`` lives on pipeline rank ``s % pp`` (interleaved 1F1B's looping order), and
    holds the layers ``plan.stage_layers(num_layers, split)[s]`` (uneven splits allowed).

    >>> from rlkit.models import tiny_lm, load
    >>> ids, mods = split_stages(load(tiny_lm("qwen2"))[0], ParallelPlan(pp=2, vpp=2), pp_rank=1)
    >>> ids, [list(m.model.layers) for m in mods], mods[-1].last
    ([1, 3], [['1'], ['3']], True)
    """
    if head not in ("lm", "value"):
        raise PlanError(f"head={head!r} must be 'lm' (log-probs) or 'value' (critic)")
    n = plan.n_stages
    ranges = plan.stage_layers(hf_model.config.num_hidden_layers, split)
    ids = [s for s in range(n) if s % plan.pp == pp_rank]
    mods = [Stage(hf_model, ranges[s], first=s == 0, last=s == n - 1, head=head, value_head=value_head,
                  logprob_chunk=logprob_chunk) for s in ids]
    return ids, mods
