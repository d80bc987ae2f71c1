"""The static figures of the widgets, and the one way to turn a matplotlib figure into PNG bytes.

Memory per rank (stacked bars), the pipeline timeline (a Gantt chart) and the plan search (memory
against tokens/s) as matplotlib figures, for the views that show them (``plan_view``, ``explorer``)
and for notebooks. ``figure_png`` renders any figure with Agg whatever the notebook's backend (under
Agg ``display(fig)`` shows only text), and ``figure_html`` / ``figure_widget`` wrap its bytes. The
figures are bare ``matplotlib.figure.Figure`` objects unless you pass ``ax``: building one never
touches pyplot's state.

>>> from rlkit.plan import ParallelPlan
>>> fig = memory_figure(ParallelPlan(dp=2).memory("qwen2.5-0.5b"))
>>> figure_png(fig)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import base64
import io
import sys
from typing import TYPE_CHECKING, Any

from rlkit.errors import PlanError
from rlkit.plan.memory import COMPONENTS as MEMORY_COLUMNS  # byte columns, stacked in this order
from rlkit.plan.memory_report import collapse_ranks
from rlkit.plan.schedule import idle_fraction
from rlkit.plan.search import plan_label

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

GIB = 2**30


# ---- figure -> PNG bytes / HTML / widget -----------------------------------------------------------
def figure_png(fig: Figure, *, dpi: float | None = 100, tight: bool = True, clear: bool = False) -> bytes:
    """PNG bytes of a matplotlib figure, rendered by Agg. ``dpi=None`` keeps the figure's own.
    ``tight`` crops to what is drawn (legends beside the axes stay in), at the cost of a second layout
    pass; the live view, which redraws often, lays out its figure itself and passes ``tight=False``.

    Afterwards the figure is closed in pyplot if pyplot manages it, so figures don't pile up in a
    kernel; ``clear=True`` also drops its artists at once (not for a figure you will draw on again).

    >>> from matplotlib.figure import Figure
    >>> figure_png(Figure(figsize=(1, 1)), dpi=None, tight=False)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    True
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi if dpi is None else dpi,
                bbox_inches="tight" if tight else None)
    if clear:
        fig.clear()
    pyplot = sys.modules.get("matplotlib.pyplot")  # not imported: then no figure belongs to pyplot
    if pyplot is not None:
        pyplot.close(fig)
    return buf.getvalue()


def figure_html(fig: Figure) -> str:
    """A base64 ``<img>`` of the figure: renders in any HTML view, offline.

    >>> from matplotlib.figure import Figure
    >>> figure_html(Figure(figsize=(1, 1)))[:32]
    "<img src='data:image/png;base64,"
    """
    return f"<img src='data:image/png;base64,{base64.b64encode(figure_png(fig)).decode()}'/>"


def figure_widget(fig: Figure) -> Any:
    """The figure as an ``ipywidgets.Image`` (works whatever the matplotlib backend).

    >>> from matplotlib.figure import Figure
    >>> figure_widget(Figure(figsize=(1, 1))).format
    'png'
    """
    import ipywidgets as W

    return W.Image(value=figure_png(fig), format="png")


def new_axes(ax: Any, size: tuple[float, float]) -> tuple[Figure, Any]:
    """``(ax.figure, ax)``, or a new bare Figure of ``size`` inches with one axes when ``ax`` is None.

    >>> fig, ax = new_axes(None, (4.0, 3.0))
    >>> fig.get_size_inches().tolist(), new_axes(ax, (1.0, 1.0))[1] is ax
    ([4.0, 3.0], True)
    """
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure as _Figure

    # A bare Figure (not pyplot) so building one never touches the notebook's backend state.
    fig = _Figure(figsize=size)
    return fig, fig.add_subplot()


