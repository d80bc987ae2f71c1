"""PlanExplorer without a browser: its numbers are the cost models' numbers, its controls change them, a
refused combination shows the PlanError, and the Pareto front of a plan search is exactly the
non-dominated fitting plans."""

from __future__ import annotations

import pandas as pd
import pytest

from rlkit.errors import PlanError
from rlkit.plan import GPUS, ParallelPlan, estimate_memory, estimate_throughput
from rlkit.widgets.explorer import PlanExplorer, explorer_figure, pareto_figure, pareto_front

LAYOUT = dict(dp=4, tp=8, pp=16, micro_batches=32)  # 512 GPUs


@pytest.fixture(scope="module")
def explorer():
    return PlanExplorer(model="llama-3-70b", gpu="H100", seq_len=4096, gpus=512, **LAYOUT)


def test_full_recompute_lowers_activations_and_peak(explorer):
    explorer.update(recompute="none")
    before = explorer.memory.copy()
    explorer.update(recompute="full")
    after = explorer.memory
    assert explorer.error is None
    assert after["activations"].max() < before["activations"].max()
    assert after["total"].max() < before["total"].max()
    # weights, grads and optimizer state do not depend on recompute
    for col in ("weights", "grads", "optimizer"):
        assert (after[col] == before[col]).all(), col
    # and the step gets slower: recompute is extra forward work
    explorer.update(recompute="none")
    none = explorer.estimate
    explorer.update(recompute="full")
    full = explorer.estimate
    # Lower bound, from llama-3-70b's published shape (hidden 8192, 80 layers, 64 heads / 8 KV heads of 128,
    # MLP 28672): "full" reruns every decoder layer's forward, 2 FLOPs per matmul weight per token, and that
    # extra forward cannot run faster than the GPUs' peak (H100 989 TFLOP/s bf16 dense, 512 GPUs). It runs in
    # the pipeline's compute phase, which 1F1B's fill and drain stretch by 1 / (1 - bubble), bubble =
    # (pp - 1) / (m + pp - 1) = 15 / 47. DP traffic stays hidden under the (longer) compute either way.
    h, kv, inter, layers = 8192, 8 * 128, 28672, 80
    tokens = LAYOUT["dp"] * LAYOUT["micro_batches"] * 1 * 4096   # micro_batch 1, seq_len 4096
    extra_fwd_flops = tokens * layers * 2 * (2 * h * h + 2 * h * kv + 3 * h * inter)
    bubble = (LAYOUT["pp"] - 1) / (LAYOUT["micro_batches"] + LAYOUT["pp"] - 1)
    floor_s = extra_fwd_flops / (512 * 989e12) / (1 - bubble)   # ~0.21 s
    assert none["dp_exposed_s"] == full["dp_exposed_s"]  # the premise: DP exposure does not absorb compute
    assert full["step_s"] - none["step_s"] >= floor_s, (none["step_s"], full["step_s"], floor_s)
    # Upper bound: one more forward is at most +1/3 of forward + backward compute and +1/2 of the TP
    # all-reduces (the forward's rerun; backward has as many), pipeline sends and DP unchanged
    assert full["step_s"] <= 1.5 * none["step_s"], (none["step_s"], full["step_s"])
    explorer.update(recompute="selective")  # reruns only the attention core: in between
    assert none["step_s"] < explorer.estimate["step_s"] < full["step_s"]
    explorer.update(recompute="none")


def test_numbers_are_the_cost_models_numbers(explorer):
    knobs = dict(seq_len=8192, micro_batch=2, recompute="selective", sequence_parallel=True, gpu="H200",
                 dp_shard="hybrid_shard", dp_shard_size=2)
    explorer.update(**knobs)
    assert explorer.error is None, explorer.error
    plan = ParallelPlan(dp=4, tp=8, pp=16, dp_shard="hybrid_shard", dp_shard_size=2, micro_batches=32,
                        devices_per_node=8)
    assert explorer.plan == plan
    mem = estimate_memory(plan, "llama-3-70b", seq_len=8192, micro_batch=2, recompute="selective",
                          sequence_parallel=True, device_memory=GPUS["H200"]["memory"])
    est = estimate_throughput(plan, "llama-3-70b", seq_len=8192, micro_batch=2, gpu="H200",
                              recompute="selective", sequence_parallel=True)
    pd.testing.assert_frame_equal(explorer.memory, mem)
    assert explorer.memory.attrs["device_memory"] == GPUS["H200"]["memory"]
    assert explorer.estimate == est
    status = explorer.status.value
    assert "tokens/s" in status and "MFU" in status and "bubble" in status and "fits" in status
    explorer.update(seq_len=4096, micro_batch=1, recompute="none", sequence_parallel=False, gpu="H100",
                    dp_shard="full_shard")


def test_pipeline_ranks_differ(explorer):
    # 1F1B: the first stage holds pp micro-batches of activations in flight, the last one
    mem = explorer.memory
    acts = mem.groupby("pp")["activations"].max()
    assert acts.iloc[0] > acts.iloc[-1] and acts.is_monotonic_decreasing


