"""Equivalence check of ``DeepSpeedModel`` against the single-process HF model, run on every rank.

``python -m rlkit.backends.deepspeed_check --layout dp2-z1:qwen2 --layout pp2-z0:llama-tied --model-dir ...``
(under ``rlkit.parallel.launch.launch``): for each layout, in one process group, every rank also runs the
unsplit reference on the same global batch (left-padded prompts, right-padded responses) and compares
log-probs / entropy (or values), the reference model's (lr=0) log-probs, the PPO loss, every gradient (HF names,
``safe_get_full_grad``), the pre-clip grad norm, the weights after ``steps`` clipped AdamW steps (the lr set
through ``optimizer.param_groups`` as the workers do), the full-weight gather strict-loaded into a fresh HF model,
optionally save -> load -> continue, and the measured memory. Rank 0 writes the JSON report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from rlkit.backends.deepspeed import DeepSpeedModel
from rlkit.errors import PlanError
from rlkit.parallel.check import (
    make_batch,
    max_over_ranks,
    ppo_loss,
    reference_forward,
    response_tokens,
    value_loss,
)
from rlkit.parallel.kit import load_hf, missing_members, split_rows
from rlkit.plan.topology import ParallelPlan


def parse_layout(text: str) -> tuple[ParallelPlan, int, str, str]:
    """``"dp2-z3:qwen2"`` -> (plan, ZeRO stage, model key, head); ``"pp2-z0:llama-tied"``, ``"dp1-z0:qwen2"``,
    ``"dp2-z2:qwen2:value"`` (a critic). Two micro-batches per rank in every layout."""
    shape, model, *rest = text.split(":")
    dims = dict(dp=1, pp=1)
    zero = 0
    for part in shape.split("-"):
        if part.startswith("z"):
            zero = int(part[1:])
        else:
            dims[part[:2]] = int(part[2:])
    plan = ParallelPlan(dp=dims["dp"], pp=dims["pp"], dp_shard="replicate",
                        micro_batches=2)
    return plan, zero, model, rest[0] if rest else "lm"


def check_layout(model: str, plan: ParallelPlan, zero: int, *, steps: int = 3, seq_len: int = 16,
                 head: str = "lm", lr: float = 1e-3, max_grad_norm: float = 1.0, ckpt_dir: str | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """One layout against the reference (see the module docstring); the report is complete on rank 0."""
    rank = dist.get_rank()
    ref = load_hf(model)
    # eps=1e-6 as rlkit.parallel.check: a 1e-8 eps magnifies reduction-order noise in near-zero gradients
    opt = dict(weight_decay=0.01, eps=1e-6, max_grad_norm=max_grad_norm, seed=seed, head=head,
               ds_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    dm = DeepSpeedModel(model, plan, zero_stage=zero, lr=1e-5, **opt)
    for g in dm.optimizer.param_groups:  # as the workers do before each update: it must reach DeepSpeed
        g["lr"] = lr
    ref_vh = None
    if head == "value":
        g = torch.Generator().manual_seed(seed)
        ref_vh = nn.Linear(ref.config.hidden_size, 1)
        with torch.no_grad():
            ref_vh.weight.normal_(0.0, getattr(ref.config, "initializer_range", 0.02), generator=g)
            ref_vh.bias.zero_()
    ref_named = dict(ref.named_parameters())
    if ref_vh is not None:
        ref_named.pop("lm_head.weight", None)  # a tied model names it once, as the embedding
        ref_named |= {f"value_head.{k}": v for k, v in ref_vh.named_parameters()}
    ref_params = list(ref_named.values())
    ref_opt = torch.optim.AdamW(ref_params, lr=lr, weight_decay=0.01, eps=1e-6, foreach=False)
    loss_fn = value_loss if head == "value" else ppo_loss
    m = plan.n_micro_batches
    n = plan.dp * m
    batches = []
    for s in range(steps):
        b = make_batch(n, seq_len, ref.config.vocab_size, seed=seed + s)
        if head == "lm":
            with torch.no_grad():
                old = reference_forward(ref, None, b)["logprobs"]
            b["old_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(s))
        batches.append(b)

    def ref_step(b, do_step=True):
        chunks = [c for d in split_rows(b, plan.dp) for c in split_rows(d, m)]
        loss = sum(loss_fn(reference_forward(ref, ref_vh, c), c) for c in chunks) / len(chunks)
        loss.backward()
        if do_step:
            torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        return loss.item()

    report: dict[str, Any] = {"plan": plan.describe(), "zero_stage": zero, "model": Path(model).name, "head": head,
                              "interface_missing": missing_members(dm)}
    mine = dm.shard_batch(batches[0])
    with torch.no_grad():
        ref_out = reference_forward(ref, ref_vh, mine)
    got = dm.logprobs(mine["input_ids"], mine["attention_mask"])
    am = mine["attention_mask"].bool()
    valid = am if head == "value" else am & torch.cat([torch.zeros_like(am[:, :1]), am[:, :-1]], 1)
    diffs = {k: max_over_ranks(((got[k] - ref_out[k]).abs() * valid).max()) for k in got}
    if head == "lm":  # scoring the response's columns only: the others 0, the scored ones unchanged
        k = seq_len // 2
        dm.set_scoring(first_column=k, entropy_grad=False)
        part = dm.logprobs(mine["input_ids"], mine["attention_mask"])
        dm.set_scoring(first_column=1)
        report["max_dscoring"] = max_over_ranks(max((part[n][:, k:] - got[n][:, k:]).abs().max() for n in part))
        report["max_unscored"] = max_over_ranks(max(part[n][:, :k].abs().max() for n in part))
    dm.set_packing(False)  # a no-op; padding-free is refused
    try:
        dm.set_packing(True)
        report["padding_free_refused"] = False
    except PlanError:
        report["padding_free_refused"] = True
    # the reference policy: a separate instance with lr=0 on the same ranks
    frozen = DeepSpeedModel(model, plan, zero_stage=zero, lr=0.0, **opt)
    got_ref = frozen.logprobs(mine["input_ids"], mine["attention_mask"])
    report["max_dlogprob_refmodel"] = max_over_ranks(max(((got_ref[k] - ref_out[k]).abs() * valid).max() for k in got_ref))
    report["refmodel_memory"] = frozen.memory().to_dict(orient="records")
    del frozen

    loss = dm.forward_backward(mine, loss_fn)
    ref_loss = ref_step(batches[0], do_step=False)
    gdiff, n_grads = 0.0, 0
    for name, g in dm.full_grads():
        gdiff = max(gdiff, (g.float() - ref_named[name].grad).abs().max().item())
        n_grads += 1
    gdiff = max_over_ranks(torch.tensor(gdiff))
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, n_grads)
    ref_gnorm = torch.nn.utils.get_total_norm([p.grad for p in ref_params]).item()
    gnorm = dm.optimizer_step()
    torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)

    ckpt = dm.save(f"{ckpt_dir}/step{dm.step}") if ckpt_dir is not None else None
    losses = [loss]
    for b in batches[1:]:
        out = dm.train_step(dm.shard_batch(b), loss_fn)
        losses.append(out["loss"])
        ref_step(b)

    sd = dm.full_state_dict(to=0)
    report.update(loss=loss, ref_loss=ref_loss, losses=losses, max_dlogprob=diffs.get("logprobs", diffs.get("values")),
                  max_dentropy=diffs.get("entropy", 0.0), max_dgrad=gdiff, grads_compared=counts,
                  grad_norm=gnorm, ref_grad_norm=ref_gnorm, gather_bytes_rank0=dm.last_transfer["bytes"])
    report["n_params"] = len(ref_named)
    report["param_bytes"] = sum(v.numel() * v.element_size() for v in ref_named.values())
    if rank == 0:
        ref_sd = {k: v.detach() for k, v in ref_named.items()}
        report["max_dweight"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        if head == "lm":
            fresh = load_hf(model)
            fresh.load_state_dict(sd, strict=True)
            report["strict_load"] = True
            with torch.no_grad():
                a = reference_forward(fresh, None, batches[0])["logprobs"]
                r = reference_forward(ref, None, batches[0])["logprobs"]
            report["max_dlogprob_gathered_model"] = (a - r).abs().max().item()
        else:
            report["strict_load"] = sorted(sd) == sorted(ref_sd)
    if ckpt is not None:
        dm2 = DeepSpeedModel(model, plan, zero_stage=zero, lr=1e-5, **opt)
        for g in dm2.optimizer.param_groups:
            g["lr"] = lr
        missing = None
        try:
            dm2.load(f"{ckpt_dir}/nothing-here")
        except Exception as e:  # CheckpointError on every rank, naming the folder
            missing = f"{type(e).__name__}: {e}"
        dm2.load(ckpt)
        report["resume_step"] = dm2.step
        for b in batches[1:]:
            dm2.train_step(dm2.shard_batch(b), loss_fn)
        sd2 = dm2.full_state_dict(to=0)
        if rank == 0:
            report["missing_ckpt_error"] = missing
            report["resume_max_dweight"] = max((sd2[k] - sd[k]).abs().max().item() for k in sd)
        del dm2
    report["memory"] = dm.memory().to_dict(orient="records")

    # weighted micro-batches (the workers' token-mean objectives): sum(w * loss) / sum(w), w = response tokens
    b = batches[-1]
    wloss = dm.forward_backward(dm.shard_batch(b), loss_fn, response_tokens)
    chunks = [c for d in split_rows(b, plan.dp) for c in split_rows(d, m)]
    ws = [response_tokens(c) for c in chunks]
    ref_w = sum(w * loss_fn(reference_forward(ref, ref_vh, c), c) for w, c in zip(ws, chunks)) / sum(ws)
    ref_w.backward()
    wdiff = 0.0
    for name, g in dm.full_grads():
        wdiff = max(wdiff, (g.float() - ref_named[name].grad).abs().max().item())
    ref_opt.zero_grad(set_to_none=True)
    dm.optimizer_step()  # leaves DeepSpeed's accumulation counters at a boundary
    report.update(weighted_loss=wloss, ref_weighted_loss=ref_w.item(), max_dgrad_weighted=max_over_ranks(torch.tensor(wdiff)))
    return report


def main(argv: list[str] | None = None) -> int:
    """Run every ``--layout`` in one process group; rank 0 writes ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", action="append", required=True, help="e.g. dp2-z3:qwen2, pp2-z0:qwen2:value (model key in --models)")
    ap.add_argument("--models", required=True, help="JSON object: model key -> local HF checkpoint folder")
    ap.add_argument("--ckpt", default=None, help="checkpoint folder: save -> load -> continue on the first layout")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from rlkit.parallel.dist import init_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed(timeout_s=300)
    models = json.loads(args.models)
    reports = []
    for i, text in enumerate(args.layout):
        plan, zero, key, head = parse_layout(text)
        rep = check_layout(models[key], plan, zero, steps=args.steps, head=head,
                           ckpt_dir=args.ckpt if i == 0 else None)
        rep["layout"] = text
        reports.append(rep)
        if rank == 0:
            print(json.dumps({k: v for k, v in rep.items() if k != "memory"}, default=str), flush=True)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"layouts": reports}, indent=1, default=str))
    dist.barrier()  # DeepSpeed's pipeline groups abort at exit without a clean teardown
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
