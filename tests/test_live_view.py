"""The Trainer's live view: metrics rows -> DataFrame, dashboard figure, widget / tqdm front ends, saved plots,
and a real notebook kernel that must show exactly one widget however many updates it gets."""

from __future__ import annotations

import gc
import io
import math
import random
import struct
import time
from pathlib import Path

import pandas as pd
import pytest

from rlkit.widgets.figures import figure_png
from rlkit.widgets.live import (
    PHASES,
    LiveView,
    in_notebook,
    metrics_figure,
    panels,
    readable,
    readable_samples,
    save_plots,
    short_label,
)

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PANELS = ["reward", "KL", "entropy", "response length", "phase timing (s)", "memory per worker (GiB)"]


def make_rows(n: int = 200, workers: int = 4, seed: int = 0) -> list[dict]:
    """Synthetic training steps: reward rises 0 -> ~1 with noise; every key the trainer emits."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "reward/mean": step / n + rng.gauss(0, 0.05), "reward/std": 0.2,
               "score/mean": step / n, "kl": 1e-3 * step, "entropy": 2.0 - step / n,
               "actor/clipfrac": 0.1, "actor/loss": -0.01, "actor/grad_norm": 1.0,
               "response_length/mean": 20.0 + step / 10, "tokens_per_s": 4000.0 + step,
               "timing/step": 1.0, "sync/bytes": 1e6, "extra/custom": float(step)}
        for p in PHASES:
            row[f"timing/{p}"] = 0.1 + rng.random() * 0.1
        for rank in range(workers):
            row[f"memory/rss_gb/rank{rank}"] = 1.0 + 0.1 * rank + step / 1e4
        row["memory/rss_max_gb"] = row[f"memory/rss_gb/rank{workers - 1}"]
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return make_rows()


def live_png(fig) -> bytes:
    """PNG bytes as the live view exports its figures: at their own dpi, laid out by metrics_figure."""
    return figure_png(fig, dpi=None, tight=False, clear=True)


def is_png(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails unless ``data`` is a PNG."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def drop(rows: list[dict], *prefixes: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in rows]


# ---- data --------------------------------------------------------------------------------------------
def test_dataframe_keeps_every_row_and_key(rows):
    view = LiveView(len(rows), mode="none")
    for row in rows:
        view.update(row)
    df = view.df
    assert df.shape == (200, len(rows[0])) and df["step"].tolist() == list(range(1, 201))
    assert df["extra/custom"].iloc[-1] == 200.0  # unknown keys are kept
    first, last = df["reward/mean"].iloc[:20].mean(), df["reward/mean"].iloc[-20:].mean()
    assert last - first == pytest.approx(0.9, abs=0.05)  # the synthetic reward rises by 180/200
    # a later row may add a key (e.g. values appear) or miss one: NaN where absent
    view2 = LiveView(mode="none")
    view2.update({"step": 1, "reward/mean": 0.1})
    view2.update({"step": 2, "kl": 0.5})
    assert math.isnan(view2.df["kl"].iloc[0]) and math.isnan(view2.df["reward/mean"].iloc[1])


def test_status_line_and_postfix_numbers():
    view = LiveView(10, mode="none", rolling=2)
    view.update({"step": 1, "reward/mean": 0.2, "kl": 0.01, "timing/step": 2.0, "tokens_per_s": 1234.0})
    # one update: steps/s comes from the trainer's own timing/step (2 s/step -> 0.5 steps/s)
    assert view.status_text() == "step 1/10 · reward 0.2 · rolling 0.2 · 0.5 steps/s · 1,234 tok/s"
    view.update({"step": 2, "reward/mean": 0.4, "kl": float("nan")})
    view.update({"step": 3, "reward/mean": 0.8})
    # rolling over the last 2 rewards; kl is the last finite value; NaN never shows
    assert view.status_text().startswith("step 3/10 · reward 0.8 · rolling 0.6 · ")
    assert view.postfix().startswith("reward=0.8 roll=0.6 kl=0.01 s/step=")


# ---- the figure --------------------------------------------------------------------------------------
def test_figure_has_every_panel_and_the_right_curves(rows):
    fig = metrics_figure(rows, rolling=10)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == ALL_PANELS
    reward = axes["reward"]
    points, rolling_line, score = reward.lines
    expected = pd.Series([r["reward/mean"] for r in rows]).rolling(10, min_periods=1).mean()
    assert max(abs(a - b) for a, b in zip(rolling_line.get_ydata(), expected)) < 1e-12
    assert len(points.get_ydata()) == 200 and len(reward.collections) == 1  # the ± std band
    timing = axes["phase timing (s)"]
    assert [c.get_label() for c in timing.collections] == list(PHASES)  # stacked in dataflow order
    # the top of the stack is the sum of the phases (steps are bars: 2 vertices per step)
    top = timing.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(max(sum(r[f"timing/{p}"] for p in PHASES) for r in rows), rel=1e-9)
    assert [ln.get_label() for ln in axes["memory per worker (GiB)"].lines] == [f"rank {i}" for i in range(4)]
    assert axes["KL"].lines[0].get_ydata()[-1] == pytest.approx(0.2)


def test_mixture_of_experts_panels_draw_each_layer():
    """An MoE run's rows: the expert load and the route flips, one line per layer and a thick one over all."""
    rows = [{"step": i, "reward/mean": 0.1, "router/load_max": 2.0 + i, "router/load_max/0": 1.5,
             "router/load_max/1": 2.0 + i, "router/flip_rate": 0.01 * i, "router/flip_rate/0": 0.0,
             "router/flip_rate/1": 0.02 * i} for i in range(1, 6)]
    axes = {ax.get_title(): ax for ax in metrics_figure(rows).axes}
    load, flips = axes["expert load max/mean per layer"], axes["route flips per layer (share of tokens)"]
    assert [ln.get_label() for ln in load.lines] == ["layer 0", "layer 1", "worst"]
    assert [ln.get_label() for ln in flips.lines] == ["layer 0", "layer 1", "all layers"]
    assert list(flips.lines[1].get_ydata()) == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.10])


