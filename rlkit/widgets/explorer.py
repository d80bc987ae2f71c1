"""An interactive memory and throughput explorer for a ParallelPlan, and the plan-search Pareto front.

``PlanExplorer`` is an ipywidgets VBox of controls (model, GPU type, sequence length, micro-batch,
DP / TP / PP / virtual stages, pipeline micro-batches, DP sharding, activation recompute, sequence
parallelism). Every change rebuilds the ``ParallelPlan`` and calls ``estimate_memory`` and
``estimate_throughput`` (rlkit.plan) with exactly those settings, then redraws the memory-per-rank bars
and a line of predicted tokens/s, MFU, step time, bubble and fit. A combination that cannot work shows
the ``PlanError`` message in the view instead of raising. The widget adds no arithmetic of its own: its
numbers are the cost models' numbers (``explorer.memory``, ``explorer.estimate``).

Where no widget frontend runs (nbconvert, GitHub) the explorer's mime bundle also carries HTML (the
status line and the memory figure as a PNG); ``explorer_figure`` is the same picture as a matplotlib
Figure. ``pareto_front`` / ``pareto_figure`` show the memory-vs-speed trade-off of ``search_plans``.

>>> from rlkit.widgets.explorer import PlanExplorer
>>> ex = PlanExplorer(model="qwen2.5-7b", dp=2, tp=4, pp=1, gpu="H100")
>>> ex.error is None, len(ex.memory), ex.estimate["tokens_per_s"] > 0
(True, 8, True)
>>> ex.update(tp=8); ex.error
'tp=8 does not divide num_attention_heads=28; choose tp in {1, 2, 4}'
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as W

from rlkit.errors import PlanError
from rlkit.plan.topology import divisors
from rlkit.plan.units import RECOMPUTE  # the cost models' modes: one list
from rlkit.widgets.figures import GIB, figure_html, figure_png, memory_figure, new_axes

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from rlkit.plan.topology import ParallelPlan

SEQ_LENS = [2**k for k in range(8, 18)]  # 256 .. 131072
# The knobs ``update`` takes: each is one control of the explorer.
KNOBS = ("model", "gpu", "seq_len", "micro_batch", "dp", "tp", "pp", "vpp", "micro_batches", "dp_shard",
         "dp_shard_size", "recompute", "sequence_parallel")


def _estimates(plan: ParallelPlan, model: Any, *, seq_len: int, micro_batch: int, gpu: str,
               recompute: str, sequence_parallel: bool, global_batch: int | None = None,
               device_memory: Any = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The two cost models with one set of settings: (``estimate_memory`` DataFrame,
    ``estimate_throughput`` dict). Device memory defaults to the GPU preset's ``memory``."""
    from rlkit.plan.memory import estimate_memory
    from rlkit.plan.throughput import GPUS, estimate_throughput

    if device_memory is None and isinstance(gpu, str) and gpu in GPUS:
        device_memory = GPUS[gpu]["memory"]
    memory = estimate_memory(plan, model, seq_len=seq_len, micro_batch=micro_batch, recompute=recompute,
                             sequence_parallel=sequence_parallel, device_memory=device_memory)
    estimate = estimate_throughput(plan, model, seq_len=seq_len, micro_batch=micro_batch,
                                   global_batch=global_batch, gpu=gpu, recompute=recompute,
                                   sequence_parallel=sequence_parallel)
    return memory, estimate


