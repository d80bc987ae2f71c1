"""Pipeline schedules: op orders against torch's own schedules, makespans and bubbles against the
closed forms, activations in flight against the known peaks."""

from types import SimpleNamespace

import pytest

from rlkit.errors import PlanError
from rlkit.plan import ParallelPlan
from rlkit.plan.memory import _in_flight
from rlkit.plan.schedule import (
    bubble_fraction,
    idle_fraction,
    peak_in_flight,
    pipeline_order,
    pipeline_timeline,
)

SHAPES = [(2, 2), (2, 6), (3, 6), (4, 4), (4, 8), (4, 12), (8, 16)]  # (pp, micro_batches)


def _torch_ops(actions, pp):
    """torch _Action list -> [(chunk, mb, "F"|"B")], dropping idle slots and REDUCE_GRAD."""
    from torch.distributed.pipelining import schedules as S

    kinds = {S._ComputationType.FORWARD: "F", S._ComputationType.FULL_BACKWARD: "B"}
    return [(a.stage_index // pp, a.microbatch_index, kinds[a.computation_type])
            for a in actions if a is not None and a.computation_type in kinds]


# ---- op order vs torch.distributed.pipelining (torch's schedule IR needs no process group) ------------
@pytest.mark.parametrize("pp,m", SHAPES)
def test_gpipe_order_matches_torch(pp, m):
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    fake = SimpleNamespace(_num_stages=pp, _n_microbatches=m)  # the attributes the IR builder reads
    ref = ScheduleGPipe._get_pipeline_order(fake)
    assert {r: _torch_ops(ref[r], pp) for r in range(pp)} == pipeline_order(pp, m, "gpipe")


@pytest.mark.parametrize("pp,m", SHAPES)
def test_1f1b_order_matches_torch(pp, m):
    from torch.distributed.pipelining.schedules import Schedule1F1B

    ours = pipeline_order(pp, m, "1f1b")
    ref = Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    # torch 2.13's 1F1B IR numbers the last rank's forwards from 1 (a display quirk); its runtime
    # (_step_microbatches) runs min(m, pp - stage) warm-up forwards, then B/F pairs, then the
    # remaining backwards. Compare the IR where it is right and that runtime rule everywhere.
    for r in range(pp - 1):
        assert _torch_ops(ref[r], pp) == ours[r]
    for r in range(pp):
        w = min(m, pp - r)
        rule = [(0, i, "F") for i in range(w)]
        for i in range(m - w):
            rule += [(0, i, "B"), (0, w + i, "F")]
        rule += [(0, i, "B") for i in range(m - w, m)]
        assert ours[r] == rule


@pytest.mark.parametrize("pp,m", [(pp, m) for pp, m in SHAPES if m % pp == 0])  # interleaving needs pp | m
@pytest.mark.parametrize("vpp", [2, 3, 4])
def test_interleaved_order_matches_torch(pp, m, vpp):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    fake = SimpleNamespace(n_local_stages=vpp, pp_group_size=pp, microbatches_per_round=pp, _n_microbatches=m)
    ref = {r: _torch_ops(ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r), pp)
           for r in range(pp)}
    assert ref == pipeline_order(pp, m, "interleaved-1f1b", vpp)


# ---- timeline: dependencies, makespan, bubble --------------------------------------------------------
@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                          ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (8, 16), (3, 6)])
@pytest.mark.parametrize("tf,tb", [(1.0, 1.0), (1.0, 2.0)])
def test_makespan_and_bubble_closed_forms(schedule, vpp, pp, m, tf, tb):
    df = pipeline_timeline(pp, m, schedule, vpp=vpp, forward_time=tf, backward_time=tb)
    assert len(df) == 2 * pp * vpp * m
    # makespan (v m + p - 1)(tF + tB) / v: GPipe and 1F1B at v = 1 (Narayanan et al. 2021)
    assert df.end.max() == pytest.approx((vpp * m + pp - 1) * (tf + tb) / vpp, rel=1e-12)
    assert idle_fraction(df) == pytest.approx(bubble_fraction(pp, m, vpp), rel=1e-12)
    # no rank runs two ops at once
    for _, ops in df.groupby("stage"):
        assert (ops.start.values[1:] >= ops.end.values[:-1] - 1e-12).all()
    # dependencies: F(v, i) after F(v-1, i); B(v, i) after B(v+1, i); B(last, i) after F(last, i)
    t = {(r.virtual_stage, r.micro_batch, r.kind): (r.start, r.end) for r in df.itertuples()}
    last = pp * vpp - 1
    for (v, i, kind), (start, _) in t.items():
        dep = (v - 1, i, "F") if kind == "F" else ((v + 1, i, "B") if v < last else (v, i, "F"))
        if dep in t:
            assert start >= t[dep][1] - 1e-12
        else:
            assert kind == "F" and v == 0


