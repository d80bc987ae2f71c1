"""The Trainer's live view: curves that update in place while ``fit`` runs, and the same plots saved to
the run directory at the end.

The trainer hands over one flat dict of metrics per step (verl/TRL key names: ``reward/mean``, ``kl``,
``timing/generate``, ``memory/rss_gb/rank0``, ...). Any key may be missing and extra keys are kept.
Where it runs decides what it draws:

- Jupyter (an IPython kernel): ONE ipywidgets VBox (progress bar, a status line, an Image of the
  dashboard PNG) displayed once; every update replaces widget values, so the cell output never piles up
  and the kernel never blocks on a frontend.
- A terminal: a tqdm bar with a compact postfix (reward, rolling reward, kl, s/step; the staleness of an
  off-policy run, the turns, tool calls and tool errors per episode of a multi-turn one); no drawing.

Figures are bare ``matplotlib.figure.Figure`` objects rendered by Agg (no pyplot global state, nothing
registered to close). A redraw of 500 rows takes ~0.1 s here; when drawing gets slow relative to the
steps, the view redraws less often (it never spends more than ``max_draw_share`` of the wall time drawing).

>>> from rlkit.widgets.live import LiveView
>>> view = LiveView(total_steps=3, mode="none")
>>> for step in range(1, 4):
...     view.update({"step": step, "reward/mean": step / 3, "kl": 0.01 * step})
>>> view.df["reward/mean"].round(2).tolist()
[0.33, 0.67, 1.0]
>>> [ax.get_title() for ax in view.figure().axes]
['reward', 'KL']
>>> view.close()
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from rlkit import atomic
from rlkit.widgets.figures import figure_png

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MODES = ("auto", "widget", "tqdm", "none")
# The phases of one RL step, stacked in dataflow order (the trainer's `timing/<phase>` keys).
PHASES = ("sync", "generate", "reward", "ref", "values", "old_logprobs", "advantage", "update_critic", "update")
PHASE_COLORS = ("#DA8BC3", "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8C8C8C", "#8172B3", "#CCB974", "#937860")
# Scalar curves: (title, key). The reward, tool errors, timing and memory panels are drawn specially.
TOOL_ERRORS = "tool errors per episode"
LINE_PANELS = (("KL", "kl"), ("entropy", "entropy"), ("response length", "response_length/mean"),
               # multi-turn episodes (rlkit.agent.episode_metrics): means per episode, and the share of the
               # episodes cut at MultiTurn.max_tokens
               ("turns per episode", "episode/turns"),
               ("tool calls per episode", "episode/tool_calls"),
               (TOOL_ERRORS, "episode/tool_errors"),
               ("truncated (fraction of episodes)", "episode/truncated"),
               # off-policy runs (async RL, or the correction on): how old the batch was and how far the engine
               # that sampled it is from the trainer (rlkit.algos.offpolicy)
               ("staleness (versions behind)", "offpolicy/staleness_max"),
               ("engine vs trainer max |Δ log p|", "offpolicy/max_abs_dlogp"),
               ("importance ratio pi_old/mu max", "offpolicy/ratio_max"),
               # dynamic sampling (rlkit.dynamic_sampling): the generated groups filtered out (all rewards equal)
               ("filtered groups (share)", "dynamic/filtered_share"),
               # streaming (rlkit.stream): the samples whose tokens span versions, and the buffer's fill
               ("samples across an update (share)", "stream/crossed_share"),
               ("stream buffer (groups)", "stream/buffer_groups"))
STALENESS = "samples by versions behind (share)"  # streaming: a stacked histogram per step
LAG_KEY = re.compile(r"^stream/staleness/(\d+)$")
# mixture of experts (rlkit.parallel.moe), one line per MoE layer and a thick one over all: the busiest expert
# over the mean, and the share of tokens whose router chose other experts than the engine (routing replay's subject)
PER_LAYER = {"expert load max/mean per layer": ("router/load_max", "worst"),
             "route flips per layer (share of tokens)": ("router/flip_rate", "all layers")}
RANK_KEY = re.compile(r"^memory/rss_gb/rank(\d+)$")
ERROR_KEY = re.compile(r"^episode/errors/(.+)$")  # tool errors of one kind per episode (bad_json, timeout, ...)
DPI = 80  # 12x6 in -> 960x480 px: readable in a notebook, cheap to render


def in_notebook() -> bool:
    """True inside an IPython kernel (Jupyter, VS Code, nbclient), False in a terminal or plain IPython.

    Only looks at IPython if something already imported it, so a plain script never pays for the import.

    >>> in_notebook()   # a doctest runs in a plain interpreter
    False
    """
    if "IPython" not in sys.modules:
        return False
    ip = sys.modules["IPython"].get_ipython()
    # A kernel-backed shell carries the kernel; the terminal IPython shell has none.
    return getattr(ip, "kernel", None) is not None


# ---- reading the rows --------------------------------------------------------------------------------
def _frame(df_or_rows: pd.DataFrame | list[dict[str, Any]]) -> pd.DataFrame:
    df = df_or_rows if isinstance(df_or_rows, pd.DataFrame) else pd.DataFrame(list(df_or_rows))
    return df.apply(pd.to_numeric, errors="coerce") if len(df.columns) else df


def _has(df: pd.DataFrame, key: str) -> bool:
    """A panel is drawn for a key that is present with at least one finite value (all-NaN = absent)."""
    return key in df.columns and bool(df[key].notna().any())


def _steps(df: pd.DataFrame) -> Any:
    """The x axis: the trainer's step numbers, or 1..n when some row lacks one."""
    if "step" in df.columns and bool(df["step"].notna().all()):
        return df["step"].to_numpy(dtype=float)
    return df.index.to_numpy() + 1.0


