"""Where each side's time goes: one run of each under py-spy (all its Python processes), samples
sorted into phases by the frames on the stack. Used by ``bench_vs_trl.py --profile``.

    .venv/bin/python bench/bench_vs_trl.py --profile --steps 20

py-spy comes with bench/setup_trl.sh (in .venv-trl/bin). It samples only processes that run Python
code and only samples that are on CPU (a thread blocked in ray.wait or a socket read is not counted),
so the tables say where CPU time went per process; Ray's C++ daemons (raylet, gcs_server) show in the
run's own ``cpu_s_by_process`` instead (psutil CPU seconds of every process of the run). Seconds are
samples / rate; it samples with ``--nonblocking`` (pausing the process to sample slowed TRL's 2 OpenMP
threads about 10x), and a few hundred samples per phase are noisy: compare shares, not steps/s.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

RATE = 50  # samples per second per process

# (phase, markers): a sample goes to the first phase with a marker in its stack (checked in this order).
RLKIT_WORKER = [
    ("start-up: imports", ["_find_and_load"]),
    ("start-up: model + engine load", ["RLWorker.__init__", "setup (rlkit/workers/group.py"]),
    ("sync weights", ["sync_weights"]),
    ("rss_gb call", ["rss_gb"]),
    ("generate: rlkit sampler (Gumbel, per-row RNG)", ["_SeededSampling"]),
    ("generate: HF generate (model forward, cache, HF sampling loop)", ["transformers/generation"]),
    ("generate: rlkit log-probs, trimming, decode", ["rollout_to_batch", "generate (rlkit/rollout"]),
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
    ("step: reward", ["_score"]),
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
                 extra: list[str] = ()) -> None:
    """One py-spy'd run of each side's HF run; prints the phase tables and writes profile.json."""
    from bench_vs_trl import ROOT, run_one

    spy = ROOT / ".venv-trl/bin/py-spy"
    if not spy.exists():
        raise SystemExit(f"{spy} is missing: run `bash bench/setup_trl.sh` (it installs py-spy)")
    report: dict[str, dict] = {}
    for x in [r for r in runs if r["engine"] == "hf"]:
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
    raise SystemExit("run it through bench_vs_trl.py --profile")


if __name__ == "__main__":
    main()
