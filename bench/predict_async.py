"""The RL step-time model (``rlkit.plan.throughput``: ``estimate_rl_step``, ``predict_rl_step``) against the
measurements here and against verl's published Qwen2.5-7B asynchronous runs (issue 26). Runs in under a second.

    .venv/bin/python bench/predict_async.py              # the two tables, as text
    .venv/bin/python bench/predict_async.py --markdown   # the same as markdown (bench/README.md)

(a) **Here**: each loop's step time predicted from the colocated run's own phases (generate, update) plus
    a sync time measured apart (bench_sync.py), with linear scaling (a phase on one core of two takes twice
    as long) and flat scaling (it takes as long), against what bench_async.py measured. The last column
    feeds each split run's own phases to the formula: it tests the composition alone.
(b) **verl**: the published one-step-off (16 GPUs) and fully async (32-128 GPUs) Qwen2.5-Math-7B DAPO runs on
    H20. "rlkit" columns: ``predict_rl_step`` with the recipe's layout and batch and one fitted number, the
    mean response length that makes the predicted update of the colocated run equal its published
    ``update_actor``; everything else (generation, pi_old, both step times) is predicted. "from verl's
    phases" columns: ``estimate_rl_step`` fed verl's published colocated phase times and rlkit's tail.
    "tail needed": the share of the colocated generation that would have to be non-parallel tail for the
    formula to reach the published async step ("-": none does, the trainer's side alone is longer).
(c) **Streaming here**: bench_stream.py's one-step-off step (rollout-bound: the rollout worker's time per
    batch) and update, and the workload's length distribution, fed to ``estimate_rl_step(lengths=...,
    staleness=8)``; its fully async step against the streaming runs' time for one-step-off's work per step
    (the ratio of trained tokens per second).
"""

from __future__ import annotations

import argparse

import pandas as pd

from rlkit.plan.throughput import estimate_rl_step, predict_rl_step

LOOPS = ("colocated sync", "split sync", "split one-step-off")

# (a) Measured here. bench/README.md, section "bench_async.py": 2026-12-05, 2-core CPU, at f8cc63a, GRPO, HF
# engine; medians of per-run medians (tiny Qwen2: 3 rounds x 12 steps; SmolLM2-135M-Instruct: 2 rounds x 7).
# Split runs: actor and rollout worker one core each; colocated: one process on both cores.
MEASURED = {
    "tiny qwen2": {"colocated sync": dict(step=0.207, generate=0.108, update=0.096),
                   "split sync": dict(step=0.232, generate=0.082, update=0.120),
                   "split one-step-off": dict(step=0.189, generate=0.083, update=0.116)},
    "smollm2-135m": {"colocated sync": dict(step=13.216, generate=4.073, update=9.103),
                     "split sync": dict(step=25.765, generate=6.581, update=14.448),
                     "split one-step-off": dict(step=23.457, generate=7.146, update=14.643)},
}
# SmolLM2 phases the README's table leaves out: medians of steps 3-7 of the same session's last round
# (runs/bench-async/*/metrics.jsonl, round 2 of 2): split sync timing/sync 3.779 s (the object-store
# transfer, on the trainer's side); one-step-off timing/old_logprobs 5.280 s (the pi_old pass of TIS).
SPLIT_SYNC_S = {"smollm2-135m": 3.779}
SPLIT_OLD_LOGPROB_S = {"smollm2-135m": 5.280}
# Sync measured apart: bench/README.md, section "bench_sync.py" (2026-12-04): dp=1 shared tensors (colocated)
# and split placement (object store). tiny: the "demo" (5M) row, the nearest size listed (bench_async's tiny
# is "small", ~4x fewer bytes), so its split sync is an upper bound.
SYNC_S = {"tiny qwen2": {"colocated": 0.0012, "split": 0.082},
          "smollm2-135m": {"colocated": 0.0041, "split": 1.98}}
FORWARD_SHARE = 1 / 3   # the pi_old pass: a forward, a third of forward + backward (predict_rl_step's prior)


def table_here() -> pd.DataFrame:
    rows = []
    for model, runs in MEASURED.items():
        co, sync = runs["colocated sync"], SYNC_S[model]
        old = FORWARD_SHARE * co["update"]
        preds = {s: estimate_rl_step(co["generate"], co["update"], sync["split"], devices=2, rollout_devices=1,
                                     scaling=s, old_logprob_s=old) for s in (1.0, 0.0)}
        bare = {s: estimate_rl_step(co["generate"], co["update"], sync["split"], devices=2, rollout_devices=1,
                                    scaling=s) for s in (1.0, 0.0)}
        split = {}
        if model in SPLIT_SYNC_S:  # each split run's own phases, fed as they are (scaling 0: no rescaling)
            for loop in ("split sync", "split one-step-off"):
                m = runs[loop]
                split[loop] = estimate_rl_step(m["generate"], m["update"], SPLIT_SYNC_S[model], devices=2,
                                               rollout_devices=1, scaling=0.0,
                                               old_logprob_s=SPLIT_OLD_LOGPROB_S[model])
        for loop, key in (("colocated sync", None), ("split sync", "split_sync_s"),
                          ("split one-step-off", "split_one_step_off_s"),
                          ("split one-step-off, no pi_old pass", "split_one_step_off_s")):
            measured = runs[loop.split(",")[0]]["step"]
            if key is None:
                lin = flat = co["generate"] + co["update"] + sync["colocated"]
                from_split = float("nan")
            else:
                src = bare if "no pi_old" in loop else preds
                lin, flat = src[1.0][key], src[0.0][key]
                from_split = split[loop][key] if loop in split else float("nan")
            rows.append({"model": model, "loop": loop, "measured s": measured,
                         "linear s": lin, "linear / measured": lin / measured,
                         "flat s": flat, "flat / measured": flat / measured,
                         "from split phases s": from_split, "split phases / measured": from_split / measured})
    return pd.DataFrame(rows)


