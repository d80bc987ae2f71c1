"""``HFEngine``: rollouts with a transformers model -- no extra install, fine for small models and tests.

Each prompt is repeated ``n`` times and the rows are left-padded into one batch (or chunks of
``hf_batch_size`` prompts). Llama / Qwen2 / Mistral models (and Qwen2.5-VL's language model) decode with rlkit's lean loop
(``rlkit.rollout.decode``: the same tokens and log-probs as ``generate``, at about half the time per
step on small models); anything else, or ``Rollout(hf_decode="generate")``, runs ``model.generate``.
Log-probs come from the raw logits (``generate``'s ``output_logits``), divided by the temperature and
log-softmaxed: rlkit's convention, the number the actor recomputes.
(``output_scores`` would instead hold the scores after top-k/top-p masking, which are -inf for tokens
the actor's forward still gives a probability to.)

Sampling is rlkit's own (``_SeededSampling``: inverse transform with one generator per sample), so a sample's
tokens depend on its seed and the model only: splitting a call over batches, DP ranks or the generation
groups of ``Rollout(tp=...)`` samples the same responses.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from rlkit.rollout.base import RolloutEngine, left_pad, named_tensor_items
from rlkit.rollout.config import Rollout, RolloutError
from rlkit.rollout.decode import KV, decode, decode_continued, scaled, token_logprobs, unsupported
from rlkit.rollout.routing import RoutingRecorder


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(t) for t in x] if isinstance(x, (list, tuple)) else [int(x)]


def stop_string_end(tokens: list[int], tokenizer, stops: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of ``tokens`` whose text contains a stop string, or None.

    Only the response is searched (never prompt + response), the rule vLLM uses too."""
    if not stops or not any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stops):
        return None
    for t in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:t], skip_special_tokens=True)
        if any(s in text for s in stops):
            return t
    return None


