"""Rollout throughput of the 3D-HybridEngine's generation layout against one engine per DP group.

    .venv/bin/python bench/bench_hybrid_rollout.py                 # 4 ranks, ParallelPlan(dp=2, tp=2)
    .venv/bin/python bench/bench_hybrid_rollout.py --dp 1          # 2 ranks, ParallelPlan(tp=2): a core each
    .venv/bin/python bench/bench_hybrid_rollout.py --size 10m --rounds 5

On local gloo ranks training under dp x tp=2 (4 ranks by default), one rollout of the same prompts and seeds
three ways:

* ``single``: today's default, ``Rollout(tp=None)``: one HF engine per DP group (2 engines), the full
  weights streamed to it; the group's other rank waits;
* ``tp1``: ``Rollout(tp=1)``: every rank an engine on its half of its replica's prompts;
* ``tp2``: ``Rollout(tp=2)``: one DTensor-TP engine per replica, over both ranks.

Each includes its weight movement (sync or resharding). Rounds interleave the layouts; medians are
printed. Tokens are forced (``ignore_eos``) so every layout generates the same count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

LAYOUTS = ("single", "tp1", "tp2")


def worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    from rlkit.models import tiny_lm
    from rlkit.parallel import ParallelModel, build_generation_groups
    from rlkit.plan import ParallelPlan
    from rlkit.plan.hybrid import GenerationLayout
    from rlkit.rollout import Rollout, make_engine
    from rlkit.workers.hybrid import HybridRollout
    from rlkit.workers.layout import SequenceLayout, generate_batch

    rank = dist.get_rank()
    box = [tiny_lm("llama", size=args.size, tie_word_embeddings=False) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    plan = ParallelPlan(dp=args.dp, tp=2)
    pm = ParallelModel(path, plan, lr=1e-3)
    ro = Rollout(engine="hf", n=args.n, max_new_tokens=args.tokens, ignore_eos=True)
    words = ["the quick brown fox", "what is two plus two ?", "count the apples :", "a b c d",
             "reinforcement learning", "one two three", "the lazy dog", "12+7="]
    dp_rank = plan.coords(rank)["dp"]
    mine = [words[(dp_rank * args.prompts + i) % len(words)] for i in range(args.prompts)]
    chunk = {"prompt": mine, "uid": list(range(args.prompts)), "row": list(range(args.prompts))}
    seq = SequenceLayout(16, args.tokens)
    engine_ranks = [plan.rank(dp=d, tp=0) for d in range(plan.dp)]
    single = make_engine(ro, path) if rank in engine_ranks else None
    hybrid = {f"tp{t}": HybridRollout(path, pm, build_generation_groups(GenerationLayout(plan, t)), ro)
              for t in (1, 2)}

    def run(layout: str) -> tuple[float, float, int]:
        dist.barrier()
        t0 = time.perf_counter()
        if layout == "single":
            stream = pm.iter_full_weights(to=engine_ranks)
            if single is not None:
                single.load_weights((n, t) for n, t in stream if t is not None)
            for _ in stream:
                pass
            t_sync = time.perf_counter() - t0
            out = generate_batch(single, seq, chunk, 11) if single is not None else None
        else:
            t_sync = hybrid[layout].reshard()["seconds"]
            out = hybrid[layout].generate(chunk, 11, seq)
        dist.barrier()
        tokens = int(out["response_mask"].sum()) if out is not None else 0
        return time.perf_counter() - t0, t_sync, tokens

    for layout in LAYOUTS:  # warm-up: first calls allocate and build caches
        run(layout)
    rows = []
    for r in range(args.rounds):
        order = LAYOUTS[r % 3:] + LAYOUTS[:r % 3]  # interleaved, rotating which goes first
        for layout in order:
            total, t_sync, tokens = run(layout)
            toks: list = [None] * dist.get_world_size()
            dist.all_gather_object(toks, tokens)
            rows.append({"round": r, "layout": layout, "seconds": total, "sync_s": t_sync, "tokens": sum(toks)})
    if rank == 0:
        Path(args.json).write_text(json.dumps({"rows": rows, "model": Path(path).name}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", help="tiny_lm size: test | small | demo | 10m")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per DP replica")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2, help="DP replicas of tp=2 (ranks = 2 * dp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    import pandas as pd

    from rlkit.parallel.launch import launch

    root = Path(__file__).resolve().parent.parent
    os.chdir(root)  # so `python -m bench.bench_hybrid_rollout` finds this file on every rank
    out = Path("runs/bench-hybrid")
    argv = [a for a in sys.argv[1:]]
    res = launch(2 * args.dp, argv, out, module="bench.bench_hybrid_rollout", timeout=1800)
    if res.report is None:
        sys.exit(f"the ranks failed: {res.returncodes}\n{res.log()}")
    df = pd.DataFrame(res.report["rows"])
    table = df.groupby("layout").agg(seconds=("seconds", "median"), sync_s=("sync_s", "median"),
                                     tokens=("tokens", "first")).reindex(list(LAYOUTS))
    table["tokens/s"] = table["tokens"] / table["seconds"]
    table["vs single"] = table["tokens/s"] / table.loc["single", "tokens/s"]
    table["engines"] = [args.dp, 2 * args.dp, args.dp]
    print(f"model {res.report['model']}; {2 * args.dp} ranks, ParallelPlan(dp={args.dp}, tp=2); {args.prompts} prompts per replica x "
          f"n={args.n} x {args.tokens} tokens; median of {args.rounds} interleaved rounds")
    print(table.round(3).to_string())


if __name__ == "__main__":
    main()