# ---- memory per device -----------------------------------------------------------------------------
def memory_figure(df: pd.DataFrame, *, max_bars: int = 32, ax: Any = None, title: str | None = None) -> Figure:
    """Stacked bars of memory per rank in GiB (weights, grads, optimizer, activations, ...), with the
    device memory as a dashed line when ``df.attrs["device_memory"]`` is set. Plans with more than
    ``max_bars`` ranks draw one bar per group of identical ranks, labelled with the ranks it stands for.

    ``df`` is what ``rlkit.plan.memory.estimate_memory`` returns: one row per rank, byte columns.

    >>> import pandas as pd
    >>> df = pd.DataFrame({"rank": [0, 1], "weights": [2**30, 2**30], "grads": [0, 0], "total": [2**30] * 2})
    >>> fig = memory_figure(df); len(fig.axes[0].patches)   # 2 weights bars; all-zero grads are left out
    2
    """
    missing = [c for c in ("total",) if c not in df.columns]
    parts = [c for c in MEMORY_COLUMNS if c in df.columns]
    if missing or not parts:
        raise PlanError(f"memory_figure needs the DataFrame of estimate_memory (columns {list(MEMORY_COLUMNS)} "
                        f"and total); got columns {list(df.columns)}")
    if len(df) > max_bars:
        bars = collapse_ranks(df)
        labels = [_bar_label(r, c) for r, c in zip(bars["ranks"], bars["count"])]
    else:
        bars = df
        labels = [str(r) for r in (df["rank"] if "rank" in df.columns else df.index)]
    fig, ax = new_axes(ax, (max(6.0, 0.35 * len(bars) + 3), 3.6))
    import matplotlib as mpl

    colors = mpl.colormaps["tab10"].colors
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for i, col in enumerate(parts):
        gib = [v / GIB for v in bars[col].astype(float)]
        if any(gib):
            ax.bar(x, gib, bottom=bottom, label=col, color=colors[i % len(colors)], width=0.8)
        bottom = [b + g for b, g in zip(bottom, gib)]
    totals = [v / GIB for v in bars["total"].astype(float)]
    if any(abs(t - b) > 1e-6 for t, b in zip(totals, bottom)):  # parts that do not add up to the peak
        ax.scatter(x, totals, marker="_", s=300, color="black", zorder=3, label="total")
    device_memory = df.attrs.get("device_memory")
    if device_memory:
        ax.axhline(device_memory / GIB, color="crimson", ls="--", lw=1.2,
                   label=f"device memory {device_memory / GIB:.1f} GiB")
    if "fits" in bars.columns:  # mark the bars that do not fit above their top
        for xi, (top, fits) in enumerate(zip(bottom, bars["fits"])):
            if not bool(fits):
                ax.text(xi, top, "✗", ha="center", va="bottom", color="crimson", fontsize=11)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=90 if len(bars) > 8 or len(df) > max_bars else 0, fontsize=8)
    ax.set_xlabel("rank" if len(df) <= max_bars else "ranks (identical ranks grouped)")
    ax.set_ylabel("GiB per device")
    ax.set_title(title or f"Memory per device ({len(df)} ranks)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _bar_label(ranks: str, count: int, width: int = 18) -> str:
    text = ranks if len(ranks) <= width else ranks[: width - 1] + "…"
    return f"{text} (×{count})" if count > 1 else text


def memory_png(df: pd.DataFrame, **kw: Any) -> bytes:
    """PNG bytes of ``memory_figure(df)``.

    >>> from rlkit.plan import ParallelPlan
    >>> memory_png(ParallelPlan(dp=2).memory("qwen2.5-0.5b"))[:4] == b"\\x89PNG"
    True
    """
    return figure_png(memory_figure(df, **kw))


# ---- pipeline timeline -----------------------------------------------------------------------------
def plot_timeline(df: pd.DataFrame, ax: Any = None) -> Any:
    """Gantt chart of a pipeline timeline (``rlkit.plan.schedule.pipeline_timeline``) on ``ax`` (a new
    pyplot figure when None): one row per stage, coloured by micro-batch, B hatched and lighter.

    >>> from rlkit.plan.schedule import pipeline_timeline
    >>> fig, ax = new_axes(None, (10.0, 2.3))
    >>> plot_timeline(pipeline_timeline(4, 8), ax=ax).get_title()
    '1f1b: pp=4, m=8; bubble 27.3%'
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * df.stage.nunique()))
    cmap = plt.get_cmap("tab20")
    m = int(df.micro_batch.max()) + 1
    label = len(df) / max(df.stage.nunique(), 1) <= 48  # text only while the boxes are wide enough
    for row in df.itertuples():
        forward = row.kind == "F"
        ax.barh(row.stage, row.end - row.start, left=row.start, height=0.8, color=cmap(row.micro_batch % 20),
                alpha=1.0 if forward else 0.55, hatch=None if forward else "//", edgecolor="black", linewidth=0.4)
        if label:
            text = f"{row.kind}{row.micro_batch}" + (f".{row.chunk}" if df.attrs.get("vpp", 1) > 1 else "")
            ax.text((row.start + row.end) / 2, row.stage, text, ha="center", va="center", fontsize=7)
    ax.set_yticks(sorted(df.stage.unique()))
    ax.set_yticklabels([f"stage {s}" for s in sorted(df.stage.unique())])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    a = df.attrs
    title = f"{a.get('schedule', '')}: pp={a.get('pp', '?')}, m={a.get('micro_batches', m)}"
    if a.get("vpp", 1) > 1:
        title += f", vpp={a['vpp']}"
    ax.set_title(f"{title}; bubble {idle_fraction(df):.1%}")
    ax.legend(handles=[Patch(facecolor="grey", label="forward"), Patch(facecolor="grey", alpha=0.55, hatch="//",
                                                                        label="backward")],
              loc="upper right", fontsize=8)
    return ax


def timeline_figure(df: pd.DataFrame, *, ax: Any = None, title: str | None = None) -> Figure:
    """Gantt chart of a pipeline timeline (the DataFrame of ``rlkit.plan.schedule.pipeline_timeline``):
    ``plot_timeline`` draws it; this puts it on a bare Figure that ``figure_png`` can export.

    >>> from rlkit.plan.schedule import pipeline_timeline
    >>> fig = timeline_figure(pipeline_timeline(pp=4, micro_batches=8))
    >>> fig.axes[0].get_title()
    '1f1b: pp=4, m=8; bubble 27.3%'
    """
    missing = [c for c in ("stage", "chunk", "micro_batch", "kind", "start", "end") if c not in df.columns]
    if missing:
        raise PlanError(f"timeline_figure needs the DataFrame of pipeline_timeline; missing columns {missing}")
    fig, ax = new_axes(ax, (10.0, 0.5 + 0.45 * df["stage"].nunique()))
    plot_timeline(df, ax=ax)
    if title:
        ax.set_title(title)
    return fig


def timeline_png(df: pd.DataFrame, **kw: Any) -> bytes:
    """PNG bytes of ``timeline_figure(df)``.

    >>> from rlkit.plan.schedule import pipeline_timeline
    >>> timeline_png(pipeline_timeline(pp=2, micro_batches=4))[:4] == b"\\x89PNG"
    True
    """
    return figure_png(timeline_figure(df, **kw))


# ---- plan search -----------------------------------------------------------------------------------
def plot_plans(df: pd.DataFrame, ax: Any = None) -> Any:
    """Memory per GPU vs tokens/s of each valid plan; fitting plans filled, the rest hollow, the
    device memory as a dashed line and the best plan labelled. ``df`` is what
    ``rlkit.plan.search_plans`` returns; ``ax`` a new pyplot figure's when None.

    >>> from rlkit.plan import search_plans
    >>> fig, ax = new_axes(None, (7.0, 4.5))
    >>> plot_plans(search_plans("qwen2.5-7b", gpus=8), ax=ax).get_title()
    'qwen2.5-7b on 8 GPUs'
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    ok = df[df["valid"]]
    fit, over = ok[ok["fits"]], ok[~ok["fits"]]
    ax.scatter(fit["memory_gib"], fit["tokens_per_s"], c="tab:green", label=f"fits ({len(fit)})", s=22)
    ax.scatter(over["memory_gib"], over["tokens_per_s"], facecolors="none", edgecolors="tab:red",
               label=f"does not fit ({len(over)})", s=22)
    mem = df.attrs.get("gpu_memory")
    if mem:
        ax.axvline(mem / GIB, color="grey", ls="--", lw=1)
    if len(fit):
        best = fit.iloc[0]
        ax.annotate(plan_label(best), (best["memory_gib"], best["tokens_per_s"]), textcoords="offset points",
                    xytext=(6, 6), fontsize=8)
    ax.set_xlabel("memory per GPU (GiB, max over ranks)")
    ax.set_ylabel("estimated tokens/s")
    ax.set_title(f"{df.attrs.get('model', '')} on {df.attrs.get('gpus', '?')} GPUs")
    ax.legend(fontsize=8)
    return ax
