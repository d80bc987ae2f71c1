"""Pipeline schedules as timelines: GPipe, 1F1B and interleaved 1F1B, simulated op by op.

Each pipeline rank runs its forward (F) and backward (B) ops in a fixed order, the order its
schedule prescribes (the same order ``torch.distributed.pipelining`` runs). An op starts as soon as
its rank is free and its input exists: F of a micro-batch on virtual stage ``v`` needs F on ``v-1``
(the activations), B on ``v`` needs B on ``v+1`` (the gradient), and B on the last stage needs its
own F (the loss). Playing those orders forward in time gives the timeline; the idle time in it is
the pipeline bubble.

Times: ``forward_time`` / ``backward_time`` are one micro-batch's F / B through ALL the layers of one
pipeline rank, so an interleaved chunk (1/vpp of the rank's layers) takes ``forward_time / vpp``.
That keeps plans with different vpp comparable at equal work.

>>> df = pipeline_timeline(pp=4, micro_batches=8, schedule="1f1b")
>>> float(df.end.max())        # (m + p - 1) * (tF + tB) = 11 * 3
33.0
>>> bubble_fraction(4, 8)      # (p - 1) / (m + p - 1)
0.2727272727272727
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlkit.errors import PlanError

if TYPE_CHECKING:
    import pandas as pd

# one op on a rank's list: (chunk, micro_batch, kind) with kind "F" or "B"
Op = tuple[int, int, str]


# ---- per-rank op orders --------------------------------------------------------------------------
def _check(pp: int, micro_batches: int, schedule: str | None, vpp: int) -> str:
    """Validate through ParallelPlan (one place for the rules and their messages); return the schedule."""
    from rlkit.plan.topology import ParallelPlan

    plan = ParallelPlan(pp=pp, vpp=vpp, micro_batches=micro_batches, schedule=schedule)
    return plan.pipeline_schedule


def _gpipe_order(pp: int, m: int, rank: int) -> list[Op]:
    # all forwards, then all backwards (torch's ScheduleGPipe runs B in micro-batch order too)
    return [(0, i, "F") for i in range(m)] + [(0, i, "B") for i in range(m)]


def _1f1b_order(pp: int, m: int, rank: int) -> list[Op]:
    # warm-up: enough forwards to fill the pipe below this rank, then one F / one B, then drain.
    # Rank s keeps at most pp - s micro-batches of activations (PipeDream-Flush, Narayanan 2021).
    warmup = min(pp - 1 - rank, m)
    ops: list[Op] = [(0, i, "F") for i in range(warmup)]
    for i in range(m - warmup):
        ops += [(0, warmup + i, "F"), (0, i, "B")]
    ops += [(0, i, "B") for i in range(m - warmup, m)]
    return ops


def _interleaved_order(pp: int, m: int, rank: int, vpp: int) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2), depth-first as Megatron and torch do it.

    Micro-batches go through the rank's chunks in rounds of ``pp``: chunk 0 for mb 0..p-1, then
    chunk 1 for the same mbs, ... Backwards walk the chunks in reverse. The warm-up is longer than
    plain 1F1B: (vpp - 1) * pp chunk-forwards plus 2 per hop from the last rank.
    """
    total = m * vpp
    warmup = min((vpp - 1) * pp + 2 * (pp - 1 - rank), total)

    def fwd_chunk(k: int) -> int:
        return (k // pp) % vpp

    def bwd_chunk(k: int) -> int:
        return vpp - 1 - (k // pp) % vpp

    next_mb = {"F": [0] * vpp, "B": [0] * vpp}

    def take(kind: str, chunk: int) -> Op:
        mb = next_mb[kind][chunk]
        next_mb[kind][chunk] += 1
        return (chunk, mb, kind)

    ops = [take("F", fwd_chunk(k)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [take("F", fwd_chunk(warmup + k)), take("B", bwd_chunk(k))]
    ops += [take("B", bwd_chunk(k)) for k in range(total - warmup, total)]
    return ops


def pipeline_order(pp: int, micro_batches: int, schedule: str | None = None, vpp: int = 1) -> dict[int, list[Op]]:
    """The ops each pipeline rank runs, in order: ``{rank: [(chunk, micro_batch, "F"|"B"), ...]}``.

    ``chunk`` is the virtual stage index on that rank (0 unless interleaved); the global virtual
    stage is ``chunk * pp + rank``.

    >>> pipeline_order(2, 3, "1f1b")[0]
    [(0, 0, 'F'), (0, 1, 'F'), (0, 0, 'B'), (0, 2, 'F'), (0, 1, 'B'), (0, 2, 'B')]
    """
    schedule = _check(pp, micro_batches, schedule, vpp)
    if schedule == "gpipe":
        return {r: _gpipe_order(pp, micro_batches, r) for r in range(pp)}
    if schedule == "1f1b":
        return {r: _1f1b_order(pp, micro_batches, r) for r in range(pp)}
    return {r: _interleaved_order(pp, micro_batches, r, vpp) for r in range(pp)}


# ---- timeline ------------------------------------------------------------------------------------
def pipeline_timeline(pp: int, micro_batches: int, schedule: str | None = None, vpp: int = 1,
                      forward_time: float = 1.0, backward_time: float = 2.0,
                      p2p_time: float = 0.0) -> pd.DataFrame:
    """Simulate one training step of a pipeline schedule.

    Args:
        pp: pipeline ranks. micro_batches: micro-batches per step.
        schedule: "gpipe" | "1f1b" | "interleaved-1f1b" (default: 1f1b, interleaved when vpp > 1).
        vpp: virtual stages (chunks) per rank.
        forward_time, backward_time: one micro-batch through all layers of one rank (a chunk takes 1/vpp).
        p2p_time: latency of each activation / gradient hand-off between ranks.

    Returns one row per op: ``stage`` (pipeline rank), ``chunk``, ``virtual_stage``, ``micro_batch``,
    ``kind`` ("F"|"B"), ``start``, ``end``; ``df.attrs`` keeps the inputs.

    >>> df = pipeline_timeline(2, 2, "gpipe", forward_time=1, backward_time=1)
    >>> df[df.stage == 1][["micro_batch", "kind", "start", "end"]].values.tolist()
    [[0, 'F', 1.0, 2.0], [1, 'F', 2.0, 3.0], [0, 'B', 3.0, 4.0], [1, 'B', 4.0, 5.0]]
    """
    import pandas as pd

    for name, value in (("forward_time", forward_time), ("backward_time", backward_time), ("p2p_time", p2p_time)):
        if not isinstance(value, (int, float)) or value < 0 or (value == 0 and name != "p2p_time"):
            raise PlanError(f"{name}={value!r} must be a {'non-negative' if name == 'p2p_time' else 'positive'} "
                            f"number of seconds (or any time unit)")
    schedule = _check(pp, micro_batches, schedule, vpp)
    orders = pipeline_order(pp, micro_batches, schedule, vpp)
    last = pp * vpp - 1
    duration = {"F": forward_time / vpp, "B": backward_time / vpp}
    done: dict[tuple[int, int, str], float] = {}  # (virtual stage, mb, kind) -> end time
    free, ptr, rows = [0.0] * pp, [0] * pp, []
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                chunk, mb, kind = orders[r][ptr[r]]
                v = chunk * pp + r
                if kind == "F":
                    dep = (v - 1, mb, "F") if v > 0 else None
                else:
                    dep = (v + 1, mb, "B") if v < last else (v, mb, "F")
                if dep is not None and dep not in done:
                    break  # this rank waits; another rank must run first
                ready = 0.0 if dep is None else done[dep] + (p2p_time if dep[0] != v else 0.0)
                start = max(free[r], ready)
                end = start + duration[kind]
                done[(v, mb, kind)] = free[r] = end
                rows.append((r, chunk, v, mb, kind, start, end))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # an order that waits on itself: a bug in the order, never a user error
            stuck = {r: orders[r][ptr[r]] for r in range(pp) if ptr[r] < len(orders[r])}
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks; next ops per rank: {stuck}")
    df = pd.DataFrame(rows, columns=["stage", "chunk", "virtual_stage", "micro_batch", "kind", "start", "end"])
    df = df.sort_values(["stage", "start"], kind="stable").reset_index(drop=True)
    df.attrs.update(pp=pp, micro_batches=micro_batches, schedule=schedule, vpp=vpp,
                    forward_time=forward_time, backward_time=backward_time, p2p_time=p2p_time)
    return df


def bubble_fraction(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Fraction of a step's device-time that the pipeline sits idle: bubble / total.

    With F and B times t_f, t_b per micro-batch per rank, every rank works m (t_f + t_b) and the step
    lasts (m + p - 1)(t_f + t_b) for GPipe and 1F1B alike, so the bubble is ``(p-1) / (m+p-1)``.
    Interleaving ``v`` chunks per rank shrinks the fill and drain to (p-1)(t_f + t_b)/v, i.e. the paper's
    (p-1)/(v m) *relative to ideal time* (Narayanan et al. 2021, eq. 2), which as a fraction of the
    total is ``(p-1) / (v m + p - 1)``. That is the number returned.

    >>> bubble_fraction(8, 8), bubble_fraction(8, 64), bubble_fraction(8, 8, vpp=4)
    (0.4666666666666667, 0.09859154929577464, 0.1794871794871795)
    """
    for name, value in (("pp", pp), ("micro_batches", micro_batches), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    return (pp - 1) / (vpp * micro_batches + pp - 1)


def idle_fraction(df: pd.DataFrame) -> float:
    """Measured bubble of a timeline: 1 - busy time / (ranks x makespan)."""
    span = df.end.max() - df.start.min()
    busy = (df.end - df.start).sum()
    return float(1 - busy / (df.stage.nunique() * span))


def peak_in_flight(df: pd.DataFrame) -> pd.Series:
    """Peak micro-batches of activations each stage holds at once, from a timeline.

    A micro-batch's activations on a chunk live from the start of its F to the end of its B. With
    interleaving a chunk holds 1/vpp of the rank's layers, so held chunks count 1/vpp each: the value
    is in "micro-batches' worth of this rank's activations". GPipe gives m, 1F1B gives pp - stage,
    interleaved 1F1B gives pp + (pp - 1) / vpp on stage 0 (Narayanan et al. 2021, sec. 2.2).

    >>> peak_in_flight(pipeline_timeline(4, 8, "1f1b")).tolist()
    [4.0, 3.0, 2.0, 1.0]
    """
    import pandas as pd

    vpp = df.attrs.get("vpp") or int(df.chunk.max()) + 1
    out = {}
    for stage, ops in df.groupby("stage"):
        # +1 when an F starts, -1 when a B ends; at equal times the release comes first
        events = [(t, 1) for t in ops.start[ops.kind == "F"]] + [(t, -1) for t in ops.end[ops.kind == "B"]]
        held, peak = 0, 0
        for _, change in sorted(events):
            held += change
            peak = max(peak, held)
        out[stage] = peak / vpp
    return pd.Series(out, name="peak_in_flight", dtype=float).rename_axis("stage")