# (b) verl's published runs, all Qwen2.5-Math-7B (Qwen2.5-7B's architecture) on H20, DAPO, vLLM.
# One-step-off: verl docs/advance/one_step_off.md (https://verl.readthedocs.io/en/latest/advance/one_step_off.html,
# "Last updated: 07/17/2025"), "Experimental Results": 2 nodes x 8 H20, generation 4 GPUs, training 12; max
# response FSDP2 20,480 tokens, Megatron 8,192. Per-step seconds as published (colocate: step, gen, old_log_prob,
# update_actor; one-step-off: step, generate_sequences, old_log_prob, update_actor) and total time (+23% FSDP2,
# +40% Megatron). Batch from the recipe script verl/experimental/one_step_off_policy/shell/dapo_7b_math_fsdp2_4_12.sh:
# 512 prompts x n=12, mini-batch 32 prompts (16 optimizer steps), max prompt 2048, rollout TP 2, gradient
# checkpointing, actor micro-batches of (prompt + response) x 2 tokens; the Megatron run is predicted with the
# same FSDP model.
# Fully async: verl docs/advance/fully_async.md (https://verl.readthedocs.io/en/latest/advance/fully_async.html,
# "Asynchronous Training on 7B Model"): max response 28K, n=16, mini-batch 32, colocate train_batch_size 512;
# fully async with require_batches 4, trigger_parameter_sync_step 4, staleness_threshold 0.5, partial_rollout,
# rollout log-probs as pi_old (no old_log_prob pass); total time over 400 steps 2.66x / 1.92x / 2.35x on
# 32 / 64 / 128 GPUs. Rollout TP 4 from recipe/fully_async_policy/shell/dapo_7b_math_fsdp2_64_64.sh.
VERL = [
    dict(setup="one-step-off, FSDP2", devices=16, rollout=4, batch=512 * 12, max_response=20480, tp=2,
         old_logprob="all", staleness=None, total_speedup=(19 * 60 + 18) / (15 * 60 + 34),
         sync=dict(step=749, gen=321, old=88, update=286), asynchronous=dict(step=520)),
    dict(setup="one-step-off, Megatron", devices=16, rollout=4, batch=512 * 12, max_response=8192, tp=2,
         old_logprob="all", staleness=None, total_speedup=(18 * 60 + 21) / (13 * 60 + 6),
         sync=dict(step=699, gen=207, old=119, update=344), asynchronous=dict(step=566)),
    dict(setup="fully async", devices=32, rollout=16, batch=512 * 16, max_response=28672, tp=4,
         old_logprob="sync", staleness=1, total_speedup=(3 * 24 * 60 + 17 * 60 + 5) / (33 * 60 + 26),
         sync=dict(step=790.10, gen=357.41, old=107.71, update=313.81), asynchronous=dict(step=294.77)),
    dict(setup="fully async", devices=64, rollout=32, batch=512 * 16, max_response=28672, tp=4,
         old_logprob="sync", staleness=1, total_speedup=(41 * 60 + 32) / (21 * 60 + 40),
         sync=dict(step=365.28, gen=150.72, old=70.26, update=133.41), asynchronous=dict(step=189.26)),
    dict(setup="fully async", devices=128, rollout=64, batch=512 * 16, max_response=28672, tp=4,
         old_logprob="sync", staleness=1, total_speedup=(40 * 60 + 48) / (17 * 60 + 22),
         sync=dict(step=356.30, gen=177.85, old=53.92, update=113.81), asynchronous=dict(step=150.63)),
]
PROMPT_LEN = 256        # mean DAPO-Math prompt with its template: an assumption (the recipes cap it at 2048)
MAX_PROMPT_LEN = 2048


def _verl_kw(c: dict) -> dict:
    return dict(gpu="H20", devices=c["devices"], rollout_devices=c["rollout"], batch=c["batch"],
                prompt_len=PROMPT_LEN, max_response_len=c["max_response"], rollout_tp=c["tp"],
                token_budget=2 * (MAX_PROMPT_LEN + c["max_response"]), minibatches=16, recompute="full",
                old_logprob=c["old_logprob"], staleness=c["staleness"])


