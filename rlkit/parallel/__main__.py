"""``torchrun --nproc-per-node N -m rlkit.parallel --dp .. --tp .. --pp .. --model PATH|tiny-qwen2``

Applies the plan to the model, checks it against the single-process model and prints a report
(loss, max |d logprob|, max |d grad|, step time, memory per rank). ``--json FILE`` writes the
report for scripts and tests. Exit code 0 only when every difference is within ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlkit.errors import PlanError, WorkerError


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlkit.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models), cut out of --dp")
    p.add_argument("--router-aux-coef", type=float, default=0.0, help="MoE: weight of the load-balancing loss")
    p.add_argument("--router-z-coef", type=float, default=0.0, help="MoE: weight of the router z-loss")
    p.add_argument("--dp-shard", default="full_shard")
    p.add_argument("--dp-shard-size", type=int, default=None)
    p.add_argument("--schedule", default=None, help="gpipe | 1f1b | interleaved-1f1b")
    p.add_argument("--micro-batches", type=int, default=None)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="tiny-qwen2", help="a path / hub id, or tiny-qwen2 | tiny-llama | tiny-qwen3_moe")
    p.add_argument("--head", default="lm", choices=["lm", "value"])
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--padding-free", action="store_true",
                   help="packed rows and token-weighted micro-batches against the padded single process")
    p.add_argument("--token-budget", type=int, default=None, help="tokens per micro-batch (with --padding-free)")
    p.add_argument("--lora", type=int, default=None, help="train LoRA adapters of this rank (alpha 2r)")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated target modules (with --lora)")
    p.add_argument("--freeze-vision", action="store_true", help="a vision-language model: keep its tower fixed")
    p.add_argument("--ckpt", default=None, help="folder for a save -> load -> continue check")
    p.add_argument("--reshard-from", default=None,
                   help="a --ckpt run's step1 folder written by another plan: load it into this plan and go on")
    p.add_argument("--json", default=None, help="write the report here (rank 0)")
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=1e-3,
                   help="AdamW lr of the compared steps (1e-3 moves a tiny model; a pretrained one wants ~1e-5)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    p.add_argument("--fail-rank", type=int, default=None, help="inject a failure on this rank (testing)")
    p.add_argument("--load-only", action="store_true",
                   help="only build the model: report peak RSS per rank while loading, beside its weights")
    return p.parse_args(argv)


def resolve_model(name: str) -> str:
    if name.startswith("tiny-"):
        from rlkit.models import tiny_lm

        return tiny_lm(name.removeprefix("tiny-"), size="test")
    return name


def _lora_config(args: argparse.Namespace):
    if args.lora is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=args.lora_targets.split(","))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from rlkit.parallel.check import format_report, run_check
    from rlkit.parallel.dist import init_distributed, propagate_errors
    from rlkit.plan.topology import ParallelPlan

    plan = ParallelPlan(dp=args.dp, tp=args.tp, pp=args.pp, vpp=args.vpp, dp_shard=args.dp_shard,
                        dp_shard_size=args.dp_shard_size, schedule=args.schedule,
                        micro_batches=args.micro_batches, ep=args.ep)
    rank, _ = init_distributed(timeout_s=args.timeout)
    try:
        with propagate_errors():
            if rank == 0:
                model = resolve_model(args.model)  # builds a tiny model once, before the others read it
            dist.barrier()
            if rank != 0:
                model = resolve_model(args.model)
            if args.load_only:
                from pathlib import Path

                from rlkit.parallel.check import measure_load

                arch = json.loads((Path(model) / "config.json").read_text()).get("model_type")
                tiny = resolve_model("tiny-llama" if arch == "llama" else "tiny-qwen2")
                try:  # the warm-up takes first-use costs out; a plan the tiny model cannot take skips it
                    plan.validate(model=tiny)
                except PlanError:
                    tiny = None
                rep = measure_load(model, plan, warmup=tiny)
                if rank == 0 and args.json:
                    with open(args.json, "w") as f:
                        json.dump(rep, f, indent=1, default=str)
                if rank == 0:
                    import pandas as pd

                    print(pd.DataFrame(rep["load"]).to_string(index=False), flush=True)
                dist.destroy_process_group()
                return 0
            if args.reshard_from:
                from rlkit.parallel.check import run_reshard_check

                rep = run_reshard_check(model, plan, args.reshard_from, steps=args.steps, seq_len=args.seq_len,
                                        micro_batch_size=args.micro_batch_size, lr=args.lr)
            else:
                rep = run_check(model, plan, steps=args.steps, seq_len=args.seq_len,
                                micro_batch_size=args.micro_batch_size, head=args.head, ckpt_dir=args.ckpt,
                                lr=args.lr, fail_rank=args.fail_rank,
                                activation_checkpointing=args.activation_checkpointing,
                                padding_free=args.padding_free, token_budget=args.token_budget,
                                lora=_lora_config(args), router_aux_coef=args.router_aux_coef,
                                router_z_coef=args.router_z_coef, freeze_vision=args.freeze_vision)
    except WorkerError as e:
        # The failing rank prints the whole traceback; the others one line naming it.
        text = str(e) if e.rank == rank else str(e).splitlines()[0]
        print(f"[rank {rank}] WorkerError(rank={e.rank}): {text}", file=sys.stderr, flush=True)
        return 3
    ok = all(rep.get(k, 0.0) <= args.tol for k in ("max_dlogprob", "max_dentropy", "max_dgrad",
                                                     "max_dweight", "resume_max_dweight", "max_dadapter",
                                                     "reshard_max_dweight_loaded", "reshard_max_dweight"))
    rep["ok"] = ok
    if rank == 0:
        print(format_report(rep), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1, default=str)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
