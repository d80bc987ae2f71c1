"""How rlkit's GRPO step time scales (issue 13): against batch size, response length and model size.

    .venv/bin/python bench/bench_scaling.py            # 3 rounds of the three sweeps + bench/scaling.png (~3.5 min)
    .venv/bin/python bench/bench_scaling.py --quick    # a smoke run: 2 points a sweep, 1 round of 1 + 2 steps
    .venv/bin/python bench/bench_scaling.py --no-big   # model sizes without SmolLM2-135M-Instruct
    .venv/bin/python bench/bench_scaling.py --trl      # + TRL on the model-size sweep, same rounds (~5.5 min in all)

Every point is an in-process ``rlkit.Trainer`` (dp=1, HF engine in fp32, 1 torch thread) running GRPO with
``ignore_eos=True``, so every response has exactly ``max_new_tokens`` tokens. A point's time is the median
over ``--steps`` steps after ``--warmup`` warm-up steps, split from rlkit's ``timing/*`` metrics into
generate, update (the actor's optimizer step) and other (reward, advantages, sync, metrics, the rest).
The sweeps run ``--rounds`` times, interleaved, and each point reports the median over rounds.

Sweeps: (a) batch = prompts_per_step x n (1x4 ... 16x4) at 32 new tokens, (b) response length (8 ... 128)
at 2x4, both on bench_vs_trl.py's tiny Qwen2 (``vs_trl_common.TINY``: 2 layers, hidden 128, tied, vocab 512); (c) model
size at 2x4x32: that tiny Qwen2, the tiny_lm sizes of rlkit/models/tiny.py, and SmolLM2-135M-Instruct
(fewer steps). ``--trl`` runs bench/trl_worker.py (TRL 1.16 GRPOTrainer, HF generate, ``.venv-trl``, 1 torch
thread) on the model-size points in each round: its work is bench_vs_trl.py's 2x4x32, but it stops at eos (its
responses may be a little shorter) and its step time is the median gap between step begins (what the loop
does between steps included) over the steps after its 2 warm-up steps (1 step on 135M). The batch and length
sweeps have no TRL points: trl_worker.py runs only bench_vs_trl.py's fixed work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helper module, by path
from vs_trl_common import PROMPTS, ROOT, model_folder  # noqa: E402

PHASES = ("generate", "update", "other")
COLORS = {"generate": "#4c72b0", "update": "#dd8452", "other": "#a5a5a5", "step": "black"}


def model_points(big: bool) -> list[tuple[str, str]]:
    """(label, folder) of the model-size sweep, smallest first."""
    import rlkit.models

    out = [("TINY", model_folder("tiny"))]
    out += [(s, rlkit.models.tiny_lm("qwen2", size=s)) for s in ("test", "small", "demo", "10m")]
    if big:
        out.append(("135M", rlkit.models.pretrained("smollm2-135m-instruct")))
    return out


def params_of(folder: str) -> int:
    """Parameters of a checkpoint, a tied embedding counted once (built on meta: no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in m.parameters())  # parameters() yields a tied tensor once


def rlkit_point(model: str, prompts_per_step: int, n: int, tokens: int, warmup: int, steps: int) -> dict:
    """One in-process GRPO Trainer: median seconds per phase over the measured steps."""
    import rlkit

    def reward(prompts, completions, **kw):  # cheap and varied: GRPO needs different rewards in a group
        return [c.count("e") / max(len(c), 1) for c in completions]

    tr = rlkit.Trainer(model=model, dataset=[{"prompt": p} for p in PROMPTS], reward=reward, algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=n, max_new_tokens=tokens, temperature=1.0,
                                             ignore_eos=True, dtype="float32"),
                       prompts_per_step=prompts_per_step, lr=1e-3, kl_coef=0.0, max_grad_norm=1.0, seed=0,
                       run_dir=tempfile.mkdtemp(prefix="rlkit-bench-scaling-"))
    try:
        rows = [tr.train_step() for _ in range(warmup + steps)][warmup:]
    finally:
        tr.close()
    lengths = {r["response_length/mean"] for r in rows}
    if lengths != {float(tokens)}:  # ignore_eos: every response is max_new_tokens long
        raise RuntimeError(f"response lengths {sorted(lengths)} != {tokens}: ignore_eos did not hold")
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    for r in rows:  # per step, so other is never negative (a median of differences, not of each phase)
        r["other"] = r["timing/step"] - r["timing/generate"] - r["timing/update"]
    return {"step": med("timing/step"), "generate": med("timing/generate"), "update": med("timing/update"),
            "other": med("other"),
            "steps": len(rows), "load": os.getloadavg()[0]}


