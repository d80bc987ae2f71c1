"""The bucketed FSDP weight gather (``ParallelModel.iter_full_weights``) against the per-parameter
``full_tensor()`` gather it replaces, bit for bit, on real gloo ranks.

``rlkit.parallel.launch`` runs this file as a module on N ranks (``python -m test_bucketed_gather``, with
tests/ on PYTHONPATH); each rank gathers the weights with bucketing off (``GATHER_BUCKET_BYTES = 0``: one
``full_tensor`` per parameter, the reference), with small buckets (several per model, some parameters
larger than a bucket) and with the default size, and rank 0 writes every rank's comparison as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# bucket limits compared with the reference (0): several buckets on the tiny models, and the default
SMALL_BUCKET = 20 * 1024


def _gather(pm: Any, limit: int, **kw: Any) -> dict[str, Any]:
    """One full iter_full_weights pass with buckets of ``limit`` bytes, counting the collectives made."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import rlkit.parallel.gather as gather_mod

    calls = {"full_tensor": 0, "broadcast": 0}
    full_tensor, broadcast = DTensor.full_tensor, dist.broadcast

    def counted_full(self, *a, **k):
        calls["full_tensor"] += 1
        return full_tensor(self, *a, **k)

    def counted_broadcast(*a, **k):
        calls["broadcast"] += 1
        return broadcast(*a, **k)

    default = gather_mod.GATHER_BUCKET_BYTES
    DTensor.full_tensor, dist.broadcast, gather_mod.GATHER_BUCKET_BYTES = counted_full, counted_broadcast, limit
    try:
        items = list(pm.iter_full_weights(**kw))
    finally:
        DTensor.full_tensor, dist.broadcast, gather_mod.GATHER_BUCKET_BYTES = full_tensor, broadcast, default
    return {"items": items, "bytes": pm.last_transfer["bytes"], **calls}


def _compare(pm: Any, **kw: Any) -> dict[str, Any]:
    """Bucketed passes against the per-parameter one: names and order, None-ness, dtypes, values (exact),
    bytes received; plus the collectives each made."""
    import torch

    import rlkit.parallel.gather as gather_mod

    ref = _gather(pm, 0, **kw)
    out: dict[str, Any] = {"n": len(ref["items"]), "received": sum(t is not None for _, t in ref["items"]),
                           "ref_bytes": ref["bytes"], "ref_full_tensor": ref["full_tensor"]}
    for label, limit in (("small", SMALL_BUCKET), ("default", gather_mod.GATHER_BUCKET_BYTES)):
        got = _gather(pm, limit, **kw)
        pairs = list(zip(ref["items"], got["items"]))
        out[label] = {
            "names": [n for n, _ in got["items"]] == [n for n, _ in ref["items"]],
            "nones": all((a is None) == (b is None) for (_, a), (_, b) in pairs),
            "exact": all(a is None or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
                         for (_, a), (_, b) in pairs),
            "bytes": got["bytes"], "full_tensor": got["full_tensor"], "broadcast": got["broadcast"]}
    # a parameter whose dim 0 does not split evenly over the ranks is among those compared
    out["uneven_rows"] = sorted(n for n, p in pm.named_parameters() if p.dim() and p.shape[0] % pm.plan.dp)[:3]
    return out