def test_missing_keys_skip_their_panels(rows):
    # GRPO with kl_coef=0 and no memory sampling: no KL, no memory panel
    assert panels(pd.DataFrame(drop(rows, "kl", "memory/"))) == ["reward", "entropy", "response length",
                                                                  "phase timing (s)"]
    # a key present but all NaN counts as absent
    nan_kl = [{**r, "kl": float("nan")} for r in rows[:5]]
    assert "KL" not in [ax.get_title() for ax in metrics_figure(nan_kl).axes]
    # only the max over workers: the memory panel shows that one line
    fig = metrics_figure(drop(rows[:5], "memory/rss_gb/"))
    assert [ln.get_label() for ln in fig.axes[-1].lines] == ["max over workers"]
    # nothing plottable: an empty figure with a note, still a valid PNG
    fig = metrics_figure([{"step": 1, "extra": 1.0}])
    assert fig.axes == [] and is_png(live_png(fig))


def test_png_bytes_are_a_valid_png(rows):
    width, height = is_png(live_png(metrics_figure(rows)))
    assert (width, height) == (960, 432)  # 12 x 5.4 in at 80 dpi: 3 columns x 2 rows of panels


# ---- widget mode -------------------------------------------------------------------------------------
def test_widget_mode_updates_in_place(rows):
    import ipywidgets as W

    view = LiveView(len(rows), mode="widget", title="run")
    progress, status, image = view.widget.children
    assert isinstance(view.widget, W.VBox)
    assert (type(progress), type(status), type(image)) == (W.IntProgress, W.HTML, W.Image)
    view.update(rows[0])
    first = image.value
    assert is_png(first) and view.draws == 1
    for row in rows[1:]:
        view.update(row)
    view.close()
    assert image.value != first and is_png(image.value)  # the same Image, its value replaced
    assert progress.value == progress.max == 200 and progress.bar_style == "success"
    assert "step 200/200" in status.value and "tok/s" in status.value


def test_redraws_follow_every(rows):
    view = LiveView(len(rows), mode="widget", every=50)
    view.max_draw_share = 1.0  # never throttle: only `every` decides
    for row in rows:
        view.update(row)
    assert view.draws == 4  # at steps 1, 51, 101, 151
    view.close()
    assert view.draws == 5  # close() draws the last step


