"""Resharding for the 3D-HybridEngine: training shards -> this rank's generation shard, and back.

The layout (which ranks generate together, which share a shard) is ``rlkit.plan.hybrid.GenerationLayout``.
Here it is carried out with real collectives, per parameter in HF order:

1. The ranks of the parameter's pipeline stage take their TP-local piece. With FSDP this is an
   all-gather inside their DP group: in buckets of weights with one exchange each where the piece is the
   whole tensor (``GATHER_BUCKET_BYTES``), else DTensor ``redistribute``; nothing without FSDP.
2. Inside each micro-DP group, the ``k = tp / t_g`` stage ranks whose training chunks make up the
   generation chunk broadcast them; every member writes them straight into its generation tensor.

Nothing is held twice. With ``k == 1`` a rank's own piece *is* its generation tensor (the training
storage, aliased). With ``k > 1`` the piece is copied into its slot, and the training storage is
released until ``release()`` copies it back after generation. Replicated tensors (norms) are aliased.

>>> gen = build_generation_groups(GenerationLayout(pm.plan, tp=2))   # on every rank  # doctest: +SKIP
>>> rs = Resharder(pm, gen)                                 # doctest: +SKIP
>>> shards, stats = rs.reshard()                            # doctest: +SKIP
>>> stats["bytes"], stats["peak_param_bytes"]               # doctest: +SKIP
>>> rs.release()                                            # doctest: +SKIP
"""

from __future__ import annotations

import fnmatch
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlkit.errors import PlanError
from rlkit.parallel.apply import DEFAULT_LAYER_PLAN
from rlkit.parallel.gather import dim0_shard, full_tensors, storage_bytes
from rlkit.parallel.groups import GenerationGroups
from rlkit.parallel.lora import ADAPTER, hf_name, is_lora, module_of, scaling

if TYPE_CHECKING:
    from rlkit.parallel.model import ParallelModel


