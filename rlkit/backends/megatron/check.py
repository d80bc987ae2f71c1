"""Equivalence check of ``MegatronModel`` against the single-process HF model, run on every rank:

    python -m rlkit.backends.megatron.check --tp 2 --model <tiny checkpoint> --json report.json

(through ``rlkit.parallel.launch.launch(n, args, tmp, module="rlkit.backends.megatron.check")``). Each rank
also runs the unsplit HF model on the same global batch (left-padded prompts, right-padded responses) and
compares log-probs / entropy (or values), the PPO-style loss, every gradient (by HF name), the grad norm,
the weights after ``--steps`` clipped AdamW steps, the full-weight gather strict-loaded into a fresh HF
model, and with ``--ckpt`` save -> load -> continue (bit-exact) and a missing checkpoint's error. Rank 0
writes the report as JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from rlkit.errors import CheckpointError
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


def run_check(model: str, plan: ParallelPlan, *, head: str = "lm", steps: int = 3, seq_len: int = 16,
              lr: float = 1e-3, max_grad_norm: float = 1.0, seed: int = 0, ckpt_dir: str | None = None) -> dict:
    """Run ``MegatronModel`` under ``plan`` and the HF reference side by side; the report (complete on rank 0)."""
    from rlkit.backends.megatron import MegatronModel, shim

    rank = dist.get_rank()
    ref = load_hf(model)
    opt = dict(lr=lr, weight_decay=0.01, eps=1e-6)  # eps 1e-6: see rlkit.parallel.check
    mm = MegatronModel(model, plan, head=head, max_grad_norm=max_grad_norm, seed=seed, **opt)
    ref_vh = None
    if head == "value":
        g = torch.Generator().manual_seed(seed)
        ref_vh = nn.Linear(ref.config.hidden_size, 1)
        with torch.no_grad():
            ref_vh.weight.normal_(0.0, getattr(ref.config, "initializer_range", 0.02), generator=g)
            ref_vh.bias.zero_()
    ref_named = dict(ref.named_parameters())
    if ref_vh is not None:
        del ref_named["lm_head.weight"]
        ref_named |= {f"value_head.{k}": v for k, v in ref_vh.named_parameters()}
    ref_params = list(ref_named.values())
    ref_opt = torch.optim.AdamW(ref_params, foreach=False, **opt)
    loss_fn = value_loss if head == "value" else ppo_loss
    m = plan.n_micro_batches
    batches = []
    for s in range(steps):
        b = make_batch(plan.dp * m, seq_len, ref.config.vocab_size, seed=seed + s)
        if ref.config.pad_token_id is not None:  # the pad id as a real token (an EOS that doubles as pad):
            b["input_ids"][:, seq_len // 2 + 1] = ref.config.pad_token_id  # HF's padding_idx trains nothing there
        with torch.no_grad():
            old = reference_forward(ref, None, b)["logprobs"]
        b["old_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(s))
        batches.append(b)

    def ref_step(b: dict[str, torch.Tensor], do_step: bool = True, weighted: bool = False) -> float:
        chunks = [c for d in split_rows(b, plan.dp) for c in split_rows(d, m)]
        w = [response_tokens(c) if weighted else 1.0 for c in chunks]
        loss = sum(wi * loss_fn(reference_forward(ref, ref_vh, c), c) for wi, c in zip(w, chunks)) / sum(w)
        loss.backward()
        if do_step:
            torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        return loss.item()

    rep: dict[str, Any] = {"plan": plan.describe(), "head": head, "shim": shim.installed(),
                           "interface_missing": missing_members(mm)}
    # a mixture-of-experts model: the experts of the first layer this rank holds (E / ep under expert parallelism)
    held = [n for n in mm.named if n.startswith("decoder.layers.0.mlp.experts.local_experts.")
            and n.endswith(".linear_fc1.weight")]
    rep["experts_per_rank"] = int(max_over_ranks(float(len(held))))
    mine = mm.shard_batch(batches[0])
    with torch.no_grad():
        ref_out = reference_forward(ref, ref_vh, mine)
    got = mm.logprobs(mine["input_ids"], mine["attention_mask"])
    am = mine["attention_mask"].bool()
    valid = am if head == "value" else am & torch.cat([torch.zeros_like(am[:, :1]), am[:, :-1]], 1)
    for k in got:
        rep[f"max_d{k.rstrip('s')}"] = max_over_ranks(((got[k] - ref_out[k]).abs() * valid).max().item())
    if head == "lm":  # set_scoring: columns before first_column come back 0, the others unchanged
        first = seq_len // 2
        mm.set_scoring(first_column=first, entropy_grad=False)
        part = mm.logprobs(mine["input_ids"], mine["attention_mask"])
        mm.set_scoring(first_column=1, entropy_grad=True)
        rep["scoring_exact"] = max_over_ranks(max(float(part[k][:, :first].abs().max()) for k in part) +
                                    max(float((part[k][:, first:] - got[k][:, first:]).abs().max()) for k in part))

    rep["loss"] = mm.forward_backward(mine, loss_fn)
    rep["ref_loss"] = ref_step(batches[0], do_step=False)
    dgrad, names = 0.0, []
    for name, g in mm.iter_full_grads(to="all"):
        names.append(name)
        dgrad = max(dgrad, (g - ref_named[name].grad).abs().max().item())
    rep["max_dgrad"] = max_over_ranks(dgrad)
    rep["grads_cover_all"] = sorted(names) == sorted(ref_named)
    rep["grad_norm"] = mm.grad_norm()
    rep["ref_grad_norm"] = torch.nn.utils.get_total_norm([p.grad for p in ref_params]).item()
    mm.optimizer_step()
    torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)

    ckpt = mm.save(f"{ckpt_dir}/step{mm.step}") if ckpt_dir else None
    losses = [rep["loss"]]
    for i, b in enumerate(batches[1:]):  # the second step weighs micro-batches by their response tokens
        weight_fn = response_tokens if i == 0 else None
        out = mm.train_step(mm.shard_batch(b), loss_fn, weight_fn)
        losses.append(out["loss"])
        ref_loss = ref_step(b, weighted=weight_fn is not None)
        if i == 0:
            rep["weighted_loss"], rep["ref_weighted_loss"] = out["loss"], ref_loss
    rep["losses"] = losses

    sd = mm.full_state_dict(to=0)
    rep["transfer_bytes"] = mm.last_transfer.get("bytes", 0.0)
    order = [n for n, _ in mm.iter_full_weights(to=0)]  # every rank learns the names, tensors only on 0
    rep["hf_order"] = order == list(ref_named)
    if rank == 0:
        rep["max_dweight"] = max((sd[k] - v.detach()).abs().max().item() for k, v in ref_named.items())
        if head == "lm":
            fresh = load_hf(model)
            # a tied model's state dict also names lm_head.weight: the same tensor as the embedding
            tied = mm.tied
            full_sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]} if tied else sd
            rep["tied"] = tied
            fresh.load_state_dict(full_sd, strict=True)  # raises on any missing or extra key
            rep["strict_load"] = True
            with torch.no_grad():
                a = reference_forward(fresh, None, mine)["logprobs"]
                b = reference_forward(ref, None, mine)["logprobs"]
            rep["max_dlogprob_gathered_model"] = ((a - b).abs() * valid).max().item()
        else:
            rep["strict_load"] = sorted(sd) == sorted(ref_named)
    rep["max_dweight"] = max_over_ranks(rep.get("max_dweight", 0.0))
    rep["memory"] = mm.memory().to_dict(orient="records")

    if ckpt is not None:
        mm.load(ckpt)
        rep["resume_step"] = mm.step
        for i, b in enumerate(batches[1:]):
            mm.train_step(mm.shard_batch(b), loss_fn, response_tokens if i == 0 else None)
        sd2 = mm.full_state_dict(to=0)
        if rank == 0:
            rep["resume_max_dweight"] = max((sd2[k] - sd[k]).abs().max().item() for k in sd)
        try:
            mm.load(f"{ckpt_dir}/no-such-step")
            rep["missing_error"] = None
        except CheckpointError as e:
            rep["missing_error"] = str(e)
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, rep["missing_error"])
        rep["missing_error_all_ranks"] = all(e and "no-such-step" in e for e in errors)
    return rep


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run the check on this rank, rank 0 writes the JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    for dim in ("tp", "pp", "dp", "ep"):
        ap.add_argument(f"--{dim}", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=None)
    ap.add_argument("--head", default="lm", choices=("lm", "value"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        plan = ParallelPlan(tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, dp_shard="replicate",
                            micro_batches=args.micro_batches)
        rep = run_check(args.model, plan, head=args.head, steps=args.steps, ckpt_dir=args.ckpt)
        if dist.get_rank() == 0:
            text = json.dumps(rep, indent=1, default=str)
            print(text)
            if args.json:
                with open(args.json, "w") as f:
                    f.write(text)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
