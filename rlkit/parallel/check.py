"""Equivalence check: a ParallelPlan against the single-process HF model, on every rank.

Each rank also runs the unsplit reference model (tiny models only) on the same global batch and
compares: per-token log-probs / entropy (or values), the loss of a PPO-style clipped objective,
every gradient, the weights after several clipped AdamW steps, the full-weight gather (loaded
strict into a fresh HF model), and optionally save -> load -> continue. Used by
``python -m rlkit.parallel`` and the tests.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from rlkit.batch import images_of
from rlkit.parallel.gather import full
from rlkit.parallel.kit import load_hf, missing_members, split_rows
from rlkit.parallel.model import ParallelModel
from rlkit.parallel.stage import position_ids_from_mask
from rlkit.plan.topology import ParallelPlan


def make_batch(n: int, seq_len: int, vocab: int, seed: int = 0, ragged: bool = False) -> dict[str, torch.Tensor]:
    """A padded RL-like batch: prompts (some left-padded) + responses (some right-padded). ``ragged``:
    lengths that vary as RL responses do (a row may keep two tokens of its response or all of them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq_len), generator=g)
    am = torch.ones(n, seq_len, dtype=torch.long)
    prompt = seq_len // 2
    resp = torch.zeros(n, seq_len, dtype=torch.long)
    for i in range(n):
        left, right = (i % 3), (i * 2) % 4          # a few pads on either side, varying by row
        if ragged:
            left = int(torch.randint(0, prompt - 1, (1,), generator=g))
            right = int(torch.randint(0, seq_len - prompt - 1, (1,), generator=g))
        am[i, :left] = 0
        am[i, seq_len - right:] = 0
        resp[i, prompt:seq_len - right] = 1
    ids = ids.masked_fill(am == 0, 0)
    return {"input_ids": ids, "attention_mask": am, "response_mask": resp,
            "advantages": torch.randn(n, generator=g), "returns": torch.randn(n, seq_len, generator=g)}


