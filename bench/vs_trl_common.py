"""The bench scripts' shared helper module: the work both sides of bench_vs_trl.py do (and of
bench_agentic_vs_trl.py, ``AGENTIC``, and bench_task_vs_trl.py, ``TASK``), how each run is
clocked (imported by both workers), and the pieces more than one bench script uses (the repo root, issue
13's tiny Qwen2, resolving a model folder, running one worker process). It imports no bench script.

At import it loads no torch, TRL or rlkit (``model_folder`` imports rlkit when called), so the TRL venv
and the rlkit venv both load it by path:

    >>> import sys; sys.path.insert(0, "bench")                       # doctest: +SKIP
    >>> from vs_trl_common import WORK, share_of                        # doctest: +SKIP
    >>> share_of(7)([[7, 7, 1, 2]])                                     # doctest: +SKIP
    [0.5]

A step here is one RL step: ``WORK["prompts_per_step"]`` prompts x ``WORK["n"]`` completions x up to
``WORK["max_new_tokens"]`` new tokens, then one optimizer step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the repo root: every default path is derived from it
BENCH = ROOT / "bench"
# issue 13's tiny Qwen2 (2 layers, hidden 128, tied embeddings, vocab 512): bench_vs_trl's default model
TINY = dict(arch="qwen2", size="test", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

# The prompts of the side-by-side probes (short plain text, no chat template).
PROMPTS = ["the quick brown fox", "what is two plus two ?", "count the apples :", "a b c d",
           "reinforcement learning", "jupyter notebooks make", "one two three", "the lazy dog"] * 8
WORK: dict[str, Any] = dict(n=4, prompts_per_step=2, max_new_tokens=32, lr=1e-3, temperature=1.0, kl=0.0,
                            max_grad_norm=1.0, seed=0, target_token="e")
WARMUP_STEPS = 2  # steps left out of steps/s: the first steps carry one-off costs (vLLM warms up here)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # bench_vs_trl --lora: the attention projections
# bench_agentic_vs_trl.py's work: GRPO with the calculator tool on rlkit.tasks.Calculator's train questions,
# prompts_per_step x n episodes of at most max_turns assistant turns (one tool round, then the answer) and
# max_tokens response tokens in all (TRL's max_completion_length), each turn up to max_new_tokens
AGENTIC: dict[str, Any] = dict(n=4, prompts_per_step=2, max_turns=2, max_new_tokens=96, max_tokens=96, lr=2e-5,
                               temperature=1.0, kl=0.0, max_grad_norm=1.0, seed=0, digits=(3, 2), train_rows=512)
# bench_task_vs_trl.py's work: GRPO on reasoning-gym's basic_arithmetic (two 1-digit terms) asked in a chat, on
# SmolLM2-135M-Instruct: prompts_per_step questions x n samples x up to max_new_tokens, rlkit.MathAnswer() as the
# reward, one optimizer step per batch, bf16 mixed precision; train_rows: the task's train rows (rlkit's order)
TASK: dict[str, Any] = dict(model="smollm2-135m-instruct", task="basic_arithmetic", test_fraction=0.3,
                            config=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1), n=8,
                            prompts_per_step=4, max_new_tokens=48, lr=1e-5, temperature=1.0, kl=0.0,
                            max_grad_norm=1.0, seed=0, train_rows=1000)


def calculator_task():
    """``rlkit.tasks.Calculator`` of ``AGENTIC``'s digits (imports rlkit: the repo root must be on sys.path;
    rlkit.tasks needs no torch, so the TRL venv imports it from the checkout too)."""
    from rlkit.tasks import Calculator

    return Calculator(digits=tuple(AGENTIC["digits"]))


def reasoning_task():
    """``rlkit.tasks.reasoning_gym`` of ``TASK`` in a chat (imports rlkit; needs reasoning-gym: the rlkit venv)."""
    from rlkit.tasks import reasoning_gym

    return reasoning_gym(TASK["task"], chat=True, test_fraction=TASK["test_fraction"], **TASK["config"])


def task_worker_args() -> argparse.Namespace:
    """The command line both task workers take: ``MODEL_DIR STEPS --rows FILE [--threads N] [--save DIR]
    [--warmup K] [--seed S]`` (``--rows``: the driver's train rows and the order rlkit visits them in, drawn
    with the same seed)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--rows", required=True, help="JSON {rows, order} written by bench_task_vs_trl.py")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--save", default=None, help="save the trained model here (for the held-out evaluation)")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="steps left out of steps/s")
    ap.add_argument("--seed", type=int, default=TASK["seed"], help="the run's seed (sampling, and rlkit's order)")
    return ap.parse_args()


