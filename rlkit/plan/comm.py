"""Communication per training step of a ParallelPlan: which collectives, how many bytes, how long.

Pure Python (no torch import). Bandwidth-only: the time of a row is its bytes over the link's
bandwidth, a lower bound that ignores latency and overlap with compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlkit.errors import PlanError
from rlkit.plan.sharding import (
    Shard,
    chunk_len,
    chunk_overlap,
    is_expert,
    layer_tensors,
    owned_tensors,
    rank_shard,
    root_tensors,
    split_dims,
    stage_layer_kinds,
)
from rlkit.plan.units import PRECISIONS, check_common, dtype_bytes, positive_int, recompute_mode

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.plan.topology import ParallelPlan

# Per-GPU, per-direction bandwidth in bytes/s (peak figures from the vendors' specs; achieved
# bus bandwidth in NCCL tests is typically 70-90% of these).
BANDWIDTHS: dict[str, float] = {
    # NVLink: NVIDIA H100 SXM datasheet, 900 GB/s bidirectional per GPU (18 NVLink4 links) = 450 GB/s
    # each way; A100 SXM: 600 GB/s bidirectional (NVLink3); B200: 1.8 TB/s bidirectional (NVLink5).
    "nvlink": 450e9, "nvlink4": 450e9, "nvlink3": 300e9, "nvlink5": 900e9,
    # PCIe x16 per direction: 3.0 ~16 GB/s, 4.0 ~32 GB/s, 5.0 ~64 GB/s raw (PCI-SIG); ~12/25/50
    # GB/s achieved for GPU peer-to-peer / host copies.
    "pcie3": 12e9, "pcie4": 25e9, "pcie5": 50e9,
    # InfiniBand per port (one NIC per GPU, as in DGX H100): NDR 400 Gb/s = 50 GB/s, HDR 200 Gb/s
    # = 25 GB/s, EDR 100 Gb/s = 12.5 GB/s (NVIDIA ConnectX-7/6 specs).
    "ib": 50e9, "ib-ndr": 50e9, "ib-hdr": 25e9, "ib-edr": 12.5e9,
    # Ethernet / RoCE line rates: Gb/s / 8.
    "400gbe": 50e9, "200gbe": 25e9, "100gbe": 12.5e9, "25gbe": 3.125e9, "10gbe": 1.25e9,
}


def bandwidth(value: Any, what: str = "bandwidth") -> float:
    """Bytes/s from a preset name in ``BANDWIDTHS`` or a positive number.

    >>> bandwidth("ib"), bandwidth(12.5e9)
    (50000000000.0, 12500000000.0)
    """
    if isinstance(value, str):
        key = value.lower()
        if key not in BANDWIDTHS:
            raise PlanError(f"{what}={value!r} is not a preset; choose one of {sorted(BANDWIDTHS)} or give bytes/s")
        return BANDWIDTHS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{what}={value!r} must be a preset name or a positive number of bytes/s")
    return float(value)


# per-rank bytes on the wire = message bytes x this factor (ring algorithms; Patarasuk & Yuan 2009,
# "Bandwidth optimal all-reduce algorithms"; NCCL's "bus bandwidth" convention)
def _ring_factor(collective: str, n: int) -> float:
    if collective.startswith("all-reduce"):
        return 2 * (n - 1) / n
    if collective.startswith(("all-gather", "reduce-scatter", "all-to-all")):
        return (n - 1) / n
    return 1.0  # point to point


def _spans_nodes(groups: list[list[int]], per: int) -> bool:
    return any(len({r // per for r in g}) > 1 for g in groups)


def estimate_communication(plan: ParallelPlan, model: Any, *, seq_len: int = 2048, micro_batch: int = 1,
                           global_batch: int | None = None, precision: str = "bf16-mixed",
                           devices_per_node: int | None = None, intra_node_bw: Any = "nvlink",
                           inter_node_bw: Any = "ib", sequence_parallel: bool = False,
                           recompute: str | None = None, activation_checkpointing: bool | None = None,
                           vocab_parallel: bool = True, gathered_logits: bool = False,
                           tp_layout: str = "fused", stage: int | None = None,
                           rollout_tp: int | None = None, _rows_only: bool = False) -> pd.DataFrame:
    """Collectives one rank runs per optimizer step: one row per (dim, collective).

    Columns: ``dim, collective, group_size, calls_per_step, bytes_per_call`` (the collective's full
    buffer: the all-reduce buffer, the all-gather output, the reduce-scatter input, the p2p
    message; an average when calls differ), ``bytes_per_step`` (per rank, on the wire:
    ``calls x bytes_per_call x f`` with ring factors f = 2(n-1)/n for all-reduce, (n-1)/n for
    all-gather and reduce-scatter, 1 for send/recv), ``link`` ("intra" or "inter": does any group
    of that kind span nodes of ``devices_per_node``), ``bandwidth`` (bytes/s), ``time_s`` (bytes /
    bandwidth). ``df.attrs``: ``stage`` (the pipeline rank described), ``micro_batches``,
    ``total_time_s``. Rows with a group of one rank are left out.

    Micro-batches per step m: ``global_batch / (dp x micro_batch)`` when given, else
    ``plan.n_micro_batches``. The rows describe one rank of pipeline rank ``stage`` (default: the
    stage with the largest total time). Messages use the TP-local, FSDP-padded tensor sizes of
    ``rlkit.plan.memory`` (layout of :func:`rlkit.plan.memory.estimate_memory`).

    **DP** (FSDP2 units: each decoder layer + the stage root; all-gathers in the compute dtype, as
    ``MixedPrecisionPolicy(param_dtype=bf16)`` casts before gathering; reductions in the grad dtype,
    fp32 under "bf16-mixed" = ``reduce_dtype``): "full_shard"/"hybrid_shard" all-gather each
    layer in forward and again in backward, the root once (FSDP2 keeps the root unsharded after
    forward), in every micro-batch; "shard_grad_op" gathers each unit once per micro-batch. Grads
    are reduced once per step, after the last micro-batch (rlkit.parallel sets
    ``set_requires_gradient_sync(False)`` before it; ``torch.distributed.pipelining`` does the
    same): every unit is reduce-scattered, and "hybrid_shard" also all-reduces the sharded grads
    across the dp/dp_shard_size replicas; "replicate" all-reduces the grads (HSDP with shard
    groups of one). With pp > 1 the pipelining schedule does not reshard after backward either,
    so a layer is gathered in the first ``min(m, pp - stage)`` forwards (1F1B warm-up) and in
    every backward, the root once per step.

    **TP** (Megatron: Shoeybi et al. 2019, Sec. 3, the f/g operators): per decoder layer and
    micro-batch 2 all-reduces in forward and 2 in backward (+2 when recomputing the forward with
    ``recompute="full"``; selective recompute repeats no collective). That is ``tp_layout="fused"``:
    one column-parallel input per block (Megatron's fused QKV and gate/up, or torchtitan's
    ``PrepareModuleInput`` before attention and MLP). ``tp_layout="per-module"`` is what
    ``rlkit.parallel.apply.apply_tp`` builds today: a ``ColwiseParallel`` on each of q, k, v, gate and
    up, so backward all-reduces each one's input gradient: 5 per layer instead of 2. Each of ``micro_batch x seq_len x hidden x compute bytes``;
    ``sequence_parallel`` replaces each by an all-gather plus a reduce-scatter of the same size
    (Korthikanti et al. 2022, Sec. 4.2.2): same bytes. The vocab-parallel embedding adds a forward
    all-reduce on the first stage and the column-parallel lm_head a backward one on the last;
    ``gathered_logits`` adds an all-gather of ``micro_batch x seq_len x vocab x compute bytes``
    (lm_head with ``output_layouts=Replicate()``, as ``rlkit.parallel`` does).

    **PP** (send/recv between neighbouring stages, Narayanan et al. 2021): per micro-batch and per
    virtual stage on this rank, activations ``micro_batch x seq_len x hidden x compute bytes``
    forward (unless it is the last stage) and their gradient backward (unless it is the first);
    ``/tp`` with ``sequence_parallel``, where each TP rank holds and sends a 1/tp slice.

    **EP** (mixture-of-experts models with ``plan.ep > 1``; ``rlkit.parallel.moe``): per sparse layer and
    micro-batch, the forward's two all-to-alls (dispatch: each token's hidden state to the ranks of its
    ``k`` experts; combine: the expert outputs back) and the backward's two (their gradients, in reverse):
    4 calls of ``micro_batch x seq_len x top_k x hidden x compute bytes`` (+2 with ``recompute="full"``),
    of which the share ``(ep - 1)/ep`` leaves the rank (a uniform router: the rest stays on the rank).
    The experts' weights are outside FSDP under EP, so a sparse layer's FSDP unit is its attention, norms
    and router, and each rank all-reduces its ``E/ep`` experts' gradients over the ``dp/ep`` expert-DP
    ranks (dim "dp", collective "all-reduce (experts)", one call per expert tensor). With ``ep == 1`` the
    experts are ordinary FSDP parameters of their layer. TP splits only the attention of a sparse layer
    (the router and experts run whole on every TP rank), so a sparse layer has 1 forward and 1 backward TP
    all-reduce (``tp_layout="per-module"``: 3 backward, for q, k, v).

    **Weight sync** (``rollout_tp=t_g``: the 3D-HybridEngine reshards the actor into generation
    tensor parallel t_g once per step, before generating): dim "reshard" rows, "all-gather (dp)" (with
    FSDP sharding: each parameter's TP-local piece gathered inside the DP group) and "broadcast
    (micro-dp)" (inside the micro-DP group of ``tp*pp/t_g`` ranks), in the stored parameter dtype.
    ``bytes_per_step`` is what the stage's most-receiving rank receives, exactly as
    :func:`estimate_resharding` counts it; ``bytes_per_call`` the average message (the gathered
    piece, the broadcast piece).

    >>> from rlkit.plan import ParallelPlan
    >>> df = ParallelPlan(tp=2, pp=2).communication("qwen2.5-0.5b", rollout_tp=1)
    >>> df[df.dim == "reshard"].collective.tolist()
    ['broadcast (micro-dp)']
    """
    spec, s, b = check_common(plan, model, seq_len, micro_batch, precision)
    full_recompute = recompute_mode(recompute, activation_checkpointing) == "full"
    if tp_layout not in ("fused", "per-module"):
        raise PlanError(f"tp_layout={tp_layout!r} must be 'fused' (Megatron / torchtitan: 2 backward all-reduces "
                        f"per layer) or 'per-module' (rlkit.parallel's ColwiseParallel on q, k, v, gate, up: 5)")
    if global_batch is not None:
        positive_int("global_batch", global_batch)
        if global_batch % (plan.dp * b):
            raise PlanError(f"global_batch={global_batch} is not divisible by dp*micro_batch={plan.dp}*{b}; "
                            f"use a multiple of {plan.dp * b}")
        m = global_batch // (plan.dp * b)
        if plan.pp > 1 and m < plan.pp:
            raise PlanError(f"global_batch={global_batch} gives {m} micro-batches per DP rank, fewer than "
                            f"pp={plan.pp}; use global_batch >= {plan.dp * b * plan.pp}")
    else:
        m = plan.n_micro_batches
    per = devices_per_node or plan.devices_per_node or plan.world_size
    positive_int("devices_per_node", per)
    bw = {"intra": bandwidth(intra_node_bw, "intra_node_bw"), "inter": bandwidth(inter_node_bw, "inter_node_bw")}
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < plan.pp):
        raise PlanError(f"stage={stage!r} must be a pipeline rank in 0..{plan.pp - 1}")

    prec = PRECISIONS[precision]
    cb, gb = prec["compute"], prec["grad"]
    tp, pp, S = plan.tp, plan.pp, plan.dp_shard_degree
    R = plan.dp // S
    act = b * s * spec.hidden_size * cb
    layer_t = layer_tensors(spec)
    layers_per_rank = [0] * pp
    for st, rng in enumerate(plan.stage_layers(spec.num_layers)):
        layers_per_rank[st % pp] += len(rng)
    ep = plan.ep
    kinds = stage_layer_kinds(spec, plan)
    # each layer kind's FSDP unit (the routed experts leave FSDP under expert parallelism)
    kind_t = {k: tuple(x for x in (layer_t if k == bool(spec.sparse_layers) else layer_tensors(spec, k))
                       if not (ep > 1 and is_expert(x))) for kk in kinds for k in kk}
    expert_el = (sum(x[1] * x[2] for x in layer_tensors(spec, True) if is_expert(x)) // ep
                 if spec.is_moe else 0)
    n_expert_t = sum(1 for x in layer_tensors(spec, True) if is_expert(x)) if spec.is_moe else 0

    links = _links(plan, per, S)
    layout = _reshard_layout(plan, spec, rollout_tp) if rollout_tp is not None else None

    def rows_of(p: int) -> list[dict]:
        L = layers_per_rank[p]
        first, last = p == 0, p == pp - 1
        out: list[tuple[str, str, int, int, int]] = []  # dim, collective, group, calls, total message bytes
        # -- DP
        n_sparse = kinds[p].get(True, 0)
        if plan.dp > 1:
            root = rank_shard(root_tensors(spec, pp, tp, p, "actor", vocab_parallel), 1, tp, 0, S, 0)
            unit_full = {k: rank_shard(kind_t[k], 1, tp, 0, S, 0).padded * S for k in kinds[p]}
            unit_full["root"] = root.padded * S
            units: dict = dict(kinds[p])
            units["root"] = 1 if root.tensors else 0
            syncs = 1  # grads reduced after the last micro-batch only
            if pp > 1:
                layer_gathers = 1 if plan.dp_shard == "shard_grad_op" else min(m, pp - p) + m
                gathers = {**{k: layer_gathers for k in kinds[p]}, "root": 1}
            else:
                gathers = {**{k: (1 if plan.dp_shard == "shard_grad_op" else 2) * m for k in kinds[p]}, "root": m}
            n_units = sum(units.values())
            if S > 1:
                out.append(("dp", "all-gather", S, sum(units[k] * gathers[k] for k in units),
                            sum(units[k] * gathers[k] * unit_full[k] for k in units) * cb))
                out.append(("dp", "reduce-scatter", S, n_units * syncs,
                            sum(units[k] * unit_full[k] for k in units) * syncs * gb))
            if R > 1:
                out.append(("dp", "all-reduce", R, n_units * syncs,
                            sum(units[k] * unit_full[k] for k in units) // S * syncs * gb))
            if ep > 1 and plan.expert_dp > 1 and n_sparse:  # the experts' grads, averaged over expert-DP
                out.append(("dp", "all-reduce (experts)", plan.expert_dp, n_sparse * n_expert_t * syncs,
                            n_sparse * expert_el * syncs * gb))
        # -- EP: dispatch and combine all-to-alls, forward and backward (and the recomputed forward)
        if ep > 1 and n_sparse:
            calls = (4 + 2 * full_recompute) * n_sparse * m
            out.append(("ep", "all-to-all", ep, calls, calls * act * spec.num_experts_per_tok))
        # -- TP
        if tp > 1:
            backward = 2 if tp_layout == "fused" else 5
            # a sparse layer splits only its attention (DeepSeek's shared experts split like an MLP)
            attn_only = n_sparse if not spec.n_shared_experts else 0
            per_attn = 1 + (1 if tp_layout == "fused" else 3) + full_recompute
            calls = ((2 + backward + 2 * full_recompute) * (L - attn_only) + per_attn * attn_only) * m \
                + (m * first + m * last) * vocab_parallel
            if sequence_parallel:
                out.append(("tp", "all-gather", tp, calls, calls * act))
                out.append(("tp", "reduce-scatter", tp, calls, calls * act))
            else:
                out.append(("tp", "all-reduce", tp, calls, calls * act))
            if last and gathered_logits and vocab_parallel:
                out.append(("tp", "all-gather (logits)", tp, m, m * b * s * spec.vocab_size * cb))
        # -- PP
        if pp > 1:
            virt = [v for v in range(plan.n_stages) if v % pp == p]
            fwd = sum(v < plan.n_stages - 1 for v in virt) * m
            bwd = sum(v > 0 for v in virt) * m
            # with sequence parallelism a stage boundary's activation is already split over TP: each
            # TP rank sends its 1/tp slice (Megatron's scatter/gather optimisation, Narayanan 2021 Sec. 4.1)
            msg = act // tp if sequence_parallel else act
            if fwd:
                out.append(("pp", "send/recv forward", 2, fwd, fwd * msg))
            if bwd:
                out.append(("pp", "send/recv backward", 2, bwd, bwd * msg))
        rows = []
        for dim, coll, n, calls, total in out:
            link = links[(dim, coll) if (dim, coll) in links else (dim, coll.split(" ")[0])]
            wire = int(round(total * _ring_factor(coll, n)))
            rows.append(dict(dim=dim, collective=coll, group_size=n, calls_per_step=calls,
                             bytes_per_call=total // calls, bytes_per_step=wire, link=link,
                             bandwidth=bw[link], time_s=wire / bw[link]))
        if layout is not None:
            rows += _reshard_rows(spec, plan, layout, prec["param"], p, links, per, bw)
        return rows

    if stage is None:
        # the busiest stage: time grows with a stage's layers and falls with its position (fewer
        # warm-up gathers), the ends add embedding / lm_head collectives; so the first stage of each
        # layer count and the two ends are the only candidates (ties go to the lowest pipeline rank)
        first_of = {}
        for p, n in enumerate(layers_per_rank):
            first_of.setdefault((n, tuple(sorted(kinds[p].items()))), p)
        candidates = sorted({0, pp - 1, *first_of.values()})
        by_stage = {p: rows_of(p) for p in candidates}
        stage = max(candidates, key=lambda p: (sum(r["time_s"] for r in by_stage[p]), -p))
        rows = by_stage[stage]
    else:
        rows = rows_of(stage)
    if _rows_only:  # the plan search's fast path: no DataFrame
        return rows  # type: ignore[return-value]
    import pandas as pd

    cols = ["dim", "collective", "group_size", "calls_per_step", "bytes_per_call", "bytes_per_step",
            "link", "bandwidth", "time_s"]
    df = pd.DataFrame(rows, columns=cols)
    df.attrs.update(model=spec.name, plan=plan.describe(), stage=stage, micro_batches=m, seq_len=s,
                    micro_batch=b, precision=precision, devices_per_node=per,
                    total_time_s=float(df["time_s"].sum()), total_bytes=int(df["bytes_per_step"].sum()))
    return df


_LINKS_CACHE: dict[tuple, dict[tuple[str, str], str]] = {}


def _links(plan: ParallelPlan, per: int, S: int) -> dict[tuple[str, str], str]:
    """'intra' or 'inter' for each kind of group: inter when any such group spans nodes.

    The answer depends only on the degrees, the rank order, the sharding and the node size (not on
    micro-batches or the schedule), so it is memoised on those: a plan search asks it for many
    plans that share a layout, and each answer enumerates every rank's groups.
    """
    key = (plan.dp, plan.tp, plan.pp, plan.vpp > 1, plan.order, plan.dp_shard == "hybrid_shard", per, S, plan.ep)
    if key not in _LINKS_CACHE:
        if len(_LINKS_CACHE) > 4096:
            _LINKS_CACHE.clear()
        _LINKS_CACHE[key] = _links_uncached(plan, per, S)
    return dict(_LINKS_CACHE[key])


def _links_uncached(plan: ParallelPlan, per: int, S: int) -> dict[tuple[str, str], str]:
    def kind(groups):
        return "inter" if _spans_nodes(groups, per) else "intra"

    dp_groups = plan.groups("dp") if plan.dp > 1 else []
    shard = [g[k:k + S] for g in dp_groups for k in range(0, len(g), S)]
    replica = [g[i::S] for g in dp_groups for i in range(S)]
    pp_groups = plan.groups("pp") if plan.pp > 1 else []
    pairs = [[g[i], g[(i + 1) % len(g)]] for g in pp_groups
             for i in range(len(g) if plan.vpp > 1 else len(g) - 1)]
    tp_kind = kind(plan.groups("tp")) if plan.tp > 1 else "intra"
    # expert parallelism: consecutive ranks of each DP group share the experts; expert-DP strides over them
    ep = plan.ep
    ep_groups = [g[k:k + ep] for g in dp_groups for k in range(0, len(g), ep)] if ep > 1 else []
    edp_groups = [g[i::ep] for g in dp_groups for i in range(ep)] if ep > 1 else []
    return {("ep", "all-to-all"): kind(ep_groups), ("dp", "all-reduce (experts)"): kind(edp_groups),
            ("dp", "all-gather"): kind(shard), ("dp", "reduce-scatter"): kind(shard),
            ("dp", "all-reduce"): kind(replica if plan.dp_shard == "hybrid_shard" else dp_groups),
            ("tp", "all-reduce"): tp_kind, ("tp", "all-gather"): tp_kind, ("tp", "reduce-scatter"): tp_kind,
            ("pp", "send/recv"): kind(pairs)}


# ---- 3D-HybridEngine resharding: training layout -> generation layout -------------------------------
def _reshard_layout(plan: ParallelPlan, spec: Any, rollout_tp: Any) -> Any:
    """The checked ``GenerationLayout`` (heads, and the vocab split the Resharder can follow)."""
    from rlkit.plan.hybrid import GenerationLayout

    return GenerationLayout(plan, tp=rollout_tp).validate(spec)


def _broadcasts(owned: list, plan: ParallelPlan, tg: int, p: int, t: int) -> tuple[int, int, int, int]:
    """What rank (pp ``p``, tp ``t``) sees of the micro-DP broadcasts, in elements: ``(received,
    calls, elements broadcast, generation shard)``. Mirrors ``Resharder.reshard``, per parameter of
    owner stage ``o``: a replicated tensor (norm, row-parallel bias) is broadcast whole by the first
    owner-stage member (training tp ``g*k``), and every other member receives it, other owner-stage
    members too; a sharded one is broadcast as the ``k`` training pieces of generation chunk ``g``,
    and a rank receives all but its own."""
    k = plan.tp // tg
    g, d = t // k, plan.tp * plan.pp // tg
    received = calls = sent = gen = 0
    for o, stage in enumerate(owned):
        for tensors, count in stage:
            for _name, d0, d1, td in tensors:
                if td is None:
                    chunk, pieces = d0 * d1, 1
                    mine = chunk if (o == p and t % k == 0) else 0  # only the source already has it
                else:
                    n, other = split_dims(d0, d1, td)
                    chunk, pieces = chunk_len(n, tg, g) * other, k
                    mine = chunk_overlap(n, plan.tp, t, tg, g) * other if o == p else 0
                gen += chunk * count
                if d > 1:
                    received += (chunk - mine) * count
                    calls += pieces * count
                    sent += chunk * count
    return received, calls, sent, gen


def _stage_tensors(spec: Any, plan: ParallelPlan, p: int) -> tuple[list, tuple]:
    """(layer tensors, root tensors) that pipeline rank ``p`` trains, its tied lm_head copy included."""
    return layer_tensors(spec), tuple(root_tensors(spec, plan.pp, plan.tp, p, "actor", True))


def _reshard_ranks(spec: Any, plan: ParallelPlan, layout: Any, nbytes: int) -> Any:
    """A function ``(p, t, j) -> dict`` of one rank's resharding bytes (memoised): pipeline rank ``p``,
    tp index ``t``, FSDP shard index ``j``."""
    owned = owned_tensors(spec, plan)
    S = plan.dp_shard_degree if plan.dp > 1 else 1
    tied_copy = spec.tie_word_embeddings and plan.pp > 1
    layer_groups = [stage[:-1] for stage in owned]  # (tensors, count) of each layer kind; the root is last
    cache: dict[tuple[int, int, int], dict[str, int]] = {}
    bcast: dict[tuple[int, int], tuple[int, int, int, int]] = {}

    def rank(p: int, t: int, j: int) -> dict[str, int]:
        if (p, t, j) in cache:
            return cache[(p, t, j)]
        if (p, t) not in bcast:
            bcast[(p, t)] = _broadcasts(owned, plan, layout.tp, p, t)
        received, calls, sent, gen = bcast[(p, t)]
        root_t = _stage_tensors(spec, plan, p)[1]
        lay = Shard()
        for tensors, count in layer_groups[p]:
            sh = rank_shard(tensors, count, plan.tp, t, S, j)
            lay = Shard(lay.padded + sh.padded, lay.actual + sh.actual, lay.local + sh.local, lay.tensors + sh.tensors)
        root = rank_shard(root_t, 1, plan.tp, t, S, j)
        head = tuple(x for x in root_t if x[0] == "lm_head") if tied_copy else ()
        copy = rank_shard(head, 1, plan.tp, t, S, j)  # a tied embedding's last-stage copy (else nothing)
        gather, gathers, held = 0, 0, 0
        if S > 1:
            # step 1: each parameter's TP-local piece is all-gathered inside the DP group (the tied copy
            # is not resharded); the FSDP shards stay allocated while generating
            gather = (lay.local - lay.actual) + (root.local - root.actual) - (copy.local - copy.actual)
            gathers = lay.tensors + root.tensors - copy.tensors
            held = lay.padded + root.padded
        else:
            held = copy.local  # the training shard is the generation shard, but for a tied copy
        out = {"fsdp_gather_bytes": gather * nbytes, "broadcast_bytes": received * nbytes,
               "received_bytes": (gather + received) * nbytes, "generation_param_bytes": (gen + held) * nbytes,
               "gather_calls": gathers, "gather_message_bytes": (lay.local + root.local - copy.local) * nbytes,
               "broadcast_calls": calls, "broadcast_message_bytes": sent * nbytes}
        cache[(p, t, j)] = out
        return out

    return rank


def estimate_resharding(plan: ParallelPlan, model: Any, rollout_tp: int, *, dtype: str = "fp32",
                        devices_per_node: int | None = None, intra_node_bw: Any = "nvlink",
                        inter_node_bw: Any = "ib") -> pd.DataFrame:
    """Bytes each rank receives when the actor reshards from ``plan`` into the generation layout of
    rollout tensor parallel ``rollout_tp`` (3D-HybridEngine), and what it holds while generating.

    One row per rank: ``rank, dp, tp, pp, gen_group, gen_tp`` (``GenerationLayout.table``'s
    coordinates), ``fsdp_gather_bytes`` (step 1: the TP-local piece gathered inside the DP group, only
    with FSDP sharding S = ``plan.dp_shard_degree`` > 1), ``broadcast_bytes`` (step 2: inside the
    micro-DP group), ``received_bytes`` (their sum), ``received_formula`` (HybridFlow's Table 2:
    ``(tp*pp - t_g)/(t_g*tp*pp) * M``, or with S > 1 ``M/t_g - M/(tp*pp*S)``), ``generation_param_bytes``
    (parameter storage alive while generating), ``param_formula`` (``M/t_g``, + ``M/(tp*pp*S)`` with
    S > 1), ``link`` of the micro-DP broadcasts ("intra"/"inter" node, as in
    :func:`estimate_communication`) and ``seconds`` (each step's bytes over its link's bandwidth, a
    lower bound). ``M`` = the model's unique parameters x ``dtype`` bytes (``df.attrs["model_bytes"]``).

    **Exact counts**, from the tensor shapes, of what ``rlkit.parallel.relayout.Resharder`` moves
    (training dtype ``dtype``; FSDP shards as ``torch.chunk`` pieces of the TP-local tensor's dim 0):
    per parameter of owner stage o, a replicated tensor (norm, row-parallel bias) is broadcast by the
    first owner-stage member of the micro-DP group and received by all the others, including other
    owner-stage members that already hold it; a sharded tensor's generation chunk (1/t_g of the split
    dim) arrives as its k = tp/t_g training pieces, of which a rank receives all but its own (all k
    off its own stage). A tied embedding is resharded once (the generation lm_head is the embedding);
    with pp > 1 the last stage's copy is training-only and stays allocated. So the formula's gap is
    the replicated tensors (whole, not 1/t_g) and, across stages, uneven stage sizes.

    >>> from rlkit.plan import ParallelPlan
    >>> df = estimate_resharding(ParallelPlan(tp=2, pp=2), "llama-2-7b", rollout_tp=2)
    >>> df[["rank", "gen_group", "gen_tp"]].values.tolist()
    [[0, 0, 0], [1, 0, 1], [2, 1, 0], [3, 1, 1]]
    >>> (df.received_bytes / df.received_formula).round(3).tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    from rlkit.plan.spec import as_spec
    from rlkit.plan.topology import ParallelPlan

    if not isinstance(plan, ParallelPlan):
        raise PlanError(f"plan={plan!r} must be a ParallelPlan")
    spec = as_spec(model)
    plan.validate(model=spec)
    layout = _reshard_layout(plan, spec, rollout_tp)
    nbytes = dtype_bytes(dtype, "dtype")
    per = devices_per_node or plan.devices_per_node or plan.world_size
    positive_int("devices_per_node", per)
    bw = {"intra": bandwidth(intra_node_bw, "intra_node_bw"), "inter": bandwidth(inter_node_bw, "inter_node_bw")}
    S = plan.dp_shard_degree if plan.dp > 1 else 1
    link = "inter" if _spans_nodes(layout.micro_dp_groups(), per) else "intra"
    dp_link = _links(plan, per, S)[("dp", "all-gather")]
    M = spec.num_params * nbytes
    received_formula = layout.received_fraction() * M
    param_formula = layout.parameter_fraction() * M
    rank_bytes = _reshard_ranks(spec, plan, layout, nbytes)
    rows = []
    for r in range(plan.world_size):
        c, g = plan.coords(r), layout.coords(r)
        b = rank_bytes(c["pp"], c["tp"], c["dp"] % S)
        seconds = b["fsdp_gather_bytes"] / bw[dp_link] + b["broadcast_bytes"] / bw[link]
        rows.append((r, c["dp"], c["tp"], c["pp"], g["dp"] * layout.micro_dp + g["group"], g["gen_tp"],
                     b["fsdp_gather_bytes"], b["broadcast_bytes"], b["received_bytes"], received_formula,
                     b["generation_param_bytes"], param_formula, link, seconds))
    import pandas as pd

    df = pd.DataFrame(rows, columns=["rank", "dp", "tp", "pp", "gen_group", "gen_tp", "fsdp_gather_bytes",
                                     "broadcast_bytes", "received_bytes", "received_formula",
                                     "generation_param_bytes", "param_formula", "link", "seconds"])
    df.attrs.update(model=spec.name, plan=plan.describe(), rollout_tp=layout.tp, dtype=dtype, model_bytes=M,
                    micro_dp=layout.micro_dp, engines=layout.engines, devices_per_node=per,
                    max_received_bytes=int(df["received_bytes"].max()), max_seconds=float(df["seconds"].max()))
    return df


def _reshard_rows(spec: Any, plan: ParallelPlan, layout: Any, nbytes: int, p: int, links: dict,
                  per: int, bw: dict) -> list[dict]:
    """``estimate_communication``'s rows for one weight sync of pipeline rank ``p``: the stage's rank
    that receives the most (tp index, and FSDP shard index at either end)."""
    S = plan.dp_shard_degree if plan.dp > 1 else 1
    rank_bytes = _reshard_ranks(spec, plan, layout, nbytes)
    b = max((rank_bytes(p, t, j) for t in range(plan.tp) for j in sorted({0, S - 1})),
            key=lambda x: x["received_bytes"])
    link = "inter" if _spans_nodes(layout.micro_dp_groups(), per) else "intra"
    rows = []
    if b["gather_calls"]:
        rows.append(dict(dim="reshard", collective="all-gather (dp)", group_size=S, calls_per_step=b["gather_calls"],
                         bytes_per_call=b["gather_message_bytes"] // b["gather_calls"],
                         bytes_per_step=b["fsdp_gather_bytes"], link=links[("dp", "all-gather")]))
    if b["broadcast_calls"]:
        rows.append(dict(dim="reshard", collective="broadcast (micro-dp)", group_size=layout.micro_dp,
                         calls_per_step=b["broadcast_calls"],
                         bytes_per_call=b["broadcast_message_bytes"] // b["broadcast_calls"],
                         bytes_per_step=b["broadcast_bytes"], link=link))
    for row in rows:
        row["bandwidth"] = bw[row["link"]]
        row["time_s"] = row["bytes_per_step"] / row["bandwidth"]
    return rows