def shard_dim(name: str, config: Any = None) -> int | None:
    """Which dim of HF weight ``name`` a TP layout splits (None: replicated), as ``apply_tp`` does:
    colwise -> dim 0 (weight and bias), rowwise -> dim 1 of the weight (bias replicated), embedding and
    lm_head -> dim 0 (vocab)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    plan = dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_LAYER_PLAN)
    module, _, kind = name.removeprefix("model.").rpartition(".")
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            if style == "colwise":
                return 0
            if style == "rowwise":
                return 1 if kind == "weight" else None
    return None


def tp_shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, config: Any = None) -> torch.Tensor:
    """This TP rank's slice of a full weight (``torch.chunk`` split, as DTensor's Shard does)."""
    dim = shard_dim(name, config)
    if dim is None or tp == 1:
        return full
    return full.chunk(tp, dim)[tp_rank].clone()


def _wanted_whole(p: torch.Tensor, dim: int | None) -> bool:
    """Whether ``p``'s generation piece is the whole tensor gathered from an FSDP dim-0 shard (no TP cut
    of it to keep): then it can come in a bucket with others (``rlkit.parallel.gather.full_tensors``)."""
    if dim0_shard(p) is None:
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return dim is None or all(n != "tp" or size == 1 for n, size in zip(names, p.device_mesh.shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Resharder:
    """Moves ``pm``'s weights into the generation layout of ``groups`` (``build_generation_groups``) and
    back; create it on every rank.

    ``reshard()`` returns this rank's generation shard (HF name -> local tensor, TP-sliced for
    ``layout.tp`` ranks; a tied lm_head is the embedding) and ``{"bytes"`` received, ``"seconds"``,
    ``"peak_param_bytes"}``: the most parameter storage (training and generation) alive at once,
    summed over distinct storages. ``release()`` drops the generation shard and gives the training
    storage back. Between the two, the training parameters must not be read.
    """

    def __init__(self, pm: ParallelModel, groups: GenerationGroups):
        layout = groups.layout
        if layout.plan != pm.plan:
            raise PlanError(f"the generation layout was made for {layout.plan.describe()} but the model "
                            f"trains under {pm.plan.describe()}")
        layout.validate(pm.config)
        self.pm, self.layout = pm, layout
        self.micro_group = groups.micro_dp
        self.members = layout.micro_dp_group(pm.rank)
        self.gen_tp = layout.coords(pm.rank)["gen_tp"]
        self._freed: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self.shards: dict[str, torch.Tensor] | None = None

    # ---- training side ---------------------------------------------------------------------------
    def _tp_local(self, p: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, int, bool]:
        """(this rank's TP-local piece of ``p``, bytes gathered for it, whether it *is* the training
        storage). Under FSDP the piece is all-gathered inside the DP group; otherwise it is aliased."""
        if not isinstance(p, DTensor):
            return p.detach(), 0, True
        names = p.device_mesh.mesh_dim_names or ()
        target = [(Shard(dim) if dim is not None else Replicate()) if n == "tp" else Replicate() for n in names]
        mine = p.to_local().detach()
        # a mesh dim of size 1 holds everything whatever its placement (DDP as HSDP with shard groups of
        # one): only the dims with peers decide whether data must move (no redistribute call, ~0.15 ms each)
        if all(have == want or size == 1
               for have, want, size in zip(p.placements, target, p.device_mesh.shape)):
            return mine, 0, True
        piece = p.redistribute(p.device_mesh, target).to_local().detach()
        if piece.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr():
            return mine, 0, True  # the mesh dims that differ have size 1 (DDP as HSDP): no data moved
        return piece, _nbytes(piece) - _nbytes(mine), False

    # ---- the resharding ----------------------------------------------------------------------------
    @torch.no_grad()
    def reshard(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        if self.shards is not None:
            raise RuntimeError("reshard() called twice without release(): the generation shard is still held")
        pm, lay = self.pm, self.layout
        t0 = time.perf_counter()
        k, tg = lay.k, lay.tp
        mine = dict(pm.named_parameters())
        shards: dict[str, torch.Tensor] = {}
        received = 0
        peak = held = storage_bytes(pm.params)
        group_size = len(self.members)
        metas = pm._param_meta()
        # LoRA: an adapter travels whole (it is small) and is merged into its layer's shard below
        dims = {name: None if is_lora(name) else shard_dim(hf_name(name), pm.config) for name, *_ in metas}
        # FSDP-sharded weights wanted whole are gathered in buckets (one exchange each), in this loop's order
        whole = [name for name, _, _, owner in metas if owner == pm.pp_rank and _wanted_whole(mine[name], dims[name])]
        gathered_whole = full_tensors([mine[name] for name in whole])
        whole = set(whole)
        for name, shape, dtype, owner in metas:
            dim = dims[name]
            gshape = list(shape)
            if dim is not None:  # torch.chunk's split, as DTensor's Shard (a vocab may not divide by t_g)
                c = -(-shape[dim] // tg)
                gshape[dim] = max(0, min(c, shape[dim] - self.gen_tp * c))
            own = alias = None
            extra = 0  # bytes this parameter adds beyond what is already held
            if owner == pm.pp_rank:
                if name in whole:
                    (own, gathered), alias = next(gathered_whole), False
                else:
                    own, gathered, alias = self._tp_local(mine[name], dim)
                received += gathered
                if not alias:
                    extra += _nbytes(own)
            srcs = [self.members[owner * k + i] for i in range(k)]
            if dim is None or k == 1:
                # one source holds the whole generation tensor: a replicated tensor, or k == 1
                src = srcs[0]
                out = own if own is not None else torch.empty(gshape, dtype=dtype, device=pm.device)
                if own is None:
                    extra += _nbytes(out)
                if group_size > 1:
                    buf = out if pm.rank == src or own is None else torch.empty_like(out)
                    dist.broadcast(buf, src=src, group=self.micro_group)
                    if pm.rank != src:
                        received += _nbytes(buf)
            else:
                out = torch.empty(gshape, dtype=dtype, device=pm.device)
                extra += _nbytes(out)
                # the k training chunks inside this generation chunk, as torch.chunk cut them
                c = -(-shape[dim] // pm.plan.tp)
                sizes = [max(0, min(c, shape[dim] - (self.gen_tp * k + i) * c)) for i in range(k)]
                for i, src in enumerate(srcs):
                    slot = out.narrow(dim, sum(sizes[:i]), sizes[i])
                    if pm.rank == src:
                        slot.copy_(own)
                        buf = slot if slot.is_contiguous() else own.contiguous()
                        if alias and buf is slot:  # the piece lives in its slot now: release it at once
                            peak = max(peak, held + extra)
                            self._release_training(own, slot)
                            extra -= self._freed[-1][1]
                            own = None
                    else:
                        buf = slot if slot.is_contiguous() else torch.empty(slot.shape, dtype=dtype, device=pm.device)
                    dist.broadcast(buf, src=src, group=self.micro_group)
                    if pm.rank != src:
                        received += _nbytes(buf)
                        if buf is not slot:
                            slot.copy_(buf)
                if own is not None and alias:
                    # the training piece now lives in the generation tensor: release it until release()
                    peak = max(peak, held + extra)
                    i = srcs.index(pm.rank)
                    self._release_training(own, out.narrow(dim, sum(sizes[:i]), sizes[i]))
                    extra -= self._freed[-1][1]
                elif own is not None:
                    extra -= _nbytes(own)  # a gathered FSDP piece, copied: dropped with this loop
            held += extra
            peak = max(peak, held)
            shards[name] = out
            del own
        if pm.lora is not None:
            shards = self._merge_adapters(shards)
        if getattr(pm.config, "tie_word_embeddings", False) and "lm_head.weight" not in shards:
            shards["lm_head.weight"] = shards["model.embed_tokens.weight"]
        self.shards = shards
        check = storage_bytes(list(pm.params) + list(shards.values()))
        stats = {"bytes": float(received), "seconds": time.perf_counter() - t0,
                 "peak_param_bytes": float(max(peak, check)), "param_bytes": float(check)}
        return shards, stats

    def _merge_adapters(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names, and each adapted layer's generation shard merged: ``W_shard + scaling * (B @ A)_shard``,
        a new tensor (the shard may be the training storage, which must stay the base)."""
        out: dict[str, torch.Tensor] = {}
        scale, tg = scaling(self.pm.lora), self.layout.tp
        for name, t in shards.items():
            if is_lora(name):
                continue
            if not name.endswith(".base_layer.weight"):
                out[hf_name(name)] = t
                continue
            mod = module_of(name)
            a, b = shards[f"{mod}.lora_A.{ADAPTER}.weight"], shards[f"{mod}.lora_B.{ADAPTER}.weight"]
            delta = (b.float() @ a.float()) * scale
            dim = shard_dim(f"{mod}.weight", self.pm.config)
            if dim is not None and tg > 1:  # this rank's rows (colwise) or columns (rowwise), as torch.chunk cut W
                c = -(-delta.shape[dim] // tg)
                delta = delta.narrow(dim, self.gen_tp * c, t.shape[dim])
            out[f"{mod}.weight"] = (t.float() + delta).to(t.dtype)
        return out

    def _release_training(self, own: torch.Tensor, slot: torch.Tensor) -> None:
        storage = own.untyped_storage()
        self._freed.append((own, storage.nbytes(), slot))
        storage.resize_(0)

    @torch.no_grad()
    def release(self) -> None:
        """Give the training storage back (copied out of the generation tensors) and drop those."""
        for own, nbytes, slot in self._freed:
            own.untyped_storage().resize_(nbytes)
            own.copy_(slot)
        self._freed = []
        self.shards = None

