"""Views of a ParallelPlan: the rank grid and the pipeline timeline.

Each view comes twice: an ipywidgets widget for Jupyter, and a static fallback that renders where no
widget frontend runs (nbconvert, GitHub, a plain REPL): an HTML table with inline styles for the grid,
a PNG for the timeline (the figures, memory per device among them, live in ``rlkit.widgets.figures``).
No custom JavaScript and nothing from a CDN: the machines this runs on are often offline.

>>> from rlkit.plan import ParallelPlan
>>> from rlkit.widgets.plan_view import PlanView, plan_html
>>> plan = ParallelPlan(dp=2, tp=2, pp=2)
>>> view = PlanView(plan, dim="tp")          # what `plan` shows as the last line of a cell
>>> view.color_of(0) == view.color_of(1)     # ranks 0 and 1 share a TP group
True
>>> "title=" in plan_html(plan)              # the HTML fallback carries hover text too
True
>>> gen = PlanView(plan, rollout_tp=1, dim="gen")   # the 3D-HybridEngine's generation groups
>>> gen.color_of(0) == gen.color_of(1)      # t_g = 1: every rank is its own engine
False
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as W
from ipywidgets.widgets.widget_string import HTMLStyle

from rlkit.errors import PlanError
from rlkit.plan.topology import DIMS, SCHEDULES, ranges_str, short_list
from rlkit.widgets.figures import timeline_png

if TYPE_CHECKING:
    from rlkit.plan.topology import ParallelPlan

# What each dimension splits and what it costs: shown next to the grid, because that is the lesson.
DIM_HELP = {
    "tp": "Tensor parallel: the ranks of a group split every layer's weight matrices and all-reduce "
          "activations twice per layer, so a TP group should sit inside one node.",
    "pp": "Pipeline parallel: the ranks of a group each hold a slice of the layers (a stage) and pass "
          "activations to the next stage; micro-batches keep the stages busy.",
    "dp": "Data parallel: the ranks of a group hold the same layers and see different data; they "
          "average gradients once per step (and shard weights/optimizer state with FSDP).",
    "ep": "Expert parallel (mixture of experts): the ranks of a group are DP ranks that share one copy of the "
          "experts, a slice of them each, and send every token to its experts' ranks and back by all-to-all "
          "twice per MoE layer; the other DP ranks hold further copies and average the experts' gradients.",
    "node": "Where the ranks run: ranks of one colour share a node (a machine). TP groups should not span two "
            "nodes (their all-reduces would cross the network twice a layer); DP and PP groups may.",
    "gen": "Generation (3D-HybridEngine): the same ranks generate with tensor parallel t_g and no pipeline; "
           "each group is one engine on a share of its DP replica's prompts, and before generating the "
           "ranks holding the same generation shard (a micro-DP group) gather it from their training shards.",
}
GEN = "gen"  # the generation-layout pseudo dimension (needs rollout_tp)
NODE = "node"  # the node each rank landed on (needs placed=: a running worker group)
EP = "ep"  # expert-parallel groups (plans with ep > 1), cut out of DP
# Wider than a node in the grid view is hard to read: wrap a node over several rows past this.
MAX_COLUMNS = 16


def group_color(index: int) -> str:
    """A CSS colour for group ``index``: golden-angle hue steps keep neighbours far apart and every
    index distinct (a fixed palette would repeat at 128 DP groups); light, so black text stays readable.

    >>> group_color(0), group_color(1)
    ('hsl(0.0, 70%, 78%)', 'hsl(137.5, 70%, 66%)')
    """
    hue = (index * 137.508) % 360.0
    light = (78, 66, 88)[index % 3]
    return f"hsl({hue:.1f}, 70%, {light}%)"


# ---- what we know about each rank (shared by the widget, the HTML and the tooltips) ------------------
class _RankFacts:
    """Everything the grid shows, computed once per plan: O(world_size), fast for 512 ranks."""

    def __init__(self, plan: ParallelPlan, model: Any = None, devices_per_node: int | None = None,
                 cluster: Any = None, rollout_tp: int | None = None, placed: Any = None) -> None:
        self.plan = plan
        self.per = int(devices_per_node or getattr(cluster, "devices_per_node", None) or plan.devices_per_node
                       or plan.world_size)
        self.n = plan.world_size
        self.coords = [plan.coords(r) for r in range(self.n)]
        # rank -> index of its group along each dim, and the groups themselves
        self.groups: dict[str, list[list[int]]] = {}
        self.group_index: dict[str, list[int]] = {}
        for dim in DIMS:
            groups = plan.groups(dim)
            index = [0] * self.n
            for i, g in enumerate(groups):
                for r in g:
                    index[r] = i
            self.groups[dim], self.group_index[dim] = groups, index
        if plan.ep > 1:
            self.groups[EP] = plan.expert_groups()
            index = [0] * self.n
            for i, g in enumerate(self.groups[EP]):
                for r in g:
                    index[r] = i
            self.group_index[EP] = index
        self.placed = _placed_nodes(placed, plan)  # rank -> the node id it runs on (None: not placed)
        if self.placed is not None:
            order = list(dict.fromkeys(self.placed))  # nodes in order of their first rank
            self.groups[NODE] = [[r for r in range(self.n) if self.placed[r] == nd] for nd in order]
            self.group_index[NODE] = [order.index(nd) for nd in self.placed]
        self.layout = None
        if rollout_tp is not None:
            from rlkit.plan.hybrid import GenerationLayout

            self.layout = GenerationLayout(plan, tp=rollout_tp)
            if model is not None:
                self.layout.validate(model)
            self.groups[GEN] = self.layout.generation_groups()
            self.gen = [self.layout.coords(r) for r in range(self.n)]
            self.micro = self.layout.micro_dp_groups()
            self.micro_index = [0] * self.n
            index = [0] * self.n
            for i, g in enumerate(self.groups[GEN]):
                for r in g:
                    index[r] = i
            for i, g in enumerate(self.micro):
                for r in g:
                    self.micro_index[r] = i
            self.group_index[GEN] = index
        self.model_name, self.stage_layers = None, None
        if model is not None:
            from rlkit.plan.spec import as_spec

            spec = as_spec(model)
            self.model_name = spec.name
            # layers per pipeline rank, computed once per pp rank rather than once per rank
            self.stage_layers = [ranges_str(plan.layers_of_rank(plan.rank(pp=p), spec.num_layers))
                                 for p in range(plan.pp)]

    def node(self, rank: int) -> tuple[int, int]:
        return rank // self.per, rank % self.per

    def rows(self) -> list[tuple[str, list[int]]]:
        """(label, ranks) per grid row: one node per row, wrapped at ``MAX_COLUMNS`` devices."""
        cols = _grid_columns(self.per)
        out = []
        for start in range(0, self.n, cols):
            node, local = self.node(start)
            ranks = list(range(start, min(start + cols, (node + 1) * self.per, self.n)))
            label = f"node {node}" if local == 0 else f"  …{local}"
            out.append((label, ranks))
        return out

    @property
    def dims(self) -> tuple[str, ...]:
        return (DIMS + ((EP,) if EP in self.groups else ()) + ((GEN,) if self.layout is not None else ())
                + ((NODE,) if NODE in self.groups else ()))

    def size(self, dim: str) -> int:
        if dim == NODE:
            return max(len(g) for g in self.groups[NODE])
        return self.layout.tp if dim == GEN else self.plan.ep if dim == EP else self.plan.size(dim)

    def summary(self) -> list[str]:
        """'64 TP groups of 8' for each dim (and the generation groups with a rollout tp)."""
        out = [f"{len(self.groups[d])} {d.upper()} groups of {self.plan.size(d)}" for d in ("tp", "pp", "dp")]
        if EP in self.groups:
            out.append(f"{len(self.groups[EP])} EP groups of {self.plan.ep} ({self.plan.expert_dp} copies of the experts)")
        if self.layout is not None:
            out.append(f"{len(self.groups[GEN])} generation groups of {self.layout.tp} (rollout tp={self.layout.tp})")
        if NODE in self.groups:
            out.append(f"running on {len(self.groups[NODE])} node(s)")
        return out

    def _gen_lines(self, rank: int) -> list[tuple[str, str]]:
        """(label, value) of a rank's place in the generation layout."""
        if self.layout is None:
            return []
        g = self.gen[rank]
        return [(f"generation group #{self.group_index[GEN][rank]}", short_list(self._members(rank, GEN))),
                ("gen_tp (generation shard)", f"{g['gen_tp']} of {self.layout.tp}"),
                ("micro-DP group", short_list(self.micro[self.micro_index[rank]]))]

    def tooltip(self, rank: int) -> str:
        c = self.coords[rank]
        node, local = self.node(rank)
        lines = [f"rank {rank} · node {node}, device {local}", f"dp={c['dp']} tp={c['tp']} pp={c['pp']}"]
        if self.stage_layers is not None:
            lines.append(f"layers {self.stage_layers[c['pp']]} (stage {c['pp']})")
        for d in ("tp", "pp", "dp") + ((EP,) if EP in self.groups else ()):
            lines.append(f"{d.upper()} group: {short_list(self._members(rank, d))}")
        lines += [f"{k}: {v}" for k, v in self._gen_lines(rank)]
        if self.placed is not None:
            lines.append(f"runs on node {self.placed[rank][:8]}")
        return "\n".join(lines)

    def details_html(self, rank: int) -> str:
        c = self.coords[rank]
        node, local = self.node(rank)
        rows = [("rank", str(rank)), ("node / local device", f"{node} / {local}"),
                ("coordinates", f"dp={c['dp']}, tp={c['tp']}, pp={c['pp']}")]
        if self.stage_layers is not None:
            rows.append((f"layers of {html.escape(self.model_name or 'model')}",
                         f"{self.stage_layers[c['pp']]} (pipeline stage {c['pp']})"))
        for d in ("tp", "pp", "dp") + ((EP,) if EP in self.groups else ()):
            rows.append((f"{d.upper()} group #{self.group_index[d][rank]}", short_list(self._members(rank, d))))
        rows += self._gen_lines(rank)
        if self.placed is not None:
            rows.append(("runs on node", f"{self.placed[rank][:8]} (with ranks {short_list(self._members(rank, NODE))})"))
        body = "".join(f"<tr><td style='padding:1px 8px 1px 0;color:#555'>{k}</td><td>{v}</td></tr>"
                       for k, v in rows)
        return f"<table style='font-size:12px'>{body}</table>"

    def _members(self, rank: int, dim: str) -> list[int]:
        return self.groups[dim][self.group_index[dim][rank]]