def worker(argv: list[str]) -> int:
    """One rank: build the plan's model (and a LoRA one with --lora), compare, rank 0 writes the JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--model", required=True)
    p.add_argument("--lora", type=int, default=None)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import torch.distributed as dist

    from rlkit.parallel import ParallelModel
    from rlkit.parallel.dist import init_distributed
    from rlkit.plan.topology import ParallelPlan

    rank, _ = init_distributed(timeout_s=60)
    plan = ParallelPlan(dp=args.dp, tp=args.tp)
    pm = ParallelModel(args.model, plan)
    rep = {"rank": rank, "all": _compare(pm, to="all"), "to0": _compare(pm, to=0)}
    if args.lora:
        from peft import LoraConfig

        cfg = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=["q_proj", "v_proj", "down_proj"])
        lora = ParallelModel(args.model, plan, lora=cfg, groups=pm.groups)
        rep["lora"] = _compare(lora, to="all")
        rep["lora_adapters"] = _compare(lora, to="all", adapters_only=True)
        rep["lora_names"] = [n for n, _ in lora.iter_full_weights("all")]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rep)
    if rank == 0:
        Path(args.json).write_text(json.dumps({"ranks": ranks}, indent=1))
    dist.destroy_process_group()
    return 0


# ---- the tests ---------------------------------------------------------------------------------------
def _launch(tmp_path: Path, nprocs: int, args: list[str]) -> dict[str, Any]:
    from rlkit.parallel.launch import launch

    here = str(Path(__file__).parent)
    with pytest.MonkeyPatch.context() as mp:  # the ranks import this file by its module name
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
        res = launch(nprocs, args, tmp_path, timeout=150, module=Path(__file__).stem)
    assert res.returncodes == [0] * nprocs and res.report is not None, res.log()
    return res.report


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict[str, Any]:
    from rlkit.models import tiny_lm

    # odd vocab (301) and MLP width (97): embedding and lm_head split 151/150, gate/up 49/48
    path = tiny_lm("qwen2", size="test", vocab_size=301, intermediate_size=97, num_hidden_layers=2)
    return _launch(tmp_path_factory.mktemp("dp2"), 2, ["--dp", "2", "--model", path, "--lora", "4"])


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory) -> dict[str, Any]:
    from rlkit.models import tiny_lm

    path = tiny_lm("qwen2", size="test", num_hidden_layers=2)
    return _launch(tmp_path_factory.mktemp("dp2tp2"), 4, ["--dp", "2", "--tp", "2", "--model", path])


def _assert_same(case: dict[str, Any]) -> None:
    for label in ("small", "default"):
        got = case[label]
        assert got["names"] and got["nones"] and got["exact"], (label, got)
        assert got["bytes"] == case["ref_bytes"], (label, got, case["ref_bytes"])  # the same bytes counted


@pytest.mark.dist
def test_dp2_full_shard_bucketed_equals_per_parameter(dp2):
    for rank in dp2["ranks"]:
        case = rank["all"]
        _assert_same(case)
        assert case["received"] == case["n"] and case["ref_bytes"] > 0
        assert "model.embed_tokens.weight" in case["uneven_rows"]  # 301 rows over 2 ranks
        # per parameter: one full_tensor each; bucketed: none, and the default bucket holds the whole tiny
        # model (one broadcast from each rank), small buckets several
        assert case["ref_full_tensor"] == case["n"]
        assert case["default"]["full_tensor"] == case["small"]["full_tensor"] == 0
        assert case["default"]["broadcast"] == 2
        assert 2 < case["small"]["broadcast"] < 2 * case["n"]


@pytest.mark.dist
def test_dp2_to_rank0_only_rank0_receives(dp2):
    r0, r1 = (rank["to0"] for rank in dp2["ranks"])
    _assert_same(r0)
    _assert_same(r1)
    assert r0["received"] == r0["n"] and r1["received"] == 0  # rank 1 iterates, gets None for every name


@pytest.mark.dist
def test_lora_merged_weights_bucketed(dp2):
    for rank in dp2["ranks"]:
        _assert_same(rank["lora"])
        _assert_same(rank["lora_adapters"])
        assert rank["lora"]["default"]["full_tensor"] == 0
        names = rank["lora_names"]
        assert "model.layers.0.self_attn.q_proj.weight" in names  # merged, under HF's name
        assert not any("lora_" in n or "base_layer" in n for n in names)


@pytest.mark.dist
def test_dp2_tp2_mixed_placements_fall_back(dp2_tp2):
    for rank in dp2_tp2["ranks"]:
        case = rank["all"]
        _assert_same(case)
        _assert_same(rank["to0"])
        # 2D (Shard(0), Shard(k)) weights go one full_tensor each; only the dim-0-sharded rest is bucketed
        assert 0 < case["default"]["full_tensor"] < case["ref_full_tensor"] == case["n"]


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
