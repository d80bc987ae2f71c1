"""One rlkit Trainer run of bench_vs_trl.py's work, in its own process (run by the rlkit venv's python).

    .venv/bin/python bench/rlkit_worker.py MODEL_DIR STEPS [--engine hf|vllm] [--ray] [--dp N] [--lora R] [--cprofile FILE]

Prints ``RESULT {json}``: steps/s and tokens/s after the warm-up steps, start-up (process start to the
first ``train_step`` begun), peak RSS (the process + Ray daemons + workers, where Ray runs), the median of each of rlkit's
``timing/<phase>`` metrics, and where start-up went (imports, Ray, workers). ``update_s_median``,
``sync_s_median`` and ``sync_bytes_median`` are the medians over the measured steps of the Trainer's
``timing/update``, ``timing/sync`` and ``sync/bytes`` metrics (``sync/bytes``: what the sync gathered between
ranks, largest rank; 0 unless the weights are sharded: at dp=1 and with ``--dp N``'s replicated weights).

``--lora R``: ``rlkit.Trainer(..., lora=lora_config(R))``, the same peft ``LoraConfig`` as ``trl_worker.py
--lora R`` (``vs_trl_common``: r=R, lora_alpha=2R, lora_dropout=0, q/k/v/o_proj).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_trl_common import PROMPTS, WARMUP_STEPS, WORK, PeakRSS, StepClock, emit, lora_config, share_of  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up
TIMED = ("generate", "update_actor", "sync_weights")  # worker methods a step calls


def _time_methods(worker, names: tuple[str, ...]) -> None:
    """On each rank: wrap ``names`` so each call's seconds inside the worker are kept (the driver's
    phase time minus this is what the Ray round trip costs)."""
    def timed(name: str, fn):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            worker._bench_s[name].append(time.perf_counter() - t)
            return out
        return call

    worker._bench_s = {n: [] for n in names}
    for n in names:
        setattr(worker, n, timed(n, getattr(worker, n)))


def _worker_times(worker) -> dict[str, list[float]]:
    return worker._bench_s


def _noop(worker, *args) -> None:
    return None


def _threads(worker) -> int:
    import torch

    return torch.get_num_threads()


def cpu_by_process() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and each descendant, summed by name."""
    import psutil

    out: dict[str, float] = {}
    me = psutil.Process(os.getpid())
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            name = "driver" if p.pid == me.pid else p.name()
            out[name] = out.get(name, 0.0) + t.user + t.system
        except psutil.Error:
            pass
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def probe(tr, batch: dict) -> dict[str, float]:
    """Median round trips of 20 calls: a bare call, and one that ships a step's batch as its argument."""
    def median_ms(fn) -> float:
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1000

    return {"bare_call_ms": median_ms(lambda: tr.group.call("rss_gb")),
            "call_with_step_batch_ms": median_ms(lambda: tr.group.apply(_noop, batch)),
            "batch_bytes": sum(v.numel() * v.element_size() for v in batch.values() if hasattr(v, "numel"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--run-dir", default=None, help="rlkit's run_dir (metrics.jsonl; default: a temp dir)")
    ap.add_argument("--cprofile", default=None, help="write a cProfile of the driver's fit() to this file")
    ap.add_argument("--probe", action="store_true", help="after fit: time bare and batch-carrying Ray calls")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (in-process: torch.set_num_threads; on Ray: "
                         "rlkit.Cluster(cpus_per_worker=N)); default: rlkit's (torch's in-process, 1 CPU a Ray rank)")
    ap.add_argument("--ray", action="store_true",
                    help="run the rank on a Ray worker (rlkit.Cluster) even at dp=1; default: dp=1 runs in-process")
    ap.add_argument("--rollout-dtype", default="float32",
                    help="the engine's dtype: float32 (default) generates with the actor's own fp32 tensors, like TRL "
                         "with HF generate; bfloat16 is a bf16 engine fed the weights after every update (verl's "
                         "and TRL + vLLM's way)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"),
                    help="the update's precision: bf16-mixed is bf16 autocast on fp32 weights (TRL's bf16=True)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (>1: Ray workers), same global batch")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train LoRA adapters of rank R (alpha 2R, q/k/v/o_proj: trl_worker.py's) instead of all weights")
    args = ap.parse_args()
    rss = PeakRSS().start()
    marks = {"python_s": time.perf_counter() - CLOCK.t0_perf}

    import tempfile

    t = time.perf_counter()
    from transformers import AutoTokenizer

    import rlkit

    marks["import_s"] = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(args.model)
    score = share_of(tok.convert_tokens_to_ids(WORK["target_token"]))

    def share_reward(prompts, completions, **kw):  # rlkit hands text: tokenized again (no ids given)
        return score([tok(c, add_special_tokens=False)["input_ids"] for c in completions])

    t = time.perf_counter()
    cluster = None  # dp=1: the Trainer runs its rank in this process
    if args.ray or args.dp > 1:
        cluster = rlkit.Cluster(**({"cpus_per_worker": args.threads} if args.threads else {}))
    elif args.threads:
        import torch

        torch.set_num_threads(args.threads)
    marks["cluster_s"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        tr = rlkit.Trainer(model=args.model, dataset=[{"prompt": p} for p in PROMPTS], reward=share_reward,
                           # dp > 1: replicated weights (DDP): a model this small gains nothing from sharding,
                           # and each rank's engine then runs on its own training tensors (no gather)
                           algorithm="grpo", cluster=cluster,
                           plan=rlkit.ParallelPlan(dp=args.dp, **({"dp_shard": "replicate"} if args.dp > 1 else {})),
                           # dp > 1: tp=1, each rank's engine on its own replica's tensors (no copy)
                           rollout=rlkit.Rollout(engine=args.engine, n=WORK["n"], dtype=args.rollout_dtype,
                                                 tp=1 if args.dp > 1 else None,
                                                 max_new_tokens=WORK["max_new_tokens"],
                                                 temperature=WORK["temperature"]),
                           prompts_per_step=WORK["prompts_per_step"], lr=WORK["lr"], kl_coef=WORK["kl"],
                           max_grad_norm=WORK["max_grad_norm"], seed=WORK["seed"], precision=args.precision,
                           lora=lora_config(args.lora) if args.lora else None,
                           run_dir=args.run_dir or tempfile.mkdtemp(prefix="rlkit-bench-"))
        marks["trainer_s"] = time.perf_counter() - t
        marks.update({f"workers_{k}": v for k, v in tr.group.timings.items()})

        step = tr.train_step

        def clocked_step():  # the bench's clock around each step (rlkit itself is not changed)
            CLOCK.begin()
            row = step()
            CLOCK.end()
            CLOCK.tokens.append(round(row["response_length/mean"] * WORK["prompts_per_step"] * WORK["n"]))
            return row

        tr.train_step = clocked_step
        marks["fit_to_first_step_s"] = time.perf_counter()  # made a duration below
        tr.group.apply(_time_methods, TIMED)
        threads = tr.group.apply(_threads)[0]
        gen = tr.workers.generate
        engine_s: list[float] = []
        last: dict = {}

        def timed_generate(*a, **k):  # the engine's own generate seconds, as the worker reports them
            out = gen(*a, **k)
            engine_s.append(float(out.get("timing", 0.0)))
            last.update({k: out[k] for k in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs")})
            return out

        tr.workers.generate = timed_generate
        if args.cprofile:
            import cProfile

            with cProfile.Profile() as prof:
                tr.fit(steps=args.steps, view="none")
            prof.dump_stats(args.cprofile)
        else:
            tr.fit(steps=args.steps, view="none")
        m = tr.metrics.iloc[WARMUP_STEPS:]
        phases = {c[len("timing/"):]: float(m[c].median()) for c in m.columns if c.startswith("timing/")}
        means = {c[len("timing/"):]: float(m[c].mean()) for c in m.columns if c.startswith("timing/")}
        inside = {k: statistics.mean(v[WARMUP_STEPS:]) for k, v in tr.group.apply(_worker_times)[0].items()
                  if len(v) > WARMUP_STEPS}
        inside["engine_generate"] = statistics.mean(engine_s[WARMUP_STEPS:])
        worker_rss = float(m["memory/rss_max_gb"].max()) * 1024
        lora_cols = {"update_s_median": "timing/update", "sync_s_median": "timing/sync",
                     "sync_bytes_median": "sync/bytes", "sync_param_bytes_median": "sync/param_bytes"}
        lora_res = {k: float(m[c].median()) if c in m.columns else None for k, c in lora_cols.items()}
        extra = {"probe": probe(tr, last)} if args.probe else {}
        cpu = cpu_by_process()
    finally:
        t = time.perf_counter()
        if cluster is not None:
            cluster.shutdown()
        else:
            tr.close()
        marks["shutdown_s"] = time.perf_counter() - t
    rss.stop()
    res = CLOCK.summary()
    marks["fit_to_first_step_s"] = CLOCK.begins[0] - marks["fit_to_first_step_s"]
    res.update(side="rlkit", engine=args.engine, dp=args.dp, rollout_dtype=args.rollout_dtype, precision=args.precision, ray=bool(cluster is not None), version=getattr(rlkit, "__version__", "?"), threads=threads,
               peak_rss_mb=rss.peak_mb, processes=rss.peak_procs, worker_peak_rss_mb=worker_rss,
               phases_median_s=phases, phases_mean_s=means, worker_mean_s=inside, startup_parts_s=marks,
               cpu_s_by_process=cpu, lora=args.lora, **lora_res, **extra,
               generate_s_per_step=means.get("generate"), wall_s=time.perf_counter() - CLOCK.t0_perf,
               step_s_median_rlkit=statistics.median(list(m["timing/step"])))
    emit(res)


if __name__ == "__main__":
    main()