def add_images(batch: dict[str, torch.Tensor], image_token_id: int, seed: int = 0, patch_dim: int = 1176,
               grid: tuple[int, int, int] | list[tuple[int, int, int]] = (1, 4, 4),
               merge: int = 2) -> dict[str, torch.Tensor]:
    """``batch`` with one image in each row's prompt, for a vision-language model: ``t*h*w / merge**2`` image
    tokens from the row's first real token on, random patches (``pixel_values``, one tensor per row) and
    the grid (``image_grid_thw``; a list of grids: row i takes ``grid[i % len(grid)]``, or the smallest where
    the row has too few real tokens for it, so rows' images differ in size); other tokens that happened to be
    the image token become text.

    >>> b = add_images(make_batch(2, 16, 500), image_token_id=460)
    >>> b["input_ids"][0, 0:4].tolist(), [tuple(p.shape) for p in b["pixel_values"]]
    ([460, 460, 460, 460], [(16, 1176), (16, 1176)])
    >>> two = add_images(make_batch(2, 16, 500), 460, grid=[(1, 4, 4), (1, 4, 6)])
    >>> [tuple(p.shape) for p in two["pixel_values"]]
    [(16, 1176), (24, 1176)]
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    ids, am = batch["input_ids"].clone(), batch["attention_mask"]
    ids[ids == image_token_id] = image_token_id - 1
    grids = [tuple(x) for x in grid] if isinstance(grid, list) else [tuple(grid)]
    tokens = {x: x[0] * x[1] * x[2] // merge**2 for x in grids}
    rows = []  # each row's grid
    for i in range(ids.shape[0]):
        want = grids[i % len(grids)]
        rows.append(want if tokens[want] <= int(am[i].sum()) else min(grids, key=tokens.get))
        first = int(am[i].argmax())
        ids[i, first:first + tokens[rows[-1]]] = image_token_id
    return {**batch, "input_ids": ids,
            "pixel_values": [torch.randn(t * h * w, patch_dim, generator=g) for t, h, w in rows],
            "image_grid_thw": [torch.tensor([list(r)]) for r in rows]}


def ppo_loss(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], clip: float = 0.2,
             entropy_coef: float = 0.01) -> torch.Tensor:
    """Token-mean PPO clipped surrogate minus an entropy bonus (the shape RL code passes in)."""
    mask = mb["response_mask"].float()
    ratio = torch.exp(out["logprobs"] - mb["old_logprobs"])
    adv = mb["advantages"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    denom = mask.sum().clamp(min=1)
    return (pg * mask).sum() / denom - entropy_coef * (out["entropy"] * mask).sum() / denom


def step_batches(ref: nn.Module, steps: int, n: int, seq_len: int, seed: int, ragged: bool = False,
                 old_logprobs: bool = True) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches of ``n`` rows (``make_batch``, seeded ``seed + step``), each with old log-probs: the
    reference model's, slightly perturbed (ratio != 1), so the clipped objective has something to clip."""
    batches = []
    for s in range(steps):
        b = make_batch(n, seq_len, ref.config.vocab_size, seed=seed + s, ragged=ragged)
        if getattr(ref, "visual", None) is not None:  # a vision-language model: an image in every prompt, of two
            # sizes (a pipeline pads each row's patches to the batch's most, and its first stage unpads them)
            b = add_images(b, ref.image_token_id, seed=seed + s, grid=[(1, 4, 4), (1, 4, 6)], merge=ref.merge)
        if old_logprobs:
            with torch.no_grad():
                old = reference_forward(ref, None, b)["logprobs"]
            b["old_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(s))
        batches.append(b)
    return batches


def value_loss(out: dict[str, torch.Tensor], mb: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = mb["response_mask"].float()
    return ((out["values"] - mb["returns"]) ** 2 * mask).sum() / mask.sum().clamp(min=1)


def reference_forward(hf: nn.Module, value_head: nn.Module | None, batch: dict[str, torch.Tensor]):
    """The plain HF model's outputs, computed the textbook way (full logits, HF's own masks). A vision-language
    model (``rlkit.models.vision.causal_view``) runs whole, images and multimodal positions its own way."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    if getattr(hf, "visual", None) is not None and "pixel_values" in batch:
        logits = hf.full(input_ids=ids, attention_mask=am, pixel_values=torch.cat(list(batch["pixel_values"])),
                         image_grid_thw=torch.cat(list(batch["image_grid_thw"])),
                         mm_token_type_ids=(ids == hf.image_token_id).int()).logits.float()
        logp = logits[:, :-1].log_softmax(-1)
        zero = torch.zeros(ids.shape[0], 1)
        return {"logprobs": torch.cat([zero, logp.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1),
                "entropy": torch.cat([zero, -(logp.exp() * logp).sum(-1)], 1)}
    pos = position_ids_from_mask(am)
    if value_head is not None:
        h = hf.model(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
        return {"values": value_head(h).squeeze(-1).float()}
    moe = bool(getattr(hf.config, "num_experts", 0))
    res = hf(input_ids=ids, attention_mask=am, position_ids=pos, **({"output_router_logits": True} if moe else {}))
    logits = res.logits.float()
    logp = logits[:, :-1].log_softmax(-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros(ids.shape[0], 1)
    out = {"logprobs": torch.cat([zero, lp], 1), "entropy": torch.cat([zero, ent], 1)}
    if moe:  # the router's losses, by transformers' own function, one layer at a time, averaged over layers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        cfg, layers = hf.config, res.router_logits
        out["aux_loss"] = sum(load_balancing_loss_func((g,), cfg.num_experts, cfg.num_experts_per_tok, am)
                              for g in layers) / len(layers)
        real = am.reshape(-1).bool()
        out["z_loss"] = sum(torch.logsumexp(g[real].float(), -1).pow(2).mean() for g in layers) / len(layers)
    return out


def run_check(model: Any, plan: ParallelPlan, *, steps: int = 3, seq_len: int = 16, micro_batch_size: int = 1,
              head: str = "lm", lr: float = 1e-3, max_grad_norm: float = 1.0, ckpt_dir: str | None = None,
              seed: int = 0, fail_rank: int | None = None, activation_checkpointing: bool = False,
              padding_free: bool = False, token_budget: int | None = None, lora: Any = None,
              router_aux_coef: float = 0.0, router_z_coef: float = 0.0, freeze_vision: bool = False) -> dict[str, Any]:
    """Run the plan and the reference side by side; returns the report (complete on rank 0).

    ``lora`` (a peft ``LoraConfig`` or a rank): the plan trains adapters only; the reference is the HF model
    with peft's own LoRA layers holding the same initial adapters, and the full weights compared are the
    merged ones (peft's ``merge``). ``max_dadapter`` compares the adapters themselves.

    A mixture-of-experts model adds the router's losses to both sides' objective (``router_aux_coef``,
    ``router_z_coef``; the reference's by transformers' ``load_balancing_loss_func``), and reports their
    values (``aux_loss`` / ``ref_aux_loss``, ``z_loss`` / ``ref_z_loss``: the first step's means).

    ``freeze_vision`` (a vision-language model): both sides keep the vision tower fixed; its weights after the
    steps are compared too (unchanged on both).

    ``padding_free``: the plan runs packed rows (``token_budget`` tokens per micro-batch) on a ragged batch,
    each micro-batch weighted by its response tokens; the reference is the padded model on the whole
    batch at once, so the objective must be the step's token mean however the plan cut it."""
    rank = dist.get_rank()
    ref = load_hf(model)
    lora_cfg = None
    if lora is not None:
        from rlkit.parallel.lora import as_lora_config, check_lora
        lora_cfg = check_lora(as_lora_config(lora), ref)  # as ParallelModel takes it (a VLM: not on its tower)
        ref = _peft_reference(ref, lora_cfg, seed)
    # eps=1e-6: Adam divides by sqrt(v) + eps, so with 1e-8 a 1e-10 difference in a near-zero
    # gradient (reduction order) moves a weight by ~1e-2 * lr; 1e-6 keeps the comparison tight.
    opt = dict(lr=lr, weight_decay=0.01, eps=1e-6, activation_checkpointing=activation_checkpointing)
    opt |= {"router_aux_coef": router_aux_coef, "router_z_coef": router_z_coef}
    if freeze_vision:
        opt["freeze_vision"] = True
        ref.visual.requires_grad_(False)
    pm = ParallelModel(model, plan, head=head, max_grad_norm=max_grad_norm, seed=seed, lora=lora_cfg, **opt)
    pm.set_packing(padding_free, token_budget)
    weight_fn = response_tokens if padding_free else None
    if fail_rank is not None and rank == fail_rank:
        raise RuntimeError(f"injected failure on rank {rank} (--fail-rank)")
    ref_vh = None
    if head == "value":  # the same seeded init ParallelModel uses
        g = torch.Generator().manual_seed(seed)
        ref_vh = nn.Linear(ref.config.hidden_size, 1)
        with torch.no_grad():
            ref_vh.weight.normal_(0.0, getattr(ref.config, "initializer_range", 0.02), generator=g)
            ref_vh.bias.zero_()
    ref_named = dict(ref.named_parameters())
    if ref_vh is not None:  # the critic trades lm_head for the value head
        del ref_named["lm_head.weight"]
        ref_named |= {f"value_head.{k}": v for k, v in ref_vh.named_parameters()}
    if lora_cfg is not None:  # only the adapters train
        ref_named = {k: v for k, v in ref_named.items() if v.requires_grad}
    ref_params = [p for p in ref_named.values() if p.requires_grad]
    ref_opt = torch.optim.AdamW(ref_params, lr=lr, weight_decay=0.01, eps=1e-6, foreach=False)
    loss_fn = value_loss if head == "value" else ppo_loss
    router: dict[str, list[float]] = {"aux_loss": [], "z_loss": [], "added": []}

    def ref_loss_fn(out, mb):
        loss = loss_fn(out, mb)
        if "aux_loss" in out:
            router["aux_loss"].append(float(out["aux_loss"]))
            router["z_loss"].append(float(out["z_loss"]))
            added = router_aux_coef * out["aux_loss"] + router_z_coef * out["z_loss"]
            router["added"].append(float(added))
            loss = loss + added
        return loss
    m = plan.n_micro_batches

    n = plan.dp * m * micro_batch_size
    batches = step_batches(ref, steps, n, seq_len, seed, ragged=padding_free, old_logprobs=head == "lm")

    def ref_step(b, do_step=True):
        # the plan's micro-batches; padding-free: the whole batch (its objective is the step's token mean)
        chunks = [b] if padding_free else [c for d in split_rows(b, plan.dp) for c in split_rows(d, m)]
        router["added"].clear()
        loss = sum(ref_loss_fn(reference_forward(ref, ref_vh, c), c) for c in chunks) / len(chunks)
        loss.backward()
        if do_step:
            torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        # the objective's value without the router's losses (reported apart), as ParallelModel returns it
        return loss.item() - sum(router["added"]) / len(chunks)

    report: dict[str, Any] = {"plan": plan.describe(), "world_size": plan.world_size, "head": head,
                              "padding_free": padding_free, "token_budget": token_budget,
                              "interface_missing": missing_members(pm)}
    mine = pm.shard_batch(batches[0])
    # 1. forward-only outputs on valid positions (token t and its predecessor are real tokens)
    with torch.no_grad():
        ref_out = reference_forward(ref, ref_vh, mine)
    got = pm.logprobs(mine["input_ids"], mine["attention_mask"], **images_of(mine))
    am = mine["attention_mask"].bool()
    valid = am & torch.cat([torch.zeros_like(am[:, :1]), am[:, :-1]], 1)
    if head == "value":
        valid = am
    diffs = {k: max_over_ranks(((got[k] - ref_out[k]).abs() * valid).max()) for k in got}

    # 2. loss and gradients of one step
    moe = bool(pm.moes)
    if moe:
        pm.router_stats()  # counts from here on
    loss = pm.forward_backward(mine, loss_fn, weight_fn)
    if moe:
        stats = pm.router_stats()
        report.update(aux_loss=stats["aux_loss"], z_loss=stats["z_loss"], expert_load=stats["load"].tolist(),
                      a2a_bytes_per_rank=stats["a2a_bytes_per_rank"])  # forward (dispatch + combine), one step
    ref_loss = ref_step(batches[0], do_step=False)
    if moe:
        report.update(ref_aux_loss=sum(router["aux_loss"]) / len(router["aux_loss"]),
                      ref_z_loss=sum(router["z_loss"]) / len(router["z_loss"]))
    gdiff, worst = 0.0, None
    tied = pm.tied
    for name, p in pm.named_parameters():
        if not p.requires_grad:  # a LoRA base: frozen, no gradient
            assert p.grad is None, f"{name} is frozen but has a gradient"
            continue
        g = full(p.grad)
        if tied and name == "lm_head.weight":  # pp > 1: the last stage's copy of the tied embedding
            name = "model.embed_tokens.weight"
        d = (g - ref_named[name].grad).abs().max().item()
        if d > gdiff:
            gdiff, worst = d, name
    report["max_dgrad_param"] = worst if gdiff > 0 else None  # this rank's worst (rank 0's in the report)
    report["grad_names"] = [n for n, p in pm.named_parameters() if p.requires_grad]  # every gradient compared
    gdiff = max_over_ranks(torch.tensor(gdiff))
    gnorm = pm.grad_norm()
    ref_gnorm = torch.nn.utils.get_total_norm([p.grad for p in ref_params]).item()
    pm.optimizer_step()
    torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)

    # 3. optionally checkpoint here, then the remaining steps
    ckpt = None
    if ckpt_dir is not None:
        ckpt = pm.save(f"{ckpt_dir}/step{pm.step}")
    times, losses = [], [loss]
    for b in batches[1:]:
        t0 = time.perf_counter()
        out = pm.train_step(pm.shard_batch(b), loss_fn, weight_fn)
        times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
        ref_step(b)

    # 4. full weights out: compare to the reference after `steps` steps; load strict into fresh HF
    sd = pm.full_state_dict(to=0)
    transfer = dict(pm.last_transfer)
    if lora_cfg is not None:
        adapters = {k: v for k, v in pm.iter_full_weights(to=0, adapters_only=True) if v is not None}
        if rank == 0:
            report["max_dadapter"] = max((adapters[k] - v.detach()).abs().max().item() for k, v in ref_named.items())
            report["adapter_bytes"] = sum(t.numel() * t.element_size() for t in adapters.values())
        ref_named = _merged_reference(ref)  # from here on the reference is the merged model, by HF name
    report.update(
        loss=loss, ref_loss=ref_loss, losses=losses,
        max_dlogprob=diffs.get("logprobs", diffs.get("values")), max_dentropy=diffs.get("entropy", 0.0),
        max_dgrad=gdiff, grad_norm=gnorm, ref_grad_norm=ref_gnorm,
        step_time_s=sum(times) / len(times) if times else None,
        gather_bytes_rank0=transfer["bytes"], gather_seconds=transfer["seconds"],
    )
    if rank == 0:
        ref_sd = {k: v.detach() for k, v in ref_named.items()}
        report["max_dweight"] = max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        report["n_full_weights"] = len(sd)
        fresh = load_hf(model)
        if head == "value":
            report["strict_load"] = sorted(sd) == sorted(ref_sd)
        else:
            # a tied model's state dict also names lm_head.weight: the same tensor as the embedding
            full_sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]} if tied else sd
            fresh.load_state_dict(full_sd, strict=True)
            report["strict_load"] = True
            report["tied"] = tied
            b = batches[0]
            with torch.no_grad():
                a = reference_forward(fresh, None, b)["logprobs"]
                r = reference_forward(ref, None, b)["logprobs"]
            report["max_dlogprob_gathered_model"] = (a - r).abs().max().item()

    # 4b. reshard into the generation layout Rollout(tp=1) (the 3D-HybridEngine's; full weights on every
    # rank, gathered inside micro-DP groups), then give the training storage back
    from rlkit.parallel.groups import build_generation_groups
    from rlkit.parallel.relayout import Resharder
    from rlkit.plan.hybrid import GenerationLayout

    resharder = Resharder(pm, build_generation_groups(GenerationLayout(plan, tp=1)))
    shards, rel = resharder.reshard()
    drel = max((shards[k] - v.detach()).abs().max().item() for k, v in ref_named.items())
    resharder.release()
    report.update(relayout_plan=f"{plan.describe()} -> Rollout(tp=1)", max_drelayout=max_over_ranks(torch.tensor(drel)),
                  relayout_bytes=rel["bytes"], relayout_seconds=rel["seconds"], relayout_held_bytes=rel["param_bytes"])

    # 5. save -> load into a fresh ParallelModel -> continue == uninterrupted run
    if ckpt is not None:
        pm2 = ParallelModel(model, plan, head=head, max_grad_norm=max_grad_norm, seed=seed, groups=pm.groups,
                            lora=lora_cfg, **opt)
        pm2.set_packing(padding_free, token_budget)
        pm2.load(ckpt)
        resumed_step = pm2.step
        for b in batches[1:]:
            pm2.train_step(pm2.shard_batch(b), loss_fn, weight_fn)
        sd2 = pm2.full_state_dict(to=0)
        if rank == 0:
            report["resume_step"] = resumed_step
            report["resume_max_dweight"] = max((sd2[k] - sd[k]).abs().max().item() for k in sd)
        del pm2

    # 6. memory per rank, measured
    mem = pm.memory(mine)
    report["memory"] = mem.to_dict(orient="records")
    # packed: the estimate's rows are as wide as the longest sequence, token_budget // width of them
    width = int(mine["attention_mask"].sum(-1).max()) if padding_free and token_budget else seq_len
    report["memory_compare"] = compare_with_estimate(mem, plan, pm.config, width, micro_batch_size if width == seq_len
                                                     else 1, head, activation_checkpointing,
                                                     token_budget=token_budget if width != seq_len else None, lora=lora_cfg)
    return report


def run_reshard_check(model: Any, plan: ParallelPlan, load_from: str, *, steps: int = 3, seq_len: int = 16,
                      micro_batch_size: int = 1, lr: float = 1e-3, max_grad_norm: float = 1.0,
                      seed: int = 0) -> dict[str, Any]:
    """Load a checkpoint another plan wrote after one step (``run_check(..., ckpt_dir=...)``) into ``plan``,
    then go on: against the single-process HF model trained on the same batches from the start.

    The reference takes step 1 itself (the saving plan matched it within ``max_dweight``), so the loaded
    weights (``reshard_max_dweight_loaded``), the next steps' losses (``reshard_loss_rel``) and the weights
    after them (``reshard_max_dweight``: this checks the resharded AdamW moments and step too, which a
    fresh optimizer would miss by ~lr) come from the reference, not from the code under test. The two
    plans must take the same global batch: ``dp * micro_batches * micro_batch_size`` equal on both."""
    ref = load_hf(model)
    pm = ParallelModel(model, plan, max_grad_norm=max_grad_norm, seed=seed, lr=lr, weight_decay=0.01, eps=1e-6)
    ref_params = list(ref.parameters())
    ref_opt = torch.optim.AdamW(ref_params, lr=lr, weight_decay=0.01, eps=1e-6, foreach=False)
    n = plan.dp * plan.n_micro_batches * micro_batch_size
    batches = step_batches(ref, steps, n, seq_len, seed)

    def ref_step(b: dict[str, torch.Tensor]) -> float:
        chunks = [c for d in split_rows(b, plan.dp) for c in split_rows(d, plan.n_micro_batches)]
        loss = sum(ppo_loss(reference_forward(ref, None, c), c) for c in chunks) / len(chunks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_params, max_grad_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        return loss.item()

    def dweight() -> float:
        sd = pm.full_state_dict(to=0)
        if dist.get_rank() != 0:
            return 0.0
        return max((sd[k] - v.detach()).abs().max().item() for k, v in ref.named_parameters() if k in sd)

    ref_step(batches[0])
    pm.load(load_from)
    report: dict[str, Any] = {"plan": plan.describe(), "world_size": plan.world_size, "reshard_from": load_from,
                              "reshard_step": pm.step, "reshard_max_dweight_loaded": max_over_ranks(dweight())}
    losses, ref_losses = [], []
    for b in batches[1:]:
        losses.append(pm.train_step(pm.shard_batch(b), ppo_loss)["loss"])
        ref_losses.append(ref_step(b))
    report.update(reshard_losses=losses, reshard_ref_losses=ref_losses,
                  reshard_loss_rel=max(abs(a - r) / max(1.0, abs(r)) for a, r in zip(losses, ref_losses)),
                  reshard_max_dweight=max_over_ranks(dweight()))
    return report


def _peft_reference(hf: nn.Module, cfg: Any, seed: int) -> nn.Module:
    """``hf`` with peft's own LoRA layers (``inject_adapter_in_model``), holding the adapters rlkit starts
    from (``init_adapters``: an input, like a seed)."""
    from peft import inject_adapter_in_model

    from rlkit.parallel.lora import init_adapters

    inject_adapter_in_model(cfg, hf)
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters() if p.requires_grad}
    init = init_adapters(shapes, seed)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n in init:
                p.copy_(init[n])
    return hf


def _merged_reference(hf: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's weights with its adapters merged by peft (a copy), by HF name."""
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(hf)
    for mod in merged.modules():
        if isinstance(mod, LoraLayer):
            mod.merge()
    out = {}
    for name, p in merged.named_parameters():
        if ".lora_" not in name:
            out[name.replace(".base_layer.", ".")] = p.detach()
    return out


def measure_load(model: Any, plan: ParallelPlan, warmup: Any = None) -> dict[str, Any]:
    """Peak host memory of building ``ParallelModel(model, plan)`` on this rank, beside what it must
    hold: this rank's weights (measured, and ``rlkit.plan.memory``'s estimate) and the checkpoint's
    largest tensor. ``load_peak_bytes`` is the rise of the process's peak RSS over its RSS before the
    build. The peak is reset just before (Linux: ``/proc/self/clear_refs``), so an earlier high-water
    mark (building the tiny warm-up model on a fresh cache, a freed warm-up load) is not counted: without
    the reset, rank 0 of a fresh clone read 238 MiB where its load peaked at ~80. ``warmup``: a tiny
    checkpoint built the same way first, so one-time costs stay out of the number."""
    import gc

    import psutil

    from rlkit.parallel.loading import CheckpointReader
    from rlkit.plan.memory import estimate_memory

    reader = CheckpointReader(model)
    sizes = [reader.numel(n) * 4 for n in reader.files]  # fp32 bytes, from the headers
    if warmup is not None:  # first-use costs (imports, process-group buffers) are not the model's
        del_me = ParallelModel(warmup, plan)
        del del_me
    gc.collect()
    dist.barrier()
    _reset_peak_rss()
    before = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    pm = ParallelModel(model, plan)
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    weights = int(pm.memory()["weights"][dist.get_rank()])
    est = estimate_memory(plan, pm.config, precision="fp32", optimizer="adamw")
    row = {"rank": dist.get_rank(), "load_peak_bytes": max(0, peak - before), "weights_bytes": weights,
           "weights_estimate": int(est["weights"][dist.get_rank()]), "largest_tensor_bytes": max(sizes),
           "load_seconds": seconds, "full_model_bytes": sum(sizes)}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {"plan": plan.describe(), "world_size": plan.world_size, "load": rows}


def _reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux: the lifetime peak (ru_maxrss) is what _peak_rss reads
        pass


def _peak_rss() -> int:
    """This process's RSS high-water mark in bytes: VmHWM (since the last reset), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def compare_with_estimate(measured, plan: ParallelPlan, config, seq_len: int, micro_batch: int,
                          head: str = "lm", activation_checkpointing: bool = False,
                          token_budget: int | None = None, lora: Any = None) -> list[dict] | None:
    """Measured bytes vs ``rlkit.plan.memory.estimate_memory`` (fp32 AdamW, gathered logits) per
    rank: ``<col>_estimate``, ``<col>_measured``, ``<col>_rel_err``. The estimate splits saved
    activations into ``activations`` and ``logits``; measured activations hold both."""
    try:
        from rlkit.plan.memory import estimate_memory
        from rlkit.plan.memory_report import compare_memory
    except ImportError:
        return None
    est = estimate_memory(plan, config, seq_len=seq_len, micro_batch=micro_batch, precision="fp32",
                          optimizer="adamw", roles=("critic",) if head == "value" else ("actor",),
                          gathered_logits=True, activation_checkpointing=activation_checkpointing,
                          flash_attention=False,  # rlkit.parallel builds HF models with eager attention
                          token_budget=token_budget, lora=lora)
    est = est.assign(activations=est["activations"] + est["logits"])
    cols = ["rank", "weights", "grads", "optimizer", "activations"]
    return compare_memory(est[cols], measured[cols]).to_dict(orient="records")


def response_tokens(mb: dict[str, torch.Tensor]) -> float:
    """A micro-batch's weight in a token-mean objective: its response tokens (a backend check's ``weight_fn``)."""
    return float(mb["response_mask"].sum())


def max_over_ranks(x: torch.Tensor | float) -> float:
    """The largest element of ``x`` over every rank (a collective; float64, so a float32 maximum is exact);
    ``inf`` when it is not finite."""
    t = torch.as_tensor(x).detach().to(torch.float64).clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.max().item() if t.dim() else t.item()
    return v if math.isfinite(v) else float("inf")


def format_report(rep: dict[str, Any]) -> str:
    """The check's report as a small text table (what ``python -m rlkit.parallel`` prints)."""
    keys = ["plan", "loss", "ref_loss", "max_dlogprob", "max_dentropy", "max_dgrad", "max_dweight",
            "max_dlogprob_gathered_model", "strict_load", "resume_max_dweight", "step_time_s",
            "gather_bytes_rank0", "gather_seconds"]
    lines = [f"{k:<28} {_fmt(rep[k])}" for k in keys if k in rep]
    if "memory" in rep:
        import pandas as pd

        mem = pd.DataFrame(rep["memory"]).set_index("rank") / 2**20
        lines += ["", "memory per rank, measured (MiB)", mem.round(3).to_string()]
    if rep.get("memory_compare"):
        cmp = pd.DataFrame(rep["memory_compare"]).set_index("rank")
        errs = cmp[[c for c in cmp if c.endswith("_rel_err")]]
        lines += ["", "estimate vs measured, relative error", errs.round(3).to_string()]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.3e}" if isinstance(v, float) else str(v)