def test_throttle_counts_redraws_on_a_controlled_clock(rows, monkeypatch):
    """Throttle behaviour on an injected clock (no wall time): each step takes 1/64 s and each draw
    1/16 s, so with max_draw_share 0.2 a draw is followed by a gap of 1/16 * (1/0.2 - 1) = 1/4 s = 16
    steps. Hand count over 100 steps: draws at steps 1, 17, 33, 49, 65, 81, 97 -> 7 (dyadic times: exact)."""
    import rlkit.widgets.live as live

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

        def __getattr__(self, name):
            return getattr(time, name)

    clock = Clock()
    monkeypatch.setattr(live, "time", clock)
    real_png = live.figure_png

    def slow_png(*a, **k):
        clock.now += 2.0 ** -4  # every draw costs 1/16 s of the fake clock
        return real_png(*a, **k)

    monkeypatch.setattr(live, "figure_png", slow_png)
    fast = LiveView(100, mode="widget")
    drawn_at_steps = []
    for i, row in enumerate(rows[:100], start=1):
        clock.now += 2.0 ** -6
        before = fast.draws
        fast.update(row)
        if fast.draws > before:
            drawn_at_steps.append(i)
    assert drawn_at_steps == [1, 17, 33, 49, 65, 81, 97], drawn_at_steps
    fast.close()
    assert fast.draws == 8  # close() draws the last step (100 was not drawn)


def test_redraw_reuses_the_figure_for_500_rows():
    """The steady state: a redraw keeps the same figure and axes, and replaces (not adds) its artists."""
    view = LiveView(500, mode="widget")
    for row in make_rows(500, workers=8):
        view.update(row)
    view.redraw()
    fig = view._fig
    axes = list(fig.axes)
    artists = [len(ax.lines) + len(ax.collections) + len(ax.patches) for ax in axes]
    view.redraw()
    assert view._fig is fig and list(fig.axes) == axes
    assert [len(ax.lines) + len(ax.collections) + len(ax.patches) for ax in axes] == artists
    view.close()


def test_no_figures_leak_over_1000_updates():
    from matplotlib import _pylab_helpers
    from matplotlib.figure import Figure

    def live_figures() -> int:
        gc.collect()
        return sum(isinstance(o, Figure) for o in gc.get_objects())

    before = live_figures()
    view = LiveView(1000, mode="widget", every=100)
    for row in make_rows(1000, workers=2):
        view.update(row)
    view.close()
    del view
    assert live_figures() == before
    assert _pylab_helpers.Gcf.get_num_fig_managers() == 0  # nothing registered with pyplot


# ---- terminal ----------------------------------------------------------------------------------------
def test_tqdm_mode_writes_a_compact_bar(rows):
    out = io.StringIO()
    with LiveView(len(rows), mode="tqdm", file=out, title="grpo") as view:
        for row in rows:
            view.update(row)
    text = out.getvalue()
    assert "grpo" in text and "200/200" in text
    for part in ("reward=", "roll=", "kl=0.2", "s/step="):
        assert part in text, text[-300:]
    assert view.widget is None and view.draws == 0  # a terminal draws nothing


