"""Weight sync against its floor, over model size (issue 13): bytes and seconds per sync, each through a
real ``rlkit.Trainer``, beside a plain copy of the same bytes (plus, for dp > 1, their loopback transfer).

    .venv/bin/python bench/bench_sync.py                 # tiny qwen2 sizes, every layout (~3.5 min here)
    .venv/bin/python bench/bench_sync.py --big           # + SmolLM2-135M-Instruct (~4.5 min in all, load ~1.3)
    .venv/bin/python bench/bench_sync.py --sizes test --layouts a,c --steps 3   # a smoke run

Layouts (each a Trainer that runs ``--steps`` GRPO steps of 2 prompts x 2 samples x 4 tokens; the table
keeps the median of rlkit's ``sync/seconds`` and ``sync/bytes`` over the steps after the first):

* a: dp=1, default Rollout: the HF engine generates with the actor's own tensors (t_g = 1): 0 bytes.
* b: dp=1, a separate fp32 HFEngine fed by ``iter_full_weights`` + ``load_weights`` (copy). rlkit picks
  this path by itself only when the engine's dtype differs (b16 below); to get it in fp32 without changing
  rlkit, this script turns off weight sharing (``rlkit.workers.rl._can_share_actor_weights``) in this
  process, where the dp=1 worker runs.
* b16: dp=1, ``Rollout(dtype="bfloat16")``: the same stream, and the copy also converts fp32 -> bf16.
* c: dp=2 FSDP full_shard (Ray, ``Cluster(num_cpus=2)``), ``Rollout(tp=1)``: the Resharder gathers the
  weights inside the DP group for the engine, in 64 MiB buckets (one gloo broadcast from each rank per bucket).
* d: dp=2 ``dp_shard="replicate"``, ``Rollout(tp=1)``: each rank's engine runs on its own replica: 0 bytes.
* e: dp=1 actor + one rollout worker, ``placement="split"``: full weights from the actor's rank 0 to the
  rollout worker over the weight channel (``rlkit.workers.weight_channel``: gloo broadcasts of 64 MiB buckets).

The floor of B bytes: ``copy_`` of tensors with the model's shapes holding B bytes (same dtypes as the
sync; the median of 3 repeats after each layout's run, then over layouts; 1 torch thread like the ranks), plus, where bytes cross processes, the time a
gloo collective of one flat tensor moves them between 2 processes on 127.0.0.1 (an all_gather for
FSDP's gather, a broadcast of the full model for split placement), measured here at each model's size.
ratio = sync s / floor s; the issue's target is 2x. gloo's all_gather moves bytes several times slower
than its broadcast here, so the table also gives the floor at the faster of the two bandwidths.

What each "bytes" column means: ``rlkit bytes`` is rlkit's ``sync/bytes`` (bytes a rank *received* from
other ranks); ``copied bytes`` is what ``HFEngine.load_weights`` wrote (recorded by wrapping it), which
rlkit's metric does not count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import torch

LAYOUTS = {
    "a": "dp=1, shared tensors (default)",
    "b": "dp=1, separate fp32 engine (copy)",
    "b16": "dp=1, separate bf16 engine (copy + fp32->bf16)",
    "c": "dp=2 full_shard, Rollout(tp=1) (all-gather)",
    "d": "dp=2 replicate, Rollout(tp=1)",
    "e": "dp=1 + split rollout worker (weight channel)",
}
PROMPTS = ["the quick brown fox", "what is two plus two ?", "count the apples :", "a b c d"] * 4


# ---- floors ----------------------------------------------------------------------------------------
def copy_seconds(shapes: list[tuple[int, ...]], src: torch.dtype, dst: torch.dtype, repeats: int = 7) -> float:
    """Median seconds of ``d.copy_(s)`` over tensors of ``shapes`` (``src`` into ``dst`` dtype).

    >>> copy_seconds([(4, 4)], torch.float32, torch.float32) >= 0
    True
    """
    if not shapes:
        return 0.0
    srcs = [torch.randn(s, dtype=src) for s in shapes]
    dsts = [torch.empty(s, dtype=dst) for s in shapes]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _transfer_rank(rank: int, port: int, sizes: list[int], repeats: int, out: dict) -> None:
    """One of the 2 gloo processes: median seconds of an all_gather (each rank holds half) and of a
    broadcast of one flat fp32 tensor of each size in ``sizes`` (bytes)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's deprecation
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for nbytes in sizes:
        n = max(2, nbytes // 4) // 2 * 2
        full = torch.empty(n)
        half = torch.randn(n // 2)
        ag, bc = [], []
        for _ in range(repeats):  # interleaved, so load drifts hit both alike
            dist.barrier()
            t = time.perf_counter()
            dist.all_gather_into_tensor(full, half)
            ag.append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            dist.broadcast(full, src=0)
            bc.append(time.perf_counter() - t)
        res[nbytes] = {"all_gather_s": statistics.median(ag), "broadcast_s": statistics.median(bc),
                       "all_gather_received": (n // 2) * 4, "broadcast_received": n * 4}
    if rank == 1:  # the receiving side of the broadcast
        out.update(res)
    dist.destroy_process_group()


def transfer_seconds(sizes: list[int], repeats: int = 5) -> dict[int, dict[str, float]]:
    """Loopback gloo transfers between 2 fresh processes, per size (bytes of the full flat tensor)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_transfer_rank, args=(port, sizes, repeats, out), nprocs=2, join=True)
        return dict(out)


# ---- what the workers report -------------------------------------------------------------------------
def _record_loads(worker) -> bool:
    """Wrap this rank's ``engine.load_weights`` to keep what each call copied (bytes, seconds)."""
    eng = getattr(worker, "engine", None)
    if eng is None or not hasattr(eng, "load_weights"):
        return False
    fn = eng.load_weights
    worker._bench_loads = []

    def load(named, *a, **k):
        stats = fn(named, *a, **k)
        worker._bench_loads.append(dict(stats))
        return stats

    eng.load_weights = load
    return True


def _loads(worker) -> list[dict]:
    return list(getattr(worker, "_bench_loads", []))


def _meta(worker) -> dict:
    """The actor's parameters (full shapes, each tensor once), its dtype, and which sync path runs."""
    meta = worker.actor._param_meta()
    eng = getattr(worker, "engine", None)
    edtype = next(eng.model.parameters()).dtype if eng is not None and hasattr(eng, "model") else None
    return {"shapes": [m[1] for m in meta], "dtype": meta[0][2], "engine_dtype": edtype,
            "shared": worker.hybrid is not None, "threads": torch.get_num_threads()}


@contextmanager
def separate_engine():
    """No weight sharing while a dp=1 (in-process) Trainer is built: rlkit then gives its worker a
    separate HFEngine in the rollout dtype, synced by a full copy after each update."""
    import rlkit.workers.rl as rl

    keep = rl._can_share_actor_weights
    rl._can_share_actor_weights = lambda *a, **k: False
    try:
        yield
    finally:
        rl._can_share_actor_weights = keep


# ---- one layout --------------------------------------------------------------------------------------
def run_layout(key: str, model: str, steps: int, cluster_fn) -> dict:
    import rlkit

    def reward(prompts, completions, **kw):
        return [float(len(c) % 3) for c in completions]

    rollout = dict(engine="hf", n=2, max_new_tokens=4, ignore_eos=True)
    kw: dict = dict(model=model, dataset=[{"prompt": p} for p in PROMPTS], reward=reward, algorithm="grpo",
                    prompts_per_step=2, lr=1e-4, seed=0, run_dir=tempfile.mkdtemp(prefix="rlkit-bench-sync-"))
    if key in ("a", "b"):
        kw.update(plan=rlkit.ParallelPlan(), rollout=rlkit.Rollout(**rollout))
    elif key == "b16":
        kw.update(plan=rlkit.ParallelPlan(), rollout=rlkit.Rollout(**rollout, dtype="bfloat16"))
    elif key == "c":
        kw.update(plan=rlkit.ParallelPlan(dp=2), rollout=rlkit.Rollout(**rollout, tp=1), cluster=cluster_fn())
    elif key == "d":
        kw.update(plan=rlkit.ParallelPlan(dp=2, dp_shard="replicate"), rollout=rlkit.Rollout(**rollout, tp=1),
                  cluster=cluster_fn())
    elif key == "e":
        kw.update(plan=rlkit.ParallelPlan(), rollout=rlkit.Rollout(**rollout), cluster=cluster_fn(),
                  placement="split")
    else:
        raise ValueError(f"layout {key!r}: choose from {sorted(LAYOUTS)}")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if key == "b":
        with separate_engine():
            tr = rlkit.Trainer(**kw)
    else:
        tr = rlkit.Trainer(**kw)
    start_s = time.perf_counter() - t0
    try:
        meta = tr.group.apply(_meta)[0]
        loader = tr.rollout_group or tr.group
        recording = any(loader.apply(_record_loads))
        rows = [tr.train_step() for _ in range(steps)]
        loads = [x for per_rank in loader.apply(_loads) for x in per_rank]
        if tr.rollout_group is not None:
            meta["engine_dtype"] = tr.rollout_group.apply(_engine_dtype)[0]
    finally:
        tr.close()
    later = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in later)  # noqa: E731
    return {"layout": key, "rlkit_bytes": med("sync/bytes"), "sync_s": med("sync/seconds"),
            "driver_sync_s": med("timing/sync"), "step_s": med("timing/step"),
            "copied_bytes": statistics.median(x["bytes"] for x in loads[1:] or loads) if recording and loads else 0.0,
            "load_s": statistics.median(x["seconds"] for x in loads[1:] or loads) if recording and loads else 0.0,
            "start_s": start_s, "load_avg": load, **meta}


def _engine_dtype(worker):
    return next(worker.engine.model.parameters()).dtype


# ---- the floor of one row ----------------------------------------------------------------------------
def floor_of(res: dict, copies: dict, transfers: dict[int, dict], full_bytes: int,
             best: bool = False) -> tuple[float, str]:
    """(floor seconds, how it is made) for one measured layout. ``best``: the transfer at the faster of
    the two measured loopback bandwidths (gloo's all_gather is several times slower than its broadcast)."""
    k = res["layout"]
    tr = dict(transfers.get(full_bytes, {}))
    if best and tr:
        gbps = max(tr["all_gather_received"] / tr["all_gather_s"], tr["broadcast_received"] / tr["broadcast_s"])
        tr["all_gather_s"], tr["broadcast_s"] = tr["all_gather_received"] / gbps, tr["broadcast_received"] / gbps
    if k in ("a", "d"):
        return 0.0, "0 bytes to move"
    if k == "b":
        return copies["fp32"], "copy fp32"
    if k == "b16":
        return copies["bf16"], "copy fp32->bf16"
    if k == "c":  # each rank receives the half it lacks: one flat all_gather, plus a copy of those bytes
        share = res["rlkit_bytes"] / full_bytes if full_bytes else 0.0
        return copies["fp32"] * share + tr.get("all_gather_s", float("nan")), "copy + all_gather"
    if k == "e":  # the whole model crosses a process boundary, then is copied into the engine
        return copies["fp32"] + tr.get("broadcast_s", float("nan")), "copy + broadcast"
    raise ValueError(k)


def fmt_bytes(b: float) -> str:
    return "0" if not b else f"{b / 2**20:.2f} MiB"


def model_list(args: argparse.Namespace) -> list[tuple[str, str]]:
    import rlkit.models

    out = [(f"tiny qwen2 {s}", rlkit.models.tiny_lm("qwen2", size=s)) for s in args.sizes.split(",") if s]
    if args.big:
        out.append(("SmolLM2-135M", rlkit.models.pretrained("smollm2-135m-instruct")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="test,small,demo,10m", help="tiny_lm sizes (rlkit/models/tiny.py SIZES)")
    ap.add_argument("--big", action="store_true", help="add SmolLM2-135M-Instruct (slow)")
    ap.add_argument("--layouts", default="a,b,b16,c,d,e", help=f"comma list of {sorted(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=5, help="train steps per layout (the first is left out)")
    ap.add_argument("--big-steps", type=int, default=3, help="steps per layout on the 135M model")
    args = ap.parse_args()
    layouts = [k for k in args.layouts.split(",") if k]
    bad = [k for k in layouts if k not in LAYOUTS]
    if bad or args.steps < 2:
        ap.error(f"--layouts {bad} not in {sorted(LAYOUTS)}, or --steps {args.steps} < 2")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's workers inherit this: torch's FSDP/DeviceMesh deprecation notices would fill the output
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")
    torch.set_num_threads(1)  # like a Ray rank with one CPU: copies and floors on the same footing
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*[Oo]versubscri.*")
    import rlkit

    models = model_list(args)
    print(f"load average at the start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); torch "
          f"{torch.__version__}, 1 torch thread per rank", flush=True)
    cluster = []

    def cluster_fn():
        if not cluster:
            cluster.append(rlkit.Cluster(num_cpus=2))
        return cluster[0]

    rows = []
    try:
        for label, path in models:
            results, floors = [], {"fp32": [], "bf16": []}
            for k in layouts:
                steps = args.big_steps if "135M" in label else args.steps
                res = run_layout(k, path, steps, cluster_fn)
                # the copy floor between layouts, so load that comes and goes hits floors and syncs alike
                for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                    floors[name].append(copy_seconds(res["shapes"], torch.float32, dt, repeats=3))
                print(f"  {label}: {k:3s} sync {res['sync_s'] * 1e3:8.3f} ms, rlkit bytes "
                      f"{fmt_bytes(res['rlkit_bytes'])}, copied {fmt_bytes(res['copied_bytes'])}, shared "
                      f"{res['shared']}, engine dtype {res['engine_dtype']}, load avg {res['load_avg']:.2f}", flush=True)
                results.append(res)
            shapes = results[0]["shapes"]
            params = sum(torch.Size(s).numel() for s in shapes)
            copies = {name: statistics.median(v) for name, v in floors.items()}
            rows.append((label, params, copies, results))
    finally:
        if cluster:
            cluster[0].shutdown()
    full_sizes = sorted({p * 4 for _, p, _, _ in rows})
    transfers = transfer_seconds(full_sizes) if any(k in layouts for k in ("c", "e")) else {}
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}\n")
    print("| model | params (tensors) | layout | rlkit bytes | copied bytes | sync s | floor s | floor is | ratio | "
          "floor s, best GB/s | ratio, best GB/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for label, params, copies, results in rows:
        for res in results:
            floor, how = floor_of(res, copies, transfers, params * 4)
            best, _ = floor_of(res, copies, transfers, params * 4, best=True)
            ratio = f"{res['sync_s'] / floor:.2f}x" if floor > 0 else "n/a"
            ratio_best = f"{res['sync_s'] / best:.2f}x" if best > 0 else "n/a"
            print(f"| {label} | {params / 1e6:.2f}M ({len(res['shapes'])}) | {res['layout']}: {LAYOUTS[res['layout']]} | "
                  f"{fmt_bytes(res['rlkit_bytes'])} | {fmt_bytes(res['copied_bytes'])} | {res['sync_s']:.5f} | "
                  f"{floor:.5f} | {how} | {ratio} | {best:.5f} | {ratio_best} |")
    print("\nLoopback transfer between 2 gloo processes (one flat fp32 tensor of the model's size, median of 5):\n")
    print("| full size | all_gather s (receives half) | GB/s | broadcast s (receives all) | GB/s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for size, t in sorted(transfers.items()):
        print(f"| {fmt_bytes(size)} | {t['all_gather_s']:.5f} | {t['all_gather_received'] / t['all_gather_s'] / 1e9:.2f}"
              f" | {t['broadcast_s']:.5f} | {t['broadcast_received'] / t['broadcast_s'] / 1e9:.2f} |")
    print("\nDriver-side timing/sync (the sync call's round trip; in the shared layouts the resharding runs "
          "inside generate, so this is only the call), and start-up per layout:\n")
    print("| model | layout | timing/sync s | step s | Trainer() s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for label, _, _, results in rows:
        for res in results:
            print(f"| {label} | {res['layout']} | {res['driver_sync_s']:.5f} | {res['step_s']:.3f} | "
                  f"{res['start_s']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
