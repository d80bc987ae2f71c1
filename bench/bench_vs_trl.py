"""rlkit against TRL, side by side on identical GRPO work (issue 13).

    bash bench/setup_trl.sh                          # once: TRL 1.16 in .venv-trl (git-ignored)
    .venv/bin/python bench/bench_vs_trl.py           # 3 rounds x 20 steps, tiny Qwen2, HF generate / HF engine
    .venv/bin/python bench/bench_vs_trl.py --rounds 5 --steps 30
    .venv/bin/python bench/bench_vs_trl.py --vllm    # + TRL vllm colocate and rlkit's vLLM engine (~20 s a start)
    .venv/bin/python bench/bench_vs_trl.py --model smollm2-135m-instruct --rounds 1 --steps 6
    .venv/bin/python bench/bench_vs_trl.py --profile # one py-spy'd run of each side: where the time goes
    .venv/bin/python bench/bench_vs_trl.py --rows ray dp2 bf16   # + rlkit on a Ray worker, at dp=2; both sides in bf16
    .venv/bin/python bench/bench_vs_trl.py --base 7d02e3e        # + every rlkit run at another commit, interleaved
    .venv/bin/python bench/bench_vs_trl.py --lora 8              # LoRA r=8: TRL + LoRA, rlkit + LoRA, rlkit full

The work, per step: 2 prompts x 4 completions x up to 32 new tokens (temperature 1), reward = the share of
completion tokens equal to the token "e", one optimizer step (lr 1e-3, constant, grad-norm clip 1.0), no
KL, dp=1. Both sides load the same model folder: by default the tiny Qwen2 of issue 13 (2 layers,
hidden 128, tied embeddings, vocab 512) built by ``rlkit.models.tiny_lm``.

Each run is its own process (bench/trl_worker.py in the TRL venv, bench/rlkit_worker.py in the rlkit
venv), so start-up counts from process start to the first step begun, and peak RSS is that process
and everything it started (for rlkit: Ray's daemons and workers). Runs are interleaved, round r
rotating the order, and the table reports medians over rounds. steps/s and tokens/s are measured
after the first 2 steps (wall clock, everything between steps included); tokens are completion tokens.

``--lora R``: both sides train LoRA adapters instead of all weights, one peft ``LoraConfig`` (r=R,
lora_alpha=2R, lora_dropout=0, q/k/v/o_proj; ``vs_trl_common.lora_config``): TRL through
``GRPOTrainer(peft_config=...)``, rlkit through ``Trainer(lora=...)``; everything else is the same work. A
round is then "TRL + LoRA r=R, HF generate", "rlkit + LoRA r=R, HF engine" and "rlkit full fine-tuning, HF
engine" (the same work, all weights), interleaved as above (``--rows`` and ``--vllm`` runs train LoRA too).
After the usual tables a LoRA table gives per run (medians over rounds) steps/s, the update's seconds per
step (rlkit: the Trainer's ``timing/update``; TRL: the end of ``_prepare_inputs``, where it generates and
scores, to the step's end), the sync's seconds and bytes per step (rlkit's ``timing/sync`` and
``sync/bytes``, bytes gathered between ranks: 0 unless the weights are sharded, so 0 at dp=1 and with
``--rows dp2``'s replicated weights; TRL with HF generate has no sync), peak RSS, and the ratios rlkit LoRA / TRL LoRA (steps/s) and rlkit LoRA / rlkit full
(update s/step, peak RSS).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module, by path
from vs_trl_common import BENCH, ROOT, model_folder, python_with, run_one  # noqa: E402


def plan_runs(args: argparse.Namespace) -> list[dict]:
    """The runs of one round: (label, command); vLLM runs only where a python with vLLM exists. With
    ``--lora R`` every run trains LoRA adapters, and one more run trains all weights (``full``)."""
    runs = _plan_runs(args)
    if not args.lora:
        return runs
    tag = f" + LoRA r={args.lora}"
    for x in runs:
        side, comma, rest = x["label"].partition(",")  # "rlkit, HF engine" -> "rlkit + LoRA r=8, HF engine"
        x.update(label=f"{side}{tag}{comma}{rest}", cmd=[*x["cmd"], "--lora", str(args.lora)],
                 key=f"{x.get('key', x['engine'])}-lora")
    # TRL 1.16 defaults to gradient checkpointing (its backward recomputes the forward): its LoRA run without
    # it too, so rlkit is held against TRL's faster configuration as well
    trl = next(x for x in runs if x["side"] == "trl" and x["engine"] == "hf")
    nogc = dict(trl, label=f"{trl['label']}, no gradient checkpointing", engine="hf-nogc", key="hf-lora-nogc",
                cmd=[*trl["cmd"], "--no-gradient-checkpointing"])
    runs.insert(runs.index(trl) + 1, nogc)
    # the same work training all weights: what LoRA saves (update time, memory); never compared with TRL
    full = dict(label="rlkit full fine-tuning, HF engine", side="rlkit", engine="hf", key="hf-full", full=True,
                cmd=[args.rlkit_python, str(BENCH / "rlkit_worker.py"), "--engine", "hf"])
    at = next(i for i, x in enumerate(runs) if x["side"] == "rlkit") + 1
    return [*runs[:at], full, *runs[at:]]


def _plan_runs(args: argparse.Namespace) -> list[dict]:
    runs = [dict(label="TRL, HF generate", side="trl", engine="hf",
                 cmd=[args.trl_python, str(BENCH / "trl_worker.py")]),
            dict(label="rlkit, HF engine", side="rlkit", engine="hf", key="hf",
                 cmd=[args.rlkit_python, str(BENCH / "rlkit_worker.py"), "--engine", "hf"])]
    extra = {  # more rlkit configurations of the same work (--rows)
        # the same Trainer on one Ray worker: what dp=1 cost before it ran in-process
        "ray": dict(label="rlkit, HF engine, Ray worker", flags=["--ray"]),
        # two Ray ranks at the same global batch, replicated weights (DDP)
        "dp2": dict(label="rlkit, HF engine, dp=2 (Ray)", flags=["--dp", "2"]),
        # a bf16 engine fed the fp32 actor's weights after each update (verl's way; TRL + vLLM's too), and
        # a bf16-mixed update (autocast on fp32 weights): what TRL's bf16=True does to both
        "bf16": dict(label="rlkit, HF engine, bf16 (rollout + bf16-mixed update)",
                     flags=["--rollout-dtype", "bfloat16", "--precision", "bf16-mixed"]),
    }
    if "bf16" in args.rows:  # TRL's own mixed precision: its best configuration may be bf16 too
        runs.append(dict(label="TRL, HF generate, bf16", side="trl", engine="hf-bf16", key="hf-bf16",
                         cmd=[args.trl_python, str(BENCH / "trl_worker.py"), "--bf16"]))
    for key in args.rows:
        runs.append(dict(label=extra[key]["label"], side="rlkit", engine="hf", key=f"hf-{key}",
                         cmd=[args.rlkit_python, str(BENCH / "rlkit_worker.py"), "--engine", "hf", *extra[key]["flags"]]))
    if not args.vllm:
        print("vLLM runs: off (pass --vllm to add TRL + vLLM colocate and rlkit's vLLM engine)")
        return runs
    if python_with(args.vllm_python, "vllm", "trl", "datasets"):
        runs.append(dict(label="TRL + vLLM colocate", side="trl", engine="vllm",
                         cmd=[args.vllm_python, str(BENCH / "trl_worker.py"), "--vllm"]))
    else:
        print(f"skip TRL + vLLM: {args.vllm_python} cannot import vllm, trl and datasets (make the vLLM venv "
              f"with `make .venv-vllm/.rlkit-installed`, then `{args.vllm_python.replace('python', 'pip')} "
              f"install trl==1.16.0 datasets`, or pass --vllm-python)")
    if python_with(args.vllm_python, "vllm", "rlkit"):
        runs.append(dict(label="rlkit, vLLM engine", side="rlkit", engine="vllm",
                         cmd=[args.vllm_python, str(BENCH / "rlkit_worker.py"), "--engine", "vllm"]))
        if "bf16" in args.rows:  # the vLLM engine in bf16, fed the fp32 actor's weights after each update
            runs.append(dict(label="rlkit, vLLM engine, bf16 (rollout + bf16-mixed update)", side="rlkit",
                             engine="vllm", key="vllm-bf16",
                             cmd=[args.vllm_python, str(BENCH / "rlkit_worker.py"), "--engine", "vllm",
                                  "--rollout-dtype", "bfloat16", "--precision", "bf16-mixed"]))
    else:
        print(f"skip rlkit + vLLM: {args.vllm_python} cannot import vllm and rlkit (`make setup-vllm` adds vLLM "
              f"to .venv: then pass --vllm-python .venv/bin/python)")
    return runs


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def with_base(runs: list[dict], rev: str, out: Path) -> tuple[list[dict], Path]:
    """``runs`` and, after each rlkit run, its twin at commit ``rev``: that commit's rlkit_worker.py on that
    commit's rlkit (a detached git worktree under ``out``, first on PYTHONPATH), the same flags."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = out / f"base-{sha}"
    if not (tree / "rlkit").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
    both = []
    for x in runs:
        both.append(x)
        if x["side"] == "rlkit":
            cmd = [c if not c.endswith("rlkit_worker.py") else str(tree / "bench" / "rlkit_worker.py") for c in x["cmd"]]
            both.append(dict(x, label=f"{x['label']} @{sha}", key=f"{x.get('key', x['engine'])}-{sha}", cmd=cmd,
                             env={"PYTHONPATH": str(tree)}, cwd=tree, base_of=x["label"]))
    return both, tree