def _rank_keys(df: pd.DataFrame) -> list[str]:
    keys = [k for k in df.columns if RANK_KEY.match(k) and _has(df, k)]
    return sorted(keys, key=lambda k: int(RANK_KEY.match(k).group(1)))


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


LABEL_CHARS = 24  # a progress label longer than this is shortened (the full title gets its own line)


def short_label(title: str, width: int = LABEL_CHARS) -> str:
    """A progress-bar label that fits: ``title`` itself when short, else its head before " on " (the
    trainer's titles read "<algorithm> on <plan>"), else its first ``width - 1`` characters and "…".

    >>> short_label("grpo"), short_label("grpo on dp=2 x tp=1 x pp=1 = 2 ranks; DP full_shard")
    ('grpo', 'grpo')
    >>> short_label("a very long run name without a plan in it")
    'a very long run name wi…'
    """
    title = " ".join(str(title).split())  # one line
    if len(title) <= width:
        return title
    head = title.split(" on ", 1)[0]
    return head if 0 < len(head) < len(title) and len(head) <= width else title[:width - 1] + "…"


# ---- completions as text a person can read -------------------------------------------------------------
# A tiny model's samples are often pieces of UTF-8 byte sequences: the tokenizer decodes those as U+FFFD
# (the replacement character), which hides what was generated. Whitespace other than a space is shown
# escaped too, so a sample stays on one table row.


def _bad(ch: str) -> bool:
    """Not printable: a control, format or unassigned character, or U+FFFD (a lost byte)."""
    return ch == "\ufffd" or not (ch.isprintable() or ch in "\n\t\r")


def _escaped(ch: str) -> str:
    return ch.encode("unicode_escape").decode("ascii")  # "\ufffd" -> r"\ufffd", "\n" -> r"\n"


def readable(completion: Any, ids: Any = None, max_ids: int = 24) -> str:
    r"""One completion as a table cell a person can read: its text when every character is printable
    (newlines and tabs escaped, so it stays on one line); else, when its token ids are given, the ids as
    ``[ids 12 7 …]``; else the text with each unprintable character escaped (U+FFFD, what a tokenizer
    makes of a lone byte, shows as ``\ufffd``).

    >>> readable("dddd"), readable("a\nb")
    ('dddd', 'a\\nb')
    >>> print(readable("\ufffdq\x08c"))
    \ufffdq\x08c
    >>> readable("\ufffdq\x08c", ids=[301, 87, 40, 67])
    '[ids 301 87 40 67]'
    >>> readable("\ufffd" * 3, ids=range(30), max_ids=4)
    '[ids 0 1 2 3 … (30 tokens)]'
    """
    text = "" if completion is None else str(completion)
    if isinstance(ids, float):  # a missing cell of a DataFrame's ids column (NaN)
        ids = None
    if any(_bad(ch) for ch in text) and ids is not None:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        shown = " ".join(map(str, ids[:max_ids]))
        return f"[ids {shown}{f' … ({len(ids)} tokens)' if len(ids) > max_ids else ''}]"
    return "".join(_escaped(ch) if _bad(ch) or ch in "\n\t\r" else ch for ch in text)