def recorded_math_answer(calls: list[dict]) -> Callable[..., list[float]]:
    """The reward of both sides of bench_task_vs_trl.py: ``rlkit.MathAnswer()`` on each completion's text (rlkit's
    ``completion_text``: a TRL conversational completion's last message) and the row's ``answer``; each call's
    questions (one per completion), mean reward and seconds are appended to ``calls``.
    Imports rlkit's reward module (pure Python, with math-verify), so both venvs use it from the checkout."""
    from rlkit.rewards.math_answer import MathAnswer
    from rlkit.tasks.base import completion_text

    score = MathAnswer()

    def math_answer(prompts, completions, answer, question=None, **columns) -> list[float]:
        t = time.perf_counter()
        out = score(prompts, [completion_text(c) for c in completions], answer=answer)
        calls.append({"questions": list(question or []), "reward_mean": sum(out) / max(len(out), 1),
                      "s": time.perf_counter() - t})
        return out

    return math_answer


def agentic_worker_args() -> argparse.Namespace:
    """The command line both agentic workers take: ``MODEL_DIR STEPS [--threads N] [--save DIR]``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--save", default=None, help="save the trained model here (for the held-out evaluation)")
    return ap.parse_args()


def lora_config(r: int):
    """The one peft ``LoraConfig`` both sides of ``bench_vs_trl.py --lora R`` train: rank ``r``, alpha ``2r``,
    no dropout, the attention projections (TRL's ``peft_config=``, rlkit's ``Trainer(lora=)``). Imports peft."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(LORA_TARGETS))


def share_of(target: int) -> Callable[[list[list[int]]], list[float]]:
    """The reward on token ids: the share of each completion's tokens equal to ``target``.

    >>> share_of(3)([[3, 1], [2, 2, 2], []])
    [0.5, 0.0, 0.0]
    """
    def reward(completion_ids: list[list[int]]) -> list[float]:
        return [sum(t == target for t in ids) / max(len(ids), 1) for ids in completion_ids]
    return reward


def process_start_time() -> float:
    """When this process started (epoch seconds): start-up is measured from here, not from ``main``."""
    import psutil

    return psutil.Process(os.getpid()).create_time()


class PeakRSS:
    """Samples the RSS of this process and all its descendants (Ray's daemons and workers included)
    every ``every_s`` seconds in a daemon thread; ``peak_mb`` is the largest sum seen.

    >>> p = PeakRSS().start()
    >>> p.stop()
    >>> p.peak_mb > 0
    True
    """

    def __init__(self, every_s: float = 0.5):
        import psutil

        self.proc, self.every_s, self.peak_mb, self.peak_procs = psutil.Process(os.getpid()), every_s, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def sample(self) -> None:
        import psutil

        total, count = 0, 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
                count += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):  # a child that just exited
                pass
        if total / 2**20 > self.peak_mb:
            self.peak_mb, self.peak_procs = total / 2**20, count

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> PeakRSS:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        self._thread.join(timeout=5)


class StepClock:
    """Begin / end times of each step (perf_counter) and the completion tokens of each step."""

    def __init__(self) -> None:
        # the process start on the perf_counter clock (create_time has the kernel's 10 ms resolution)
        self.t0_perf = time.perf_counter() - (time.time() - process_start_time())
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.tokens: list[int] = []

    def begin(self) -> None:
        self.begins.append(time.perf_counter())

    def end(self) -> None:
        self.ends.append(time.perf_counter())

    def summary(self, warmup: int = WARMUP_STEPS) -> dict[str, Any]:
        """steps/s and tokens/s over the steps after ``warmup`` (wall clock from the first measured
        step's begin to the last step's end: everything between steps counts), start-up seconds."""
        n = min(len(self.begins), len(self.ends))
        if n <= warmup:
            raise RuntimeError(f"only {n} steps ran; need more than warmup={warmup}")
        wall = self.ends[n - 1] - self.begins[warmup]
        toks = sum(self.tokens[warmup:n]) if len(self.tokens) >= n else float("nan")
        gaps = [self.begins[i + 1] - self.begins[i] for i in range(warmup, n - 1)]
        return {"steps": n, "measured_steps": n - warmup, "steps_per_s": (n - warmup) / wall,
                "tokens_per_s": toks / wall, "median_step_s": statistics.median(gaps) if gaps else wall,
                "startup_s": self.begins[0] - self.t0_perf, "first_steps_s": self.begins[warmup] - self.begins[0],
                "tokens_per_step": toks / (n - warmup)}


