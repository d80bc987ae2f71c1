"""One TRL GRPOTrainer run of bench_vs_trl.py's work, in its own process (run by the TRL venv's python).

    .venv-trl/bin/python bench/trl_worker.py MODEL_DIR STEPS [--vllm] [--bf16] [--lora R]

Prints ``RESULT {json}``: steps/s and tokens/s after the warm-up steps, start-up (process start to the
first step begun), peak RSS, the seconds spent inside ``generate`` per step, and the update's seconds per
step (``update_s_median``: from the end of GRPOTrainer's ``_prepare_inputs``, where it generates and scores,
to the step's end: the loss forward, backward, grad-norm clip, optimizer and scheduler step, zero_grad).

``--lora R``: TRL's own LoRA path, ``GRPOTrainer(..., peft_config=lora_config(R))`` (``vs_trl_common``:
r=R, lora_alpha=2R, lora_dropout=0, q/k/v/o_proj); the reference would be the base with adapters off (no
KL here, so none is computed); with ``--vllm`` TRL merges the adapters into the weights it sends vLLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vs_trl_common import PROMPTS, WORK, PeakRSS, StepClock, emit, lora_config, share_of  # noqa: E402

CLOCK = StepClock()  # before the heavy imports: they are part of start-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("steps", type=int)
    ap.add_argument("--vllm", action="store_true", help="TRL's vllm_mode='colocate' (needs vllm in this venv)")
    ap.add_argument("--bf16", action="store_true", help="GRPOConfig(bf16=True): TRL's mixed precision (autocast)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train LoRA adapters of rank R (peft_config; alpha 2R, q/k/v/o_proj) instead of all weights")
    ap.add_argument("--no-gradient-checkpointing", action="store_true",
                    help="GRPOConfig(gradient_checkpointing=False); TRL 1.16 defaults to True (recompute in backward)")
    ap.add_argument("--out", default=None, help="TRL's output_dir (nothing is saved; default: a temp dir)")
    args = ap.parse_args()
    rss = PeakRSS().start()
    marks = {"python_s": time.perf_counter() - CLOCK.t0_perf}
    t = time.perf_counter()
    import tempfile

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.generation.utils import GenerationMixin
    from trl import GRPOConfig, GRPOTrainer

    marks["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(WORK["seed"])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    marks["model_s"] = time.perf_counter() - t
    score = share_of(tok.convert_tokens_to_ids(WORK["target_token"]))

    gen_s: list[float] = []
    update_s: list[float] = []  # per step: the end of _prepare_inputs to on_step_end
    prepared: list[float] = []  # when the step's batch was ready
    inner = GenerationMixin.generate

    def timed_generate(self, *a, **kw):  # the time TRL spends inside HF generate, per call
        t = time.perf_counter()
        out = inner(self, *a, **kw)
        gen_s.append(time.perf_counter() - t)
        return out

    GenerationMixin.generate = timed_generate

    def share_reward(completions, completion_ids=None, **kw):
        if completion_ids is None:  # older TRL: no ids given
            completion_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in completions]
        CLOCK.tokens.append(sum(len(ids) for ids in completion_ids))
        return score(completion_ids)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            CLOCK.begin()

        def on_step_end(self, *a, **k):
            CLOCK.end()
            if prepared:  # the update: from the batch ready (generated, scored) to the step's end
                update_s.append(CLOCK.ends[-1] - prepared.pop())

    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 256} if args.vllm else {}
    cfg = GRPOConfig(
        output_dir=args.out or tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, bf16=args.bf16, fp16=False,
        per_device_train_batch_size=WORK["prompts_per_step"] * WORK["n"], num_generations=WORK["n"],
        gradient_accumulation_steps=1, max_completion_length=WORK["max_new_tokens"],
        temperature=WORK["temperature"], learning_rate=WORK["lr"], lr_scheduler_type="constant",
        beta=WORK["kl"], max_grad_norm=WORK["max_grad_norm"], max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", dataloader_num_workers=0, seed=WORK["seed"],
        **({"gradient_checkpointing": False} if args.no_gradient_checkpointing else {}), **vllm)
    t = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=share_reward, args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tok,
                          callbacks=[Clock()], peft_config=lora_config(args.lora) if args.lora else None)
    marks["trainer_s"] = time.perf_counter() - t
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    prepare = trainer._prepare_inputs  # Trainer.training_step calls it first: generation + scoring happen in it

    def timed_prepare(*a, **k):
        out = prepare(*a, **k)
        prepared[:] = [time.perf_counter()]
        return out

    trainer._prepare_inputs = timed_prepare
    t = time.perf_counter()
    trainer.train()
    rss.stop()
    res = CLOCK.summary()
    marks["train_to_first_step_s"] = CLOCK.begins[0] - t
    w = len(gen_s) - res["measured_steps"]
    upd = update_s[-res["measured_steps"]:] if len(update_s) >= res["measured_steps"] else []
    res.update(side="trl", engine="vllm" if args.vllm else "hf", bf16=args.bf16, version=trl.__version__,
               lora=args.lora, trainable_params=trainable,
               update_s_median=statistics.median(upd) if upd else None,
               update_s_per_step=statistics.mean(upd) if upd else None,
               threads=torch.get_num_threads(), peak_rss_mb=rss.peak_mb, processes=rss.peak_procs,
               generate_s_per_step=(sum(gen_s[w:]) / res["measured_steps"]) if gen_s and w >= 0 else None,
               wall_s=time.perf_counter() - CLOCK.t0_perf, startup_parts_s=marks,
               cpu_s_by_process={"driver": round(sum(os.times()[:2]), 2)})
    emit(res)


if __name__ == "__main__":
    main()