def test_known_small_timeline():
    df = pipeline_timeline(2, 2, "1f1b", forward_time=1, backward_time=2)
    got = [(r.stage, r.kind, r.micro_batch, r.start, r.end) for r in df.itertuples()]
    assert got == [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 4, 6), (0, "B", 1, 7, 9),
                   (1, "F", 0, 1, 2), (1, "B", 0, 2, 4), (1, "F", 1, 4, 5), (1, "B", 1, 5, 7)]


def test_p2p_latency():
    def makespan(schedule, p2p):
        return pipeline_timeline(4, 8, schedule, p2p_time=p2p).end.max()

    # GPipe's critical path crosses 2 (p - 1) rank boundaries: down with F, back up with B
    assert makespan("gpipe", 0.5) - makespan("gpipe", 0) == pytest.approx(2 * 3 * 0.5)
    # 1F1B's steady state waits on a round trip per B/F pair as well, so it pays more
    assert makespan("1f1b", 0.5) - makespan("1f1b", 0) > 2 * 3 * 0.5


def test_bubble_formula_values_and_trends():
    assert bubble_fraction(1, 1) == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(8, 8, vpp=2) == pytest.approx(7 / 23)
    assert bubble_fraction(8, 64) < bubble_fraction(8, 16) < bubble_fraction(8, 8)
    with pytest.raises(PlanError, match="micro_batches=0"):
        bubble_fraction(4, 0)


# ---- activations in flight ---------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(4, 8), (8, 16), (3, 6)])
def test_peak_in_flight(pp, m):
    assert peak_in_flight(pipeline_timeline(pp, m, "gpipe")).tolist() == [m] * pp
    assert peak_in_flight(pipeline_timeline(pp, m, "1f1b")).tolist() == [pp - s for s in range(pp)]
    inter = peak_in_flight(pipeline_timeline(pp, m, "interleaved-1f1b", vpp=2))
    # stage 0 of interleaved 1F1B holds p + (p - 1)/v micro-batches' worth (Megatron, sec. 2.2)
    assert inter[0] == pytest.approx(pp + (pp - 1) / 2)


# ---- errors and the ParallelPlan delegates -----------------------------------------------------------
def test_bad_inputs_name_value_and_fix():
    with pytest.raises(PlanError, match="micro_batches=2 < pp=4.*micro_batches>=4"):
        pipeline_timeline(4, 2, "1f1b")
    with pytest.raises(PlanError, match="divisible by pp=4"):
        pipeline_timeline(4, 6, vpp=2)
    with pytest.raises(PlanError, match="schedule='zb'"):
        pipeline_timeline(4, 4, "zb")
    with pytest.raises(PlanError, match="forward_time=0"):
        pipeline_timeline(4, 4, forward_time=0)
    assert len(pipeline_timeline(4, 2, "gpipe")) == 16  # GPipe is fine with m < p


def test_plan_delegates():
    plan = ParallelPlan(dp=2, pp=4, vpp=2, micro_batches=8)
    df = plan.pipeline(forward_time=2.0)
    assert df.attrs["schedule"] == "interleaved-1f1b" and df.end.max() == pytest.approx((16 + 3) * 4 / 2)
    assert plan.bubble_fraction() == pytest.approx(3 / 19)
    assert ParallelPlan(dp=8).bubble_fraction() == 0.0


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("pp,m", [(4, 4), (4, 8), (8, 16)])
def test_memory_model_in_flight_matches_timeline(schedule, vpp, pp, m):
    # rlkit.plan.memory uses closed forms for activations in flight; the simulated timeline checks them
    plan = ParallelPlan(pp=pp, vpp=vpp, micro_batches=m, schedule=schedule)
    measured = peak_in_flight(plan.pipeline()) * vpp  # in chunks, the memory model's unit
    assert measured.tolist() == [_in_flight(plan, r) for r in range(pp)]
