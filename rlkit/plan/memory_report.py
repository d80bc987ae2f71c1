"""Reading a memory estimate (``rlkit.plan.memory.estimate_memory``): ranks that hold the same bytes
collapsed to one row each, a paragraph on whether the plan fits and what to change when it does not, and
the estimate beside a measurement.

>>> from rlkit.plan import ParallelPlan, estimate_memory
>>> print(explain_fit(estimate_memory(ParallelPlan(dp=2), "qwen2.5-0.5b", device_memory="80GiB"))[:26])
All 2 ranks fit in 80.00 G
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlkit.errors import PlanError
from rlkit.plan.memory import COMPONENTS
from rlkit.plan.topology import ranges_str

if TYPE_CHECKING:
    import pandas as pd


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


_ADVICE = {
    "weights": "shard model state over more ranks (dp_shard='full_shard', larger dp/tp/pp)",
    "grads": "shard grads (dp_shard='shard_grad_op' or 'full_shard') or raise tp/pp",
    "optimizer": "shard optimizer state (dp_shard='full_shard' over more ranks) or raise tp/pp",
    "param_buffers": "use dp_shard='full_shard' instead of keeping unsharded copies",
    "activations": "recompute activations (recompute='selective' or 'full'), lower micro_batch/seq_len (or the token budget), or raise tp (with sequence_parallel)",
    "logits": "lower micro_batch or seq_len, or raise tp (vocab-parallel logits)",
    "kv_cache": "lower the rollout's max_tokens or gpu_memory_utilization",
    "rollout_weights": "raise the rollout tp or use rollout sleep=True",
}


def collapse_ranks(df: pd.DataFrame) -> pd.DataFrame:
    """Group ranks whose memory columns are identical: one row per distinct rank kind with ``ranks``
    (e.g. '0-7,16-23') and ``count``. A 512-rank plan usually has only ~pp distinct kinds.

    >>> from rlkit.plan import ParallelPlan, estimate_memory
    >>> kinds = collapse_ranks(estimate_memory(ParallelPlan(dp=2, pp=2), "qwen2.5-0.5b"))
    >>> kinds[["ranks", "count"]].values.tolist()
    [['0-1', 2], ['2-3', 2]]
    """
    cols = [c for c in COMPONENTS if c in df.columns] + ["total"]
    ranks = df["rank"] if "rank" in df.columns else df.index.to_series()
    keyed = df[cols].copy()
    keyed["_rank"] = ranks.to_numpy()
    if "fits" in df.columns:
        keyed["fits"] = df["fits"].to_numpy()
    by = cols + (["fits"] if "fits" in df.columns else [])
    out = (keyed.groupby(by, sort=False, dropna=False)["_rank"]
           .agg(lambda s: ranges_str(sorted(int(x) for x in s))).rename("ranks").reset_index())
    out["count"] = keyed.groupby(by, sort=False, dropna=False)["_rank"].size().to_numpy()
    out.attrs.update(df.attrs)
    return out


def explain_fit(df: pd.DataFrame) -> str:
    """One paragraph: which rank is largest, whether it fits ``df.attrs['device_memory']``, and
    which component dominates (with a hint what to change) when it does not.

    >>> from rlkit.plan import ParallelPlan, estimate_memory
    >>> explain_fit(estimate_memory(ParallelPlan(dp=2), "llama-2-13b", device_memory="80GiB"))[:43]
    '2 of 2 ranks do not fit in 80.00 GiB. The l'
    """
    if df.empty:
        return "no ranks"
    top = df.loc[df["total"].idxmax()]
    where = f"rank {int(top['rank'])} (dp={int(top['dp'])}, tp={int(top['tp'])}, pp={int(top['pp'])})"
    parts = sorted(((c, int(top[c])) for c in COMPONENTS if c in df), key=lambda kv: -kv[1])
    total = int(top["total"])
    breakdown = ", ".join(f"{c} {_gib(v)} ({100 * v / total:.0f}%)" for c, v in parts[:3] if v)
    mem = df.attrs.get("device_memory")
    if mem is None:
        return f"The largest rank is {where} at {_gib(total)}: {breakdown}. Pass device_memory to check the fit."
    bad = int((df["total"] > mem).sum())
    if not bad:
        return (f"All {len(df)} ranks fit in {_gib(mem)}; the largest is {where} at {_gib(total)} "
                f"({100 * total / mem:.0f}%): {breakdown}.")
    comp, _ = parts[0]
    return (f"{bad} of {len(df)} ranks do not fit in {_gib(mem)}. The largest is {where} at {_gib(total)}, "
            f"{_gib(total - mem)} over: {breakdown}. {comp} dominates; {_ADVICE[comp]}.")


def compare_memory(estimate_df: pd.DataFrame, measured_df: pd.DataFrame) -> pd.DataFrame:
    """Side by side per rank: for each byte column in both frames, ``<col>_estimate``,
    ``<col>_measured`` and ``<col>_rel_err`` = (estimate - measured) / measured (0 when both are 0).

    ``measured_df`` needs a ``rank`` column and any of the component columns (``weights``, ``grads``,
    ``optimizer``, ``activations``, ``total``...). For the persistent columns, measure unique
    storages (``untyped_storage().nbytes()`` deduplicated by ``data_ptr``) of the local tensors of
    parameters, their ``.grad`` and the optimizer's ``exp_avg``/``exp_avg_sq`` (skip ``step``).

    >>> import pandas as pd
    >>> est = pd.DataFrame({"rank": [0], "weights": [100], "total": [150]})
    >>> compare_memory(est, pd.DataFrame({"rank": [0], "weights": [80]}))["weights_rel_err"].tolist()
    [0.25]
    """
    import numpy as np
    import pandas as pd

    if "rank" not in measured_df or "rank" not in estimate_df:
        raise PlanError("compare_memory needs a 'rank' column in both frames")
    cols = [c for c in (*COMPONENTS, "total") if c in estimate_df and c in measured_df]
    if not cols:
        raise PlanError(f"measured_df shares no byte column with the estimate; name columns like {list(COMPONENTS)}")
    m = estimate_df[["rank", *cols]].merge(measured_df[["rank", *cols]], on="rank", suffixes=("_estimate", "_measured"))
    out = pd.DataFrame({"rank": m["rank"]})
    for c in cols:
        e, r = m[f"{c}_estimate"].astype(float), m[f"{c}_measured"].astype(float)
        out[f"{c}_estimate"], out[f"{c}_measured"] = m[f"{c}_estimate"], m[f"{c}_measured"]
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"{c}_rel_err"] = np.where(r == 0, np.where(e == 0, 0.0, np.inf), (e - r) / r)
    return out


__all__ = ["collapse_ranks", "compare_memory", "explain_fit"]
