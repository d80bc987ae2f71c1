"""One run of bench_vlm_vs_trl.py's work (GRPO on the Shapes pictures, the tiny Qwen2.5-VL), in its own process:
rlkit's ``Trainer`` (the rlkit venv) or TRL's ``GRPOTrainer`` (the TRL venv, which cannot import rlkit).

    .venv/bin/python     bench/vlm_vs_trl_worker.py rlkit MODEL_DIR STEPS --rows DIR/rows.json [--threads N] [--warmup K] [--seed S] [--dtype bf16|fp32]
    .venv-trl/bin/python bench/vlm_vs_trl_worker.py trl   MODEL_DIR STEPS --rows DIR/rows.json [...the same]

``--rows``: the driver's JSON ``{"work", "rows", "order"}``: the hyper-parameters (``work``), the train rows
(``{"id", "prompt", "image": a PNG file beside the JSON, "answer"}``) and the order rlkit's sampler visits them in.
Both sides read the same PNG files. rlkit: ``Trainer(dataset=rows, reward=Shapes().reward, epochs=1,
rollout=Rollout(engine="hf"))``, its own epoch order. TRL: the rows in that order (``shuffle_dataset=False``), the
image-only Qwen2.5-VL processor built from the checkpoint's files as ``processing_class`` (what
``rlkit.models.load_processor`` builds where torchvision is missing: transformers 5's ``AutoProcessor`` for
Qwen2.5-VL needs torchvision for its video processor), and ``shapes_reward`` (``Shapes().reward`` for
``question="count"`` in a few lines: the first integer of the completion's text, cut at an end marker, equals
the answer). ``--dtype bf16``: bf16 autocast on fp32 weights on both sides (rlkit ``precision="bf16-mixed"``,
``Rollout(dtype="bfloat16")``; TRL ``bf16=True``); ``fp32``: fp32 throughout.

Prints ``RESULT {json}``: steps/s after the warm-up steps, each step's seconds, per-step phase medians over the
measured steps (rlkit: its ``timing/*`` metrics; TRL: ``generate`` inside HF ``generate``, ``prepare`` =
``_prepare_inputs`` (generation, reward, advantages), ``reward``, ``update`` = batch ready to step end), the row
ids each step's reward saw (the driver checks both sides trained on the same rows), rewards and lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # vs_trl_common only: the TRL side never imports rlkit
from vs_trl_common import PeakRSS, StepClock, TRLPhases, emit  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up

# rlkit.tasks.Shapes(question="count").reward, re-implemented for the TRL venv (rlkit.tasks.base.END_MARKERS,
# rlkit.tasks.arith._NUMBER); bench_vlm_vs_trl.py checks it against Shapes().reward before the runs
END_RE = re.compile("|".join(re.escape(m) for m in ("<|endoftext|>", "<|im_end|>", "</s>", "<pad>")))
NUMBER = re.compile(r"-?\d{1,64}")


def shapes_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 where the first integer of the completion's text (cut at an end marker) is the answer, else 0.0.

    >>> shapes_reward(None, ["2", "There are 2 shapes", "3<|im_end|>", "", [{"content": "02"}]], ["2"] * 5)
    [1.0, 1.0, 0.0, 0.0, 1.0]
    """
    out = []
    for c, a in zip(completions, answer):
        if isinstance(c, (list, tuple)):  # TRL's conversational completion: the last message's content
            c = c[-1] if c else ""
        if isinstance(c, dict):
            c = c.get("content", "")
        text = END_RE.split(str(c or ""), maxsplit=1)[0]
        m = NUMBER.search(text)
        want = str(a).strip()
        want = str(int(want)) if re.fullmatch(r"-?\d+", want) else want
        out.append(float(m is not None and str(int(m.group())) == want))
    return out


def args_of() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["rlkit", "trl"])
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--rows", required=True, help="the driver's rows.json (work, rows, order)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of steps/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    return ap.parse_args()


def load_rows(path: str) -> tuple[dict, list[dict], list[int]]:
    """``(work, rows, order)`` with each row's image opened from its PNG (RGB, fully loaded)."""
    from PIL import Image

    spec = json.loads(open(path).read())
    base = os.path.dirname(os.path.abspath(path))
    rows = []
    for r in spec["rows"]:
        with Image.open(os.path.join(base, r["image"])) as im:
            img = im.convert("RGB")
        rows.append({"id": r["id"], "prompt": r["prompt"], "image": img, "answer": r["answer"]})
    return spec["work"], rows, spec["order"]


def recorded(score, calls: list[dict]):
    """``score`` wrapped: each call's row ids (one per completion), mean reward and seconds go to ``calls``."""
    def reward(prompts, completions, answer, id=None, completion_ids=None, **kw):
        t = time.perf_counter()
        out = score(prompts, completions, answer=answer)
        calls.append({"ids": [int(i) for i in (id or [])], "reward_mean": sum(out) / max(len(out), 1),
                      "s": time.perf_counter() - t})
        if completion_ids is not None:  # TRL passes the sampled ids (rlkit's lengths come from its metrics)
            CLOCK.tokens.append(sum(len(x) for x in completion_ids))
        return out

    reward.__name__ = "shapes_reward"
    return reward