class TRLPhases:
    """Where a TRL ``GRPOTrainer`` run spends each step, on ``clock``'s steps: ``generate`` (inside HF generate),
    ``prepare`` (``_prepare_inputs``: generation and scoring), ``reward`` (what the caller's reward function
    ``add``s) and ``update`` (from the batch ready to the step's end); and TRL's own logged numbers (``logs``).

    >>> phases = TRLPhases(StepClock())   # then: phases.time_generate(); GRPOTrainer(..., callbacks=phases.callbacks())
    >>> phases.per_step()
    {'generate': [], 'prepare': [], 'reward': [], 'update': []}
    """

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.phase: dict[str, list[list[float]]] = {k: [] for k in ("generate", "prepare", "reward", "update")}
        self.logs: list[dict] = []
        self._prepared: list[float] = []

    def add(self, name: str, seconds: float) -> None:
        """``seconds`` of phase ``name`` in the current step."""
        self.phase[name][-1].append(seconds)

    def time_generate(self) -> None:
        """Time every HF ``generate`` call from now on (as the ``generate`` phase)."""
        from transformers.generation.utils import GenerationMixin

        inner = GenerationMixin.generate

        def timed_generate(model, *a, **kw):
            t = time.perf_counter()
            out = inner(model, *a, **kw)
            self.add("generate", time.perf_counter() - t)
            return out

        GenerationMixin.generate = timed_generate

    def callbacks(self) -> list:
        """The trainer callbacks that open each step's entries, time the steps and the update, keep TRL's logs."""
        from transformers import TrainerCallback

        phases = self

        class Clock(TrainerCallback):
            def on_step_begin(self, *a, **k):
                for v in phases.phase.values():
                    v.append([])
                phases.clock.begin()

            def on_step_end(self, *a, **k):
                phases.clock.end()
                if phases._prepared:  # the update: from the batch ready (generated, scored) to the step's end
                    phases.add("update", phases.clock.ends[-1] - phases._prepared.pop())

        class Logs(TrainerCallback):
            def on_log(self, _args, _state, _control, logs=None, **k):
                if logs:
                    phases.logs.append({key: v for key, v in logs.items() if isinstance(v, (int, float))})

        return [Clock(), Logs()]

    def time_prepare(self, trainer: Any) -> None:
        """Time ``trainer._prepare_inputs`` (``Trainer.training_step`` calls it first: generation and scoring)."""
        prepare = trainer._prepare_inputs

        def timed_prepare(*a, **k):
            t = time.perf_counter()
            out = prepare(*a, **k)
            self._prepared[:] = [time.perf_counter()]
            self.add("prepare", self._prepared[0] - t)
            return out

        trainer._prepare_inputs = timed_prepare

    def per_step(self) -> dict[str, list[float]]:
        """Each phase's seconds per step, over the steps the clock saw end."""
        n = len(self.clock.ends)
        return {k: [sum(x) for x in v[:n]] for k, v in self.phase.items()}

    def medians(self, warmup: int) -> dict[str, float]:
        """Each timed phase's median seconds a step, after ``warmup`` steps."""
        return {k: statistics.median(v[warmup:]) for k, v in self.per_step().items() if v[warmup:] and any(v)}


def emit(result: dict[str, Any]) -> None:
    """One machine-readable line for the orchestrator (bench_vs_trl.py), with this process's own peak RSS."""
    result["driver_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def model_folder(name: str) -> str:
    """``tiny`` -> the tiny Qwen2 of issue 13 (``TINY``, built once); a known pretrained name or a folder
    as is. Imports rlkit (call it from the rlkit venv)."""
    import rlkit.models

    if name == "tiny":
        spec = dict(TINY)
        return rlkit.models.tiny_lm(spec.pop("arch"), spec.pop("size"), **spec)
    return rlkit.models.pretrained(name)


def python_with(python: str, *modules: str) -> bool:
    """Whether ``python`` exists and imports every one of ``modules``."""
    if not Path(python).exists():
        return False
    code = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
    return subprocess.run([python, "-c", code, *modules], capture_output=True).returncode == 0


def run_one(run: dict, model: str, steps: int, log: Path, timeout_s: float, extra: Sequence[str] = ()) -> dict:
    """Run one worker process (``run["cmd"]`` + model + steps + ``extra``, in the repo root); its RESULT
    line as a dict (the full output goes to ``log``)."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    if "--threads" in extra:  # the OpenMP pool is sized at torch's import: set it before, too
        env["OMP_NUM_THREADS"] = extra[list(extra).index("--threads") + 1]
    env.pop("VIRTUAL_ENV", None)
    # a shell that sets PYTHONDONTWRITEBYTECODE (this sandbox's does) leaves a venv without bytecode caches: every
    # run then compiles its imports from source (rlkit's venv, made under that shell, took 3.9 s to import
    # instead of 1.3 s, while TRL's had its caches). Both sides may write and read their caches, as `make` lets them
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(run.get("env", {}))  # e.g. PYTHONPATH of another commit's checkout (bench_vs_trl --base)
    load = os.getloadavg()[0]  # another session on the same cores shows here (steps/s then drops)
    t0 = time.perf_counter()
    # in the run's own checkout (bench_vs_trl --base): Ray puts the driver's working folder first on its
    # workers' sys.path, so from the repo root they would import this checkout's rlkit
    proc = subprocess.run([*run["cmd"], model, str(steps), *extra], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=run.get("cwd", ROOT))
    wall = time.perf_counter() - t0
    log.write_text(f"$ {' '.join(run['cmd'])} {model} {steps} {' '.join(extra)}\n--- stdout\n{proc.stdout}"
                   f"\n--- stderr\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{run['label']} failed (exit {proc.returncode}); full log in {log}:\n{tail}")
    res = json.loads(lines[-1][len("RESULT "):])
    res["process_wall_s"], res["load_avg_1min_before"] = wall, load
    return res