def trl_point(model: str, steps: int, timeout_s: float = 900) -> dict | None:
    """TRL's median step seconds on bench_vs_trl.py's work (2x4x32, eos allowed), or None without TRL."""
    python = ROOT / ".venv-trl/bin/python"
    if not python.exists():
        print(f"skip TRL: {python} is missing (bash bench/setup_trl.sh)")
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run([str(python), str(ROOT / "bench/trl_worker.py"), model, str(steps), "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(f"TRL failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-3:]}")
        return None
    res = json.loads(lines[-1][len("RESULT "):])
    return {"step": res["median_step_s"], "generate": res.get("generate_s_per_step"),
            "tokens_per_step": res.get("tokens_per_step")}


def sweep(name: str, points: list[tuple[str, dict]], warmup: int, steps: int) -> list[tuple[str, dict]]:
    out = []
    for label, kw in points:
        k = dict(kw)
        res = rlkit_point(k.pop("model"), warmup=k.pop("warmup", warmup), steps=k.pop("steps", steps), **k)
        print(f"  {name} {label:>6s}: step {res['step']:.3f} s (generate {res['generate']:.3f}, update "
              f"{res['update']:.3f}, other {res['other']:.3f}) over {res['steps']} steps, load {res['load']:.2f}",
              flush=True)
        out.append((label, res))
    return out


def merge(runs: list[list[tuple[str, dict]]]) -> list[tuple[str, dict]]:
    """Per point, the median over rounds of each phase's (per-round median) seconds."""
    out = []
    for i, (label, first) in enumerate(runs[0]):
        vals = [run[i][1] for run in runs]
        out.append((label, {**first, **{k: statistics.median(v[k] for v in vals) for k in ("step", *PHASES)},
                            "rounds": [round(v["step"], 4) for v in vals]}))
    return out


def table(title: str, xname: str, rows: list[tuple[str, dict]], extra: dict[str, dict] | None = None) -> str:
    """A markdown table of one sweep; seconds per step, and each phase's share."""
    head = f"| {xname} | step s | generate s | update s | other s | generate share | step s per round |"
    sep = "| --- | ---: | ---: | ---: | ---: | ---: | --- |"
    if extra is not None:
        head, sep = head + " TRL step s (rounds) |", sep + " ---: |"
    out = [f"**{title}**", "", head, sep]
    for label, r in rows:
        line = (f"| {label} | {r['step']:.3f} | {r['generate']:.3f} | {r['update']:.3f} | {r['other']:.3f} | "
                f"{r['generate'] / r['step']:.0%} | {', '.join(f'{x:.3f}' for x in r['rounds'])} |")
        if extra is not None:
            t = extra.get(label)
            line += f" {t['step']:.3f} ({', '.join(f'{x:.3f}' for x in t['rounds'])}) |" if t else " - |"
        out.append(line)
    return "\n".join(out)