def base_table(results: dict[str, list[dict]], runs: list[dict]) -> str:
    """This checkout against the base commit, per configuration: median steps/s of each and the median
    of the per-round ratios (the two ran minutes apart in the same round)."""
    out = ["| configuration | steps/s this checkout | steps/s base | this / base | same, median of per-round ratios |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for x in runs:
        if "base_of" not in x or not results[x["label"]] or not results[x["base_of"]]:
            continue
        head, base = results[x["base_of"]], results[x["label"]]
        h, b = med([r["steps_per_s"] for r in head]), med([r["steps_per_s"] for r in base])
        paired = med([a["steps_per_s"] / c["steps_per_s"] for a, c in zip(head, base)])
        out.append(f"| {x['base_of']} | {h:.2f} | {b:.2f} | {h / b:.3f}x | {paired:.3f}x |")
    return "\n".join(out)


def table(results: dict[str, list[dict]], runs: list[dict]) -> str:
    """The side-by-side markdown table: per-round steps/s, medians, and rlkit / TRL ratios."""
    best_trl = max((med([r["steps_per_s"] for r in results[x["label"]]]) for x in runs if x["side"] == "trl"),
                   default=float("nan"))
    trl_by_engine = {x["engine"]: results[x["label"]] for x in runs if x["side"] == "trl"}
    head = ("| run | torch threads | steps/s (rounds) | steps/s median | tokens/s | start-up s | peak RSS MB (all processes) | "
            "rlkit / TRL (same engine) | same, median of per-round ratios | rlkit / TRL's best |")
    out = [head, "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x in runs:
        rs = results[x["label"]]
        sps = med([r["steps_per_s"] for r in rs])
        same = None if x.get("full") else trl_by_engine.get(x["engine"])  # --lora's full run: not TRL's work
        ratio = paired = best = ""
        if x["side"] == "rlkit":
            if same:
                ratio = f"{sps / med([r['steps_per_s'] for r in same]):.2f}x"
                # the TRL run of the same round ran minutes apart at most: the ratio least moved by load
                paired = f"{med([a['steps_per_s'] / b['steps_per_s'] for a, b in zip(rs, same)]):.2f}x"
            best = "" if x.get("full") else f"{sps / best_trl:.2f}x"
        rounds = ", ".join(f"{r['steps_per_s']:.2f}" for r in rs)
        threads = "/".join(sorted({str(r.get("threads", "?")) for r in rs}))
        out.append(f"| {x['label']} | {threads} | {rounds} | {sps:.2f} | "
                   f"{med([r['tokens_per_s'] for r in rs]):.0f} | {med([r['startup_s'] for r in rs]):.1f} | "
                   f"{med([r['peak_rss_mb'] for r in rs]):.0f} | {ratio} | {paired} | {best} |")
    return "\n".join(out)


def phase_table(results: dict[str, list[dict]], runs: list[dict]) -> str:
    """Where a measured step's time goes: means over its steps, medians over rounds. For rlkit, the
    driver's phase time and (in brackets) the time inside the worker's method: the gap is the Ray call. For
    TRL, the update is from the end of ``_prepare_inputs`` (generation and rewards) to the step's end."""
    out = ["| run | step s | generate s [in engine] | update s [in worker] | sync s [in worker] | rest s |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for x in runs:
        rs = results[x["label"]]
        step = med([1 / r["steps_per_s"] for r in rs])
        gens = [r["generate_s_per_step"] for r in rs if r.get("generate_s_per_step") is not None]
        gen = med(gens)
        if x["side"] == "rlkit":
            g, gtxt = _driver_and_worker(rs, "generate", "engine_generate")
            u, utxt = _driver_and_worker(rs, "update", "update_actor")
            sy, stxt = _driver_and_worker(rs, "sync", "sync_weights")
            out.append(f"| {x['label']} | {step:.4f} | {gtxt} | {utxt} | {stxt} | {step - g - u - sy:.4f} |")
        else:
            gtxt = f"{gen:.4f}" if gens else "-"
            upds = [r["update_s_per_step"] for r in rs if r.get("update_s_per_step") is not None]
            if gens and upds:  # trl_worker.py's update clock: the end of _prepare_inputs to the step's end
                upd = med(upds)
                out.append(f"| {x['label']} | {step:.4f} | {gtxt} | {upd:.4f} | - | {step - gen - upd:.4f} "
                           f"(reward, logs) |")
                continue
            rest = f"{step - gen:.4f} (update, reward, logs)" if gens else "-"
            out.append(f"| {x['label']} | {step:.4f} | {gtxt} | - | - | {rest} |")
    return "\n".join(out)


def lora_table(results: dict[str, list[dict]], runs: list[dict]) -> str:
    """``--lora``: per run, medians over rounds of steps/s, update and sync seconds per step, sync bytes per
    step and peak RSS; for rlkit's LoRA runs the ratios to TRL's LoRA run of the same engine (steps/s) and,
    for the plain HF-engine one, to rlkit's full fine-tuning run (update s/step, peak RSS)."""
    def col(rs: list[dict], key: str) -> float:
        return med([r[key] for r in rs if r.get(key) is not None])

    def num(v: float, fmt: str) -> str:
        return "-" if v != v else format(v, fmt)

    trl_by_engine = {x["engine"]: results[x["label"]] for x in runs if x["side"] == "trl"}
    full = next((results[x["label"]] for x in runs if x.get("full")), [])
    out = ["| run | steps/s | update s/step | sync s/step | sync bytes/step | peak RSS MB | "
           "rlkit LoRA / TRL LoRA steps/s | same, median of per-round ratios | rlkit LoRA / TRL LoRA's best | "
           "rlkit LoRA / rlkit full update s/step | rlkit LoRA / rlkit full peak RSS |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    best_trl = max((col(results[x["label"]], "steps_per_s") for x in runs if x["side"] == "trl"), default=float("nan"))
    for x in runs:
        rs = results[x["label"]]
        sps, upd, rss = col(rs, "steps_per_s"), col(rs, "update_s_median"), col(rs, "peak_rss_mb")
        vs_trl = paired = vs_best = vs_upd = vs_rss = ""
        if x["side"] == "rlkit" and not x.get("full"):
            vs_best = f"{sps / best_trl:.2f}x"
            same = trl_by_engine.get(x["engine"])
            if same:
                vs_trl = f"{sps / col(same, 'steps_per_s'):.2f}x"
                paired = f"{med([a['steps_per_s'] / b['steps_per_s'] for a, b in zip(rs, same)]):.2f}x"
            if full and x.get("key") == "hf-lora":  # the same configuration as the full run but for LoRA
                vs_upd = f"{upd / col(full, 'update_s_median'):.2f}x"
                vs_rss = f"{rss / col(full, 'peak_rss_mb'):.2f}x"
        out.append(f"| {x['label']} | {num(sps, '.2f')} | {num(upd, '.4f')} | {num(col(rs, 'sync_s_median'), '.4f')} | "
                   f"{num(col(rs, 'sync_bytes_median'), ',.0f')} | {num(rss, '.0f')} | {vs_trl} | {paired} | {vs_best} | "
                   f"{vs_upd} | {vs_rss} |")
    return "\n".join(out)


def _driver_and_worker(rs: list[dict], phase: str, inside: str) -> tuple[float, str]:
    drv = med([r["phases_mean_s"].get(phase, 0.0) for r in rs])
    wk = med([r["worker_mean_s"].get(inside, float("nan")) for r in rs])
    return drv, f"{drv:.4f} [{wk:.4f}]"


def startup_table(results: dict[str, list[dict]], runs: list[dict]) -> str:
    """Start-up, process start to the first step begun, by part (medians over rounds)."""
    keys: list[str] = []
    for x in runs:
        for r in results[x["label"]]:
            keys += [k for k in r.get("startup_parts_s", {}) if k not in keys]
    out = ["| run | start-up s | " + " | ".join(k.removesuffix("_s") for k in keys) + " |",
           "| --- | ---: | " + " | ".join("---:" for _ in keys) + " |"]
    for x in runs:
        rs = results[x["label"]]
        cells = [med([r["startup_parts_s"][k] for r in rs if k in r.get("startup_parts_s", {})]) for k in keys]
        out.append(f"| {x['label']} | {med([r['startup_s'] for r in rs]):.1f} | "
                   + " | ".join("" if c != c else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(out)


def machine() -> str:
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) // 2**20 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), 0)
    return f"{os.cpu_count()} cores ({cpu}), {mem} GiB, load average {os.getloadavg()[0]:.1f} at the start"


# ---- --profile: where each side's time goes ---------------------------------------------------------
# One run of each side under py-spy (all its Python processes), samples sorted into phases by the frames on
# the stack. py-spy comes with bench/setup_trl.sh (beside the TRL venv's python). It samples only processes
# that run Python code and only samples that are on CPU (a thread blocked in ray.wait or a socket read is
# not counted), so the tables say where CPU time went per process; Ray's C++ daemons (raylet, gcs_server)
# show in the run's own ``cpu_s_by_process`` instead (psutil CPU seconds of every process of the run).
# Seconds are samples / rate; it samples with ``--nonblocking`` (pausing the process to sample slowed TRL's
# 2 OpenMP threads about 10x), and a few hundred samples per phase are noisy: compare shares, not steps/s.

RATE = 50  # samples per second per process

# (phase, markers): a sample goes to the first phase with a marker in its stack (checked in this order).
RLKIT_WORKER = [
    ("start-up: imports", ["_find_and_load"]),
    ("start-up: model + engine load", ["RLWorker.__init__", "setup (rlkit/workers/group.py"]),
    ("sync weights", ["sync_weights"]),
    ("generate: rlkit sampler (inverse transform, per-row RNG)", ["_SeededSampling"]),
    ("generate: HF generate (model forward, cache, HF sampling loop)", ["transformers/generation"]),
    ("generate: rlkit log-probs, trimming, decode", ["generate_batch", "generate (rlkit/rollout"]),
    ("update: backward", ["backward (torch", "_engine_run_backward"]),
    ("update: optimizer", ["step (torch/optim", "_single_tensor_adamw", "_multi_tensor_adamw", "clip_grad"]),
    ("update: forward + loss", ["update_actor"]),
    ("end: close (engine freed, gc)", ["_RankWorker.close", "RLWorker.close", "HFEngine.close"]),
    ("Ray: (de)serialize args / results", ["serializ", "pickle", "deserialize"]),
    ("Ray: task loop / other", [""]),
]
RLKIT_DRIVER = [
    ("start-up: imports", ["_find_and_load"]),
    ("start-up: Ray init", ["Cluster.__init__", "ray.init", "init (ray/"]),
    ("start-up: Trainer + workers", ["Trainer.__init__"]),
    ("step: reward", ["score (rlkit/rewards"]),
    ("step: advantages", ["_advantages"]),
    ("step: metrics log (jsonl rewrite)", ["_log (rlkit/trainer.py"]),
    ("step: Ray calls (submit, put, wait, get)", ["call_dp", "_gather", "call (rlkit/workers", "ray/"]),
    ("end: plots + shutdown", ["save_plots", "shutdown"]),
    ("step: other", ["train_step", "fit ("]),
    ("other", [""]),
]
TRL = [
    ("start-up: imports", ["_find_and_load"]),
    ("start-up: model load", ["from_pretrained"]),
    ("start-up: GRPOTrainer init", ["GRPOTrainer.__init__", "__init__ (trl/"]),
    ("generate: HF generate (model forward, cache, HF sampling loop)", ["transformers/generation", "timed_generate"]),
    ("update: backward", ["backward (torch", "_engine_run_backward", "backward (accelerate"]),
    ("update: optimizer", ["step (torch/optim", "_single_tensor_adamw", "_multi_tensor_adamw", "clip_grad"]),
    ("step: rewards, advantages, logs", ["_generate_and_score", "_calculate_rewards", "log ("]),
    ("update: forward + loss", ["compute_loss", "_compute_loss", "_get_per_token_logps"]),
    ("step: other (Trainer loop)", ["train ("]),
    ("other", [""]),
]


# a sample whose innermost frame is one of these is a thread waiting (py-spy cannot always tell an idle
# thread in a container): counted apart, never as CPU time
IDLE_LEAVES = ("wait (threading.py", "select (selectors.py", "sleep", "main_loop (ray/_private/worker.py",
               "_recv", "recv_into", "accept (socket.py", "poll (", "_worker (concurrent/futures/thread.py",
               "run_forever", "_run_once (asyncio")


def read_raw(path: Path) -> dict[str, collections.Counter]:
    """py-spy raw (collapsed) output -> {process label: Counter(stack -> samples)}. With --subprocesses
    each stack starts with its chain of ``process PID:"cmdline"`` frames; the innermost names it."""
    procs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        k = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        head = frames[k] if k >= 0 else "process ?"
        procs[head][";".join(frames[k + 1:])] += int(count)
    return procs


def classify(stacks: collections.Counter, rules: list[tuple[str, list[str]]]) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        leaf = stack.rsplit(";", 1)[-1]
        if not stack or any(m in leaf for m in IDLE_LEAVES):
            out["(waiting: not CPU)"] += n
            continue
        out[next(name for name, marks in rules if any(m in stack for m in marks))] += n
    return out


def role(label: str, stacks: collections.Counter) -> str:
    """What a sampled process is, from its command line (and, for Ray workers, what they ran)."""
    names = [("rlkit_worker.py", "rlkit driver"), ("trl_worker.py", "TRL process"),
             ("dashboard/agent.py", "Ray dashboard agent"), ("runtime_env/agent", "Ray runtime-env agent"),
             ("dashboard/dashboard.py", "Ray dashboard head"), ("monitor.py", "Ray monitor"),
             ("log_monitor.py", "Ray log monitor")]
    if "default_worker.py" in label:
        busy = any("rlkit/" in st for st in stacks)
        return "Ray worker (the rank)" if busy else "Ray worker (idle, pre-started)"
    if "log_monitor.py" in label:
        return "Ray log monitor"
    return next((who for mark, who in names if mark in label), "other: " + label[:60])


def profile_runs(runs: list[dict], model: str, steps: int, out: Path, timeout_s: float,
                 extra: list[str] = (), spy: Path = ROOT / ".venv-trl/bin/py-spy") -> None:
    """One py-spy'd run of each side's HF run; prints the phase tables and writes profile.json."""
    if not spy.exists():
        raise SystemExit(f"{spy} is missing: run `bash bench/setup_trl.sh` (it installs py-spy)")
    report: dict[str, dict] = {}
    for x in [r for r in runs if r["engine"] == "hf" and not r.get("full")]:
        raw = out / f"pyspy-{x['side']}.txt"
        # --nonblocking: never pause the process to sample (pausing torch's OpenMP threads slowed TRL ~10x)
        spied = dict(x, cmd=[str(spy), "record", "--subprocesses", "--nonblocking", "-r", str(RATE), "--format",
                             "raw", "-o", str(raw), "--", *x["cmd"]])
        more = [*extra, *(["--probe"] if x["side"] == "rlkit" else [])]
        res = run_one(spied, model, steps, out / f"profile-{x['side']}.log", timeout_s, more)
        procs = read_raw(raw)
        tables = {}
        for label, stacks in procs.items():
            who = role(label, stacks)
            rules = {"rlkit driver": RLKIT_DRIVER, "Ray worker (the rank)": RLKIT_WORKER, "TRL process": TRL}.get(who)
            phases = classify(stacks, rules or [("(all)", [""])])
            tables.setdefault(who, collections.Counter()).update(phases)
        report[x["label"]] = {"result": res, "cpu_s": {w: {k: v / RATE for k, v in t.most_common()}
                                                      for w, t in tables.items()}}
        print(f"\n## {x['label']}: {res['steps']} steps, {res['steps_per_s']:.2f} steps/s under py-spy, "
              f"start-up {res['startup_s']:.1f} s")
        for who, t in sorted(tables.items(), key=lambda kv: -sum(v for k, v in kv[1].items() if k[0] != "(")):
            total = sum(v for k, v in t.items() if not k.startswith("(waiting")) / RATE
            print(f"\n{who}: {total:.1f} CPU s sampled\n\n| phase | CPU s | ms per step (all {steps}) |\n"
                  f"| --- | ---: | ---: |")
            for k, v in t.most_common():
                per = "" if k.startswith(("start-up", "end", "other", "(")) else f"{v / RATE / steps * 1000:.1f}"
                print(f"| {k} | {v / RATE:.2f} | {per} |")
        for key in ("cpu_s_by_process", "probe"):
            if key in res:
                print(f"\n{key}: {json.dumps(res[key], indent=1)}")
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(f"\nraw stacks and logs in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (issue 13's tiny Qwen2), a pretrained name or a folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per run (the first 2 are not measured)")
    ap.add_argument("--vllm", action="store_true", help="add the vLLM runs (each vLLM start costs ~20 s)")
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"))
    ap.add_argument("--rlkit-python", default=sys.executable)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    ap.add_argument("--out", default=str(ROOT / "runs/bench_vs_trl"), help="logs and results.json go here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both sides (default: each side's own: TRL one per core, rlkit 1 per rank)")
    ap.add_argument("--profile", action="store_true", help="one py-spy'd run per side instead of the rounds")
    ap.add_argument("--base", default=None, help="a commit: also run every rlkit configuration at it, "
                                                 "interleaved in the same rounds (a speed change, side by side)")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="both sides train LoRA adapters of rank R (alpha 2R, q/k/v/o_proj), plus one rlkit run "
                         "training all weights; a LoRA table follows the usual ones")
    ap.add_argument("--rows", nargs="*", default=[], choices=("ray", "dp2", "bf16"),
                    help="more rlkit runs: ray (one Ray worker), dp2 (2 Ray ranks, same global batch), bf16 "
                         "(a bf16 rollout engine)")
    args = ap.parse_args()
    if args.lora is not None and args.lora < 1:
        ap.error(f"--lora {args.lora}: the rank must be a positive int")
    if args.rounds < 1 or args.steps < 3:
        ap.error(f"--rounds {args.rounds} --steps {args.steps}: need rounds >= 1 and steps >= 3 (2 are warm-up)")
    if not python_with(args.trl_python, "trl", "datasets"):
        sys.exit(f"{args.trl_python} cannot import trl and datasets: run `bash bench/setup_trl.sh` (or make "
                 f"bench-trl), or pass --trl-python")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_folder(args.model)
    runs = plan_runs(args)
    base_tree = None
    if args.base:
        runs, base_tree = with_base(runs, args.base, out)
    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.profile:
        profile_runs(runs, model, args.steps, out, args.timeout, threads, Path(args.trl_python).parent / "py-spy")
        return
    print(f"model {model}\nmachine: {machine()}\n{args.rounds} rounds x {args.steps} steps, runs: "
          f"{[x['label'] for x in runs]}", flush=True)
    results: dict[str, list[dict]] = {x["label"]: [] for x in runs}
    failed: dict[str, str] = {}  # label -> the error's last line (the run is not retried)
    for r in range(args.rounds):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for x in order:
            if x["label"] in failed:
                continue
            try:
                res = run_one(x, model, args.steps, out / f"r{r}-{x['side']}-{x.get('key', x['engine'])}.log",
                              args.timeout, threads)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one configuration failing: say so, go on
                lines = str(e).strip().splitlines()
                failed[x["label"]] = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1])[:300]
                print(f"round {r + 1}: {x['label']} FAILED: {e}", flush=True)
                continue
            results[x["label"]].append(res)
            print(f"round {r + 1}: {x['label']:22s} {res['steps_per_s']:.2f} steps/s, start-up "
                  f"{res['startup_s']:.1f} s, {res['threads']} thread(s), peak RSS {res['peak_rss_mb']:.0f} MB, process "
                  f"{res['process_wall_s']:.1f} s, load average before {res['load_avg_1min_before']:.1f}", flush=True)
    (out / "results.json").write_text(json.dumps({"model": model, "args": vars(args), "results": results,
                                                  "failed": failed}, indent=1))
    runs = [x for x in runs if results[x["label"]]]
    print("\n\n".join(["", table(results, runs), phase_table(results, runs), startup_table(results, runs),
                       *([lora_table(results, runs)] if args.lora else [])]))
    if base_tree is not None:
        print("\n" + base_table(results, runs))
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    for label, why in failed.items():
        print(f"\n{label}: failed, {why}")


if __name__ == "__main__":
    main()