class _StopOnStrings(StoppingCriteria):
    """Stops a row once its response text (not the prompt) contains a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prompt_width: int):
        self.tokenizer, self.stops, self.prompt_width = tokenizer, stops, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


def _last_nonzero(flags: torch.Tensor) -> torch.Tensor:
    """(rows, 1): the index of each row's last True in ``flags`` (rows, n) (0 where none is).

    >>> _last_nonzero(torch.tensor([[True, False, True, False], [False, False, False, False]])).tolist()
    [[2], [0]]
    """
    n = flags.shape[-1]
    return (n - 1 - flags.flip(-1).int().argmax(-1, keepdim=True)).masked_fill(~flags.any(-1, keepdim=True), 0)


class _SeededSampling(LogitsProcessor):
    """Samples each row from ``softmax(logits / T)`` (after top-k, then top-p, as HF's warpers do) by inverse
    transform: one uniform number per row and step, from the row's own generator, is located in the row's
    cumulative distribution (summed in float64). A row's draws depend on its seed and its own logits only,
    never on its batch.

    One uniform per draw, where Gumbel-max needs one per vocabulary entry: on a 49k vocabulary that was a
    quarter of a decode step. ``pick(logits)`` returns the drawn tokens (the lean decode loop); as a
    ``LogitsProcessor`` it hands ``generate`` scores that are 0 at the drawn token and -inf elsewhere, whose
    argmax is the draw. Each row's uniforms are drawn ``max_new_tokens`` at a time (``torch.rand(steps)``
    continues the stream exactly as ``steps`` calls of ``torch.rand(1)`` would), so step t of a call always
    uses the same number.

    >>> s = _SeededSampling([1, 2], Rollout(max_new_tokens=3, top_k=2))
    >>> picks = [s.pick(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])) for _ in range(3)]
    >>> all(p[0] > 0 and p[1] < 2 for p in picks)  # top_k=2 never draws a row's least likely token
    True
    """

    BLOCK = 256  # tokens per block of the two-level search (``pick``)

    def __init__(self, seeds: list[int], cfg: Rollout):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_k, self.top_p = cfg.temperature, max(cfg.top_k, 0), cfg.top_p
        self.block, self.step = max(1, cfg.max_new_tokens), 0
        self.uniforms = torch.empty(0, len(seeds), dtype=torch.float64)  # (steps drawn, rows)

    def _uniform(self) -> torch.Tensor:
        """This step's uniform numbers (rows,) float64 in [0, 1)."""
        if self.step >= self.uniforms.shape[0]:  # the next block of every row's stream
            more = torch.stack([torch.rand(self.block, generator=g, dtype=torch.float64) for g in self.gens], 1)
            self.uniforms = torch.cat([self.uniforms, more])
        self.step += 1
        return self.uniforms[self.step - 1]

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (rows, V) float32: ``softmax(logits / T)`` with top-k / top-p's dropped
        tokens at 0."""
        x = scaled(logits, self.temperature)
        if 0 < self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:  # drop the least likely tokens whose total mass is <= 1 - top_p (keep one)
            sorted_x, order = torch.sort(x, dim=-1)
            drop = sorted_x.softmax(-1).cumsum(-1) <= 1 - self.top_p
            drop[:, -1] = False
            x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return x.softmax(-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """This step's tokens (rows,) for raw ``logits`` (rows, V): the first token whose cumulative mass
        passes the row's uniform, so a dropped token (no mass) is never drawn.

        The search runs in two levels: the cumulative mass of blocks of ``BLOCK`` tokens finds the block, then
        the cumulative mass inside that one block (float64) finds the token, the uniform rescaled onto the
        block's own total. One float64 cumulative sum over a 49k vocabulary (a float64 copy and a sequential
        scan of every entry) was a tenth of a decode step at 32 rows. The block sums are float32: a block's
        chance is off by their rounding (~1e-7 of its mass), the tokens inside it keep exact proportions.
        """
        probs = self.probs(logits)
        rows, V = probs.shape
        blk = self.BLOCK
        if V <= 16 * blk:  # a small vocabulary: one cumulative sum costs less than the two levels' extra calls
            cdf = probs.cumsum(-1, dtype=torch.float64)
            u = self._uniform().to(cdf.device)[:, None] * cdf[:, -1:]  # the total is 1 up to float32 rounding
            return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=V - 1)
        p = (F.pad(probs, (0, -V % blk)) if V % blk else probs).view(rows, -1, blk)  # the padding has no mass
        mass = p.sum(-1).double()  # (rows, blocks)
        outer = mass.cumsum(-1)
        u = self._uniform().to(outer.device)[:, None] * outer[:, -1:]
        b = torch.minimum(torch.searchsorted(outer, u, right=True), _last_nonzero(mass > 0))  # (rows, 1): the block
        inside = p.gather(1, b[:, :, None].expand(-1, 1, blk))[:, 0].cumsum(-1, dtype=torch.float64)  # (rows, BLOCK)
        m = mass.gather(1, b)
        at = (u - (outer.gather(1, b) - m)) / m * inside[:, -1:]  # u's share of the block, on its own cumulative sum
        has_mass = inside.diff(dim=-1, prepend=torch.zeros_like(at)) > 0
        i = torch.minimum(torch.searchsorted(inside, at, right=True), _last_nonzero(has_mass))
        return (b * blk + i)[:, 0]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        drawn = self.pick(scores)  # generate (greedy) takes the argmax: the draw
        return torch.full_like(scores, float("-inf")).scatter_(1, drawn[:, None], 0.0)


class _Scripted(LogitsProcessor):
    """``Rollout.script`` in the decode loop: rows with a scripted response take its tokens, one a step, then
    draw as ``base`` draws (``_SeededSampling``, or the argmax with ``None``). Log-probs are untouched: they
    come from the raw logits of whichever token was taken."""

    def __init__(self, forced: list[list[int]], base: _SeededSampling | None):
        width = max(map(len, forced), default=0)
        self.forced = torch.full((len(forced), width), -1, dtype=torch.long)
        for i, f in enumerate(forced):
            self.forced[i, :len(f)] = torch.tensor(f, dtype=torch.long)
        self.base, self.step = base, 0

    def _now(self, device: torch.device) -> torch.Tensor:
        t, self.step = self.step, self.step + 1
        return self.forced[:, t].to(device) if t < self.forced.shape[1] else None

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        drawn = self.base.pick(logits) if self.base is not None else logits.argmax(-1)
        now = self._now(logits.device)
        return drawn if now is None else torch.where(now >= 0, now, drawn)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        x = self.base(input_ids, scores) if self.base is not None else scores
        now = self._now(scores.device)
        if now is not None and bool((now >= 0).any()):
            rows = (now >= 0).nonzero()[:, 0]
            x = x.clone()
            x[rows] = float("-inf")
            x[rows, now[rows]] = 0.0
        return x


def scripted_tokens(script: tuple[tuple[str, str], ...], tokenizer, contexts: list[list[int]]) -> list[list[int]]:
    """The scripted response's tokens for each context (``[]`` where no rule applies; see ``check_script``)."""
    import re

    rules = [re.compile(f"(?:{pattern})\\Z", re.S) for pattern, _ in script]
    out = []
    for ids in contexts:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        hit = next(((m, response) for rule, (_, response) in zip(rules, script) if (m := rule.search(text))), None)
        out.append(tokenizer.encode(hit[0].expand(hit[1]), add_special_tokens=False) if hit else [])
    return out


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Run ``model`` in eval mode and give every module back the train/eval flag it had (a model that
    trains elsewhere keeps training after a rollout).

    >>> m = torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Dropout()).train()
    >>> _ = m[1].eval()
    >>> with eval_mode(m):
    ...     [x.training for x in m.modules()]
    [False, False, False]
    >>> [x.training for x in m.modules()]
    [True, True, False]
    """
    training = [m for m in model.modules() if m.training]
    model.eval()
    try:
        yield model
    finally:
        for m in training:
            m.training = True


class KVStore:
    """Running samples' keys and values between calls (``HFEngine.continue_ids``: streaming's chunks, a
    multi-turn episode's turns), by sample key, each with the tokens it covers and tagged with the weights it
    was computed under (``gen``, counted by ``new_weights``).

    ``take`` hands an entry out (and forgets it) when its tokens begin the asked ones and, unless
    ``keep_on_load``, it comes from the current weights; ``put`` keeps one, dropping the oldest entries past
    ``limit_bytes``.

    >>> store = KVStore(limit_bytes=10_000)
    >>> kv = [(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))]        # one layer, 3 tokens: 192 bytes
    >>> store.put("a", kv, [5, 6, 7]); store.take("a", [5, 6, 7, 8]) is kv, store.take("a", [5, 6, 7])
    (True, None)
    >>> store.put("a", kv, [5, 6, 7]); store.take("a", [5, 6, 9, 8])  # other tokens: not these keys
    >>> store.put("a", kv, [5, 6, 7]); store.new_weights(); store.take("a", [5, 6, 7])  # older weights
    >>> store.keep_on_load = True; store.put("a", kv, [5, 6, 7]); store.new_weights(); store.take("a", [5, 6, 7]) is kv
    True
    >>> store.reused, store.stale_reused
    (6, 3)
    """

    def __init__(self, limit_bytes: int = 2**30):
        self.limit_bytes = limit_bytes
        self.entries: dict[Any, tuple[int, KV, list[int], int]] = {}  # key -> (gen, keys and values, tokens, bytes)
        self.gen = 0                # weight loads so far
        self.keep_on_load = False   # new weights keep the entries (stale keys and values allowed)
        self.nbytes = 0
        self.reused = 0             # prefix tokens handed out (not prefilled again), over the store's life
        self.stale_reused = 0       # of those, computed under older weights

    def take(self, key: Any, tokens: list[int] | None) -> KV | None:
        """The entry of ``key`` if its tokens are the first of ``tokens`` (``None``: only forget it)."""
        gen, kv, covered, nbytes = self.entries.pop(key, (None, None, [], 0))
        self.nbytes -= nbytes
        if kv is None or tokens is None or tokens[:len(covered)] != covered or \
                (gen != self.gen and not self.keep_on_load):
            return None
        self.reused += len(covered)
        self.stale_reused += len(covered) if gen != self.gen else 0
        return kv

    def put(self, key: Any, kv: KV, tokens: list[int]) -> None:
        """Keep ``kv``, the keys and values of ``tokens``, under ``key``."""
        self.take(key, None)  # an older entry of this key
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        self.entries[key] = (self.gen, kv, list(tokens), nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.limit_bytes and len(self.entries) > 1:
            self.take(next(iter(self.entries)), None)

    def new_weights(self) -> None:
        self.gen += 1
        if not self.keep_on_load:
            self.entries.clear()
            self.nbytes = 0


class HFEngine(RolloutEngine):
    """Rollouts with ``model.generate``; takes a loaded model or a path.

    >>> from rlkit.models import tiny_lm
    >>> eng = HFEngine(tiny_lm("qwen2", size="test"), n=2, max_new_tokens=8, seed=0)
    >>> b = eng.generate(["12+7=", "3*4="])
    >>> b.response_ids.shape[0], b.prompt_index.tolist()
    (4, [0, 0, 1, 1])
    """

    name = "hf"

    def __init__(self, model_or_path, tokenizer=None, config: Rollout | None = None, **options):
        config = config or Rollout(engine="hf")
        if options:
            import dataclasses
            config = dataclasses.replace(config, **options)
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

            from rlkit.models.vision import is_vision_language
            from rlkit.rollout.base import load_tokenizer

            path = self.path = str(model_or_path)
            dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
            vl = is_vision_language(AutoConfig.from_pretrained(path))
            model = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_pretrained(path, dtype=dtype)
            if torch.cuda.is_available():
                model = model.to("cuda")
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        else:
            model, self.path = model_or_path, None
        self.model = model  # generate() runs it in eval mode and restores its mode afterwards
        # a vision-language model: the token its images fill (and weights arrive under the checkpoint's names)
        self.image_token_id = getattr(model.config, "image_token_id", None)
        self.last_decode = ""  # "lean" or "generate (why)": which loop the last chunk ran
        self.kv = KVStore()  # streaming (continue_ids): running samples' keys and values between chunks
        self.device = next(model.parameters()).device
        gen = model.generation_config
        self.eos_ids = _as_list(gen.eos_token_id) or _as_list(getattr(tokenizer, "eos_token_id", None))
        pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        super().__init__(config, tokenizer, getattr(model.config, "max_position_embeddings", None), int(pad))
        if config.stop and tokenizer is None:
            raise RolloutError(f"stop={list(config.stop)} needs a tokenizer; pass tokenizer= to HFEngine")

    def _generation_config(self, cfg: Rollout) -> GenerationConfig:
        # [] (not None) for "no end token": generate fills None from the model's generation_config.
        # Always "greedy" for generate: sampling is _SeededSampling's, which picks the token it draws.
        ends = ([] if cfg.ignore_eos else self.eos_ids) + list(cfg.stop_token_ids)
        return GenerationConfig(do_sample=False, max_new_tokens=cfg.max_new_tokens, eos_token_id=ends,
                                pad_token_id=self.pad_token_id, output_logits=True, return_dict_in_generate=True,
                                temperature=None, top_k=None, top_p=None)

    @torch.no_grad()
    def generate_ids(self, prompts, cfg, seeds, images=None):
        if images is not None and self.image_token_id is None:
            raise RolloutError(f"prompts with images were given to {type(self.model).__name__}, a text-only model; "
                               f"use a vision-language model (e.g. rlkit.models.tiny_lm('qwen2_5_vl'))")
        with eval_mode(self.model):
            return self._generate_chunks(prompts, cfg, seeds, images=images)

    def continue_ids(self, prefixes, cfg, seeds, keys, room=None, stale_kv=False, keep_ended=False):
        """``generate_ids`` of one sample per prefix that keeps each sample's keys and values (``self.kv``) under
        ``keys[i]`` between calls (the lean loop only): a prefix that begins with the tokens its key's last call
        covered (that call's prefix and new tokens) prefills only the rest. A sample that stops (unless
        ``keep_ended``: a multi-turn episode's turn, continued after the tool's reply), or whose new tokens
        reach ``room[i]`` (what it may still take), is dropped from the store. The store empties when weights
        load, unless this call had ``stale_kv=True``: then a sample goes on over keys and values of older
        weights (PipelineRL's in-flight updates); its tokens' log-probs are still the ones this engine sampled
        them with."""
        if cfg.n != 1:
            raise RolloutError(f"continue_ids samples one continuation per prefix (n=1), got n={cfg.n}")
        self.kv.keep_on_load = stale_kv
        self._reused = [0] * len(prefixes)
        with eval_mode(self.model):
            return (*self._generate_chunks(prefixes, cfg, seeds, keys, room, keep_ended), self._reused)

    def forget(self, keys: Iterable[Any]) -> None:
        """Drop the kept keys and values of ``keys`` (samples that will not be continued)."""
        for key in keys:
            self.kv.take(key, None)

    def _generate_chunks(self, prompts, cfg, seeds, keys=None, room=None, keep_ended=False, images=None):
        temp = cfg.temperature if cfg.temperature > 0 else 1.0
        ends = set(([] if cfg.ignore_eos else self.eos_ids) + list(cfg.stop_token_ids))
        # each prompt repeated n times, adjacent (what num_return_sequences does, but greedy allows it too)
        rows = [p for p in prompts for _ in range(cfg.n)]
        row_images = None if images is None else [p for p in images for _ in range(cfg.n)]
        chunk = (cfg.hf_batch_size or len(prompts)) * cfg.n
        responses, logprobs, reasons = [], [], []
        devices = [self.device] if self.device.type == "cuda" else []
        # sample j of prompt i draws from its own stream: the same tokens however prompts are batched
        row_seeds = [(seed * 1_000_003 + j) % 2**63 for seed in seeds for j in range(cfg.n)]
        forced = [f for f in scripted_tokens(cfg.script, self.tokenizer, prompts) for _ in range(cfg.n)] \
            if cfg.script else None
        self.last_routing = [] if cfg.record_routing else None
        if cfg.record_routing and keys is not None:
            raise RolloutError("record_routing=True with continued samples (streaming) is not supported yet: a "
                               "sample's routing would span several calls; use record_routing=False with streaming")
        with torch.random.fork_rng(devices=devices):  # nothing here moves the caller's RNG
            for start in range(0, len(rows), chunk):
                ids, mask = left_pad(rows[start:start + chunk], self.pad_token_id)
                sampler = _SeededSampling(row_seeds[start:start + chunk], cfg) if cfg.temperature > 0 else None
                if forced is not None:
                    sampler = _Scripted(forced[start:start + chunk], sampler)
                kv = None
                # continued samples: the lean loop's kept keys and values, for text models
                if keys is None or self._lean(ids, cfg) is not None or self.image_token_id is not None:
                    new, lp, routing = self._decode(ids, mask, cfg, sampler, temp,
                                                    None if row_images is None else row_images[start:start + chunk])
                else:
                    past = [self.kv.take(key, p[:-1]) for p, key in zip(rows[start:start + chunk],
                                                                         keys[start:start + chunk])]
                    self._reused[start:start + chunk] = [0 if kv is None else kv[0][0].shape[1] for kv in past]
                    self.last_decode = "lean"
                    new, lp, kv = decode_continued(self.model, rows[start:start + chunk], past, cfg.max_new_tokens,
                                                   *self._lean_ends(cfg, sampler), temp)
                for r, (row, row_lp) in enumerate(zip(new.tolist(), lp.tolist())):
                    end, reason = len(row), "length"
                    hit = next((t + 1 for t, tok in enumerate(row) if tok in ends), None)
                    if hit is not None:
                        end, reason = hit, "stop"
                    s_end = stop_string_end(row[:end], self.tokenizer, cfg.stop) if cfg.stop else None
                    if s_end is not None:
                        end, reason = s_end, "stop"
                    responses.append(row[:end])
                    logprobs.append(row_lp[:end])
                    reasons.append(reason)
                    if cfg.record_routing:  # the prompt's and the kept tokens' choices (the last token's: none)
                        self.last_routing.append(routing[r][:len(rows[start + r]) + end])
                    if kv is not None and (reason == "length" or keep_ended) and \
                            (room is None or end < room[start + r]):  # it goes on next call: keep what it fed
                        fed = rows[start + r] + row[:end - 1]
                        self.kv.put(keys[start + r], [(k[:, :len(fed)], v[:, :len(fed)]) for k, v in kv[r]], fed)
        return responses, logprobs, reasons

    def _lean(self, ids: torch.Tensor, cfg: Rollout) -> str | None:
        """Why the lean loop cannot run this chunk (None: it can)."""
        if cfg.hf_decode == "generate":
            return "hf_decode='generate'"
        if cfg.record_routing:
            return "record_routing=True"
        return unsupported(self.model, ids.shape[1] + cfg.max_new_tokens)

    def _lean_ends(self, cfg: Rollout, sampler: _SeededSampling | _Scripted | None) -> tuple:
        """The lean loop's ``pick, end_ids, pad_id, stop`` for ``cfg``."""
        stop = None
        if cfg.stop:
            by_text = _StopOnStrings(self.tokenizer, cfg.stop, 0)
            stop = lambda new: by_text(new, None)  # noqa: E731
        ends = ([] if cfg.ignore_eos else self.eos_ids) + list(cfg.stop_token_ids)
        return sampler.pick if sampler is not None else lambda x: x.argmax(-1), ends, self.pad_token_id, stop

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, cfg: Rollout,
                sampler: _SeededSampling | _Scripted | None, temp: float, images: list | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
        """New tokens (rows, T), their log-probs at ``temp`` and (``record_routing``) each row's recorded routing
        for one left-padded chunk: the lean loop
        when it can stand in for ``generate`` on this model (``decode.unsupported``), else ``generate``.
        ``images``: each row's ``ImagePrompt`` or None (a vision-language model's ``generate`` takes them)."""
        why = self._lean(ids, cfg)
        self.last_decode = "lean" if why is None else f"generate ({why})"
        if why is None:
            return (*decode(self.model, ids, mask, cfg.max_new_tokens, *self._lean_ends(cfg, sampler), temp,
                            images=images), None)
        stopping = StoppingCriteriaList([_StopOnStrings(self.tokenizer, cfg.stop, ids.shape[1])] if cfg.stop else [])
        recorder = RoutingRecorder(self.model) if cfg.record_routing else contextlib.nullcontext()
        with recorder:
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=self._generation_config(cfg), stopping_criteria=stopping,
                                      logits_processor=LogitsProcessorList([sampler] if sampler is not None else []),
                                      **self._image_inputs(ids, images))
        new = out.sequences[:, ids.shape[1]:]
        # with record_routing, every new token's choices per row (_generate_chunks keeps each row's up to its end)
        routing = recorder.per_row(mask, [new.shape[1]] * new.shape[0]) if cfg.record_routing else None
        # log-prob of each sampled token under softmax(raw logits / T), one step at a time so the
        # (rows, vocab) float32 copy exists once, not per step
        return new, torch.stack([token_logprobs(step, new[:, t], temp) for t, step in enumerate(out.logits)], 1), routing

    def _image_inputs(self, ids: torch.Tensor, images: list | None) -> dict[str, torch.Tensor]:
        """A vision-language model's ``generate`` keywords for a chunk: the rows' images joined in row order and
        which tokens are image tokens (its multimodal positions count from them)."""
        if self.image_token_id is None:
            return {}
        # positions come from this call's tokens: the last call's offsets (kept on the model) must not carry over
        self.model.model.rope_deltas = None
        kw = {"mm_token_type_ids": (ids == self.image_token_id).int().to(self.device)}
        given = [p for p in images or [] if p is not None]
        if given:
            kw["pixel_values"] = torch.cat([p.pixel_values for p in given]).to(self.device)
            kw["image_grid_thw"] = torch.cat([p.image_grid_thw for p in given]).to(self.device)
        return kw

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy tensors (HF names, e.g. ``model.layers.0.mlp.up_proj.weight``) into the model in place.

        >>> from rlkit.models import tiny_lm, load
        >>> model, tok = load(tiny_lm("qwen2", size="test"))
        >>> eng = HFEngine(model, tok)
        >>> eng.load_weights(model.state_dict())["tensors"] == len(model.state_dict())
        True
        """
        t0 = time.perf_counter()
        self.kv.new_weights()
        state = self.model.state_dict()
        nbytes, count = 0, 0
        for name, t in named_tensor_items(named_tensors):
            if name not in state and self.image_token_id is not None:  # a checkpoint name (rlkit's trainer's)
                from rlkit.models.vision import module_name

                name = module_name(name)
            if name not in state:
                raise RolloutError(f"load_weights got {name!r}, which this model does not have; expected HF "
                                   f"checkpoint names such as {list(state)[:3]}")
            if state[name].shape != t.shape:
                raise RolloutError(f"load_weights: {name!r} has shape {tuple(t.shape)} but the model's is "
                                   f"{tuple(state[name].shape)}; send full (gathered) tensors")
            state[name].copy_(t)  # state_dict tensors share storage with the parameters
            nbytes += t.numel() * t.element_size()
            count += 1
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0, "tensors": count}

    def _base_weight(self, name: str) -> torch.Tensor:
        if self.path is not None:
            return super()._base_weight(name)
        # built from a module: no checkpoint to re-read, so the first sync keeps a copy of each adapted layer
        base = self.__dict__.setdefault("_lora_base", {})
        if name not in base:
            base[name] = self.model.state_dict()[name].detach().clone()
        return base[name]

    def sleep(self) -> None:
        if self.device.type == "cuda":  # park weights on the host while the trainer uses the GPU
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def close(self) -> None:
        self.model = None
        gc.collect()