def readable_samples(samples: pd.DataFrame, column: str = "completion", ids_column: str = "completion_ids",
                     ) -> pd.DataFrame:
    r"""``trainer.samples()`` with each completion shown by ``readable`` (a copy; the rewards were computed
    on the raw text). Uses the token ids of column ``ids_column`` where the frame has it.

    >>> df = pd.DataFrame({"prompt": ["ccc", "ccc"], "completion": ["cccc", "\ufffdc"], "reward": [1.0, 0.25]})
    >>> readable_samples(df)["completion"].tolist()
    ['cccc', '\\ufffdc']
    """
    out = samples.copy()
    if column in out.columns and len(out):
        ids = out[ids_column] if ids_column in out.columns else [None] * len(out)
        out[column] = [readable(text, i) for text, i in zip(out[column], ids)]
    return out


# ---- the panels --------------------------------------------------------------------------------------
def _reward_panel(ax: Any, df: pd.DataFrame, x: Any, rolling: int) -> None:
    """Per-step mean reward as points, its rolling mean as a line, and a band of ± the (rolling) batch
    std: the points show noise, the line shows the trend, the band shows how spread out the samples are."""
    mean = df["reward/mean"]
    roll = mean.rolling(rolling, min_periods=1).mean()
    ax.plot(x, mean.to_numpy(), ".", ms=3, color="#4C72B0", alpha=0.5, label="reward/mean")
    ax.plot(x, roll.to_numpy(), "-", lw=1.8, color="#4C72B0", label=f"rolling {rolling}")
    if _has(df, "reward/std"):
        std = df["reward/std"].rolling(rolling, min_periods=1).mean()
        ax.fill_between(x, (roll - std).to_numpy(), (roll + std).to_numpy(), color="#4C72B0", alpha=0.15,
                        lw=0, label="± std")
    if _has(df, "score/mean"):  # the verifier's score before any KL shaping
        ax.plot(x, df["score/mean"].to_numpy(), "-", lw=1, color="#55A868", alpha=0.8, label="score/mean")
    # eval_every's held-out scores, on the steps that ran them: avg@k, and the largest pass@j and maj@k
    evals = [c for c in df.columns if c.startswith(("eval/avg@", "eval/maj@"))]
    passes = sorted((c for c in df.columns if c.startswith("eval/pass@")), key=lambda c: int(c.rsplit("@", 1)[1]))
    for key, color in zip(evals + passes[-1:], ("#C44E52", "#8172B2", "#DD8452")):
        at = df[key].notna().to_numpy()
        ax.plot(np.asarray(x)[at], df[key].to_numpy()[at], "o-", ms=4, lw=1, color=color, label=key)
    _legend_on_top(ax)


def _timing_panel(ax: Any, df: pd.DataFrame, x: Any) -> None:
    """Seconds per phase, stacked per step."""
    present = [(p, c) for p, c in zip(PHASES, PHASE_COLORS) if _has(df, f"timing/{p}")]
    _stacked(ax, df, x, [(p, f"timing/{p}") for p, _ in present], [c for _, c in present])


def _stacked(ax: Any, df: pd.DataFrame, x: Any, parts: list[tuple[str, str]], colors: Any = None) -> None:
    """``parts`` (label, key) stacked per step, drawn as bars without gaps: one stepped ``fill_between`` per
    part. 7 polygons cost a few ms; 7 x 500 bar rectangles (or ``stairs`` patches, whose limits
    matplotlib walks segment by segment) cost 0.1-0.2 s."""
    import numpy as np

    xs = np.asarray(x, dtype=float)
    # Step edges halfway between steps, so each step owns a block however the steps are spaced.
    half = np.diff(xs) / 2 if len(xs) > 1 else np.array([0.5])
    edges = np.concatenate([[xs[0] - half[0]], xs[:-1] + half, [xs[-1] + half[-1]]])
    xx = np.repeat(edges, 2)[1:-1]  # each step's block: (left, y), (right, y)
    bottom = np.zeros(len(xs))
    colors = colors or [f"C{i}" for i in range(len(parts))]
    for (label, key), c in zip(parts, colors):
        top = bottom + df[key].fillna(0.0).to_numpy()
        ax.fill_between(xx, np.repeat(bottom, 2), np.repeat(top, 2), color=c, lw=0, label=label)
        bottom = top
    _legend_on_top(ax)


def _tool_errors_panel(ax: Any, df: pd.DataFrame, x: Any) -> None:
    """Tool errors per episode: all of them, and one line per kind that occurred. A step's row has a kind's
    key only when that kind occurred in it, so a kind absent from a row that has the total counts 0 there."""
    total = df["episode/tool_errors"]
    ax.plot(x, total.to_numpy(), "-", lw=1.6, color="#C44E52", label="all")
    kinds = sorted((ERROR_KEY.match(k).group(1), k) for k in df.columns if ERROR_KEY.match(k) and _has(df, k))
    for kind, k in kinds:
        ax.plot(x, df[k].where(total.isna(), df[k].fillna(0.0)).to_numpy(), "--", lw=1.0, label=kind)
    if kinds:
        _legend_on_top(ax)