def plot(panels: list[tuple[str, str, list[tuple[str, dict]]]], path: Path, trl: dict[str, dict]) -> None:
    """Three panels in one PNG: stacked bars (generate / update / other) for batch and length, lines on
    log-log axes for model size (TRL's step time as crosses where measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4), dpi=80)
    for ax, (title, xname, rows) in zip(axes, panels):
        if xname == "model":  # three orders of magnitude: phases as lines on log-log axes
            xs = [r["params"] for _, r in rows]
            for ph in ("step", *PHASES):
                ax.plot(xs, [r[ph] for _, r in rows], marker="o", label=ph,
                        color=COLORS.get(ph, "black"), linestyle="--" if ph == "step" else "-")
            if trl:
                tx = [(r["params"], trl[lab]["step"]) for lab, r in rows if lab in trl]
                ax.scatter(*zip(*tx), marker="x", s=60, color="crimson", zorder=3, label="TRL step")
            for (lab, r) in rows:
                ax.annotate(lab.split(" (")[0], (r["params"], r["step"]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("parameters")
            ax.legend(fontsize=8, loc="upper left")
        else:  # stacked bars: generate / update / other
            xs = range(len(rows))
            bottom = [0.0] * len(rows)
            for ph in PHASES:
                vals = [r[ph] for _, r in rows]
                ax.bar(xs, vals, bottom=bottom, color=COLORS[ph], label=ph, width=0.7)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_xticks(list(xs), [lab for lab, _ in rows])
            ax.set_xlabel(xname)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("seconds per step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("rlkit GRPO step time (dp=1, HF engine fp32, 1 torch thread, ignore_eos; median of steps)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 points a sweep, 1 + 2 steps, no 135M")
    ap.add_argument("--rounds", type=int, default=3, help="times each sweep runs, interleaved (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--big-steps", type=int, default=2, help="measured steps on the 135M model (1 warm-up)")
    ap.add_argument("--no-big", action="store_true", help="leave SmolLM2-135M-Instruct out of the model sweep")
    ap.add_argument("--trl", action="store_true", help="also run TRL on the model-size points (its own work)")
    ap.add_argument("--png", default=str(ROOT / "bench/scaling.png"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # one rank, one thread: what bench_vs_trl compares
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    warmup, steps = (1, 2) if args.quick else (args.warmup, args.steps)
    t0 = time.perf_counter()
    print(f"load average at the start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores), torch "
          f"{torch.__version__}, {torch.get_num_threads()} torch thread", flush=True)
    tiny = model_folder("tiny")
    batches = [(1, 4), (2, 4), (4, 4), (8, 4), (16, 4)]
    lengths = [8, 16, 32, 64, 128]
    models = model_points(big=not (args.no_big or args.quick))
    if args.quick:
        batches, lengths, models = batches[:2], lengths[:2], models[:2]
    sizes = {label: params_of(folder) for label, folder in models}
    models.sort(key=lambda m: sizes[m[0]])  # smallest first (bench_vs_trl's TINY is bigger than "test")
    c_points = []
    for label, folder in models:
        kw = dict(model=folder, prompts_per_step=2, n=4, tokens=32)
        if label == "135M":
            kw.update(warmup=1, steps=args.big_steps)
        c_points.append((label, kw))
    a_points = [(f"{p}x{n}", dict(model=tiny, prompts_per_step=p, n=n, tokens=32)) for p, n in batches]
    b_points = [(str(t), dict(model=tiny, prompts_per_step=2, n=4, tokens=t)) for t in lengths]
    rounds: list[tuple[list, list, list]] = []
    trl_runs: dict[str, list[dict]] = {label: [] for label, _ in models}
    for r in range(1 if args.quick else args.rounds):  # the sweeps interleaved: load drifts hit every point
        print(f"round {r + 1}", flush=True)
        rounds.append((sweep("batch", a_points, warmup, steps), sweep("length", b_points, warmup, steps),
                       sweep("model", c_points, warmup, steps)))
        for label, folder in models if args.trl else ():  # TRL in the same round as rlkit's points
            res = trl_point(folder, steps=3 if label == "135M" else warmup + steps)
            if res:
                trl_runs[label].append(res)
                print(f"  TRL   {label:>6s}: step {res['step']:.3f} s, {res['tokens_per_step']:.0f} tokens/step",
                      flush=True)
    a, b, c = (merge([rd[i] for rd in rounds]) for i in range(3))
    for (label, _), (_, r) in zip(models, c):
        r["params"] = sizes[label]
    shown = {label: f"{label} ({sizes[label] / 1e6:.2f}M)" if sizes[label] >= 1e6 else f"{label} ({sizes[label] / 1e3:.0f}k)"
             for label, _ in models}
    c = [(shown[label], r) for label, r in c]
    trl = {shown[label]: {"step": statistics.median(x["step"] for x in runs), "rounds": [x["step"] for x in runs]}
           for label, runs in trl_runs.items() if runs}
    panels = [("(a) batch (prompts x n), 32 tokens, tiny Qwen2", "batch", a),
              ("(b) response length, 2x4, tiny Qwen2", "new tokens", b),
              ("(c) model size, 2x4x32", "model", c)]
    plot(panels, Path(args.png), trl)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}; whole run {time.perf_counter() - t0:.0f} s; "
          f"plot: {args.png} ({Path(args.png).stat().st_size // 1024} KB)\n")
    print(table("(a) batch size, 32 new tokens, tiny Qwen2 of bench_vs_trl.py", "prompts x n", a))
    print()
    print(table("(b) response length, 2 prompts x 4, tiny Qwen2", "new tokens", b))
    print()
    print(table("(c) model size, 2 prompts x 4 x 32 tokens", "model (params)", c, trl if args.trl else None))


if __name__ == "__main__":
    main()
