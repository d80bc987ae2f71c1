"""Check the 3D-HybridEngine on real process groups: ``python -m rlkit.workers.hybrid_check`` on N ranks.

For each training plan and each valid ``Rollout(tp=t_g)`` it measures, on every rank:

* the generation shard against the HF checkpoint's own weights (loaded with ``transformers``, not through
  rlkit) sliced for ``t_g`` by Megatron's split, written out here (exact), and the training weights after
  ``release()`` against before (exact);
* bytes received, seconds and parameter memory of one resharding, beside HybridFlow's formulas;
* generation in the layout (every rank generating) against one HF engine on the full model, for the
  same prompts and seeds: greedy and sampled tokens, and the log-probs.

Rank 0 writes the report (``--json``). Run it with ``rlkit.parallel.launch``:

>>> from rlkit.parallel.launch import launch
>>> res = launch(4, ["--plans", "1x2x2"], "/tmp/hy", module="rlkit.workers.hybrid_check")  # doctest: +SKIP
>>> res.report["runs"][0]["rows"][0]["bytes"]                                            # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

PROMPTS = ["12+7=", "3*4=", "ab", "hello there", "x", "99-3=", "a b c", "zz"]


def _model(arch: str, tied: bool = False) -> str:
    from rlkit.models import tiny_lm

    # untied by default, so both pipeline ends hold one vocab matrix each and the stages are the same size
    return tiny_lm(arch, size="test", vocab_size=256, tie_word_embeddings=tied)


# Megatron's TP split of a Llama/Qwen2 decoder, written out for the check (not rlkit's own table): the
# matrices that produce heads / MLP channels split by rows (dim 0, biases too), the ones that consume them
# by columns (dim 1, biases whole); embedding and LM head by vocab rows; norms whole.
_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_COLUMNS = ("o_proj", "down_proj")


def hf_slice(name: str, weight: torch.Tensor, tg: int, g: int) -> torch.Tensor:
    """Generation TP rank ``g``'s slice (of ``tg``) of the HF weight ``name``, by Megatron's split."""
    module, kind = name.rsplit(".", 2)[-2:]
    dim = 0 if module in _ROWS else 1 if module in _COLUMNS and kind == "weight" else None
    return weight if dim is None or tg == 1 else weight.chunk(tg, dim)[g]


def check_plan(path: str, plan, temperatures=(0.0, 1.0), max_new_tokens: int = 8) -> list[dict]:
    """Every ``t_g`` of ``plan`` on this rank: one row per (t_g, temperature). A collective."""
    from transformers import AutoModelForCausalLM

    from rlkit.parallel import ParallelModel
    from rlkit.parallel.groups import build_generation_groups
    from rlkit.parallel.relayout import Resharder
    from rlkit.plan.hybrid import GenerationLayout, valid_generation_tp
    from rlkit.rollout import Rollout, make_engine
    from rlkit.workers.hybrid import HybridRollout
    from rlkit.workers.layout import SequenceLayout, generate_batch

    pm = ParallelModel(path, plan, lr=1e-3)
    rank = dist.get_rank()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = {n: t.detach() for n, t in hf.state_dict().items()}
    model_bytes = sum(t.numel() * t.element_size() for n, t in hf.named_parameters())
    before = dict(pm.iter_full_weights("all"))
    req = {"prompt": PROMPTS, "uid": list(range(len(PROMPTS))), "row": list(range(len(PROMPTS)))}
    seq = SequenceLayout(16, max_new_tokens)
    rows = []
    for tg in valid_generation_tp(plan, pm.config):
        layout = GenerationLayout(plan, tg)
        groups = build_generation_groups(layout)  # a collective: every rank, every t_g, in order
        resharder = Resharder(pm, groups)
        shards, stats = resharder.reshard()
        g = layout.coords(rank)["gen_tp"]
        missing = sorted(set(full) ^ set(shards))
        if missing:
            raise AssertionError(f"generation shard and checkpoint name different tensors: {missing[:4]}")
        shard_err = max((shards[n] - hf_slice(n, t, tg, g)).abs().max().item() for n, t in full.items())
        resharder.release()
        restore_err = max((t - before[n]).abs().max().item() for n, t in pm.iter_full_weights("all"))
        row = {"plan": plan.describe(), "dims": [plan.dp, plan.tp, plan.pp], "dp_shard": plan.dp_shard,
               "model_path": str(path), "t_g": tg, "rank": rank,
               "model_bytes": model_bytes, "shard_err": shard_err, "restore_err": restore_err,
               "bytes": stats["bytes"], "seconds": stats["seconds"], "param_bytes": stats["param_bytes"],
               "peak_param_bytes": stats["peak_param_bytes"],
               "bytes_formula": layout.received_fraction() * model_bytes,
               "param_formula": layout.parameter_fraction() * model_bytes}
        for temp in temperatures:
            rollout = Rollout(engine="hf", n=2, max_new_tokens=max_new_tokens, temperature=temp, seed=3)
            hybrid = HybridRollout(path, pm, groups, rollout)
            hybrid.reshard()
            got = hybrid.generate(req, 5, seq)
            want = generate_batch(make_engine(rollout, path), seq, req, 5) if got is not None else None
            key = "greedy" if temp == 0 else "sampled"
            row[f"{key}_prompts_here"] = hybrid.prompts_generated
            if got is not None:
                row[f"{key}_same_tokens"] = bool(torch.equal(got["input_ids"], want["input_ids"]))
                row[f"{key}_max_dlogprob"] = (got["rollout_logprobs"] - want["rollout_logprobs"]).abs().max().item()
            hybrid.close()
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", nargs="+", default=["1x2x2"],
                    help="dp x tp x pp, optionally :dp_shard (e.g. 2x2x2:replicate)")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--tied", action="store_true", help="tie the input and output embeddings")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("RLKIT_PG_TIMEOUT", "120"))))
    from rlkit.plan import ParallelPlan

    path = None
    if dist.get_rank() == 0:
        path = _model(args.arch, args.tied)  # built once, before the others read it
    box = [path]
    dist.broadcast_object_list(box, src=0)
    runs = []
    for spec in args.plans:
        dims, _, shard = spec.partition(":")
        dp, tp, pp = (int(x) for x in dims.split("x"))
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, dp_shard=shard or "full_shard")
        rows = check_plan(box[0], plan)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        runs.append({"plan": spec, "rows": [r for part in everyone for r in part]})
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
