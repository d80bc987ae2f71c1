"""ParallelPlan: the one object that owns the DP x TP x PP layout.

Pure Python: ranks <-> coordinates, process groups, pipeline layer split, placement on nodes,
and validation. Rank order is Megatron's by default (tp fastest, then dp, then pp), which is the
same row-major order as a ``torch.distributed.DeviceMesh`` of shape ``(pp, dp, tp)``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlkit import display
from rlkit.errors import PlanError

if TYPE_CHECKING:
    import pandas as pd

DIMS = ("dp", "tp", "pp")

# How the data-parallel dimension holds model state (ZeRO stages in DeepSpeed's words).
SHARDING = {
    "replicate": "DDP / ZeRO-0: every DP rank holds full weights, grads and optimizer state",
    "shard_grad_op": "ZeRO-2: grads and optimizer state sharded over DP, weights replicated",
    "full_shard": "FSDP / ZeRO-3: weights, grads and optimizer state sharded over DP",
    "hybrid_shard": "HSDP: full shard inside groups of dp_shard_size ranks, replicated across groups",
}
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: the degrees a dimension of size ``n`` can split into.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def short_list(xs: list[int], keep: int = 8) -> str:
    """A list of ranks, elided in the middle when longer than ``keep``, so tooltips stay a few lines.

    >>> short_list([0, 1, 2]), short_list(list(range(0, 512, 32)))
    ('[0, 1, 2]', '[0, 32, 64, 96, 128, 160, …, 448, 480]')
    """
    if len(xs) <= keep:
        return str(xs)
    return "[" + ", ".join(map(str, xs[: keep - 2])) + ", …, " + ", ".join(map(str, xs[-2:])) + "]"


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fix = {"dp": "use dp=1 for no data parallelism", "tp": "use tp=1 for no tensor parallelism",
               "pp": "use pp=1 for no pipeline parallelism", "vpp": "use vpp=1 for one stage per pipeline rank",
               "micro_batches": "e.g. micro_batches=pp (None: pp)",
               "devices_per_node": "e.g. devices_per_node=8 (None: all ranks on one node)",
               "dp_shard_size": "a divisor of dp (None: all of dp)",
               "ep": "use ep=1 for no expert parallelism"}.get(name, f"e.g. {name}=1")
        raise PlanError(f"{name}={value!r} must be a positive integer; {fix}")


@dataclass(frozen=True)
class ParallelPlan:
    """A DP x TP x PP layout of ``world_size = dp * tp * pp`` ranks.

    Args:
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees.
        vpp: virtual pipeline stages per pipeline rank (interleaved 1F1B); needs pp > 1.
        order: rank order, fastest-varying dim first ("tp-dp-pp" is Megatron's).
        dp_shard: how DP holds model state: one of ``SHARDING`` ("full_shard" by default).
        dp_shard_size: with "hybrid_shard", the size of each sharding group (divides dp).
        micro_batches: micro-batches per step through the pipeline (default: pp).
        schedule: pipeline schedule, "gpipe" | "1f1b" | "interleaved-1f1b" (default: 1f1b, or
            interleaved-1f1b when vpp > 1).
        devices_per_node: devices on each node for placement (default: all ranks on one node).
        ep: expert parallelism (mixture-of-experts models): each group of ``ep`` consecutive DP ranks shares
            one copy of the experts, ``num_experts / ep`` on each, and tokens travel to their experts by
            all-to-all. Cut out of ``dp`` (Megatron's and TorchTitan's layout), so it divides ``dp`` and
            leaves the world size alone; the experts are data-parallel (replicated) over the other
            ``dp / ep`` ranks (``expert_dp``), while the rest of the model is sharded over all ``dp``.

    >>> plan = ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8)
    >>> plan.world_size, len(plan.groups("tp")), len(plan.groups("pp")), len(plan.groups("dp"))
    (512, 64, 32, 128)
    >>> plan.coords(9)
    {'dp': 1, 'tp': 1, 'pp': 0}
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    order: str = "tp-dp-pp"
    dp_shard: str = "full_shard"
    dp_shard_size: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    devices_per_node: int | None = None
    ep: int = 1
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp"):
            _check_degree(name, getattr(self, name))
        parts = tuple(p.strip() for p in str(self.order).split("-"))
        if sorted(parts) != sorted(DIMS):
            raise PlanError(f"order={self.order!r} must name each of dp, tp, pp once, fastest first, "
                            f"e.g. order='tp-dp-pp' (Megatron) or order='tp-pp-dp'")
        object.__setattr__(self, "_order", parts)
        if self.dp_shard not in SHARDING:
            raise PlanError(f"dp_shard={self.dp_shard!r} is not a sharding mode; choose one of "
                            f"{sorted(SHARDING)}")
        if self.dp_shard == "hybrid_shard":
            size = self.dp_shard_size
            if size is None or isinstance(size, bool) or not isinstance(size, int) or size < 1 or self.dp % size:
                raise PlanError(f"dp_shard='hybrid_shard' needs dp_shard_size dividing dp={self.dp}; "
                                f"got dp_shard_size={size!r}; choose one of {divisors(self.dp)}")
        elif self.dp_shard_size not in (None, self.dp):
            raise PlanError(f"dp_shard_size={self.dp_shard_size!r} only applies with dp_shard='hybrid_shard'")
        _check_degree("ep", self.ep)
        if self.dp % self.ep:
            raise PlanError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism is cut out of the "
                            f"data-parallel ranks; choose ep in {divisors(self.dp)} or raise dp")
        if self.vpp > 1 and self.pp == 1:
            raise PlanError(f"vpp={self.vpp} needs pipeline parallelism; set pp>=2 or vpp=1")
        if self.micro_batches is not None:
            _check_degree("micro_batches", self.micro_batches)
        sched = self.schedule
        if sched is not None and sched not in SCHEDULES:
            raise PlanError(f"schedule={sched!r} is not a pipeline schedule; choose one of {list(SCHEDULES)}")
        if sched == "interleaved-1f1b" and self.vpp == 1:
            raise PlanError("schedule='interleaved-1f1b' needs vpp>=2 virtual stages per rank; set vpp=2")
        if self.vpp > 1 and sched in ("gpipe", "1f1b"):
            raise PlanError(f"vpp={self.vpp} needs schedule='interleaved-1f1b' (or leave schedule unset)")
        if self.devices_per_node is not None:
            _check_degree("devices_per_node", self.devices_per_node)
        if self.n_micro_batches < self.pp and self.pipeline_schedule != "gpipe":
            raise PlanError(f"micro_batches={self.n_micro_batches} < pp={self.pp}: 1F1B schedules need at "
                            f"least one micro-batch per stage; set micro_batches>={self.pp}")
        if self.pipeline_schedule == "interleaved-1f1b" and self.n_micro_batches % self.pp:
            raise PlanError(f"interleaved 1F1B needs micro_batches divisible by pp={self.pp}; got "
                            f"micro_batches={self.n_micro_batches}; use a multiple of {self.pp}")

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def n_micro_batches(self) -> int:
        return self.micro_batches if self.micro_batches is not None else self.pp

    @property
    def pipeline_schedule(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (pp x vpp virtual stages)."""
        return self.pp * self.vpp

    def size(self, dim: str) -> int:
        self._check_dim(dim)
        return getattr(self, dim)

    @property
    def dp_shard_degree(self) -> int:
        """How many ranks one copy of the model state is sharded over on the DP dim."""
        return {"replicate": 1, "shard_grad_op": self.dp, "full_shard": self.dp,
                "hybrid_shard": self.dp_shard_size or self.dp}[self.dp_shard]

    @property
    def expert_dp(self) -> int:
        """How many replicas of each expert there are: the DP ranks left over by ``ep`` (``dp // ep``)."""
        return self.dp // self.ep

    @property
    def dp_replicate_degree(self) -> int:
        return self.dp // self.dp_shard_degree if self.dp_shard == "hybrid_shard" else (
            self.dp if self.dp_shard == "replicate" else 1)

    # ---- ranks <-> coordinates ---------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank: ``{"dp": .., "tp": .., "pp": ..}``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise PlanError(f"rank={rank!r} is outside this plan's world of {self.world_size} ranks "
                            f"(0..{self.world_size - 1})")
        out, rest = {}, rank
        for dim in self._order:
            out[dim] = rest % self.size(dim)
            rest //= self.size(dim)
        return {d: out[d] for d in DIMS}

    def rank(self, *, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates."""
        coords = {"dp": dp, "tp": tp, "pp": pp}
        for dim, value in coords.items():
            if not isinstance(value, int) or not 0 <= value < self.size(dim):
                raise PlanError(f"{dim}={value!r} is outside 0..{self.size(dim) - 1} for {dim}={self.size(dim)}")
        rank, stride = 0, 1
        for dim in self._order:
            rank += coords[dim] * stride
            stride *= self.size(dim)
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """The process groups along ``dim``: each list holds the ranks that differ only in ``dim``."""
        self._check_dim(dim)
        stride = 1
        for d in self._order[:self._order.index(dim)]:
            stride *= self.size(d)
        n = self.size(dim)
        # a group starts at every rank whose ``dim`` coordinate is 0; members step by the dim's stride
        return [list(range(base, base + n * stride, stride))
                for base in range(self.world_size) if (base // stride) % n == 0]

    def expert_groups(self) -> list[list[int]]:
        """The expert-parallel groups: each holds ``ep`` consecutive DP ranks (same tp and pp coordinates) that
        share one copy of the experts, an all-to-all apart (one group per rank when ``ep == 1``).

        >>> ParallelPlan(dp=4, ep=2).expert_groups()
        [[0, 1], [2, 3]]
        >>> ParallelPlan(dp=4, tp=2, ep=2).expert_groups()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        """
        out = []
        for group in self.groups("dp"):
            group = sorted(group, key=lambda r: self.coords(r)["dp"])
            out += [group[i:i + self.ep] for i in range(0, len(group), self.ep)]
        return sorted(out)

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The ranks in ``rank``'s group along ``dim``."""
        c = self.coords(rank)
        return [self.rank(**{**c, dim: i}) for i in range(self.size(dim))]

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(shape, names)`` for ``init_device_mesh``: slowest dim first, so the mesh's row-major
        rank order equals this plan's rank order.

        >>> ParallelPlan(dp=2, tp=4, pp=2).mesh_shape()
        ((2, 2, 4), ('pp', 'dp', 'tp'))
        """
        names = tuple(reversed(self._order))
        return tuple(self.size(d) for d in names), names

    # ---- pipeline layer split ----------------------------------------------------------------
    def stage_layers(self, num_layers: int, split: list[int] | None = None) -> list[range]:
        """Decoder layers held by each of the ``pp * vpp`` (virtual) stages, in model order.

        Uneven counts give the extra layers to the middle stages, since the first stage also holds
        the embedding and the last the final norm and lm_head. ``split`` sets the counts by hand.

        >>> [list(r) for r in ParallelPlan(pp=2).stage_layers(5)]
        [[0, 1, 2], [3, 4]]
        """
        n = self.n_stages
        if split is not None:
            if len(split) != n or any(not isinstance(k, int) or k < 1 for k in split) or sum(split) != num_layers:
                raise PlanError(f"layer split {split} must be {n} positive counts summing to "
                                f"num_hidden_layers={num_layers}")
            counts = list(split)
        else:
            if num_layers < n:
                raise PlanError(f"pp*vpp={n} stages but the model has only {num_layers} layers; "
                                f"choose pp*vpp <= {num_layers}")
            base, extra = divmod(num_layers, n)
            counts = [base] * n
            # middle stages first, outward; ends last
            order = sorted(range(n), key=lambda s: (s in (0, n - 1), abs(s - (n - 1) / 2)))
            for s in order[:extra]:
                counts[s] += 1
        out, start = [], 0
        for k in counts:
            out.append(range(start, start + k))
            start += k
        return out

    def layers_of_rank(self, rank: int, num_layers: int, split: list[int] | None = None) -> list[int]:
        """Layers held by a rank: virtual stage ``s`` lives on pipeline rank ``s % pp``."""
        pp_rank = self.coords(rank)["pp"]
        stages = self.stage_layers(num_layers, split)
        return [layer for s, r in enumerate(stages) if s % self.pp == pp_rank for layer in r]

    # ---- placement ---------------------------------------------------------------------------
    def node_of(self, rank: int, devices_per_node: int | None = None) -> int:
        self.coords(rank)  # validates the rank
        per = devices_per_node or self.devices_per_node or self.world_size
        return rank // per

    def placement_warnings(self, devices_per_node: int | None = None) -> list[str]:
        """Reasons this placement will be slow: TP groups that cross nodes (TP all-reduces every
        layer, so keep it inside the NVLink domain)."""
        per = devices_per_node or self.devices_per_node or self.world_size
        out = []
        crossing = [g for g in self.groups("tp") if len({r // per for r in g}) > 1]
        if crossing:
            ok = [t for t in divisors(per) if t <= per]
            out.append(f"{len(crossing)} TP group(s) span nodes (e.g. ranks {crossing[0]} with "
                       f"{per} devices per node); TP all-reduces every layer, keep tp <= devices_per_node "
                       f"and tp fastest in order: tp in {ok}")
        return out

    def table(self, model: Any = None, devices_per_node: int | None = None) -> pd.DataFrame:
        """One row per rank: rank, node, local device, dp, tp, pp, and with a model the layers its
        pipeline stage holds."""
        import pandas as pd

        per = devices_per_node or self.devices_per_node or self.world_size
        num_layers = _num_layers(model) if model is not None else None
        rows = []
        for r in range(self.world_size):
            row = {"rank": r, "node": r // per, "local_device": r % per, **self.coords(r)}
            if num_layers is not None:
                layers = self.layers_of_rank(r, num_layers)
                row["layers"] = ranges_str(layers)
                row["first_stage"] = row["pp"] == 0
                row["last_stage"] = row["pp"] == self.pp - 1
            rows.append(row)
        return pd.DataFrame(rows)

    # ---- validation --------------------------------------------------------------------------
    def validate(self, model: Any = None, cluster: Any = None, batch: int | None = None,
                 devices: int | None = None, micro_batch_size: int | None = None) -> ParallelPlan:
        """Check the plan against a model, a cluster (or a device count) and a global batch.

        Raises ``PlanError`` naming the bad value and the fix; returns the plan when all is well.

        >>> ParallelPlan(tp=3).validate(model={"num_attention_heads": 8, "num_key_value_heads": 8,
        ...                                     "num_hidden_layers": 4, "hidden_size": 64})
        Traceback (most recent call last):
        ...
        rlkit.errors.PlanError: tp=3 does not divide num_attention_heads=8; choose tp in {1, 2, 4, 8}
        """
        if model is not None:
            self._validate_model(model)
        if cluster is not None or devices is not None:
            available = devices if devices is not None else _cluster_devices(cluster)
            if self.world_size > available:
                raise PlanError(f"the plan needs dp*tp*pp={self.dp}*{self.tp}*{self.pp}={self.world_size} "
                                f"devices but only {available} are available; shrink a degree or add devices")
            per = getattr(cluster, "devices_per_node", None) if cluster is not None else None
            for w in self.placement_warnings(per):
                warnings.warn(w, stacklevel=2)
        if batch is not None:
            self._validate_batch(batch, micro_batch_size)
        return self

    def _validate_model(self, model: Any) -> None:
        from rlkit.plan.spec import as_spec

        spec = as_spec(model)
        heads, kv = spec.num_attention_heads, spec.num_key_value_heads
        if heads % self.tp:
            raise PlanError(f"tp={self.tp} does not divide num_attention_heads={heads}; "
                            f"choose tp in {_fmt_set(_common_divisors(heads, kv))}")
        if kv % self.tp:
            ok = _common_divisors(heads, kv)
            raise PlanError(f"tp={self.tp} does not divide num_key_value_heads={kv} (GQA); each TP rank "
                            f"needs whole KV heads, and rlkit does not replicate KV heads; choose tp in "
                            f"{_fmt_set(ok)}")
        if spec.intermediate_size % self.tp:
            raise PlanError(f"tp={self.tp} does not divide intermediate_size={spec.intermediate_size}; "
                            f"choose tp in {_fmt_set(_common_divisors(heads, kv, spec.intermediate_size))}")
        experts = spec.num_experts
        if self.ep > 1 and not experts:
            raise PlanError(f"ep={self.ep} needs a mixture-of-experts model, but {spec.name or 'the model'} is "
                            f"dense (no num_experts in its config); use ep=1")
        if experts and experts % self.ep:
            raise PlanError(f"ep={self.ep} does not divide num_experts={experts}; each EP rank holds whole "
                            f"experts: choose ep in {_fmt_set([d for d in divisors(experts) if self.dp % d == 0])}")
        if self.n_stages > spec.num_layers:
            what = f"pp*vpp={self.pp}*{self.vpp}={self.n_stages}" if self.vpp > 1 else f"pp={self.pp}"
            raise PlanError(f"{what} stages but {spec.name or 'the model'} has num_hidden_layers="
                            f"{spec.num_layers}; each stage needs at least one layer: choose pp*vpp <= "
                            f"{spec.num_layers}")

    def _validate_batch(self, batch: int, micro_batch_size: int | None) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise PlanError(f"batch={batch!r} must be a positive integer (sequences per step)")
        if batch % self.dp:
            raise PlanError(f"global batch={batch} is not divisible by dp={self.dp}; use a batch that is "
                            f"a multiple of {self.dp}")
        per_dp = batch // self.dp
        if per_dp % self.n_micro_batches:
            raise PlanError(f"each DP rank gets batch/dp={per_dp} sequences, not divisible into "
                            f"micro_batches={self.n_micro_batches}; use a global batch that is a multiple of "
                            f"dp*micro_batches={self.dp * self.n_micro_batches}")
        if micro_batch_size is not None and per_dp != micro_batch_size * self.n_micro_batches:
            raise PlanError(f"batch={batch} != dp*micro_batches*micro_batch_size={self.dp}*"
                            f"{self.n_micro_batches}*{micro_batch_size}; adjust one of them")

    # ---- misc --------------------------------------------------------------------------------
    def with_(self, **changes: Any) -> ParallelPlan:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def layout(self) -> dict[str, Any]:
        """The degrees that decide which rank holds which shard (micro-batches and the schedule do not):
        what a checkpoint records of the plan that wrote it, and what loading compares to reshard.

        >>> ParallelPlan(dp=2, tp=2).layout()["tp"], ParallelPlan(dp=2).layout() == ParallelPlan(dp=2, micro_batches=4).layout()
        (2, True)
        """
        return {"world_size": self.world_size, **{f: getattr(self, f) for f in
                                                  ("dp", "tp", "pp", "vpp", "ep", "order", "dp_shard", "dp_shard_size")}}

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.ep > 1:  # not a factor of the world: cut out of dp
            parts[0] = f"dp={self.dp} (ep={self.ep})"
        return (f"{' x '.join(parts)} = {self.world_size} ranks; DP {self.dp_shard}"
                + (f"({self.dp_shard_size})" if self.dp_shard == "hybrid_shard" else "")
                + (f"; {self.pipeline_schedule} with {self.n_micro_batches} micro-batches" if self.pp > 1 else ""))

    def _check_dim(self, dim: str) -> None:
        if dim not in DIMS:
            raise PlanError(f"unknown dimension {dim!r}; choose one of {list(DIMS)}")

    # ---- schedules and throughput (delegates) ------------------------------------------------
    def pipeline(self, **kw: Any) -> pd.DataFrame:
        """Timeline of one step of this plan's pipeline schedule (see ``rlkit.plan.schedule``).

        >>> float(ParallelPlan(pp=4, micro_batches=8).pipeline().end.max())
        33.0
        """
        from rlkit.plan.schedule import pipeline_timeline

        return pipeline_timeline(self.pp, self.n_micro_batches, self.pipeline_schedule, self.vpp, **kw)

    def bubble_fraction(self) -> float:
        """Idle fraction of a step from pipeline fill and drain: (p-1) / (vpp*m + p-1).

        >>> ParallelPlan(pp=4, micro_batches=8).bubble_fraction()
        0.2727272727272727
        """
        from rlkit.plan.schedule import bubble_fraction

        return bubble_fraction(self.pp, self.n_micro_batches, self.vpp)

    def throughput(self, model: Any, **kw: Any) -> dict:
        """Estimated training step time and tokens/s (see ``rlkit.plan.throughput.estimate_throughput``)."""
        from rlkit.plan.throughput import estimate_throughput

        return estimate_throughput(self, model, **kw)


    # ---- views (drawn by rlkit.widgets, found through rlkit.display: this layer never imports them) --
    def show(self, model: Any = None, dim: str = "tp", cluster: Any = None, placed: Any = None) -> Any:
        """The interactive rank grid (an ipywidgets widget): cells coloured by DP/TP/PP group, with
        coordinates, node, layers (given a model) and group members on hover and click. ``placed``: a running
        worker group of this plan (``trainer.group``), whose ranks ``dim="node"`` colours by the node they run on.

        >>> view = ParallelPlan(dp=2, tp=2, pp=2).show(model="qwen2.5-7b", dim="pp")
        >>> len(view.cells)
        8
        >>> by_node = ParallelPlan(dp=2).show(dim="node", placed=["n0", "n1"])   # rank 0 on n0, rank 1 on n1
        >>> by_node.color_of(0) != by_node.color_of(1)
        True
        """
        return display.view(self, "widget", model=model, dim=dim, cluster=cluster, placed=placed)

    def _repr_html_(self) -> str | None:
        # static fallback (nbconvert, GitHub, no widget frontend): an HTML grid with inline styles
        return display.view(self, "html")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict | None:
        # Jupyter: the widget, with the HTML grid in the same bundle as the fallback
        return display.view(self, "mimebundle")


    # ---- cost models (delegates) -------------------------------------------------------------
    def memory(self, model: Any, *, token_budget: int | None = None, lora: Any = None, **kw: Any) -> pd.DataFrame:
        """Bytes per rank to train ``model`` on this plan (see ``rlkit.plan.memory.estimate_memory``).
        ``token_budget``: padding-free micro-batches of up to that many tokens, rows of ``seq_len``
        (the longest sequence), instead of ``micro_batch`` sequences. ``lora``: train LoRA adapters
        (a peft ``LoraConfig`` or an int rank) on the frozen model: grads and optimizer state of the
        adapters only.

        >>> df = ParallelPlan(dp=8).memory("llama-2-7b", precision="bf16-mixed")
        >>> int((df.weights + df.grads + df.optimizer)[0]) == 16 * 6_738_415_616 // 8
        True
        >>> packed = ParallelPlan().memory("llama-2-7b", seq_len=1024, token_budget=4096)
        >>> int(packed.activations[0]) == int(ParallelPlan().memory("llama-2-7b", seq_len=4096).activations[0])
        True
        >>> lora = ParallelPlan(dp=8).memory("llama-2-7b", precision="bf16-mixed", lora=16)
        >>> int(lora.optimizer[0]) < int(df.optimizer[0]) // 100      # AdamW state of the adapters only
        True
        """
        from rlkit.plan.memory import estimate_memory

        return estimate_memory(self, model, token_budget=token_budget, lora=lora, **kw)

    def communication(self, model: Any, **kw: Any) -> pd.DataFrame:
        """Collectives per step of one rank (see ``rlkit.plan.comm.estimate_communication``).

        >>> ParallelPlan(dp=2, tp=2).communication("qwen2.5-0.5b").dim.tolist()
        ['dp', 'dp', 'tp']
        """
        from rlkit.plan.comm import estimate_communication

        return estimate_communication(self, model, **kw)

def _num_layers(model: Any) -> int:
    from rlkit.plan.spec import as_spec

    return as_spec(model).num_layers


def _cluster_devices(cluster: Any) -> int:
    if isinstance(cluster, int):
        return cluster
    for attr in ("num_devices", "world_size"):
        value = getattr(cluster, attr, None)
        if value is not None:
            return int(value() if callable(value) else value)
    raise PlanError(f"cannot tell how many devices cluster={cluster!r} has; pass devices=N")


def _common_divisors(*ns: int) -> list[int]:
    return [d for d in divisors(min(ns)) if all(n % d == 0 for n in ns)]


def _fmt_set(values: list[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def ranges_str(layers: list[int]) -> str:
    """Sorted integers as ranges of consecutive runs.

    >>> ranges_str([0, 1, 2, 5, 6, 9])
    '0-2,5-6,9'
    """
    if not layers:
        return ""
    spans, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(f"{start}-{prev}" if prev > start else f"{start}")
        if x is not None:
            start = prev = x
    return ",".join(spans)