def _placed_nodes(placed: Any, plan: ParallelPlan) -> list[str] | None:
    """Rank -> node id from ``placed``: a running worker group (its ``nodes``), anything with a ``group`` (a
    Trainer), or a list of node ids, one per rank."""
    if placed is None:
        return None
    nodes = getattr(getattr(placed, "group", None), "nodes", None) or getattr(placed, "nodes", None) or placed
    if not isinstance(nodes, (list, tuple)) or len(nodes) != plan.world_size:
        raise PlanError(f"placed={placed!r} must be a running worker group of this plan (trainer.group), a Trainer, "
                        f"or a list of {plan.world_size} node ids, one per rank")
    return [str(n) for n in nodes]


def _grid_columns(per: int) -> int:
    """Cells per row: a whole node when it fits, else the largest divisor of the node <= MAX_COLUMNS."""
    if per <= MAX_COLUMNS:
        return per
    return max((d for d in range(8, MAX_COLUMNS + 1) if per % d == 0), default=MAX_COLUMNS)


def _check_view_dim(dim: str, facts: _RankFacts | None = None) -> None:
    if dim == GEN and (facts is None or facts.layout is None):
        raise PlanError("dim='gen' colours ranks by generation group and needs the rollout tensor parallel "
                        "size: pass rollout_tp=t_g, e.g. PlanView(plan, rollout_tp=2, dim='gen')")
    if dim == EP and (facts is None or EP not in facts.groups):
        raise PlanError("dim='ep' colours ranks by expert-parallel group, which a plan has with ep > 1 (a mixture of "
                        "experts): e.g. ParallelPlan(dp=4, ep=2)")
    if dim == NODE and (facts is None or NODE not in facts.groups):
        raise PlanError("dim='node' colours ranks by the node they run on, which a running group knows: pass "
                        "placed=trainer.group (or a WorkerGroup), e.g. plan.show(dim='node', placed=trainer.group)")
    if dim not in DIMS + (EP, GEN, NODE):
        ok = list(facts.dims) if facts is not None else list(DIMS)
        raise PlanError(f"dim={dim!r} is not a parallel dimension; choose one of {ok}")