def _per_layer_panel(ax: Any, df: pd.DataFrame, x: Any, key: str, overall: str) -> None:
    """``key/<layer>`` for every layer as a thin line, ``key`` (over the layers) as a thick one."""
    layers = sorted((int(k.rsplit("/", 1)[1]), k) for k in df.columns if k.startswith(key + "/") and _has(df, k))
    for i, k in layers:
        ax.plot(x, df[k].to_numpy(), "-", lw=0.8, alpha=0.7, label=f"layer {i}")
    ax.plot(x, df[key].to_numpy(), "-", lw=2.0, color="#222222", label=overall)
    if len(layers) <= 8:
        _legend_on_top(ax)


def _memory_panel(ax: Any, df: pd.DataFrame, x: Any) -> None:
    ranks = _rank_keys(df)
    for k in ranks:
        ax.plot(x, df[k].to_numpy(), "-", lw=1.2, label=f"rank {RANK_KEY.match(k).group(1)}")
    if not ranks:  # only the max over workers was reported
        ax.plot(x, df["memory/rss_max_gb"].to_numpy(), "-", lw=1.2, label="max over workers")
    if len(ranks) <= 8:  # a legend of 64 ranks hides the curves
        _legend_on_top(ax)


def _legend_on_top(ax: Any, ncol: int = 4) -> None:
    """A legend in rows across the top, over headroom added to the y range so it never hides data
    (loc="best" would, and it costs a search over every point)."""
    n = len(ax.get_legend_handles_labels()[1])
    rows = math.ceil(n / ncol)
    ax.legend(loc="upper left", fontsize=7, frameon=False, ncol=ncol, handlelength=1.2, columnspacing=0.8,
              borderaxespad=0.2)
    ax._rlkit_headroom = 0.16 * rows  # applied after autoscaling, as a share of the data range


def panels(df: pd.DataFrame) -> list[str]:
    """The titles of the panels ``metrics_figure`` draws for ``df``, in order (absent keys -> no panel).

    >>> panels(pd.DataFrame([{"step": 1, "entropy": 2.0, "timing/update": 0.5}]))
    ['entropy', 'phase timing (s)']
    >>> panels(pd.DataFrame([{"step": 1, "router/load_max": 1.5, "router/load_max/0": 1.5}]))
    ['expert load max/mean per layer']
    """
    out = ["reward"] if _has(df, "reward/mean") else []
    out += [title for title, key in LINE_PANELS if _has(df, key)]
    if any(LAG_KEY.match(k) for k in df.columns):
        out.append(STALENESS)
    out += [title for title, (key, _) in PER_LAYER.items() if _has(df, key)]
    if any(_has(df, f"timing/{p}") for p in PHASES):
        out.append("phase timing (s)")
    if _rank_keys(df) or _has(df, "memory/rss_max_gb"):
        out.append("memory per worker (GiB)")
    return out


def metrics_figure(df_or_rows: pd.DataFrame | list[dict[str, Any]], *, rolling: int = 10, title: str = "",
                   only: tuple[str, ...] | None = None, fig: Figure | None = None) -> Figure:
    """The dashboard for the rows so far as a bare Agg ``Figure`` (no pyplot state; drop it when done).

    Panels, each only when its keys are present: reward (points, rolling mean, ± std band), KL, entropy,
    response length; a multi-turn run's turns, tool calls and tool errors (all, and by kind) per episode and
    its truncated share; an off-policy run's staleness, engine/trainer mismatch and importance ratios; phase
    timing (stacked per step), memory per worker. ``only`` restricts to some titles.
    ``fig``: a figure this function drew before; when its panels are still the same they are redrawn in
    place (keeps the axes and their ticks: about half the cost of a fresh figure).

    >>> rows = [{"step": i, "reward/mean": i / 10, "kl": 0.0} for i in range(1, 11)]
    >>> [ax.get_title() for ax in metrics_figure(rows).axes]
    ['reward', 'KL']
    """
    df = _frame(df_or_rows)
    titles = [t for t in panels(df) if only is None or t in only]
    key = (tuple(titles), title)
    if fig is None or getattr(fig, "_rlkit_panels", None) != key:
        fig = _new_figure(titles, title, fig)
        fig._rlkit_panels = key  # what this figure's axes are, for reuse
    if not titles:
        return fig
    x = _steps(df)
    line_keys = dict(LINE_PANELS)
    for name, ax in zip(titles, fig.axes):
        # Drop last redraw's data artists but keep the axes (and their tick objects).
        for artist in [*ax.lines, *ax.collections, *ax.patches]:
            artist.remove()
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        ax.relim()
        ax.set_autoscaley_on(True)  # the headroom below pinned the y limits on the last redraw
        ax._rlkit_headroom = 0.0
        if name == "reward":
            _reward_panel(ax, df, x, rolling)
        elif name == "phase timing (s)":
            _timing_panel(ax, df, x)
        elif name == STALENESS:
            lags = sorted((int(LAG_KEY.match(k).group(1)), k) for k in df.columns if LAG_KEY.match(k))
            _stacked(ax, df, x, [(f"{lag} behind", k) for lag, k in lags])
        elif name == "memory per worker (GiB)":
            _memory_panel(ax, df, x)
        elif name == TOOL_ERRORS:
            _tool_errors_panel(ax, df, x)
        elif name in PER_LAYER:
            _per_layer_panel(ax, df, x, *PER_LAYER[name])
        else:
            ax.plot(x, df[line_keys[name]].to_numpy(), "-", lw=1.2, color="#4C72B0")
        ax.autoscale_view()
        if ax._rlkit_headroom:
            lo, hi = ax.get_ylim()
            ax.set_ylim(lo, hi + (hi - lo) * ax._rlkit_headroom / (1 - ax._rlkit_headroom))
    return fig


