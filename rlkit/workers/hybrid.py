"""Rollout in the generation layout on every training rank (the 3D-HybridEngine, ``Rollout(tp=t_g)``).

Each DP replica's ``tp*pp`` ranks form ``tp*pp / t_g`` generation groups (``rlkit.plan.hybrid``); their
process groups come from ``rlkit.parallel.groups.build_generation_groups``. On every rank:

``reshard()`` (the worker's ``sync_weights``):

1. the actor's training shards -> this rank's generation shard (``rlkit.parallel.relayout``);
2. the shard goes into the engine: an HF model whose layers are DTensor-TP over the ``t_g`` ranks of the
   group (plain tensors for ``t_g = 1``), or a vLLM engine (``t_g = 1``);

``generate()``:

3. the group generates its contiguous slice of the replica's prompts, all its ranks in lockstep
   (same prompts, same per-prompt seeds, so the same samples: the ones one engine would draw);
4. ``release()``: the engine's weights are dropped and the training storage given back, before training
   resumes;
5. the replica's results are gathered in group order (= prompt order) on the rank ``call_dp`` reads.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from rlkit.batch import Batch
from rlkit.errors import PlanError
from rlkit.parallel import ParallelModel
from rlkit.parallel.apply import apply_tp
from rlkit.parallel.groups import GenerationGroups
from rlkit.parallel.relayout import Resharder
from rlkit.rollout import Rollout, engine_name, make_engine
from rlkit.workers.layout import SequenceLayout, generate_batch


class HybridRollout:
    """The rollout side of one rank under ``Rollout(tp=t_g)``; see the module docstring.

    >>> gen = build_generation_groups(GenerationLayout(plan, tp=2))               # doctest: +SKIP
    >>> hr = HybridRollout(model_path, actor, gen, rollout)                      # doctest: +SKIP
    >>> hr.reshard()                                # every rank: bytes received  # doctest: +SKIP
    >>> hr.generate(chunk, seed, layout)  # every rank; the batch on the replica's collector rank  # doctest: +SKIP
    """

    def __init__(self, model_path: str, actor: ParallelModel, groups: GenerationGroups, rollout: Rollout):
        self.actor, self.gen_layout, self.rollout = actor, groups.layout, rollout
        self.rank = actor.rank
        self.resharder = Resharder(actor, groups)
        c = self.gen_layout.coords(self.rank)
        self.group_index, self.gen_tp = c["group"], c["gen_tp"]
        plan = self.gen_layout.plan
        self.collector = plan.rank(dp=c["dp"], tp=0, pp=plan.pp - 1)
        # the replica's ranks (all tp x pp of one dp index): results are gathered inside it
        self.replica_group, self.replica_ranks = groups.replica, groups.replica_ranks
        if engine_name(rollout, model_path) == "vllm":
            self.engine = make_engine(rollout, model_path)  # holds its own copy; loaded after each reshard
            self.shell = None
        else:
            from rlkit.rollout.base import load_tokenizer
            from rlkit.rollout.hf import HFEngine

            self.shell, self.slots = _engine_shell(model_path, actor, self.gen_layout.tp, groups.tp_mesh)
            self.engine = HFEngine(self.shell, load_tokenizer(model_path), rollout)
            self.engine.device = actor.device
        self.held = False  # the generation shard is in the engine (between reshard and release)
        self.prompts_generated = 0  # prompts this rank's generation group sampled, over all calls

    @torch.no_grad()
    def reshard(self) -> dict[str, float]:
        """The actor's weights into the generation layout and the engine, held until ``release``: bytes
        received, seconds (resharding and loading), parameter bytes held and their peak."""
        self.release()
        shards, stats = self.resharder.reshard()
        self.held = True
        t0 = time.perf_counter()
        if self.shell is not None:
            _install(self.slots, shards)
        else:  # vLLM keeps a copy of its own; it sleeps between rollouts where it can (GPU)
            self.engine.wake_up()
            self.engine.load_weights(shards.items())
        return {"bytes": stats["bytes"], "seconds": stats["seconds"] + time.perf_counter() - t0,
                "param_bytes": stats["param_bytes"], "peak_param_bytes": stats["peak_param_bytes"]}

    @torch.no_grad()
    def generate(self, prompts: dict[str, Any], seed: int, layout: SequenceLayout, agent: Any = None,
                 **overrides: Any) -> Batch | None:
        """Generate this group's slice of ``prompts`` (the replica's request) with the weights ``reshard``
        put in place (called without one, it reshards first), release them, gather the replica's
        samples on its collector rank (None elsewhere)."""
        if not self.held:
            self.reshard()
        try:
            sl = self.gen_layout.prompt_slices(len(prompts["prompt"]))[self.group_index]
            part = None
            if sl.stop > sl.start:
                sub = {k: list(prompts[k])[sl] for k in ("prompt", "uid", "row", "env_row") if k in prompts}
                self.prompts_generated += sl.stop - sl.start
                # each prompt seeded by its place in the step (its uid): the samples are the ones a single
                # engine for the whole call would draw
                part = generate_batch(self.engine, layout, sub, seed, agent=agent, **overrides)
        finally:
            self.release()
        if len(self.replica_ranks) == 1:  # one rank: nothing to gather (gather_object pickles the batch, 1-2 ms)
            parts = [part] if part is not None else []
        else:  # one copy per generation group (its gen_tp == 0 rank) goes to the collector, in group order
            mine = (self.group_index, part) if self.gen_tp == 0 else None
            box: list[Any] = [None] * len(self.replica_ranks) if self.rank == self.collector else None
            dist.gather_object(mine, box, dst=self.collector, group=self.replica_group)
            if self.rank != self.collector:
                return None
            parts = [p for _, p in sorted(x for x in box if x is not None) if p is not None]
        return Batch.cat(parts).replace(timing=max(p.timing for p in parts))

    def release(self) -> None:
        """Drop the generation shard and give the actor its training storage back (a no-op if not held)."""
        if not self.held:
            return
        if self.shell is not None:
            _uninstall(self.slots)
        else:
            self.engine.sleep()
        self.resharder.release()
        self.held = False

    def close(self) -> None:
        self.release()
        if self.shell is None:
            self.engine.close()
        self.engine = self.shell = None


def _engine_shell(model_path: str, actor: ParallelModel, tg: int, tp_mesh: Any) -> tuple[nn.Module, list]:
    """The HF model the engine runs, built on meta and laid out for ``tg``-way TP; its parameters are
    slots that ``_install`` fills with the generation shard (and ``_uninstall`` empties)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    from rlkit.models.vision import checkpoint_name, is_vision_language

    config = AutoConfig.from_pretrained(str(model_path))
    vl = is_vision_language(config)
    if vl and tg > 1:
        raise PlanError(f"Rollout(tp={tg}) for a vision-language model is not supported yet; use Rollout(tp=1)")
    dtype = next(iter(actor.params)).dtype
    with torch.device("meta"):
        shell = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_config(config, dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        shell.lm_head.weight = shell.get_input_embeddings().weight
    if tg > 1:
        apply_tp(shell, tp_mesh, config)
    # rotary modules (the language model's, a vision tower's) hold computed buffers: built for real
    for name, rotary in [(n, m) for n, m in shell.named_modules() if hasattr(m, "inv_freq")]:
        parent, _, attr = name.rpartition(".")
        with torch.device(actor.device):
            setattr(shell.get_submodule(parent), attr, type(rotary)(config=getattr(rotary, "config", config)))
    try:
        shell.generation_config = GenerationConfig.from_pretrained(str(model_path))
    except OSError:
        shell.generation_config = GenerationConfig.from_model_config(config)
    shell.config.use_cache = True
    slots = []  # (module, attribute, HF name, meta parameter), each tensor once (a tied lm_head follows)
    seen: dict[int, str] = {}
    for mod_name, mod in shell.named_modules():
        for attr, p in list(mod.named_parameters(recurse=False)):
            name = f"{mod_name}.{attr}" if mod_name else attr
            name = checkpoint_name(name) if vl else name  # the actor's names are the checkpoint's
            slots.append((mod, attr, seen.get(id(p), name), p))
            seen.setdefault(id(p), name)
    return shell.eval(), slots


def _install(slots: list, shards: dict[str, torch.Tensor]) -> None:
    for mod, attr, name, meta in slots:
        t = shards[name]
        if isinstance(meta, DTensor):
            t = DTensor.from_local(t, meta.device_mesh, meta.placements, run_check=False,
                                   shape=meta.shape, stride=meta.stride())
        setattr(mod, attr, nn.Parameter(t, requires_grad=False))


def _uninstall(slots: list) -> None:
    for mod, attr, _name, meta in slots:
        setattr(mod, attr, meta)