def run_rlkit(args, work, rows) -> dict:
    import torch

    import rlkit

    torch.set_num_threads(args.threads)
    calls: list[dict] = []
    bf16 = args.dtype == "bf16"
    tr = rlkit.Trainer(model=args.model, dataset=rows, reward=recorded(rlkit.tasks.Shapes().reward, calls),
                       algorithm="grpo",
                       rollout=rlkit.Rollout(engine="hf", n=work["n"], max_new_tokens=work["max_new_tokens"],
                                             temperature=work["temperature"], dtype="bfloat16" if bf16 else "float32"),
                       prompts_per_step=work["prompts_per_step"], epochs=1, lr=work["lr"], lr_schedule="constant",
                       kl_coef=work["kl"], max_grad_norm=work["max_grad_norm"],
                       precision="bf16-mixed" if bf16 else "fp32", seed=args.seed,
                       run_dir=tempfile.mkdtemp(prefix="rlkit-vlm-"))
    step = tr.train_step
    step_of_call: list[int] = []

    def clocked_step():  # the bench's clock around each step (rlkit itself is not changed)
        CLOCK.begin()
        before = len(calls)
        row = step()
        CLOCK.end()
        step_of_call.extend([len(CLOCK.ends) - 1] * (len(calls) - before))
        CLOCK.tokens.append(round(row["response_length/mean"] * work["prompts_per_step"] * work["n"]))
        return row

    tr.train_step = clocked_step
    try:
        tr.fit(steps=args.steps, view="none")
        m = tr.metrics
    finally:
        tr.close()
    n = len(CLOCK.ends)
    measured = m.iloc[args.warmup:]
    return dict(version=getattr(rlkit, "__version__", "?"), threads=torch.get_num_threads(),
                phases_median_s={c[len("timing/"):]: float(measured[c].median())
                                 for c in m.columns if c.startswith("timing/")},
                reward_per_step=[float(x) for x in m["reward/mean"]],
                response_length_per_step=[float(x) for x in m["response_length/mean"]],
                ids_per_step=[[i for c, s in zip(calls, step_of_call) if s == k for i in c["ids"]] for k in range(n)])


def image_only_processor(path: str):
    """The checkpoint's Qwen2.5-VL processor without its video processor (``rlkit.models.load_processor``'s
    fallback, rebuilt here: the TRL venv cannot import rlkit, and has no torchvision either)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class Qwen2_5_VLImageProcessor(Qwen2_5_VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    config = json.loads(open(os.path.join(path, "processor_config.json")).read())
    images = Qwen2VLImageProcessorPil(**{k: v for k, v in config["image_processor"].items()
                                         if k not in ("image_processor_type", "processor_class")})
    tok = AutoTokenizer.from_pretrained(path)
    return Qwen2_5_VLImageProcessor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)


def run_trl(args, work, rows, order) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = Dataset.from_list([rows[i] for i in order])  # rlkit's visiting order, step by step
    processor = image_only_processor(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    calls: list[dict] = []
    score = recorded(shapes_reward, calls)
    phases = TRLPhases(CLOCK)

    def reward(*a, **kw):
        out = score(*a, **kw)
        phases.add("reward", calls[-1]["s"])
        return out

    reward.__name__ = "shapes_reward"
    phases.time_generate()

    bf16 = args.dtype == "bf16"
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-vlm-"), use_cpu=True, bf16=bf16, fp16=False,
        per_device_train_batch_size=work["prompts_per_step"] * work["n"], num_generations=work["n"],
        gradient_accumulation_steps=1, num_iterations=1, max_completion_length=work["max_new_tokens"],
        temperature=work["temperature"], learning_rate=work["lr"], lr_scheduler_type="constant", beta=work["kl"],
        max_grad_norm=work["max_grad_norm"], max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=args.seed, gradient_checkpointing=False,
        shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=processor,
                          callbacks=phases.callbacks())
    phases.time_prepare(trainer)
    trainer.train()
    n = len(CLOCK.ends)
    per_call = len(calls) // max(n, 1) or 1  # reward calls per step (TRL: one per batch)
    return dict(version=trl.__version__, threads=torch.get_num_threads(), phases_median_s=phases.medians(args.warmup),
                phases_per_step_s=phases.per_step(), gradient_checkpointing=cfg.gradient_checkpointing,
                reward_per_step=[statistics.mean(c["reward_mean"] for c in calls[i * per_call:(i + 1) * per_call])
                                 for i in range(n)],
                response_length_per_step=[t / (work["prompts_per_step"] * work["n"]) for t in CLOCK.tokens[:n]],
                ids_per_step=[[i for c in calls[k * per_call:(k + 1) * per_call] for i in c["ids"]] for k in range(n)],
                trl_logs=phases.logs)


def main() -> None:
    args = args_of()
    if args.threads:  # before torch's import too (run_one sets OMP_NUM_THREADS from --threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rss = PeakRSS().start()
    work, rows, order = load_rows(args.rows)
    extra = run_rlkit(args, work, rows) if args.side == "rlkit" else run_trl(args, work, rows, order)
    rss.stop()
    res = CLOCK.summary(warmup=args.warmup)
    phases = extra["phases_median_s"]
    steps = [e - b for b, e in zip(CLOCK.begins, CLOCK.ends)]
    phases.setdefault("step", statistics.median(steps[args.warmup:]))
    res.update(side=args.side, dtype=args.dtype, warmup=args.warmup, seed=args.seed, peak_rss_mb=rss.peak_mb,
               step_s_per_step=steps, **extra)
    emit(res)


if __name__ == "__main__":
    main()