def _new_figure(titles: list[str], title: str, fig: Figure | None) -> Figure:
    """An empty grid of titled axes, up to 3 per row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(3, max(1, len(titles)))
    nrows = max(1, math.ceil(len(titles) / cols))
    size = (4.0 * cols, 2.7 * nrows + (0.3 if title else 0.0))
    if fig is None:
        fig = Figure(figsize=size, dpi=DPI)
        FigureCanvasAgg(fig)  # the Agg canvas renders PNGs without any pyplot backend
    else:
        fig.clear()
        fig.set_size_inches(size)
    if title:
        fig.suptitle(title, fontsize=11)
    if not titles:
        fig.text(0.5, 0.5, "no metrics to plot yet", ha="center", va="center", color="gray")
        return fig
    for i, name in enumerate(titles):
        ax = fig.add_subplot(nrows, cols, i + 1)
        # An explicit y skips matplotlib's title auto-placement, which measures every tick label (~40%
        # of a redraw); few ticks, because each tick is several artists to build and draw.
        ax.set_title(name, fontsize=10, y=1.0, pad=3)
        ax.locator_params(nbins=4)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, lw=0.5)
        if i >= len(titles) - cols:  # bottom row only: saves vertical space
            ax.set_xlabel("step", fontsize=8)
    # Fixed margins instead of tight/constrained layout: those re-measure every text and double the cost.
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.22 / nrows + 0.02,
                        top=1 - (0.2 if title else 0.12) / nrows, wspace=0.25, hspace=0.55)
    return fig


def save_plots(df_or_rows: pd.DataFrame | list[dict[str, Any]], run_dir: str | os.PathLike,
               *, rolling: int = 10, title: str = "") -> list[str]:
    """Write ``reward.png`` (the reward panel alone, when the rows have ``reward/mean``) and
    ``dashboard.png`` (every panel) into ``run_dir`` (created if missing); return the paths written.

    >>> import tempfile
    >>> rows = [{"step": i, "reward/mean": i / 10, "timing/update": 0.1} for i in range(1, 11)]
    >>> [os.path.basename(p) for p in save_plots(rows, tempfile.mkdtemp())]
    ['reward.png', 'dashboard.png']
    """
    df = _frame(df_or_rows)
    figs = {"dashboard.png": metrics_figure(df, rolling=rolling, title=title)}
    if _has(df, "reward/mean"):
        figs = {"reward.png": metrics_figure(df, rolling=rolling, title=title, only=("reward",)), **figs}
    paths = []
    for name, fig in figs.items():
        path = os.path.join(os.fspath(run_dir), name)
        # whole files or none: a reader (or a crash) never sees half a PNG; creates run_dir if missing
        atomic.write_bytes(path, figure_png(fig, dpi=None, tight=False, clear=True))
        paths.append(path)
    return paths


# ---- the live view -----------------------------------------------------------------------------------
class LiveView:
    """Live training curves: ``update(row)`` after each step, ``close()`` at the end.

    ``mode``: "auto" picks "widget" inside a Jupyter kernel and "tqdm" elsewhere; "none" only records.
    ``title``: what runs (the trainer's "grpo on dp=2 x tp=1 x pp=1 = 2 ranks; DP full_shard"); the bar is
    labelled ``label`` (default: ``short_label(title)``, "grpo") and a longer title gets a line of its own
    (above the tqdm bar; over the status line and as the bar's tooltip in the widget).
    ``every``: redraw the figure at most every that many steps (the bar and status line update each step).
    ``rolling``: window of the rolling reward. ``file``: where the tqdm bar writes (default stderr).
    ``workers``: a function returning the run's workers (``Cluster.table()``'s rows: node, memory, the call each
    is in, last heartbeat), shown under the curves in the widget at each redraw (``workers_html``).
    ``samples``: a function returning the recent samples (``Trainer.samples()``'s frame); when they have images
    (a vision-language run) the widget shows the newest with their thumbnails, completions and rewards under
    the curves at each redraw (``samples_html``), and ``view`` as a cell's last line shows the dashboard and
    that panel as HTML (the static fallback). Text-only samples show no panel.

    >>> import io
    >>> out = io.StringIO()
    >>> view = LiveView(total_steps=2, mode="tqdm", file=out)
    >>> view.update({"step": 1, "reward/mean": 0.5, "kl": 0.02, "timing/step": 1.5})
    >>> view.update({"step": 2, "reward/mean": 0.7, "kl": 0.03, "timing/step": 1.5})
    >>> view.close()
    >>> "2/2" in out.getvalue() and "reward=0.7" in out.getvalue()
    True
    >>> view.status_text().split(" · ")[:3]
    ['step 2/2', 'reward 0.7', 'rolling 0.6']
    """

    #: at most this share of wall time goes to redrawing; slower redraws are spaced further apart
    max_draw_share = 0.2

    def __init__(self, total_steps: int | None = None, *, every: int = 1, rolling: int = 10, title: str = "",
                 mode: str = "auto", file: IO[str] | None = None, label: str | None = None,
                 workers: Callable[[], pd.DataFrame] | None = None,
                 samples: Callable[[], pd.DataFrame] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"LiveView(mode={mode!r}): mode must be one of {MODES}")
        if total_steps is not None and int(total_steps) < 0:
            raise ValueError(f"LiveView(total_steps={total_steps}): must be >= 0 or None (unknown)")
        if int(every) < 1 or int(rolling) < 1:
            raise ValueError(f"LiveView(every={every}, rolling={rolling}): both must be >= 1")
        self.total_steps = None if total_steps is None else int(total_steps)
        self.every, self.rolling, self.title = int(every), int(rolling), title
        self.label = short_label(title or "train") if label is None else label
        self.mode = ("widget" if in_notebook() else "tqdm") if mode == "auto" else mode
        self.rows: list[dict[str, Any]] = []
        self.draw_s = 0.0  # seconds the last redraw took (figure + PNG)
        self.draws = 0  # redraws so far
        self._df: pd.DataFrame | None = None
        self._fig: Figure | None = None  # reused across redraws (see metrics_figure(fig=))
        self._times: list[float] = []  # wall clock at each update, for steps/s
        self._drawn_rows = 0
        self._drawn_at = -math.inf
        self._closed = False
        self.workers = workers
        self.samples = samples
        self.widget: Any = None
        self._bar: Any = None
        if self.mode == "widget":
            self._build_widget()
        elif self.mode == "tqdm":
            from tqdm.auto import tqdm

            if self._title_line():
                # its own line, on the bar's stream: the bar keeps its width
                tqdm.write(self._title_line(), file=file if file is not None else sys.stderr)
            self._bar = tqdm(total=self.total_steps, desc=self.label, unit="step", file=file,
                             dynamic_ncols=True, leave=True)

    # -- the data ----------------------------------------------------------------------------------
    @property
    def df(self) -> pd.DataFrame:
        """The rows so far as a DataFrame (one row per step, one column per key seen)."""
        if self._df is None:
            self._df = pd.DataFrame(self.rows)
        return self._df

    def figure(self) -> Figure:
        """The dashboard for the rows so far (a new bare Agg Figure each call)."""
        return metrics_figure(self.df, rolling=self.rolling, title=self.title)

    def png(self) -> bytes:
        """The dashboard as PNG bytes."""
        return figure_png(self.figure(), dpi=None, tight=False, clear=True)

    def _repr_png_(self) -> bytes:  # static fallback: `view` as a cell's last line shows the figure
        return self.png()

    def _repr_html_(self) -> str | None:
        """The static fallback with a sample panel: the dashboard (a PNG) and the recent samples with their
        images; None without image samples (then the PNG alone shows, as ``_repr_png_``)."""
        panel = self.samples_html()
        if not panel:
            return None
        png = base64.b64encode(self.png()).decode("ascii")
        return f"<img src='data:image/png;base64,{png}' style='max-width:100%'>{panel}"

    # -- the stream --------------------------------------------------------------------------------
    def update(self, row: dict[str, Any]) -> None:
        """Record one step's metrics; move the bar and status line; redraw when due."""
        if self._closed:
            raise RuntimeError("LiveView.update() after close(): create a new LiveView for a new run")
        self.rows.append(dict(row))
        self._df = None
        self._times.append(time.perf_counter())
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.update(1)
        if self.widget is not None:
            self._progress.max = max(self.total_steps or 0, len(self.rows), 1)
            self._progress.value = len(self.rows)
            self._status.value = self._status_html()
            if self._redraw_due():
                self.redraw()

    def _redraw_due(self) -> bool:
        if len(self.rows) - self._drawn_rows < self.every and self._drawn_rows > 0:
            return False
        # Spend at most max_draw_share of the wall time drawing: after a draw of d seconds wait
        # d * (1/share - 1) seconds. Steps of seconds redraw every step; a fast loop redraws less often.
        gap = self.draw_s * (1.0 / self.max_draw_share - 1.0)
        return time.perf_counter() - self._drawn_at >= gap

    def redraw(self) -> None:
        """Render the figure into the widget's Image now (a no-op outside widget mode)."""
        if self.widget is None:
            return
        t0 = time.perf_counter()
        self._fig = metrics_figure(self.df, rolling=self.rolling, title=self.title, fig=self._fig)
        self._image.value = figure_png(self._fig, dpi=None, tight=False)  # kept: the next redraw reuses it
        if self.workers is not None:
            self._workers.value = self.workers_html()
        if self.samples is not None:
            self._samples.value = self.samples_html()
        self._drawn_at = time.perf_counter()
        self.draw_s = self._drawn_at - t0
        self._drawn_rows = len(self.rows)
        self.draws += 1

    def close(self, error: bool = False) -> None:
        """Final redraw (so the figure shows every step) and close the bar. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self.widget is not None:
            if self._drawn_rows != len(self.rows):
                self.redraw()
            if self._fig is not None:
                self._fig.clear()  # free the artists now; the Image keeps the last PNG
                self._fig = None
            done = self.total_steps is None or len(self.rows) >= self.total_steps
            self._progress.bar_style = "danger" if error else ("success" if done else "warning")

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(error=exc_type is not None)

    def workers_html(self) -> str:
        """The worker panel: one row per rank (group, rank, node and its labels, memory, the call it is in,
        seconds since its last heartbeat), a rank that stopped reporting in red. Empty without ``workers``.

        >>> import pandas as pd
        >>> rows = pd.DataFrame([{"group": "rl", "rank": 0, "node": "4b6140a8", "node_labels": "zone=a",
        ...                       "rss_gb": 0.48, "busy": "update", "busy_s": 1.2, "heartbeat_s": 0.7, "alive": True}])
        >>> "zone=a" in LiveView(mode="none", workers=lambda: rows).workers_html()
        True
        """
        if self.workers is None:
            return ""
        try:
            df = self.workers()
        except Exception as e:  # the cluster going away mid-run: the panel says so, the run goes on
            return f"<div style='font-size:11px;color:#b00'>workers: {html.escape(str(e).splitlines()[0])}</div>"
        out = ["<table style='font:11px monospace;border-collapse:collapse;margin-top:4px'><tr>"
               + "".join(f"<th style='padding:0 6px;text-align:left'>{h}</th>" for h in
                         ("group", "rank", "node", "labels", "RSS GiB", "in", "heartbeat")) + "</tr>"]
        for r in df.to_dict("records"):
            busy = f"{r['busy']} {r['busy_s']:.0f}s" if r.get("busy") else "idle"
            colour = "" if r.get("alive") else "color:#b00"
            cells = (r["group"], r["rank"], r["node"], r.get("node_labels") or "", f"{r['rss_gb']:.2f}", busy,
                     f"{r['heartbeat_s']:.0f}s ago")
            out.append(f"<tr style='{colour}'>" + "".join(f"<td style='padding:0 6px'>{html.escape(str(c))}</td>"
                                                          for c in cells) + "</tr>")
        return "".join(out) + "</table>"

    def samples_html(self) -> str:
        """The sample panel (``rlkit.widgets.samples.samples_panel_html``): the newest samples with their image
        thumbnails, prompt, completion and reward. Empty without ``samples`` or when they have no images.

        >>> import pandas as pd
        >>> from PIL import Image
        >>> from rlkit.widgets.samples import with_images
        >>> df = with_images(pd.DataFrame({"step": [1], "prompt": ["Which?"], "completion": ["a"], "reward": [1.0]}),
        ...                  [{"image": Image.new("RGB", (56, 56))}])
        >>> '<img src="data:image/png;base64,' in LiveView(mode="none", samples=lambda: df).samples_html()
        True
        """
        from rlkit.widgets.samples import samples_panel_html

        if self.samples is None:
            return ""
        try:
            df = self.samples()
        except Exception as e:  # a view never stops the run
            what = str(e).splitlines()[0] if str(e) else type(e).__name__
            return f"<div style='font-size:11px;color:#b00'>samples: {html.escape(what)}</div>"
        return samples_panel_html(df)

    # -- the words ---------------------------------------------------------------------------------
    def _last(self, key: str) -> float | None:
        for row in reversed(self.rows):
            v = row.get(key)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                return float(v)
        return None

    def _rolling(self, key: str) -> float | None:
        vals = [float(r[key]) for r in self.rows[-self.rolling:] if r.get(key) is not None]
        vals = [v for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else None

    def seconds_per_step(self) -> float | None:
        """Recent seconds per step: wall clock between updates (what the user waits, view included);
        the trainer's own ``timing/step`` until two updates exist."""
        times = self._times[-(self.rolling + 1):]
        if len(times) >= 2 and times[-1] > times[0]:
            return (times[-1] - times[0]) / (len(times) - 1)
        return self._rolling("timing/step")

    def status_text(self) -> str:
        """'step k/N · reward r · rolling r̄ · x steps/s · y tok/s' (unknown parts left out)."""
        parts = [f"step {len(self.rows)}/{self.total_steps if self.total_steps is not None else '?'}"]
        reward = self._last("reward/mean")
        if reward is not None:
            parts += [f"reward {_fmt(reward)}", f"rolling {_fmt(self._rolling('reward/mean'))}"]
        sps = self.seconds_per_step()
        if sps:
            parts.append(f"{_fmt(1.0 / sps)} steps/s")
        tok = self._last("tokens_per_s")
        if tok is not None:
            parts.append(f"{tok:,.0f} tok/s")
        return " · ".join(parts)

    def postfix(self) -> str:
        """The tqdm postfix: 'reward=.. roll=.. kl=.. [stale=..] [turns=.. calls=.. tool_err=..] s/step=..'
        (unknown parts left out; the bracketed ones come with off-policy and multi-turn runs)."""
        parts = []
        reward = self._last("reward/mean")
        if reward is not None:
            parts += [f"reward={_fmt(reward)}", f"roll={_fmt(self._rolling('reward/mean'))}"]
        kl = self._last("kl")
        if kl is not None:
            parts.append(f"kl={_fmt(kl, 2)}")
        stale = self._last("offpolicy/staleness_max")
        if stale is not None:
            parts.append(f"stale={stale:g}")
        for name, key in (("turns", "episode/turns"), ("calls", "episode/tool_calls"), ("tool_err", "episode/tool_errors")):
            value = self._last(key)  # means per episode over the step's episodes
            if value is not None:
                parts.append(f"{name}={_fmt(value, 2)}")
        sps = self.seconds_per_step()
        if sps:
            parts.append(f"s/step={_fmt(sps, 2)}")
        return " ".join(parts)

    def _title_line(self) -> str:
        """The full title when the bar's label does not already say it all ("" otherwise)."""
        title = " ".join(self.title.split())
        return title if title and title != self.label else ""

    # -- the widget --------------------------------------------------------------------------------
    def _status_html(self) -> str:
        status = f"<span style='font-family:monospace'>{html.escape(self.status_text())}</span>"
        if not self._title_line():
            return status
        return f"<div style='font-weight:bold'>{html.escape(self._title_line())}</div>{status}"

    def _build_widget(self) -> None:
        import ipywidgets as W

        # description_width "initial": the label at its own width, never cut to "grpo on d..."
        self._progress = W.IntProgress(value=0, min=0, max=max(self.total_steps or 0, 1),
                                       description=self.label, tooltip=self.title or None, bar_style="info",
                                       style={"description_width": "initial"}, layout=W.Layout(width="60%"))
        self._status = W.HTML(value=self._status_html())
        self._image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self._workers = W.HTML()  # the worker panel, under the curves when there are workers to show
        self._samples = W.HTML()  # the sample panel: recent samples with their images (empty for text-only ones)
        self.widget = W.VBox([self._progress, self._status, self._image]
                             + ([self._workers] if self.workers is not None else [])
                             + ([self._samples] if self.samples is not None else []))
        if in_notebook():
            # Displayed exactly once; later updates only set widget values (comm messages), so the
            # cell's output never grows and nothing waits on the frontend.
            from IPython.display import display

            display(self.widget)