def _dim_name(dim: str) -> str:
    return "generation" if dim == GEN else "node" if dim == NODE else dim.upper()


# ---- the rank grid: static HTML --------------------------------------------------------------------
def plan_html(plan: ParallelPlan, dim: str = "tp", model: Any = None, devices_per_node: int | None = None,
              cluster: Any = None, rollout_tp: int | None = None, placed: Any = None) -> str:
    """The rank grid as self-contained HTML (inline styles, hover text in ``title``): the fallback
    that renders without a widget frontend. With ``rollout_tp`` the hover text also gives each
    rank's generation group, shard (``gen_tp``) and micro-DP group, and ``dim="gen"`` colours the
    cells by generation group.

    >>> from rlkit.plan import ParallelPlan
    >>> html_text = plan_html(ParallelPlan(dp=2, tp=2, pp=2), dim="pp")
    >>> html_text.count("<td title=")
    8
    >>> "gen_tp (generation shard): 1 of 2" in plan_html(ParallelPlan(tp=2, pp=2), dim="gen", rollout_tp=2)
    True
    >>> "2 EP groups of 2 (2 copies of the experts)" in plan_html(ParallelPlan(dp=4, ep=2), dim="ep")
    True

    ``placed`` (a running worker group, e.g. ``trainer.group``, or one node id per rank): ``dim="node"``
    colours each rank by the node it runs on.

    >>> "runs on node bbbb" in plan_html(ParallelPlan(dp=2, tp=2), dim="node", placed=["aaaa"] * 2 + ["bbbb"] * 2)
    True
    """
    facts = _RankFacts(plan, model, devices_per_node, cluster, rollout_tp, placed)
    _check_view_dim(dim, facts)
    return _grid_html(facts, dim)


