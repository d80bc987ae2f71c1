"""`rlkit plan`: print a parallel plan from the command line.

    rlkit plan --model qwen2.5-7b --dp 2 --tp 2 --pp 2 --gpu-memory 80GB

prints the plan summary, its process groups, the per-rank table (abbreviated for big plans), and the
estimated memory per rank and pipeline bubble. A bad plan prints the PlanError's one-line message
(which names the value and the fix) and exits with status 2, like any other usage error.

>>> main(["--dp", "4", "--tp", "8", "--pp", "16", "--devices-per-node", "8"])  # doctest: +ELLIPSIS
Plan: dp=4 x tp=8 x pp=16 = 512 ranks; DP full_shard; 1f1b with 16 micro-batches
...
0
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from rlkit.errors import PlanError
from rlkit.plan.topology import SCHEDULES, SHARDING, ParallelPlan, short_list

GIB = 2**30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlkit plan", description="Show a DP x TP x PP plan: groups, ranks, "
                                "memory per rank and pipeline bubble.")
    p.add_argument("--model", help="bundled model name (e.g. qwen2.5-7b), local folder with config.json, or hub id")
    for dim, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline")):
        p.add_argument(f"--{dim}", type=int, default=1, help=f"{what}-parallel degree (default 1)")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per rank (interleaved 1F1B)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per step (default: pp)")
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default: 1f1b, interleaved with vpp>1)")
    p.add_argument("--order", default="tp-dp-pp", help="rank order, fastest dim first (default: tp-dp-pp)")
    p.add_argument("--dp-shard", default="full_shard", choices=sorted(SHARDING), help="how DP holds model state")
    p.add_argument("--dp-shard-size", type=int, help="sharding group size for --dp-shard hybrid_shard")
    p.add_argument("--devices-per-node", type=int, help="devices per node (default: all ranks on one node)")
    p.add_argument("--seq-len", type=int, default=4096, help="sequence length for the memory estimate")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch for the memory estimate")
    p.add_argument("--gpu-memory", help="device memory, e.g. 80GB or 80GiB: adds a fits column")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recompute for the memory estimate (default none)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism with TP")
    p.add_argument("--eager-attention", action="store_true",
                   help="attention that keeps the s^2 scores (CPU / eager); the default is flash/SDPA as on GPUs")
    p.add_argument("--max-rows", type=int, default=32, help="abbreviate the rank table past this many rows")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `rlkit plan` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.max_rows < 1:
            raise PlanError(f"max_rows={args.max_rows} must be a positive integer (rank-table rows shown), e.g. 32")
        plan = ParallelPlan(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, order=args.order,
                            dp_shard=args.dp_shard, dp_shard_size=args.dp_shard_size,
                            micro_batches=args.micro_batches, schedule=args.schedule,
                            devices_per_node=args.devices_per_node)
        if args.model:
            plan.validate(model=args.model)
        print(report(plan, args.model, seq_len=args.seq_len, micro_batch=args.micro_batch,
                     gpu_memory=args.gpu_memory, max_rows=args.max_rows, recompute=args.recompute,
                     sequence_parallel=args.sequence_parallel, flash_attention=not args.eager_attention))
    except PlanError as e:
        # the message already names the bad value and the fix; a traceback would only hide it
        print(f"rlkit plan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rlkit plan ... | head`: the reader left early, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def report(plan: ParallelPlan, model: Any = None, *, seq_len: int = 4096, micro_batch: int = 1,
           gpu_memory: str | int | None = None, max_rows: int = 32, **memory_kw: Any) -> str:
    """The text `rlkit plan` prints, as a string. ``memory_kw`` go to ``estimate_memory``
    (recompute, sequence_parallel, flash_attention: its defaults are the CLI's).

    >>> print(report(ParallelPlan(dp=2, tp=2)).splitlines()[0])
    Plan: dp=2 x tp=2 x pp=1 = 4 ranks; DP full_shard
    """
    out = [f"Plan: {plan.describe()}"]
    if model is not None:
        from rlkit.plan.spec import as_spec

        spec = as_spec(model)
        moe = (f" ({spec.active_params / 1e9:.2f}B active: {spec.num_experts} experts, top-{spec.num_experts_per_tok})"
               if spec.is_moe else "")
        out.append(f"Model: {spec.name}: {spec.num_params / 1e9:.2f}B params{moe}, {spec.num_layers} layers, "
                   f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads")
    out += ["", "Groups (the ranks that communicate along one dimension):", *_groups_lines(plan)]
    for w in plan.placement_warnings():
        out.append(f"Warning: {w}")
    out += ["", _table_text(plan, model, max_rows)]
    if model is not None:
        out += ["", _memory_text(plan, model, seq_len, micro_batch, gpu_memory, **memory_kw)]
    if plan.pp > 1:
        out += ["", _bubble_text(plan)]
    return "\n".join(out)


def _groups_lines(plan: ParallelPlan, first: int = 4) -> list[str]:
    lines = []
    for dim in ("tp", "pp", "dp"):
        groups = plan.groups(dim)
        shown = "  ".join(short_list(g) for g in groups[:first]) + ("  …" if len(groups) > first else "")
        lines.append(f"  {dim.upper()}: {len(groups)} groups of {plan.size(dim)}: {shown}")
    return lines


def _table_text(plan: ParallelPlan, model: Any, max_rows: int) -> str:
    table = plan.table(model)
    if len(table) <= max_rows:
        return f"Ranks:\n{table.to_string(index=False)}"
    import pandas as pd

    head, tail = max_rows * 2 // 3, max_rows // 3
    # one to_string for head and tail together keeps the columns aligned across the gap
    lines = pd.concat([table.head(head), table.tail(tail)]).to_string(index=False).splitlines()
    lines.insert(head + 1, f"  … {len(table) - head - tail} more ranks …")
    return f"Ranks (first {head} and last {tail} of {len(table)}):\n" + "\n".join(lines)


def _memory_text(plan: ParallelPlan, model: Any, seq_len: int, micro_batch: int,
                 gpu_memory: str | int | None, **memory_kw: Any) -> str:
    if importlib.util.find_spec("rlkit.plan.memory") is None:
        return "Memory per rank: (rlkit.plan.memory is not available in this version)"
    from rlkit.plan import memory
    from rlkit.plan.memory_report import collapse_ranks, explain_fit

    df = memory.estimate_memory(plan, model, seq_len=seq_len, micro_batch=micro_batch, device_memory=gpu_memory,
                                **memory_kw)
    kinds = collapse_ranks(df)
    # all-zero components (no rollout engine, say) would only widen the table
    byte_cols = [c for c in kinds.columns if c not in ("ranks", "count", "fits") and (c == "total" or kinds[c].any())]
    shown = kinds[["ranks", "count"]].copy()
    for c in byte_cols:
        shown[c] = (kinds[c] / GIB).round(2)
    if "fits" in kinds.columns:
        shown["fits"] = kinds["fits"]
    settings = f"recompute={df.attrs['recompute']}, sequence_parallel={df.attrs['sequence_parallel']}, " \
               f"{'flash' if df.attrs['flash_attention'] else 'eager'} attention"
    text = (f"Memory per rank in GiB (seq_len={seq_len}, micro_batch={micro_batch}, {settings}; identical ranks "
            f"grouped):\n"
            + shown.to_string(index=False))
    if "fits" in df.columns:
        text += "\n" + explain_fit(df)
    return text


def _bubble_text(plan: ParallelPlan) -> str:
    return (f"Pipeline: {plan.pipeline_schedule}, pp={plan.pp}" + (f", vpp={plan.vpp}" if plan.vpp > 1 else "")
            + f", {plan.n_micro_batches} micro-batches: bubble {plan.bubble_fraction():.1%} of step time "
            f"((pp-1)/(vpp*m+pp-1))")


if __name__ == "__main__":
    sys.exit(main())