def _rate(x: float) -> str:
    """1234567 -> '1.23M'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def summary_line(memory: pd.DataFrame, estimate: dict[str, Any]) -> str:
    """One line of what the cost models predict: tokens/s, per GPU, MFU, step time, bubble, fit.

    >>> import pandas as pd
    >>> mem = pd.DataFrame({"total": [60 * 2**30, 70 * 2**30], "fits": [True, False]})
    >>> mem.attrs["device_memory"] = 64 * 2**30
    >>> est = dict(tokens_per_s=2.5e6, tokens_per_s_per_gpu=4882.8, achieved_mfu=0.41, step_s=3.2, bubble=0.1)
    >>> summary_line(mem, est)
    '2.5M tokens/s · 4.88k tokens/s/GPU · MFU 41.0% · step 3.20 s · bubble 10.0% · ✗ 1 of 2 ranks do not fit (peak 70.0 GiB > 64.0 GiB)'
    """
    peak = float(memory["total"].max()) / GIB
    text = (f"{_rate(estimate['tokens_per_s'])} tokens/s · {_rate(estimate['tokens_per_s_per_gpu'])} tokens/s/GPU"
            f" · MFU {estimate['achieved_mfu']:.1%} · step {estimate['step_s']:.2f} s"
            f" · bubble {estimate['bubble']:.1%}")
    device = memory.attrs.get("device_memory")
    if "fits" not in memory.columns or not device:
        return text + f" · peak {peak:.1f} GiB per rank"
    over = int((~memory["fits"].astype(bool)).sum())
    if over == 0:
        return text + f" · ✓ every rank fits (peak {peak:.1f} GiB ≤ {device / GIB:.1f} GiB)"
    return text + f" · ✗ {over} of {len(memory)} ranks do not fit (peak {peak:.1f} GiB > {device / GIB:.1f} GiB)"


def explorer_figure(plan: ParallelPlan, model: Any, *, seq_len: int = 4096, micro_batch: int = 1,
                    gpu: str = "H100", recompute: str = "none", sequence_parallel: bool = False,
                    global_batch: int | None = None, device_memory: Any = None) -> Figure:
    """The explorer's picture without widgets: memory per rank (stacked bars, the device memory as a
    dashed line) titled with the predicted tokens/s. Raises ``PlanError`` for a plan that cannot work.

    >>> from rlkit.plan import ParallelPlan
    >>> fig = explorer_figure(ParallelPlan(dp=2, tp=4, pp=2, devices_per_node=8), "qwen2.5-7b", seq_len=2048)
    >>> "tokens/s" in fig.axes[0].get_title()
    True
    """
    from rlkit.plan.spec import as_spec

    memory, estimate = _estimates(plan, model, seq_len=seq_len, micro_batch=micro_batch, gpu=gpu,
                                  recompute=recompute, sequence_parallel=sequence_parallel,
                                  global_batch=global_batch, device_memory=device_memory)
    return memory_figure(memory, title=_title(as_spec(model).name, plan, gpu, estimate))


def _title(name: str | None, plan: ParallelPlan, gpu: Any, estimate: dict[str, Any]) -> str:
    return (f"{name or 'model'} · {plan.describe().split(';')[0]} on {gpu}: "
            f"{_rate(estimate['tokens_per_s'])} tokens/s, MFU {estimate['achieved_mfu']:.0%}")


class PlanExplorer(W.VBox):
    """Controls for a plan's layout and training settings, redrawing memory per rank and the predicted
    throughput on every change.

    Args:
        plan: a ``ParallelPlan`` to start from (its dp, tp, pp, vpp, dp_shard, micro_batches); the
            keyword knobs below override it.
        model: a bundled config name (the dropdown lists ``bundled_models()``) or anything ``as_spec``
            takes (a ModelSpec, an HF config): added to the dropdown under its name.
        gpus: when set, a plan whose dp*tp*pp differs is shown as an error (the cluster's size).
        devices_per_node: GPUs per node (placement, and which links TP / DP use).
        global_batch: sequences per step for the throughput (default dp x micro_batches x micro_batch).
        **knobs: initial values of the controls (``KNOBS``): gpu ("H100"), seq_len (4096),
            micro_batch (1), dp, tp, pp, vpp (1), micro_batches (default pp), dp_shard
            ("full_shard"), dp_shard_size (with "hybrid_shard"), recompute ("none"),
            sequence_parallel (False).

    Read-only results of the last redraw: ``plan``, ``memory`` (the ``estimate_memory`` DataFrame),
    ``estimate`` (the ``estimate_throughput`` dict) and ``error`` (the PlanError message, or None;
    ``memory``, ``estimate`` and ``plan`` are None while it is set). ``update(**knobs)`` sets controls
    and redraws once; ``controls`` maps each knob to its widget.

    >>> ex = PlanExplorer(model="llama-3-70b", dp=4, tp=8, pp=16, gpus=512)
    >>> ex.plan.world_size, ex.memory["pp"].nunique()
    (512, 16)
    >>> before = ex.memory["activations"].max()
    >>> ex.update(recompute="full"); bool(ex.memory["activations"].max() < before)
    True
    >>> ex.update(dp=8); ex.error
    'dp*tp*pp=8*8*16=1024 but gpus=512: change dp, tp or pp so their product is 512'
    """

    def __init__(self, plan: ParallelPlan | None = None, model: Any = "llama-3-70b", *, gpus: int | None = None,
                 devices_per_node: int = 8, global_batch: int | None = None, **knobs: Any) -> None:
        from rlkit.plan.spec import as_spec, bundled_models
        from rlkit.plan.throughput import GPUS
        from rlkit.plan.topology import SHARDING

        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise PlanError(f"PlanExplorer got unknown knobs {unknown}; choose from {list(KNOBS)}")
        start: dict[str, Any] = dict(gpu="H100", seq_len=4096, micro_batch=1, dp=1, tp=1, pp=1, vpp=1,
                                     micro_batches=None, dp_shard="full_shard", dp_shard_size=None,
                                     recompute="none", sequence_parallel=False)
        if plan is not None:
            start.update(dp=plan.dp, tp=plan.tp, pp=plan.pp, vpp=plan.vpp, dp_shard=plan.dp_shard,
                         dp_shard_size=plan.dp_shard_size, micro_batches=plan.micro_batches)
            devices_per_node = plan.devices_per_node or devices_per_node
        start.update(knobs)
        self.gpus, self.devices_per_node, self.global_batch = gpus, devices_per_node, global_batch
        self._plan: ParallelPlan | None = None
        self._memory: pd.DataFrame | None = None
        self._estimate: dict[str, Any] | None = None
        self._error: str | None = None
        self._quiet = True  # no redraw while the controls are built or set together

        # model: bundled names, plus a passed-in spec under its name
        self._models: dict[str, Any] = {name: name for name in bundled_models()}
        self._model_label = self._add_model(model, as_spec)

        def slider(name: str, value: int, hi: int) -> W.IntSlider:
            return W.IntSlider(value=value, min=1, max=max(hi, value), description=name, continuous_update=False,
                               style={"description_width": "initial"}, layout=W.Layout(width="210px"))

        def dropdown(name: str, options: list, value: Any, width: str = "210px") -> W.Dropdown:
            return W.Dropdown(options=options, value=value, description=name, layout=W.Layout(width=width),
                              style={"description_width": "initial"})

        seq_lens = sorted(set(SEQ_LENS) | {int(start["seq_len"])})
        pp0 = int(start["pp"])
        mb0 = start["micro_batches"] if start["micro_batches"] is not None else pp0
        self.controls: dict[str, Any] = {
            "model": dropdown("model", list(self._models), self._model_label, "240px"),
            "gpu": dropdown("GPU", list(GPUS), start["gpu"], "170px"),
            "seq_len": W.SelectionSlider(options=seq_lens, value=int(start["seq_len"]), description="seq_len",
                                         continuous_update=False, style={"description_width": "initial"},
                                         layout=W.Layout(width="250px")),
            "micro_batch": slider("micro_batch", int(start["micro_batch"]), 16),
            "dp": slider("dp", int(start["dp"]), 128),
            "tp": slider("tp", int(start["tp"]), 16),
            "pp": slider("pp", pp0, 32),
            "vpp": slider("vpp", int(start["vpp"]), 8),
            "micro_batches": slider("micro_batches", int(mb0), 128),
            "dp_shard": dropdown("dp_shard", list(SHARDING), start["dp_shard"], "220px"),
            "dp_shard_size": dropdown("shard group", [1], 1, "140px"),
            "recompute": dropdown("recompute", list(RECOMPUTE), start["recompute"], "170px"),
            "sequence_parallel": W.Checkbox(value=bool(start["sequence_parallel"]), description="sequence parallel",
                                            indent=False, layout=W.Layout(width="150px")),
        }
        for v in ("gpu", "dp_shard", "recompute"):
            self._check_choice(v, start[v])
        self._refresh_shard_sizes(start["dp_shard_size"])
        self.controls["dp_shard"].tooltip = "; ".join(f"{k}: {v}" for k, v in SHARDING.items())
        self.controls["recompute"].add_class("rlkit-explorer-recompute")
        for control in self.controls.values():
            control.observe(self._on_change, names="value")

        self.status = W.HTML()
        self.status.add_class("rlkit-explorer-status")
        self.image = W.Image(format="png")
        self.image.add_class("rlkit-explorer-memory")
        c = self.controls
        wrap = W.Layout(flex_flow="row wrap", align_items="center")
        rows = [W.HBox([c["model"], c["gpu"], c["seq_len"], c["micro_batch"]], layout=wrap),
                W.HBox([c["dp"], c["tp"], c["pp"], c["vpp"]], layout=wrap),
                W.HBox([c["micro_batches"], c["dp_shard"], c["dp_shard_size"], c["recompute"],
                        c["sequence_parallel"]], layout=wrap)]
        super().__init__([*rows, self.status, self.image])
        self.add_class("rlkit-plan-explorer")
        self._quiet = False
        self.redraw()

    # ---- results ---------------------------------------------------------------------------------
    @property
    def plan(self) -> ParallelPlan | None:
        """The plan of the last redraw (None when its combination was refused)."""
        return self._plan

    @property
    def memory(self) -> pd.DataFrame | None:
        """The ``estimate_memory`` DataFrame of the last redraw (one row per rank)."""
        return self._memory

    @property
    def estimate(self) -> dict[str, Any] | None:
        """The ``estimate_throughput`` dict of the last redraw."""
        return self._estimate

    @property
    def error(self) -> str | None:
        """The PlanError message of the last redraw, or None when the plan works."""
        return self._error

    @property
    def knobs(self) -> dict[str, Any]:
        """The controls' current values (model as its dropdown label)."""
        return {k: c.value for k, c in self.controls.items()}

    # ---- changing it -----------------------------------------------------------------------------
    def update(self, **knobs: Any) -> None:
        """Set controls (any of ``KNOBS``) as a user would and redraw once.

        Raises ``PlanError`` for an unknown knob, a choice no dropdown offers, or a non-positive
        degree; combinations the plan refuses (tp not dividing the heads, ...) go to ``error``.
        """
        from rlkit.plan.spec import as_spec

        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise PlanError(f"update() got unknown knobs {unknown}; choose from {list(KNOBS)}")
        self._quiet = True
        try:
            for name, value in knobs.items():
                control = self.controls[name]
                if name == "model":
                    label = self._add_model(value, as_spec)
                    if label not in control.options:
                        control.options = list(self._models)
                    control.value = label
                elif name in ("gpu", "dp_shard", "recompute"):
                    self._check_choice(name, value)
                    control.value = value
                elif name == "seq_len":
                    value = _positive(name, value)
                    if value not in control.options:
                        control.options = sorted({*control.options, value})
                    control.value = value
                elif name == "sequence_parallel":
                    control.value = bool(value)
                elif name == "dp_shard_size":
                    continue  # set after dp, below
                else:  # an IntSlider: widen it instead of letting it clamp the value
                    value = _positive(name, value)
                    control.max = max(control.max, value)
                    control.value = value
            self._refresh_shard_sizes(knobs.get("dp_shard_size"))
        finally:
            self._quiet = False
        self.redraw()

    def _on_change(self, change: dict) -> None:
        if self._quiet:
            return
        if change["owner"] is self.controls["dp"] or change["owner"] is self.controls["dp_shard"]:
            self._quiet = True
            try:
                self._refresh_shard_sizes(self.controls["dp_shard_size"].value)
            finally:
                self._quiet = False
        self.redraw()

    def redraw(self) -> None:
        """Rebuild the plan from the controls, run the cost models and redraw (or show the error)."""
        from rlkit.plan.spec import as_spec
        from rlkit.plan.topology import ParallelPlan

        k = self.knobs
        model = self._models[k["model"]]
        try:
            plan = ParallelPlan(dp=k["dp"], tp=k["tp"], pp=k["pp"], vpp=k["vpp"], dp_shard=k["dp_shard"],
                                dp_shard_size=k["dp_shard_size"] if k["dp_shard"] == "hybrid_shard" else None,
                                micro_batches=k["micro_batches"], devices_per_node=self.devices_per_node)
            plan.validate(model=as_spec(model))  # the model's rules first: they name the fix for tp, pp
            if self.gpus is not None and plan.world_size != self.gpus:
                raise PlanError(f"dp*tp*pp={plan.dp}*{plan.tp}*{plan.pp}={plan.world_size} but gpus={self.gpus}: "
                                f"change dp, tp or pp so their product is {self.gpus}")
            memory, estimate = _estimates(plan, model, seq_len=k["seq_len"], micro_batch=k["micro_batch"],
                                          gpu=k["gpu"], recompute=k["recompute"],
                                          sequence_parallel=k["sequence_parallel"], global_batch=self.global_batch)
        except PlanError as e:
            self._plan = self._memory = self._estimate = None
            self._error = str(e)
            self.status.value = (f"<div style='color:#b00;font-family:sans-serif'>✗ <b>PlanError</b>: "
                                 f"{html.escape(self._error)}</div>")
            self.image.layout.display = "none"
            return
        self._plan, self._memory, self._estimate, self._error = plan, memory, estimate, None
        line = summary_line(memory, estimate)
        warn = "".join(f"<br><span style='color:#b60'>⚠ {html.escape(w)}</span>"
                       for w in plan.placement_warnings(self.devices_per_node))
        self.status.value = (f"<div style='font-family:sans-serif'><b>{html.escape(plan.describe())}</b><br>"
                             f"{html.escape(line)}{warn}</div>")
        self.image.value = figure_png(memory_figure(memory, title=_title(as_spec(model).name, plan, k["gpu"],
                                                                         estimate)))
        self.image.layout.display = ""

    # ---- static fallback -------------------------------------------------------------------------
    def static_html(self) -> str:
        """The view as self-contained HTML (status line and memory figure): what a saved notebook shows."""
        if self._memory is None:
            return self.status.value
        from rlkit.plan.spec import as_spec

        k = self.knobs
        fig = memory_figure(self._memory, title=_title(as_spec(self._models[k["model"]]).name, self._plan,
                                                       k["gpu"], self._estimate))
        return self.status.value + figure_html(fig)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # the widget, plus HTML in the same bundle for frontends (and saved notebooks) without widgets
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        return {**bundle, "text/html": self.static_html()}

    # ---- helpers ---------------------------------------------------------------------------------
    def _add_model(self, model: Any, as_spec: Any) -> str:
        if isinstance(model, str) and model in self._models:
            return model
        spec = as_spec(model)  # fails early, with as_spec's message, on something that is no model
        label = model if isinstance(model, str) else (spec.name or "custom model")
        self._models[label] = spec if not isinstance(model, str) else model
        return label

    def _check_choice(self, name: str, value: Any) -> None:
        options = list(self.controls[name].options)
        if value not in options:
            raise PlanError(f"{name}={value!r} is not one of the choices {options}")

    def _refresh_shard_sizes(self, wanted: int | None) -> None:
        """The HSDP shard-group sizes are the divisors of dp; shown only with dp_shard='hybrid_shard'.
        Default: the largest group whose dp x tp ranks fit in one node."""
        dp, tp = self.controls["dp"].value, self.controls["tp"].value
        control = self.controls["dp_shard_size"]
        sizes = divisors(dp)
        if wanted not in sizes:
            wanted = control.value if control.value in sizes else max(
                (s for s in sizes if s * tp <= self.devices_per_node), default=1)
        if list(control.options) != sizes:
            control.options = sizes
        control.value = wanted
        control.layout.display = "" if self.controls["dp_shard"].value == "hybrid_shard" else "none"


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive integer")
    return value


# ---- the plan search's trade-off ----------------------------------------------------------------------
def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """The fitting plans no other fitting plan beats on both memory and speed: a row is dropped when
    another fitting row has ``memory_gib`` <= and ``tokens_per_s`` >= its own with one of them
    strictly better (identical points are all kept). ``df`` is what ``search_plans`` returns (rows
    with ``valid`` False or ``fits`` False never count); sorted by memory, index kept.

    >>> import pandas as pd
    >>> df = pd.DataFrame({"memory_gib": [10, 20, 15, 30, 5], "tokens_per_s": [1.0, 3.0, 0.5, 4.0, 9.0],
    ...                    "fits": [True, True, True, True, False]})
    >>> pareto_front(df).index.tolist()
    [0, 1, 3]
    """
    import numpy as np

    ok = df["fits"].astype(bool) if "fits" in df.columns else True
    if "valid" in df.columns:
        ok = ok & df["valid"].astype(bool)
    fit = df[ok]
    mem = fit["memory_gib"].astype(float)
    tps = fit["tokens_per_s"].astype(float)
    known = mem.notna() & tps.notna()
    fit, mem, tps = fit[known], mem[known], tps[known]
    best_at = tps.groupby(mem).max().sort_index()               # fastest plan at each memory value
    best_below = best_at.cummax().shift(1, fill_value=-np.inf)  # fastest plan using strictly less memory
    keep = (tps.to_numpy() == best_at.reindex(mem).to_numpy()) & (tps.to_numpy() > best_below.reindex(mem).to_numpy())
    front = fit[keep]
    return front.sort_values(["memory_gib", "tokens_per_s"], kind="stable")


def pareto_figure(df: pd.DataFrame, *, ax: Any = None, title: str | None = None) -> Figure:
    """Memory per GPU (x) against tokens/s (y) of the plans ``search_plans`` returns: fitting plans
    filled, the valid ones that do not fit hollow, the Pareto front (``pareto_front``) as a step line
    with its fastest plan labelled, and the GPU memory as a dashed line.

    >>> import pandas as pd
    >>> df = pd.DataFrame({"memory_gib": [10.0, 20.0, 90.0], "tokens_per_s": [1e5, 2e5, 3e5],
    ...                    "fits": [True, True, False], "valid": [True] * 3})
    >>> fig = pareto_figure(df); [len(c.get_offsets()) for c in fig.axes[0].collections]
    [2, 1]
    """
    front = pareto_front(df)
    ok = df[df["valid"].astype(bool)] if "valid" in df.columns else df
    fits = ok["fits"].astype(bool)
    fit, over = ok[fits], ok[~fits]
    fig, ax = new_axes(ax, (7.5, 4.5))
    ax.scatter(fit["memory_gib"], fit["tokens_per_s"], s=20, color="tab:green", alpha=0.7,
               label=f"fits ({len(fit)})")
    ax.scatter(over["memory_gib"], over["tokens_per_s"], s=20, facecolors="none", edgecolors="tab:red",
               label=f"does not fit ({len(over)})")
    if len(front):
        ax.step(front["memory_gib"], front["tokens_per_s"], where="post", color="black", lw=1.4,
                label=f"Pareto front ({len(front)})")
        best = front.loc[front["tokens_per_s"].astype(float).idxmax()]
        if {"dp", "tp", "pp"} <= set(front.columns):
            text = f"dp={best['dp']} tp={best['tp']} pp={best['pp']}"
            if "vpp" in front.columns and best["vpp"] > 1:
                text += f" vpp={best['vpp']}"
            if "dp_shard" in front.columns:
                text += f" {best['dp_shard']}"
            if "recompute" in front.columns and best["recompute"] not in (None, "none"):
                text += f" recompute={best['recompute']}"
            if "sequence_parallel" in front.columns and best["sequence_parallel"] is True:
                text += " SP"
            ax.annotate(text, (best["memory_gib"], best["tokens_per_s"]), textcoords="offset points",
                        xytext=(-6, 6), ha="right", fontsize=8)
    mem = df.attrs.get("gpu_memory")
    if mem:
        ax.axvline(mem / GIB, color="crimson", ls="--", lw=1.1, label=f"GPU memory {mem / GIB:.1f} GiB")
    xlabel = "memory per GPU (GiB, max over ranks)"
    if mem and len(ok):  # plans far past the GPU's memory would squeeze the interesting part to the left
        right = 2 * mem / GIB
        beyond = int((ok["memory_gib"].astype(float) > right).sum())
        if beyond:
            ax.set_xlim(0, right)
            xlabel += f"; {beyond} plans above {right:.0f} GiB not shown"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("estimated tokens/s")
    ax.set_title(title or f"{df.attrs.get('model', 'plans')} on {df.attrs.get('gpus', '?')} GPUs: "
                          f"memory vs speed")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def pareto_png(df: pd.DataFrame, **kw: Any) -> bytes:
    """PNG bytes of ``pareto_figure(df)``."""
    return figure_png(pareto_figure(df, **kw))