def fit_response_len(c: dict) -> int:
    """The mean response length at which the predicted colocated update equals verl's ``update_actor``."""
    lo, hi = 1, c["max_response"]
    while lo < hi:
        mid = (lo + hi) // 2
        if predict_rl_step("qwen2.5-7b", response_len=mid, **_verl_kw(c))["update_s"] < c["sync"]["update"]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _from_phases(c: dict, tail_s: float) -> dict:
    """``estimate_rl_step`` fed verl's published colocated phases, with ``tail_s`` of the generation as tail."""
    s = c["sync"]
    return estimate_rl_step(s["gen"], s["update"], devices=c["devices"], rollout_devices=c["rollout"],
                            old_logprob_s=s["old"], old_logprob_in=c["old_logprob"], tail_s=tail_s,
                            staleness=c["staleness"])


def table_verl() -> pd.DataFrame:
    rows = []
    for c in VERL:
        key = "split_one_step_off_s" if c["staleness"] is None else "fully_async_s"
        length = fit_response_len(c)
        r = predict_rl_step("qwen2.5-7b", response_len=length, **_verl_kw(c))
        s, published = c["sync"], c["asynchronous"]["step"]
        tail = min(r["tail_s"], s["gen"])

        p = _from_phases(c, tail)
        grid = [s["gen"] * i / 1000 for i in range(1001)]
        needed = next((t / s["gen"] for t in grid if _from_phases(c, t)[key] <= published), float("nan"))
        rows.append({"setup": c["setup"], "GPUs (rollout:train)": f"{c['devices']} ({c['rollout']}:"
                     f"{c['devices'] - c['rollout']})",
                     "verl sync s": s["step"], "verl async s": published, "verl x": s["step"] / published,
                     "verl x total time": c["total_speedup"], "fitted mean response": length,
                     "gen rlkit / verl": r["generate_s"] / s["gen"], "pi_old rlkit / verl": r["old_logprob_s"] / s["old"],
                     "rlkit sync s": r["colocated_sync_s"], "rlkit async s": r[key],
                     "rlkit x": r["colocated_sync_s"] / r[key],
                     "verl phases: async s": p[key], "verl phases: x": p["colocated_sync_s"] / p[key],
                     "tail needed": needed})
    return pd.DataFrame(rows)


# (c) Streaming, measured here. bench/README.md, section "bench_stream.py": 2026-12-07 01:41-01:50 UTC, 2-core
# CPU, at 8470071, tiny Qwen2, GRPO, split placement (one core each), 8 prompts x n=4, max_new_tokens 64; medians
# over 3 rounds. One-step-off is rollout-bound (the trainer waits 0.171 s of its 0.311 s step), so its step is
# the rollout worker's time per batch.
STREAM = {"one-step-off": dict(step=0.311, update=0.119, tok_s=1692.9),
          "streaming": dict(step=0.187, update=0.098, tok_s=2047.4),
          "streaming, stream_stale_kv": dict(step=0.169, update=0.094, tok_s=2587.0)}
STREAM_STALENESS = 8


def stream_lengths(batches: int = 2000, seed: int = 0) -> list[list[int]]:
    """The bench's workload as batches of response lengths: 8 of its 100 prompts a step, drawn at random,
    4 samples each; one prompt in ten is answered at length (taken to run to the 64-token cap), the rest in
    8 tokens (scripted)."""
    import random

    rng = random.Random(seed)
    return [[64 if row % 10 == 0 else 8 for row in rng.sample(range(100), 8) for _ in range(4)]
            for _ in range(batches)]


def table_stream() -> pd.DataFrame:
    off = STREAM["one-step-off"]
    r = estimate_rl_step(off["step"], off["update"], devices=2, rollout_devices=1, scaling=0.0,
                         staleness=STREAM_STALENESS, lengths=stream_lengths())
    rows = [{"loop": "one-step-off", "measured s": off["step"], "predicted s": r["split_one_step_off_s"],
             "measured x": 1.0, "predicted x": 1.0}]
    for name in ("streaming", "streaming, stream_stale_kv"):
        m = STREAM[name]
        rows.append({"loop": name, "measured s": off["tok_s"] / m["tok_s"] * off["step"],
                     "predicted s": r["fully_async_s"], "measured x": m["tok_s"] / off["tok_s"],
                     "predicted x": r["fully_async_vs_one_step_off"]})
    out = pd.DataFrame(rows)
    out["tail share"] = r["tail_share"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (needs tabulate)")
    args = ap.parse_args()
    for title, df in (("(a) measured here (2-core CPU, 2026-12-05) against the model", table_here()),
                      ("(b) verl's published Qwen2.5-7B runs (H20) against the model", table_verl()),
                      ("(c) streaming measured here (2-core CPU, 2026-12-07) against the model fed the lengths",
                       table_stream())):
        print(f"\n{title}\n")
        if args.markdown:
            print(df.astype(object).where(df.notna(), None).to_markdown(index=False, floatfmt=".4g", missingval="-"))
        else:
            with pd.option_context("display.width", 250, "display.max_columns", 30, "display.precision", 3):
                print(df.to_string(index=False))


if __name__ == "__main__":
    main()
