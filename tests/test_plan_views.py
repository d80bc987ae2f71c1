"""ParallelPlan views (widget grid, HTML fallback, memory bars, pipeline timeline), `rlkit plan` CLI and
the plan notebook. Real ipywidgets and matplotlib objects; colours are checked against the plan's own
groups, so a wrong colouring (or a wrong group) fails."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

from rlkit.errors import PlanError
from rlkit.plan import ParallelPlan
from rlkit.plan.cli import main
from rlkit.plan.memory import estimate_memory
from rlkit.plan.memory_report import collapse_ranks
from rlkit.plan.schedule import bubble_fraction, pipeline_timeline
from rlkit.plan.search import search_plans
from rlkit.widgets.figures import (
    GIB,
    figure_html,
    memory_figure,
    memory_png,
    plot_plans,
    plot_timeline,
    timeline_figure,
    timeline_png,
)
from rlkit.widgets.plan_view import PlanView, TimelineView, plan_html

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BIG = dict(dp=4, tp=8, pp=16, devices_per_node=8)  # the seed's 512-GPU example


def _assert_colours_follow_groups(plan: ParallelPlan, colour_of, dim: str) -> None:
    """Same colour <=> same group along dim, for every pair of ranks."""
    group = {r: i for i, g in enumerate(plan.groups(dim)) for r in g}
    for a, b in itertools.combinations(range(plan.world_size), 2):
        same_colour = colour_of(a) == colour_of(b)
        assert same_colour == (group[a] == group[b]), (dim, a, b, colour_of(a), colour_of(b))


# ---- rank grid widget ------------------------------------------------------------------------------
def test_small_plan_widget_recolours_by_group_and_shows_details():
    plan = ParallelPlan(dp=2, tp=2, pp=2)
    view = plan.show(model="qwen2.5-7b")  # 28 layers -> 14 per pipeline stage
    assert [b.description for b in view.cells] == [str(r) for r in range(8)]
    for dim in ("tp", "dp", "pp", "tp"):  # toggling the real control recolours the cells
        view.dim_buttons.value = dim
        _assert_colours_follow_groups(plan, view.color_of, dim)
        assert f"{len(plan.groups(dim))} {dim.upper()} groups of {plan.size(dim)}" in view.legend.value
    # rank 5 = tp 1, dp 0, pp 1 in Megatron order; clicking its cell fills the details pane
    view.cells[5].click()
    assert view.selected == 5
    for text in ("dp=0, tp=1, pp=1", "14-27", "[4, 5]", "[1, 5]", "node / local device</td><td>0 / 5"):
        assert text in view.details.value, text
    tip = view.cells[5].tooltip
    assert "dp=0 tp=1 pp=1" in tip and "layers 14-27" in tip and "DP group: [5, 7]" in tip
    with pytest.raises(PlanError, match="dim='ep'"):
        view.dim = "ep"


def test_expert_parallel_groups_in_the_grid():
    """ParallelPlan(dp=4, tp=2, ep=2): EP groups pair consecutive DP ranks of one TP coordinate (Megatron order:
    ranks 0 and 2 are dp 0 and 1 at tp 0), which the 'EP groups' button colours; a dense plan has no EP view."""
    plan = ParallelPlan(dp=4, tp=2, ep=2)
    view = PlanView(plan, dim="ep")
    groups = {r: i for i, g in enumerate([[0, 2], [1, 3], [4, 6], [5, 7]]) for r in g}  # written out by hand
    for a, b in itertools.combinations(range(8), 2):
        assert (view.color_of(a) == view.color_of(b)) == (groups[a] == groups[b]), (a, b)
    assert "4 EP groups of 2" in view.legend.value and "all-to-all" in view.legend.value
    assert "EP group: [4, 6]" in view.facts.tooltip(6)
    with pytest.raises(PlanError, match="dim='ep' colours ranks by expert-parallel group"):
        PlanView(ParallelPlan(dp=4), dim="ep")


def test_512_rank_widget_colours_every_group_apart():
    # (its build time is measured in bench/bench_search.py, not asserted here)
    plan = ParallelPlan(**BIG)
    view = PlanView(plan, model="llama-3-70b")
    assert len(view.cells) == 512
    grid_rows = view.children[3].children[0].children  # header, toggle, legend, HBox(grid, details)
    assert len(grid_rows) == 64 and all(len(row.children) == 1 + 8 for row in grid_rows)  # nodes x devices
    for dim, n_groups in (("tp", 64), ("pp", 32), ("dp", 128)):
        view.dim = dim
        colours = [view.color_of(r) for r in range(512)]
        assert len(set(colours)) == n_groups  # every group its own colour
        for g in plan.groups(dim):
            assert len({colours[r] for r in g}) == 1
    view.select(511)
    assert "75-79" in view.details.value and "[504, 505, 506, 507, 508, 509, 510, 511]" in view.details.value


def test_generation_layout_beside_the_training_one():
    from rlkit.plan.hybrid import GenerationLayout

    plan = ParallelPlan(dp=2, tp=4, pp=2)
    lay = GenerationLayout(plan, tp=2)  # k = 2: training tp ranks 0,1 -> gen shard 0; groups strided
    view = PlanView(plan, rollout_tp=2)
    assert [v for _, v in view.dim_buttons.options] == ["dp", "tp", "pp", "gen"]
    view.dim_buttons.value = "gen"
    engine = {r: i for i, g in enumerate(lay.generation_groups()) for r in g}
    for a, b in itertools.combinations(range(plan.world_size), 2):
        assert (view.color_of(a) == view.color_of(b)) == (engine[a] == engine[b]), (a, b)
    assert view.color_of(0) == view.color_of(2) != view.color_of(1)  # engine 0 is ranks [0, 2]
    assert "8 generation groups of 2" in view.legend.value
    # rank 5: dp 1, tp 1, pp 0 -> generation group 1 + 4 * dp = 5, shard 0, micro-DP group of 4
    assert lay.coords(5) == {"dp": 1, "group": 1, "gen_tp": 0}
    tip = view.cells[5].tooltip
    assert "generation group #5: [5, 7]" in tip and "gen_tp (generation shard): 0 of 2" in tip
    assert "micro-DP group: [4, 5, 12, 13]" in tip
    view.cells[5].click()
    assert "generation group #5" in view.details.value and "[4, 5, 12, 13]" in view.details.value
    view.dim = "tp"  # the training dims still work
    _assert_colours_follow_groups(plan, view.color_of, "tp")
    # the HTML fallback: cells coloured by generation group, the layout in the hover text
    text = plan_html(plan, dim="gen", rollout_tp=2)
    cells = re.findall(r"<td title=\"([^\"]*)\" style='[^']*background:([^']*)'>(\d+)</td>", text)
    colour = {int(r): bg for _, bg, r in cells}
    for g in lay.generation_groups():
        assert len({colour[r] for r in g}) == 1
    assert len(set(colour.values())) == 8 and "8 generation groups of 2 (rollout tp=2)" in text
    assert "cells coloured by <b>generation</b> group" in text
    with pytest.raises(PlanError, match="dim='gen' .* pass rollout_tp=t_g"):
        PlanView(plan, dim="gen")
    with pytest.raises(PlanError, match=r"Rollout\(tp=3\)"):
        plan_html(plan, rollout_tp=3)


# ---- static fallbacks ------------------------------------------------------------------------------
def test_html_fallback_has_every_rank_coloured_by_group():
    plan = ParallelPlan(**BIG)
    text = plan._repr_html_()
    cells = re.findall(r"<td title=\"([^\"]*)\" style='[^']*background:([^']*)'>(\d+)</td>", text)
    assert sorted(int(r) for _, _, r in cells) == list(range(512))
    colour = {int(r): bg for _, bg, r in cells}
    for g in plan.groups("tp"):
        assert len({colour[r] for r in g}) == 1
    assert len(set(colour.values())) == 64
    assert "64 TP groups of 8 · 32 PP groups of 16 · 128 DP groups of 4" in text
    small = ParallelPlan(dp=2, tp=2, pp=2)
    _assert_colours_follow_groups(small, dict(
        (int(r), bg) for _, bg, r in re.findall(r"<td title=\"([^\"]*)\" style='[^']*background:([^']*)'>(\d+)</td>",
                                                plan_html(small, dim="pp"))).get, "pp")
    bundle = plan._repr_mimebundle_()
    assert {"text/plain", "text/html", "application/vnd.jupyter.widget-view+json"} <= set(bundle)


def test_memory_bars_collapse_identical_ranks_and_draw_device_line():
    plan = ParallelPlan(**BIG)
    df = estimate_memory(plan, "llama-3-70b", seq_len=4096, device_memory="40GB")
    kinds = collapse_ranks(df)
    # 1F1B keeps pp - stage micro-batches in flight, so ranks differ by pipeline stage only:
    # one kind per stage, the 32 ranks of stage s being s*32 .. s*32+31 in Megatron order
    assert kinds["ranks"].tolist() == [f"{32 * s}-{32 * s + 31}" for s in range(16)]
    assert kinds["count"].tolist() == [32] * 16
    fig = memory_figure(df)
    ax = fig.axes[0]
    assert len(ax.get_xticklabels()) == 16
    tops: dict[int, float] = {}
    for patch in ax.patches:  # stacked segments: the top of each bar is the rank's total
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert [tops[i] for i in range(16)] == pytest.approx((kinds["total"] / GIB).tolist(), rel=1e-9)
    line = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert line and line[0].get_ydata()[0] == pytest.approx(40e9 / GIB)
    assert sum("✗" in t.get_text() for t in ax.texts) == int((~kinds["fits"]).sum()) > 0
    small = estimate_memory(ParallelPlan(dp=2, tp=2, pp=2), "qwen2.5-7b", device_memory="80GB")
    png = memory_png(small)
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert figure_html(memory_figure(small)).startswith("<img src='data:image/png;base64,iVBORw0KGgo")


def test_plot_timeline_draws_every_op():
    import matplotlib.pyplot as plt

    df = pipeline_timeline(4, 8, "interleaved-1f1b", vpp=2)
    ax = plot_timeline(df)  # no ax: a new pyplot figure, closed below (later tests count pyplot's figures)
    assert len(ax.patches) == len(df) and "bubble 15.8%" in ax.get_title()
    plt.close(ax.figure)


def test_plot_plans():
    import matplotlib.pyplot as plt

    df = search_plans("qwen2.5-7b", gpus=8)
    ax = plot_plans(df)
    assert sum(len(c.get_offsets()) for c in ax.collections) == int(df.valid.sum())
    plt.close(ax.figure)


def test_timeline_png_and_widget_controls_redraw():
    df = pipeline_timeline(4, 8, "1f1b")
    fig = timeline_figure(df)
    assert "27.3%" in fig.axes[0].get_title()  # (p-1)/(m+p-1) = 3/11
    assert timeline_png(df).startswith(PNG_MAGIC)
    view = TimelineView(ParallelPlan(pp=4, micro_batches=8))
    first = bytes(view.image.value)
    assert first.startswith(PNG_MAGIC) and f"{bubble_fraction(4, 8):.1%}" in view.status.value
    view.micro_batches.value = 16
    assert f"{bubble_fraction(4, 16):.1%}" in view.status.value and bytes(view.image.value) != first
    view.schedule.value = "interleaved-1f1b"  # drawn with vpp=2
    assert "vpp=2" in view.status.value and f"{bubble_fraction(4, 16, vpp=2):.1%}" in view.status.value
    view.micro_batches.value = 6  # interleaved needs a multiple of pp: the error shows, no exception
    assert "micro_batches divisible by pp=4" in view.status.value


# ---- CLI -------------------------------------------------------------------------------------------
def test_cli_512_gpu_example_prints_groups_table_and_bubble(capsys):
    rc = main(["--model", "llama-3-70b", "--dp", "4", "--tp", "8", "--pp", "16", "--devices-per-node", "8",
               "--gpu-memory", "80GB"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("512 ranks", "TP: 64 groups of 8", "PP: 32 groups of 16", "DP: 128 groups of 4",
                 "[0, 8, 16, 24]", "of 512", "75-79", f"bubble {bubble_fraction(16, 16):.1%}"):
        assert text in out, text
    memory = out.split("Memory per rank in GiB")[1].split("Pipeline:")[0].splitlines()
    assert [line.split()[0] for line in memory[2:18]] == [f"{32 * s}-{32 * s + 31}" for s in range(16)]
    assert len(out.splitlines()) < 80  # the rank table is abbreviated


def test_cli_bad_plan_exits_2_with_one_line(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
              "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "rlkit.plan.cli", "--model", str(tmp_path), "--tp", "3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "tp=3 does not divide num_attention_heads=8" in lines[0] and "{1, 2, 4, 8}" in lines[0]


def test_cli_bad_memory_size_exits_2(capsys):
    assert main(["--model", "qwen2.5-7b", "--tp", "2", "--gpu-memory", "80XB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "80XB" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_plan_layer_imports_no_view_libraries():
    # the views are lazy delegates: the plan math must stay importable without ipywidgets/matplotlib/torch
    code = ("import sys, rlkit.plan; rlkit.plan.ParallelPlan(dp=2).groups('dp'); "
            "print(sorted(m for m in ('ipywidgets', 'matplotlib', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_plan_layer_never_imports_a_higher_layer_or_private_names():
    # rlkit.plan sits below everything but rlkit's bottom helpers: its views come through rlkit.display;
    # and modules of plan/ and widgets/ use only each other's public names
    import ast

    above = ("rlkit.widgets", "rlkit.workers", "rlkit.trainer", "rlkit.cluster", "rlkit.parallel", "rlkit.rollout")
    for path in sorted((ROOT / "rlkit" / "plan").glob("*.py")) + sorted((ROOT / "rlkit" / "widgets").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlkit"):
                modules, names = [node.module], [a.name for a in node.names]
            else:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if path.parent.name == "plan":
                assert not any(m.startswith(above) for m in modules), where
            assert not any(n.startswith("_") for n in names), where