def _grid_html(facts: _RankFacts, dim: str) -> str:
    esc = html.escape
    cell = ("padding:2px 4px;min-width:26px;text-align:center;border:1px solid #fff;"
            "font:11px monospace;color:#111")
    out = [f"<div style='font-family:sans-serif;font-size:12px'><b>{esc(facts.plan.describe())}</b><br>"
           f"{' · '.join(facts.summary())}; cells coloured by <b>{_dim_name(dim)}</b> group "
           f"(same colour = same group; hover a cell for details)<br>"]
    for w in facts.plan.placement_warnings(facts.per):
        out.append(f"<span style='color:#b00'>⚠ {esc(w)}</span><br>")
    out.append("<table style='border-collapse:collapse;margin-top:4px'>")
    index = facts.group_index[dim]
    for label, ranks in facts.rows():
        out.append(f"<tr><td style='font:11px monospace;color:#555;padding-right:6px;white-space:pre'>"
                   f"{esc(label)}</td>")
        for r in ranks:
            out.append(f"<td title=\"{esc(facts.tooltip(r))}\" style='{cell};background:"
                       f"{group_color(index[r])}'>{r}</td>")
        out.append("</tr>")
    out.append("</table></div>")
    return "".join(out)


# ---- the rank grid: widget -------------------------------------------------------------------------
class PlanView(W.VBox):
    """The interactive rank grid: one cell per rank laid out as nodes x devices, coloured by its group
    along ``dim`` (toggle DP/TP/PP), hover a cell for details, click it for the details pane.

    Attributes: ``cells`` (one Button per rank), ``dim_buttons``, ``details``, ``dim`` (settable),
    ``color_of(rank)``, ``select(rank)``.

    ``rollout_tp=t_g`` adds the 3D-HybridEngine's generation layout (``rlkit.plan.hybrid.GenerationLayout``)
    beside the training one: a "Gen groups" toggle (``dim="gen"``) colours ranks by generation group,
    and hover text and details give each rank's generation group, ``gen_tp`` and micro-DP group.

    >>> from rlkit.plan import ParallelPlan
    >>> view = PlanView(ParallelPlan(dp=4, tp=8, pp=16, devices_per_node=8), model="llama-3-70b")
    >>> len(view.cells), view.dim
    (512, 'tp')
    >>> view.select(9); "layers" in view.details.value
    True
    """

    def __init__(self, plan: ParallelPlan, model: Any = None, dim: str = "tp",
                 devices_per_node: int | None = None, cluster: Any = None, rollout_tp: int | None = None,
                 placed: Any = None) -> None:
        self.plan = plan
        self.facts = facts = _RankFacts(plan, model, devices_per_node, cluster, rollout_tp, placed)
        _check_view_dim(dim, facts)
        # Every cell shares one Layout and each group one ButtonStyle, all passed in at construction
        # (a default style per Button costs ~1 ms each): a 512-rank grid builds in ~0.1 s, and
        # recolouring only re-points each cell at its group's style.
        cell_layout = W.Layout(width="46px", height="26px", margin="1px", padding="0")
        self._styles: dict[str, list[W.ButtonStyle]] = {}
        options = [("DP groups", "dp"), ("TP groups", "tp"), ("PP groups", "pp")]
        if EP in facts.groups:
            options.append(("EP groups", EP))
        if facts.layout is not None:
            options.append(("Gen groups", GEN))
        if NODE in facts.groups:
            options.append(("Nodes", NODE))
        self.dim_buttons = W.ToggleButtons(options=options, value=dim, tooltips=[DIM_HELP[d] for _, d in options],
                                           style=W.ToggleButtonsStyle(button_width="90px"))
        styles, index = self._group_styles(dim), facts.group_index[dim]
        self.cells = [W.Button(description=str(r), tooltip=facts.tooltip(r), layout=cell_layout,
                               style=styles[index[r]]) for r in range(facts.n)]
        for r, b in enumerate(self.cells):
            b.on_click(lambda _b, r=r: self.select(r))
        # rows keep their height (flex 0 0 auto): in the scrolling box they would otherwise shrink to slivers
        label_layout, label_style = W.Layout(width="62px", flex="0 0 auto"), HTMLStyle()
        row_layout = W.Layout(flex="0 0 auto")
        rows = [W.HBox([W.HTML(f"<pre style='margin:0;font-size:11px'>{label}</pre>", layout=label_layout,
                               style=label_style), *[self.cells[r] for r in ranks]], layout=row_layout)
                for label, ranks in facts.rows()]
        grid = W.VBox(rows, layout=W.Layout(max_height="440px", overflow="auto"))
        warn = "".join(f"<div style='color:#b00'>⚠ {html.escape(w)}</div>"
                       for w in plan.placement_warnings(facts.per))
        header = W.HTML(f"<b>{html.escape(plan.describe())}</b><br>{' · '.join(facts.summary())}{warn}")
        self.legend = W.HTML()
        self.details = W.HTML("<i>click a rank for its details</i>")
        self.selected: int | None = None
        self.dim_buttons.observe(lambda change: self._recolor(change["new"]), names="value")
        self._recolor(dim)
        super().__init__([header, self.dim_buttons, self.legend,
                          W.HBox([grid, self.details], layout=W.Layout(align_items="flex-start"))])

    @property
    def dim(self) -> str:
        return self.dim_buttons.value

    @dim.setter
    def dim(self, value: str) -> None:
        _check_view_dim(value, self.facts)
        self.dim_buttons.value = value  # the observer recolours

    def color_of(self, rank: int) -> str:
        """The CSS colour of a rank's cell: its group's colour along the selected dim."""
        return self.cells[rank].style.button_color

    def select(self, rank: int) -> None:
        """Show a rank's details in the pane (what a click on its cell does)."""
        self.selected = rank
        self.details.value = self.facts.details_html(rank)

    def _group_styles(self, dim: str) -> list[W.ButtonStyle]:
        if dim not in self._styles:
            self._styles[dim] = [W.ButtonStyle(button_color=group_color(i))
                                 for i in range(len(self.facts.groups[dim]))]
        return self._styles[dim]

    def _recolor(self, dim: str) -> None:
        styles, index = self._group_styles(dim), self.facts.group_index[dim]
        for r, b in enumerate(self.cells):
            if b.style is not styles[index[r]]:
                b.style = styles[index[r]]
        what = f"{len(styles)} node(s)" if dim == NODE else f"{len(styles)} {_dim_name(dim)} groups of {self.facts.size(dim)}"
        self.legend.value = f"<span style='font-size:12px'>{what}. {html.escape(DIM_HELP[dim])}</span>"


