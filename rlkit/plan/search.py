"""Plan search: every DP x TP x PP layout of a model on N GPUs, sized and ranked; and a recommendation.

``search_plans`` enumerates (dp, tp, pp, vpp, dp_shard, micro_batches) with dp * tp * pp == gpus,
keeps the ones ``ParallelPlan`` rejects with the reason in ``why_not``, and for the rest adds the
peak memory per GPU (``estimate_memory``, max over ranks) and the estimated tokens/s
(``estimate_throughput``). ``recommend`` picks one for a goal and says why, in numbers.

>>> df = search_plans("qwen2.5-7b", gpus=8, gpu_memory="80GB", seq_len=4096)
>>> top = df.iloc[0]
>>> bool(top.fits), int(top.dp * top.tp * top.pp)
(True, 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlkit.errors import PlanError

if TYPE_CHECKING:
    import pandas as pd

    from rlkit.plan.topology import ParallelPlan

GOALS = ("throughput", "convergence", "cost")
GIB = 2**30


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shardings(dp: int, tp: int, gpus_per_node: int, wanted: tuple[str, ...]) -> list[tuple[str, int | None]]:
    """(dp_shard, dp_shard_size) options for a DP degree. With dp == 1 they are all the same layout,
    so one is kept. HSDP shards inside a node (the fast links) and replicates across nodes."""
    if dp == 1:
        return [("full_shard", None)]
    out = []
    for mode in wanted:
        if mode == "hybrid_shard":
            size = max([d for d in _divisors(dp) if d * tp <= gpus_per_node] or [1])
            if 1 < size < dp:
                out.append((mode, size))
        else:
            out.append((mode, None))
    return out


def _micro_batch_options(n_mb: int, pp: int, vpp: int) -> list[int]:
    """Micro-batches per pipeline flush: with pp == 1 a micro-batch at a time (gradient accumulation);
    otherwise pp, 2pp, 4pp, ... dividing the micro-batches per DP rank, plus all of them in one flush."""
    if pp == 1:
        return [1]
    out, m = [], pp
    while m <= n_mb:
        if n_mb % m == 0:
            out.append(m)
        m *= 2
    if n_mb >= pp and (vpp == 1 or n_mb % pp == 0):  # interleaving needs whole rounds of pp
        out.append(n_mb)
    return sorted(set(out))


def _variants(recompute: Any, activation_checkpointing: bool | None, sequence_parallel: bool | None,
              tp: int) -> list[tuple[str, bool]]:
    """(recompute, sequence_parallel) settings to try for a layout, fastest first: recompute only
    adds FLOPs, and SP costs the same TP bytes as plain TP while holding less (so SP comes first)."""
    from rlkit.plan.units import RECOMPUTE, recompute_mode

    if recompute is None and activation_checkpointing is None:
        modes = list(RECOMPUTE)
    elif isinstance(recompute, (list, tuple)):
        modes = [recompute_mode(r) for r in recompute]
        if not modes:
            raise PlanError(f"recompute={recompute!r} names no mode; choose from {list(RECOMPUTE)}")
    else:
        modes = [recompute_mode(recompute, activation_checkpointing)]
    modes = [m for m in RECOMPUTE if m in modes]
    sps = [True, False] if sequence_parallel is None else [bool(sequence_parallel)]
    if tp == 1:
        sps = [False]  # no TP, nothing to split the sequence over
    return [(m, sp) for m in modes for sp in sps]


def search_plans(model: Any, gpus: int, gpus_per_node: int = 8, gpu_memory: Any = "80GB", *, seq_len: int = 4096,
                 global_batch: int | None = None, micro_batch: int = 1, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", shardings: tuple[str, ...] | None = None, include_vpp: bool = True,
                 recompute: str | tuple[str, ...] | None = None, activation_checkpointing: bool | None = None,
                 sequence_parallel: bool | None = None, variants: str = "best", gpu: str | dict = "H100",
                 network: str = "nvlink+ib", mfu: float | None = None, roles: tuple[str, ...] = ("actor",),
                 flash_attention: bool = True, token_budget: int | None = None, lora: Any = None,
                 image_tokens: int = 0, freeze_vision_tower: bool = False) -> pd.DataFrame:
    """Every DP x TP x PP plan of ``model`` on ``gpus`` GPUs, ranked best first.

    Args:
        model: anything ``as_spec`` takes. gpus: GPUs in all. gpus_per_node: GPUs per node.
        gpu_memory: memory per GPU ("80GB", "141GB", bytes).
        seq_len, micro_batch: tokens per sequence and sequences per micro-batch.
        global_batch: sequences per step, the same for every plan so they compare at equal work
            (default 4 x gpus x micro_batch).
        token_budget: padding-free micro-batches of up to this many tokens (``TrainerConfig.
            micro_batch_tokens``; replaces ``micro_batch``, leave it 1): each plan runs the packer's
            micro-batch count, ``ceil(global_batch / dp / (token_budget // seq_len))`` (at least pp, a
            multiple of pp when interleaved; the ``micro_batches`` column), in one flush; memory and
            throughput are those of ``estimate_memory`` / ``estimate_throughput`` with the same
            ``token_budget``.
        shardings: dp_shard modes to try (default all of ``SHARDING``).
        include_vpp: also try interleaved 1F1B with 2 and 4 virtual stages (when every stage gets a layer).
        recompute: the activation-recompute modes to try: None (all of "none", "selective", "full"),
            one mode, or a tuple of them; ``activation_checkpointing=True`` is ``recompute="full"``.
        sequence_parallel: None (try with and without where tp > 1), True or False.
        variants: "best" keeps, for each layout and micro-batch count, the fastest (recompute,
            sequence_parallel) setting that fits (or, when none fits, the one needing least memory):
            the others are slower at no saving that matters. "all" keeps a row for every setting.
        gpu, network, mfu: for the throughput estimate (``rlkit.plan.throughput``; ``mfu=None`` is
            the calibrated kernel efficiency).
        flash_attention, precision, optimizer, roles: for the memory estimate
            (``rlkit.plan.memory.estimate_memory``). The defaults are those of every cost model here:
            a GPU training stack (bf16-mixed AdamW, flash/SDPA attention).
        lora: train LoRA adapters on the frozen model (a peft ``LoraConfig`` or an int rank; see
            ``estimate_memory``): the memory column counts grads and optimizer state of the adapters only.
            The throughput estimate stays that of full fine-tuning (LoRA skips the base's weight
            gradients and reduces only the adapters' gradients, so it is a little pessimistic). With
            ``lora_dropout > 0`` plans with tp > 1 are invalid (rlkit refuses them).
        image_tokens, freeze_vision_tower: a vision-language model's image tokens per sequence (part of
            ``seq_len``) and whether its vision tower trains, for both estimates (see ``estimate_memory``).

    A mixture-of-experts model also tries expert parallelism: ``ep`` over the divisors of ``dp`` that
    divide ``num_experts`` (with full_shard / shard_grad_op; the ``ep`` column, 1 for dense models).

    Returns one row per candidate: ``dp, tp, pp, vpp, ep, dp_shard, dp_shard_size, micro_batches,
    schedule, recompute, sequence_parallel, valid, memory_gib`` (max over ranks), ``fits,
    tokens_per_s, tokens_per_s_per_gpu, step_s, bubble, achieved_mfu, tp_spans_nodes, why_not``
    (empty when usable) and ``plan`` (the ParallelPlan). Usable plans come first, fastest first;
    then plans that do not fit, smallest first; then invalid ones.

    Fast at scale: memory is computed per pipeline rank, not per GPU (``peak_memory``), and shared by
    plans that differ only in micro-batches beyond 2 pp; communication without DataFrames.

    With a token budget of 4 sequences (16384 tokens of 4096), each DP rank's 64 / dp sequences run as
    (64 / dp) / 4 packed micro-batches (at least pp):

    >>> packed = search_plans("qwen2.5-7b", gpus=8, seq_len=4096, global_batch=64, token_budget=16384)
    >>> top = packed.iloc[0]
    >>> bool(top.micro_batches == max(top.pp, 64 // top.dp // 4)), bool(top.fits)
    (True, True)

    LoRA holds much less per GPU than full fine-tuning, so more layouts fit:

    >>> full = search_plans("qwen2.5-7b", gpus=4, gpu_memory="40GB", seq_len=4096, include_vpp=False)
    >>> lora = search_plans("qwen2.5-7b", gpus=4, gpu_memory="40GB", seq_len=4096, include_vpp=False, lora=16)
    >>> int(lora.fits.sum()) > int(full.fits.sum()), lora.attrs["lora"].r
    (True, 16)
    """
    import pandas as pd

    from rlkit.plan.memory import budget_rows, peak_memory
    from rlkit.plan.spec import LoraSpec, as_spec
    from rlkit.plan.throughput import estimate_throughput, gpu_info, network_info
    from rlkit.plan.topology import SHARDING, ParallelPlan
    from rlkit.plan.units import parse_bytes

    spec = as_spec(model)
    lo = LoraSpec.coerce(lora)
    if lo is not None:
        lo.layer_targets(spec)  # fail early on targets that match nothing
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    rows_per_mb = budget_rows(token_budget, seq_len, micro_batch) if token_budget is not None else None
    if variants not in ("best", "all"):
        raise PlanError(f"variants={variants!r} must be 'best' (one setting per layout) or 'all'")
    mem = parse_bytes(gpu_memory)
    gpu_info(gpu), network_info(network)  # fail early on a bad preset name
    _variants(recompute, activation_checkpointing, sequence_parallel, 2)  # and on a bad mode
    wanted = tuple(shardings) if shardings is not None else tuple(SHARDING)
    bad = [s for s in wanted if s not in SHARDING]
    if bad:
        raise PlanError(f"shardings={bad} are not dp_shard modes; choose from {list(SHARDING)}")
    if global_batch is None:
        global_batch = 4 * gpus * micro_batch
    per_node = min(gpus_per_node, gpus)

    rows: list[dict] = []
    memory_cache: dict[tuple, int] = {}
    spans_cache: dict[tuple[int, int, int], bool] = {}
    mem_kw = dict(seq_len=seq_len, micro_batch=micro_batch, precision=precision, optimizer=optimizer, roles=roles,
                  flash_attention=flash_attention, token_budget=token_budget, lora=lo, image_tokens=image_tokens,
                  freeze_vision_tower=freeze_vision_tower)
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            # uneven stages are allowed (the ends get fewer layers, as Llama 3 405B's pipeline did)
            vpps = [1] + ([v for v in (2, 4) if spec.num_layers >= pp * v] if include_vpp and pp > 1 else [])
            for vpp in vpps:
                n_mb, rest = divmod(global_batch, dp * micro_batch)
                base = dict(dp=dp, tp=tp, pp=pp, vpp=vpp)
                if rest:
                    rows.append({**base, "why_not": f"global_batch={global_batch} is not divisible by "
                                                    f"dp*micro_batch={dp * micro_batch}"})
                    continue
                options = _micro_batch_options(n_mb, pp, vpp)
                if rows_per_mb is not None and options:  # packed: the packer's count, in one flush
                    packed = max(pp, -(-n_mb // rows_per_mb))
                    options = [-(-packed // pp) * pp if vpp > 1 else packed]
                if not options:
                    rows.append({**base, "why_not": f"{n_mb} micro-batches per DP rank < pp={pp}; the pipeline "
                                                    f"cannot fill (raise global_batch)"})
                    continue
                try:  # the model-shape rules do not depend on sharding or micro-batches: check once
                    ParallelPlan(dp=dp, tp=tp, pp=pp, vpp=vpp, micro_batches=options[0]).validate(model=spec)
                except PlanError as e:
                    rows.append({**base, "why_not": str(e)})
                    continue
                if lo is not None and lo.lora_dropout and tp > 1:
                    rows.append({**base, "why_not": f"LoRA lora_dropout={lo.lora_dropout} needs tp=1 (TP ranks "
                                                    f"would draw different dropout masks)"})
                    continue
                settings = _variants(recompute, activation_checkpointing, sequence_parallel, tp)
                for shard, size in _shardings(dp, tp, per_node, wanted):
                    # expert parallelism (MoE models): ep over the divisors of dp that divide the experts;
                    # it splits the DP dimension, so not with HSDP or replicate (ParallelPlan refuses them)
                    eps = [e for e in _divisors(dp) if spec.num_experts % e == 0] if spec.is_moe else [1]
                    if shard in ("hybrid_shard", "replicate"):
                        eps = [1]
                    for ep, m in ((e, m) for e in eps for m in options):
                        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, vpp=vpp, dp_shard=shard, dp_shard_size=size,
                                            micro_batches=m if pp > 1 or rows_per_mb else None,
                                            devices_per_node=per_node, ep=ep)
                        if (dp, tp, pp) not in spans_cache:  # depends on the degrees only
                            spans_cache[(dp, tp, pp)] = bool(plan.placement_warnings(per_node))
                        row0 = {**base, "ep": ep, "dp_shard": shard, "dp_shard_size": size, "micro_batches": m,
                                "plan": plan, "schedule": plan.pipeline_schedule if pp > 1 else "none",
                                "tp_spans_nodes": spans_cache[(dp, tp, pp)]}
                        sized = []
                        for rc, sp in settings:
                            # activations in flight stop growing once m >= 2 pp (1F1B / interleaved)
                            key = (dp, tp, pp, vpp, ep, shard, size, min(m, 2 * pp), rc, sp)
                            if key not in memory_cache:
                                memory_cache[key] = peak_memory(plan, spec, recompute=rc, sequence_parallel=sp,
                                                                **mem_kw)["peak"]
                            sized.append((rc, sp, memory_cache[key]))
                            if variants == "best" and memory_cache[key] <= mem:
                                break  # the fastest setting that fits: the rest are slower
                        if variants == "best":
                            fitting = [v for v in sized if v[2] <= mem]
                            sized = fitting[:1] or [min(sized, key=lambda v: v[2])]
                        for rc, sp, peak in sized:
                            est = estimate_throughput(plan, spec, seq_len=seq_len, global_batch=global_batch,
                                                      micro_batch=micro_batch, gpu=gpu, mfu=mfu, network=network,
                                                      devices_per_node=per_node, precision=precision,
                                                      recompute=rc, sequence_parallel=sp, token_budget=token_budget,
                                                      image_tokens=image_tokens,
                                                      freeze_vision_tower=freeze_vision_tower)
                            row = {**row0, "recompute": rc, "sequence_parallel": sp, "memory_gib": peak / GIB,
                                   "fits": peak <= mem,
                                   **{k: est[k] for k in ("tokens_per_s", "tokens_per_s_per_gpu", "step_s",
                                                          "bubble", "achieved_mfu")}}
                            if peak > mem:
                                row["why_not"] = f"needs {peak / GIB:.1f} GiB per GPU > {mem / GIB:.1f} GiB"
                            rows.append(row)
    df = pd.DataFrame(rows)
    columns = ["dp", "tp", "pp", "vpp", "ep", "dp_shard", "dp_shard_size", "micro_batches", "schedule", "recompute",
               "sequence_parallel", "valid",
               "memory_gib", "fits", "tokens_per_s", "tokens_per_s_per_gpu", "step_s", "bubble", "achieved_mfu",
               "tp_spans_nodes", "why_not", "plan"]
    for c in columns:
        if c not in df:
            df[c] = None
    df["valid"] = df["plan"].notna()
    df["fits"] = df["fits"].fillna(False).astype(bool)
    df["why_not"] = df["why_not"].fillna("")
    df["dp_shard_size"] = df["dp_shard_size"].astype("Int64")
    df["micro_batches"] = df["micro_batches"].astype("Int64")
    df["ep"] = df["ep"].fillna(1).astype(int)
    usable = df["valid"] & df["fits"]
    df["_group"] = (~usable).astype(int) + (~df["valid"]).astype(int)
    df["_speed"] = -df["tokens_per_s"].astype(float).fillna(0)
    df = df.sort_values(["_group", "_speed", "memory_gib"], kind="stable")
    df = df.drop(columns=["_group", "_speed"])[columns].reset_index(drop=True)
    df.attrs.update(searched_all_recompute="full" in [m for m, _ in _variants(recompute, activation_checkpointing,
                                                                            sequence_parallel, 2)],
                    flash_attention=flash_attention, precision=precision, optimizer=optimizer, roles=roles,
                    lora=lo)
    df.attrs.update(model=spec.name, gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory=mem, seq_len=seq_len,
                    global_batch=global_batch, micro_batch=micro_batch, gpu=gpu, network=network,
                    variants=variants, token_budget=token_budget)
    return df


def plan_label(row: Any) -> str:
    """A row of ``search_plans`` in a few words.

    >>> plan_label({"dp": 2, "tp": 4, "pp": 1, "vpp": 1, "dp_shard": "full_shard"})
    'dp=2 tp=4 pp=1 full_shard'
    """
    s = f"dp={row['dp']} tp={row['tp']} pp={row['pp']}"
    if row["vpp"] > 1:
        s += f" vpp={row['vpp']}"
    if row.get("ep", 1) > 1:
        s += f" ep={row['ep']}"
    return s + f" {row['dp_shard']}"


# ---- recommend ------------------------------------------------------------------------------------
_SHOW = ["dp", "tp", "pp", "vpp", "dp_shard", "micro_batches", "memory_gib", "tokens_per_s", "bubble", "why_not"]


@dataclass
class Recommendation:
    """The plan ``recommend`` picked, why (in words and numbers), and the alternatives it weighed.

    >>> rec = recommend("qwen2.5-0.5b", gpus=8)
    >>> (rec.plan.dp, rec.plan.tp, rec.plan.pp)
    (8, 1, 1)
    >>> print(rec)                        # doctest: +ELLIPSIS
    dp=8 x tp=1 x pp=1 = 8 ranks; ...
    """

    plan: ParallelPlan
    reason: str
    table: pd.DataFrame
    goal: str = "throughput"
    estimate: dict | None = None

    def __str__(self) -> str:
        alt = self.table[[c for c in _SHOW if c in self.table]].head(6)
        return f"{self.reason}\n\nAlternatives (best first):\n{alt.to_string(float_format=lambda x: f'{x:,.3g}')}"

    def _repr_html_(self) -> str:
        import html

        alt = self.table[[c for c in _SHOW if c in self.table]].head(10)
        paragraphs = "".join(f"<p>{html.escape(p)}</p>" for p in self.reason.split("\n") if p.strip())
        return f"<div>{paragraphs}<p><b>Alternatives</b></p>{alt.to_html(float_format=lambda x: f'{x:,.3g}')}</div>"


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def _state_bytes_per_param(precision: str, optimizer: str) -> int:
    """Persistent bytes per parameter: weights + grads + optimizer states (ZeRO paper, sec. 3.1)."""
    from rlkit.plan.units import OPTIMIZERS, PRECISIONS

    p = PRECISIONS[precision]
    return p["param"] + p["grad"] + OPTIMIZERS[optimizer] * p["state"]


def _state(spec: Any, precision: str, optimizer: str, lora: Any = None) -> tuple[int, str]:
    """The whole model's training state in bytes (weights + grads + optimizer states), and in words.
    With LoRA the base is frozen: its weights only, and the adapters' full state."""
    b = _state_bytes_per_param(precision, optimizer)
    if lora is None:
        return spec.num_params * b, f"{b} bytes/param with {precision} {optimizer}, most of it {optimizer} state"
    from rlkit.plan.spec import LoraSpec
    from rlkit.plan.units import PRECISIONS

    n, w = LoraSpec.coerce(lora).params(spec), PRECISIONS[precision]["param"]
    return (spec.num_params * w + n * b,
            f"LoRA: the frozen weights at {w} bytes/param and the {n / 1e6:.1f}M adapter params at {b} "
            f"with {precision} {optimizer}")


def _no_fit_error(spec: Any, df: pd.DataFrame, gpus: int, per_bytes: int, precision: str, optimizer: str) -> PlanError:
    valid = df[df["valid"]]
    state, words = _state(spec, precision, optimizer, df.attrs.get("lora"))
    need = -(-state // per_bytes)
    if len(valid):
        small = valid.sort_values("memory_gib").iloc[0]
        best = f"the smallest plan ({plan_label(small)}) needs {small['memory_gib']:.1f} GiB per GPU"
    else:
        best = f"no layout is even valid ({df['why_not'].iloc[0]})"
    return PlanError(
        f"no plan of {spec.name} ({spec.num_params / 1e9:.1f}B params) fits on {gpus} GPUs with "
        f"{per_bytes / GIB:.1f} GiB each: {best}. Its training state alone is {state / GIB:.0f} GiB "
        f"({words}), so at least "
        f"{need} GPUs before activations; add GPUs, use larger-memory GPUs, or lower seq_len / micro_batch"
        + ("" if df.attrs.get("searched_all_recompute") else ", or let the search try recompute='full'"))


def recommend(model: Any, gpus: int, gpus_per_node: int = 8, gpu_memory: Any = "80GB",
              network: str = "nvlink+ib", goal: str = "throughput", **search_kw: Any) -> Recommendation:
    """Pick a plan for ``model`` on ``gpus`` GPUs and explain the choice with its numbers.

    The selection guide the numbers usually confirm:

    * a model whose training state fits on one GPU: pure data parallelism (one gradient all-reduce a
      step, no per-layer collectives, no pipeline bubble);
    * weights that do not fit: tensor parallelism inside a node (up to 8, over NVLink), since TP
      all-reduces activations in every layer;
    * still too big, or a slow network between nodes: pipeline parallelism across nodes (it sends only
      activations at stage boundaries), with enough micro-batches to keep the bubble small;
    * optimizer states dominate (12 of the 16 bytes/param of mixed-precision Adam): ZeRO-3 / FSDP
      shards them over DP.

    Goals: "throughput" takes the fastest plan that fits; "convergence" the smallest DP degree (smaller
    global batch) among plans within 2x of the fastest; "cost" the fewest GPUs (up to ``gpus``) on
    which some plan fits, then the fastest there.

    Raises ``PlanError`` with the numbers when no plan fits. ``search_kw`` go to ``search_plans``.

    >>> rec = recommend("llama-2-70b", gpus=64)
    >>> rec.plan.tp > 1 and rec.plan.tp <= 8
    True
    """
    from rlkit.plan.spec import as_spec
    from rlkit.plan.throughput import network_info
    from rlkit.plan.units import parse_bytes

    if goal not in GOALS:
        raise PlanError(f"goal={goal!r} is not a goal; choose one of {list(GOALS)}")
    spec = as_spec(model)
    net = network_info(network)
    per_bytes = parse_bytes(gpu_memory)
    precision = search_kw.get("precision", "bf16-mixed")
    optimizer = search_kw.get("optimizer", "adamw")
    micro_batch = search_kw.get("micro_batch", 1)
    search_kw.setdefault("global_batch", 4 * gpus * micro_batch)  # the same work for every GPU count

    def search(n: int) -> pd.DataFrame:
        return search_plans(spec, n, gpus_per_node, gpu_memory, network=network, **search_kw)

    tried: list[int] = []
    if goal == "cost":
        counts = sorted({n for n in (1, 2, 4, 8) if n <= min(gpus_per_node, gpus)}
                        | set(range(gpus_per_node, gpus + 1, gpus_per_node)) | {gpus})
        for n in counts:
            df, n_used = search(n), n
            tried.append(n)
            if (df["valid"] & df["fits"]).any():
                break
    else:
        df, n_used = search(gpus), gpus
    usable = df[df["valid"] & df["fits"]]
    if usable.empty:
        raise _no_fit_error(spec, df, gpus, per_bytes, precision, optimizer)

    pick = usable.iloc[0]
    if goal == "convergence":
        close = usable[usable["tokens_per_s"] >= 0.5 * pick["tokens_per_s"]]
        pick = close.sort_values(["dp", "tokens_per_s"], ascending=[True, False], kind="stable").iloc[0]
    plan = pick["plan"]
    gib = per_bytes / GIB
    lines = [
        f"{plan.describe()}. For {spec.name} ({spec.num_params / 1e9:.2f}B params) on {n_used} x {per_bytes / 1e9:.0f} GB "
        f"GPUs ({network}), goal '{goal}': estimated {_fmt_rate(pick['tokens_per_s'])} tokens/s "
        f"({_fmt_rate(pick['tokens_per_s_per_gpu'])}/GPU, {pick['achieved_mfu']:.0%} MFU), "
        f"{pick['memory_gib']:.1f} GiB per GPU of {gib:.1f}, pipeline bubble {pick['bubble']:.1%}."]
    lines += _why_shape(spec, df, pick, plan, gib, net, precision, optimizer)
    if goal == "convergence":
        gb = plan.dp * micro_batch * (plan.n_micro_batches if plan.pp > 1 else 1)
        lines.append(f"Goal 'convergence': of the {len(close)} plans within 2x of the fastest, this one has the "
                     f"smallest DP degree (dp={plan.dp}), so the global batch can be as small as {gb} sequences "
                     f"per step; pure throughput would pick {plan_label(usable.iloc[0])} at "
                     f"{_fmt_rate(usable.iloc[0]['tokens_per_s'])} tokens/s.")
    if goal == "cost":
        lines.append(f"Goal 'cost': {n_used} GPUs is the fewest on which a plan fits (tried {tried}); with all "
                     f"{gpus} GPUs the fastest plan would run more tokens/s at a higher price.")
    others = usable[usable.index != pick.name]
    if len(others):
        nxt = others.iloc[0]
        lines.append(f"Next best: {plan_label(nxt)} at {_fmt_rate(nxt['tokens_per_s'])} tokens/s, "
                     f"{nxt['memory_gib']:.1f} GiB per GPU. {len(usable)} of {len(df)} candidates fit; "
                     f"{int((~df['valid']).sum())} are invalid (see the why_not column).")
    return Recommendation(plan=plan, reason="\n".join(lines), table=df, goal=goal, estimate=pick.to_dict())


def _why_shape(spec: Any, df: pd.DataFrame, pick: Any, plan: Any, gib: float, net: dict, precision: str,
               optimizer: str) -> list[str]:
    """The selection guide, applied to this pick, citing the numbers that decided it."""
    out = []
    pure = df[df["valid"] & (df["tp"] == 1) & (df["pp"] == 1)].sort_values("memory_gib")
    state, words = _state(spec, precision, optimizer, df.attrs.get("lora"))
    state_gib = state / GIB
    if plan.tp == 1 and plan.pp == 1:
        out.append(f"The model fits with data parallelism alone ({pick['memory_gib']:.1f} GiB per GPU), so "
                   f"pure DP: one gradient reduction per step, no per-layer collectives, no pipeline bubble.")
    else:
        if len(pure) and not pure.iloc[0]["fits"]:
            out.append(f"Pure DP does not fit: even fully sharded it needs {pure.iloc[0]['memory_gib']:.1f} GiB "
                       f"per GPU (> {gib:.1f}).")
        elif len(pure):
            best_pure = pure[pure["fits"]].sort_values("tokens_per_s", ascending=False).iloc[0]
            out.append(f"Pure DP fits ({best_pure['memory_gib']:.1f} GiB) but is estimated slower "
                       f"({_fmt_rate(best_pure['tokens_per_s'])} tokens/s).")
        if plan.tp > 1:
            where = "inside one node, over NVLink" if not pick["tp_spans_nodes"] else "ACROSS nodes (slow)"
            out.append(f"TP={plan.tp} splits every layer's weights and activations {where}; TP all-reduces "
                       f"activations in every layer, so it belongs on the fastest links "
                       f"({net['intra_node_bw'] / 1e9:.0f} GB/s here).")
        if plan.pp > 1:
            out.append(f"PP={plan.pp} splits the {spec.num_layers} layers into stages, which can sit on different "
                       f"nodes: only activations cross a stage boundary ({net['inter_node_bw'] / 1e9:.1f} GB/s "
                       f"between nodes here). {plan.pipeline_schedule} with {plan.n_micro_batches} micro-batches"
                       + (f" and {plan.vpp} virtual stages" if plan.vpp > 1 else "")
                       + f" leaves a {pick['bubble']:.1%} bubble.")
    if pick.get("recompute", "none") != "none" or pick.get("sequence_parallel"):
        from rlkit.plan.memory import peak_memory

        bare = peak_memory(plan, spec, seq_len=df.attrs["seq_len"], micro_batch=df.attrs["micro_batch"],
                           precision=precision, optimizer=optimizer, roles=df.attrs.get("roles", ("actor",)),
                           flash_attention=df.attrs.get("flash_attention", True),
                           token_budget=df.attrs.get("token_budget"), lora=df.attrs.get("lora"))["peak"] / GIB
        what = []
        if pick["sequence_parallel"]:
            what.append("sequence parallelism (norm and dropout activations split over TP, same TP bytes)")
        if pick["recompute"] != "none":
            what.append(f"recompute='{pick['recompute']}' ("
                        + ("the attention core is recomputed in backward, a few % more FLOPs" if pick["recompute"]
                           == "selective" else "each layer's forward runs again in backward, 1/3 more FLOPs") + ")")
        out.append(f"Activations: {' and '.join(what)}; without either this layout needs {bare:.1f} GiB per GPU"
                   + (f", over the {gib:.1f} GiB." if bare > gib else "."))
    if plan.dp > 1:
        rep_txt = ""
        if plan.dp_shard != "replicate":  # the same layout and settings, replicated
            from dataclasses import replace

            from rlkit.plan.memory import peak_memory

            rep = peak_memory(replace(plan, dp_shard="replicate", dp_shard_size=None), spec,
                              seq_len=df.attrs["seq_len"], micro_batch=df.attrs["micro_batch"], precision=precision,
                              optimizer=optimizer, roles=df.attrs.get("roles", ("actor",)),
                              flash_attention=df.attrs.get("flash_attention", True),
                              token_budget=df.attrs.get("token_budget"), lora=df.attrs.get("lora"),
                              recompute=pick.get("recompute", "none"),
                              sequence_parallel=bool(pick.get("sequence_parallel", False)))["peak"] / GIB
            rep_txt = f"; replicated (DDP) it would take {rep:.1f} GiB per GPU"
            rep_txt += "" if rep <= gib else f", over the {gib:.1f} GiB"
        if plan.dp_shard != "replicate":
            zero = "ZeRO-2" if plan.dp_shard == "shard_grad_op" else "ZeRO-3/FSDP"
            out.append(f"DP={plan.dp} with {plan.dp_shard} ({zero}): the training state is {state_gib:.1f} GiB "
                       f"in all ({words}), sharded over {plan.dp_shard_degree} ranks: {pick['memory_gib']:.1f} "
                       f"GiB per GPU{rep_txt}.")
        else:
            out.append(f"DP={plan.dp} replicates the model (DDP): the state fits ({pick['memory_gib']:.1f} GiB per "
                       f"GPU), and replication avoids FSDP's weight all-gathers.")
    return out