def test_auto_mode_and_bad_input():
    assert not in_notebook()
    assert LiveView(mode="auto", file=io.StringIO()).mode == "tqdm"
    with pytest.raises(ValueError, match="mode='bogus'.*one of"):
        LiveView(mode="bogus")
    with pytest.raises(ValueError, match="every=0"):
        LiveView(every=0, mode="none")
    with pytest.raises(KeyError), LiveView(3, mode="widget") as failed:  # fit() raised mid-run
        failed.update({"step": 1, "reward/mean": 0.0})
        raise KeyError("boom")
    assert failed.widget.children[0].bar_style == "danger"
    # rows without a step number still plot (x = 1..n)
    assert metrics_figure([{"reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}]).axes[0].lines[0].get_xdata()[0] == 1
    view = LiveView(mode="none")
    view.close()
    with pytest.raises(RuntimeError, match="after close"):
        view.update({"step": 1})


# ---- labels and samples a person can read -----------------------------------------------------------
TRAINER_TITLE = "grpo on dp=2 x tp=1 x pp=1 = 2 ranks; DP full_shard"  # what Trainer.fit passes


def test_a_long_title_labels_the_bar_short_and_keeps_a_line_of_its_own(rows):
    assert short_label(TRAINER_TITLE) == "grpo" and short_label("run") == "run"
    assert short_label("x" * 40) == "x" * 23 + "…" and len(short_label("x" * 40)) == 24
    out = io.StringIO()
    with LiveView(3, mode="tqdm", file=out, title=TRAINER_TITLE) as view:
        for row in rows[:3]:
            view.update(row)
    lines = out.getvalue().splitlines()
    assert lines[0] == TRAINER_TITLE and "grpo: " in lines[-1] and "3/3" in lines[-1], lines
    view = LiveView(3, mode="widget", title=TRAINER_TITLE)
    progress, status, _ = view.widget.children
    # the label whole (its width is the text's, not a fixed 90 px), the full title in the tooltip and
    # on its own line over the status
    assert progress.description == "grpo" and progress.style.description_width == "initial"
    assert progress.tooltip == TRAINER_TITLE
    view.update(rows[0])
    assert status.value.index(TRAINER_TITLE) < status.value.index("step 1/3")
    view.close()
    short = LiveView(3, mode="widget", title="run")  # a short title is the label, said once
    assert short.widget.children[0].description == "run" and "run" not in short.widget.children[1].value


def test_completions_show_as_text_or_ids():
    junk = "\ufffd\ufffdq\ufffdcemh|icear\ufffd\x08"  # a random tiny model's sample, as decoded
    assert readable("dddddddd") == "dddddddd" and readable("") == "" and readable(None) == ""
    assert readable("a b\nc") == "a b\\nc"  # one table row
    assert readable(junk) == "\\ufffd\\ufffdq\\ufffdcemh|icear\\ufffd\\x08"  # every lost byte visible
    assert "\ufffd" not in readable(junk) and readable(junk).isprintable()
    assert readable(junk, ids=[301, 87, 40]) == "[ids 301 87 40]"
    assert readable("ddd", ids=[70, 70, 70]) == "ddd"  # printable text wins over ids
    df = pd.DataFrame({"step": [1, 1, 1], "prompt": ["ccc"] * 3, "completion": ["cccc", junk, junk],
                       "completion_ids": [[67] * 4, [301, 87], float("nan")], "reward": [1.0, 0.0, 0.0]})
    shown = readable_samples(df)
    assert shown["completion"].tolist() == ["cccc", "[ids 301 87]", readable(junk)]
    assert df["completion"].tolist()[1] == junk and shown["reward"].tolist() == [1.0, 0.0, 0.0]  # a copy
    assert readable_samples(df.drop(columns="completion_ids"))["completion"].tolist()[1] == readable(junk)


# ---- run directory -----------------------------------------------------------------------------------
def test_save_plots_writes_the_pngs(rows, tmp_path):
    run_dir = tmp_path / "runs" / "r1"  # created if missing
    paths = save_plots(pd.DataFrame(rows), run_dir)
    assert paths == [str(run_dir / "reward.png"), str(run_dir / "dashboard.png")]
    reward_wh, dash_wh = (is_png(Path(p).read_bytes()) for p in paths)
    assert reward_wh[0] < dash_wh[0]  # one panel vs three columns
    # written through a temp file and os.replace (rlkit.atomic): nothing else is left in the folder
    assert sorted(p.name for p in run_dir.iterdir()) == ["dashboard.png", "reward.png"]
    # rows without a reward (list input): only the dashboard
    assert save_plots(drop(rows[:3], "reward/"), tmp_path / "r2") == [str(tmp_path / "r2" / "dashboard.png")]


# ---- a multi-turn run's episodes ------------------------------------------------------------------------
EPISODE_PANELS = ["turns per episode", "tool calls per episode", "tool errors per episode",
                  "truncated (fraction of episodes)"]


def test_a_multi_turn_run_draws_its_episodes(tmp_path, capsys):
    """A real agentic run (scripted tool calls, rlkit.tasks.calc) through ``fit``: the live view draws turns,
    tool calls and tool errors per episode (all, and by kind) and the truncated share, each step's value the
    mean over that step's episodes as ``trainer.samples()`` lists them; the tqdm postfix says the turns."""
    import rlkit
    from rlkit.tasks import calc

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression; an odd result raises (so some calls fail).

        Args:
            expression: the expression, e.g. "12 * 4"
        """
        out = calc.calculator(expression)
        if int(out) % 2:
            raise ValueError(f"{out} is odd")
        return out

    # a random tiny model whose turns on odd ``b`` are scripted calls (rlkit.tasks.calc.calculator_script): those
    # episodes turn twice, the others once; the panels below depend on the script and the rows, not on sampling
    path = rlkit.models.tiny_lm("qwen2", size="small", max_position_embeddings=1024)
    tr = rlkit.Trainer(model=path, dataset=calc.Calculator(digits=(2, 1)), tools=[calculator],
                       algorithm="grpo", rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=96,
                                                               script=calc.calculator_script(b=r"\d*[13579]")),
                       # 110 response tokens: a call, its result and a short answer fit; a long error message
                       # leaves no room for the answer (truncated)
                       multi_turn=rlkit.MultiTurn(max_turns=3, max_tokens=110, tool_prompt=calc.TINY_TOOL_PROMPT),
                       prompts_per_step=4, lr=1e-3, seed=0, run_dir=str(tmp_path / "run"))
    try:
        df = tr.fit(steps=3, view="tqdm")
        samples = tr.samples()
    finally:
        tr.close()
    samples["truncated"] = (samples["finish_reason"] == "max_tokens").astype(float)
    by_step = samples.groupby("step")[["turns", "tool_calls", "tool_errors", "truncated"]].mean()
    assert by_step.index.tolist() == [1, 2, 3] and len(samples) == 3 * 8
    axes = {ax.get_title(): ax for ax in metrics_figure(df).axes}
    # after the single-turn curves (kl_coef=0: no KL), before the off-policy ones
    assert list(axes)[:3 + len(EPISODE_PANELS)] == ["reward", "entropy", "response length", *EPISODE_PANELS]
    for title, column in zip(EPISODE_PANELS, by_step.columns):
        drawn = axes[title].lines[0].get_ydata()
        assert list(drawn) == pytest.approx(by_step[column].tolist()), (title, list(drawn))
    # this run has episodes that turn 1 or 2 times, failed calls and truncated episodes: every panel is off zero
    assert set(samples["turns"]) >= {1, 2} and by_step["turns"].max() <= 3
    assert by_step["tool_errors"].max() > 0 and by_step["truncated"].max() > 0
    # the tool errors by kind: one dashed line per kind that occurred, 0 where a step had none; they add up
    errors = axes["tool errors per episode"]
    kinds = sorted(k.split("/")[-1] for k in df.columns if k.startswith("episode/errors/"))
    assert "raised" in kinds and [ln.get_label() for ln in errors.lines] == ["all", *kinds]
    assert sum(ln.get_ydata() for ln in errors.lines[1:]) == pytest.approx(list(errors.lines[0].get_ydata()))
    assert (tmp_path / "run" / "dashboard.png").exists()
    last = by_step.iloc[-1]
    tail = capsys.readouterr().err.strip().split("\r")[-1]  # the finished bar: step 3's postfix
    for part in (f"turns={last['turns']:.2g}", f"calls={last['tool_calls']:.2g}", f"tool_err={last['tool_errors']:.2g}"):
        assert part in tail, tail


def test_episode_panels_only_for_episode_rows(rows):
    assert not set(EPISODE_PANELS) & set(panels(pd.DataFrame(rows)))  # a single-turn run: none of them
    view = LiveView(2, mode="none")
    view.update({"step": 1, "episode/turns": 2.0, "episode/tool_calls": 1.0, "episode/tool_errors": 0.0,
                 "episode/truncated": 0.0})
    view.update({"step": 2, "episode/turns": 1.5, "episode/tool_calls": 1.0, "episode/tool_errors": 0.5,
                 "episode/truncated": 0.25, "episode/errors/timeout": 0.5})
    assert panels(view.df) == EPISODE_PANELS
    assert view.postfix().startswith("turns=1.5 calls=1 tool_err=0.5 s/step=")
    timeout = {ax.get_title(): ax for ax in view.figure().axes}["tool errors per episode"].lines[1]
    assert timeout.get_label() == "timeout" and list(timeout.get_ydata()) == [0.0, 0.5]  # absent in step 1: 0


# ---- a real notebook kernel --------------------------------------------------------------------------
def test_notebook_shows_exactly_one_widget():
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "from rlkit.widgets.live import LiveView, in_notebook\nprint(in_notebook())",
        "view = LiveView(total_steps=20, title='nb')",
        "for i in range(1, 21):\n"
        "    view.update({'step': i, 'reward/mean': i / 20, 'kl': 0.01, 'timing/update': 0.1})\n"
        "view.close()",
        "print(view.mode, view.widget.children[0].value, len(view.widget.children[2].value) > 0)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [cell.outputs for cell in nb.cells]
    assert outputs[0][0]["text"].strip() == "True"
    widget_views = [o for cell in outputs for o in cell
                    if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widget_views) == 1 and outputs[1] == widget_views  # displayed once, by the constructor
    assert outputs[2] == []  # 20 updates and close(): no output pile-up
    assert outputs[3][0]["text"].strip() == "widget 20 True"
    # the widget state the frontend would see: the progress bar at 20 of 20
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"] for m in state.values() if m["model_name"] == "IntProgressModel"]
    assert [(b["value"], b["max"], b["bar_style"]) for b in bars] == [(20, 20, "success")]