def plan_mimebundle(plan: ParallelPlan, **kw: Any) -> dict[str, Any]:
    """What Jupyter shows for a plan: the widget, plus HTML and text fallbacks in the same bundle so a
    frontend without widgets (or a saved notebook) still shows the grid."""
    bundle: dict[str, Any] = {"text/plain": repr(plan), "text/html": plan_html(plan, **kw)}
    widget_bundle = PlanView(plan, **kw)._repr_mimebundle_() or {}
    widget_bundle.pop("text/plain", None)
    return {**bundle, **widget_bundle}


# ---- pipeline timeline -----------------------------------------------------------------------------
class TimelineView(W.VBox):
    """The pipeline timeline with controls that redraw it: schedule (gpipe / 1f1b / interleaved-1f1b)
    and a micro-batches slider. ``timeline(pp, micro_batches, schedule=, vpp=)`` makes the DataFrame
    (default ``rlkit.plan.schedule.pipeline_timeline``). A combination the schedule does not allow
    shows the PlanError's message instead of a picture.

    >>> from rlkit.plan import ParallelPlan
    >>> view = TimelineView(ParallelPlan(pp=4, micro_batches=8))
    >>> view.schedule.value = "gpipe"; view.status.value
    'gpipe, pp=4, 8 micro-batches: bubble 27.3%'
    """

    def __init__(self, plan: ParallelPlan, timeline: Any = None, max_micro_batches: int = 32) -> None:
        from rlkit.plan.schedule import pipeline_timeline

        self.timeline = timeline or pipeline_timeline
        if plan.pp < 2:
            raise PlanError(f"pp={plan.pp}: there is no pipeline to draw; use a plan with pp>=2")
        self.plan = plan
        self.schedule = W.ToggleButtons(options=list(SCHEDULES), value=plan.pipeline_schedule)
        self.micro_batches = W.IntSlider(value=plan.n_micro_batches, min=1, description="micro-batches",
                                         max=max(max_micro_batches, plan.n_micro_batches),
                                         continuous_update=False)
        self.image, self.status = W.Image(format="png"), W.HTML()
        self.schedule.observe(self.redraw, names="value")
        self.micro_batches.observe(self.redraw, names="value")
        super().__init__([W.HBox([self.schedule, self.micro_batches]), self.status, self.image])
        self.redraw()

    def redraw(self, _change: Any = None) -> None:
        from rlkit.plan.schedule import idle_fraction

        schedule, m = self.schedule.value, self.micro_batches.value
        # interleaved 1F1B needs virtual stages: show it with 2 per rank when the plan has none
        vpp = max(self.plan.vpp, 2) if schedule == "interleaved-1f1b" else 1
        try:
            plan = self.plan.with_(schedule=schedule, micro_batches=m, vpp=vpp)
            df = self.timeline(plan.pp, plan.n_micro_batches, schedule=plan.pipeline_schedule, vpp=plan.vpp)
        except (PlanError, ValueError) as e:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(e))}</span>"
            return
        self.status.value = (f"{schedule}, pp={plan.pp}" + (f", vpp={vpp}" if vpp > 1 else "")
                             + f", {m} micro-batches: bubble {idle_fraction(df):.1%}")
        self.image.value = timeline_png(df)