def test_invalid_tp_shows_the_error_naming_it():
    ex = PlanExplorer(model="qwen2.5-7b", dp=2, tp=4)
    assert ex.error is None
    ex.update(tp=8)  # 28 heads do not split 8 ways
    assert ex.error is not None and "tp=8" in ex.error and "28" in ex.error
    assert ex.memory is None and ex.estimate is None
    assert "PlanError" in ex.status.value and "tp=8" in ex.status.value
    assert ex.image.layout.display == "none"
    ex.update(tp=2)
    assert ex.error is None and ex.memory is not None and ex.image.layout.display == ""


def test_world_size_mismatch_and_pipeline_errors_are_shown():
    ex = PlanExplorer(model="llama-3-8b", dp=2, tp=4, gpus=8)
    ex.update(dp=4)
    assert "dp*tp*pp=4*4*1=16" in ex.error and "gpus=8" in ex.error
    ex.update(dp=1, pp=2, micro_batches=1)  # 1F1B needs at least pp micro-batches
    assert "micro_batches=1" in ex.error


def test_update_refuses_unknown_knobs_and_choices():
    ex = PlanExplorer(model="qwen2.5-0.5b", dp=2)
    with pytest.raises(PlanError, match="unknown knobs"):
        ex.update(tensor_parallel=2)
    with pytest.raises(PlanError, match="recompute='some'"):
        ex.update(recompute="some")
    with pytest.raises(PlanError, match="tp=0"):
        ex.update(tp=0)
    ex.update(dp=256, seq_len=3000)  # past the slider's end / not a power of two: widened, not clamped
    assert ex.plan.dp == 256 and ex.memory.attrs["seq_len"] == 3000


def test_model_dropdown_and_passed_spec():
    from rlkit.plan import as_spec, bundled_models

    ex = PlanExplorer(model=as_spec("qwen2.5-1.5b"), dp=2)
    assert set(bundled_models()) <= set(ex.controls["model"].options)
    assert ex.memory.attrs["model"] == "qwen2.5-1.5b"
    ex.update(model="llama-3-8b")
    assert ex.memory.attrs["model"] == "llama-3-8b"


def test_static_fallbacks():
    ex = PlanExplorer(model="qwen2.5-7b", dp=2, tp=4, pp=2)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "tokens/s" in bundle["text/html"] and "<img src='data:image/png;base64," in bundle["text/html"]
    fig = explorer_figure(ex.plan, "qwen2.5-7b", seq_len=4096)
    assert "tokens/s" in fig.axes[0].get_title()
    assert any(line.get_linestyle() == "--" for line in fig.axes[0].lines)  # the device-memory line


def test_pareto_front_hand_made():
    df = pd.DataFrame({
        "memory_gib":   [10.0, 20.0, 15.0, 30.0, 5.0, 20.0, 40.0, 25.0, 10.0],
        "tokens_per_s": [1.0,  3.0,  0.5,  4.0,  9.0, 2.0,  4.0,  3.0,  1.0],
        "fits":         [True, True, True, True, False, True, True, True, True],
        "valid":        [True, True, True, True, True, True, True, True, True],
    })
    # 0 (10, 1) and 8 (10, 1) tie and are both kept; 1 (20, 3) beats 5 (20, 2) and 7 (25, 3);
    # 3 (30, 4) beats 6 (40, 4); 2 (15, 0.5) loses to 0; 4 does not fit
    front = pareto_front(df)
    assert front.index.tolist() == [0, 8, 1, 3]
    # brute force: a fitting row is kept iff no other fitting row is <= in memory and >= in speed,
    # strictly better in one
    fit = df[df.fits]
    brute = [i for i, r in fit.iterrows()
             if not any((o.memory_gib <= r.memory_gib and o.tokens_per_s >= r.tokens_per_s
                         and (o.memory_gib < r.memory_gib or o.tokens_per_s > r.tokens_per_s))
                        for j, o in fit.iterrows() if j != i)]
    assert sorted(front.index) == sorted(brute)
    # invalid rows never count
    df.loc[3, "valid"] = False
    assert pareto_front(df).index.tolist() == [0, 8, 1, 6]


def test_pareto_figure_on_a_search():
    from rlkit.plan import search_plans

    df = search_plans("qwen2.5-7b", gpus=16, gpu_memory="40GB", seq_len=4096)
    front = pareto_front(df)
    assert len(front) >= 1 and front["fits"].all()
    assert front["tokens_per_s"].is_monotonic_increasing  # more memory buys more speed along the front
    fig = pareto_figure(df)
    ax = fig.axes[0]
    filled, hollow = ax.collections[:2]
    assert len(filled.get_offsets()) == int((df.valid & df.fits).sum())
    assert len(hollow.get_offsets()) == int((df.valid & ~df.fits).sum())
    step = [ln for ln in ax.lines if ln.get_label().startswith("Pareto front")]
    assert step and step[0].get_drawstyle() == "steps-post"
