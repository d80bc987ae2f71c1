"""Views over objects from the layers below: plan grid, memory bars, pipeline timeline, live curves.

Importing this package is cheap: it only tells ``rlkit.display`` which function here draws each plan
object (by name; the view's module, and ipywidgets, load when one is first shown). ``rlkit/__init__.py``
imports it, so ``plan`` as a cell's last line shows the rank grid although ``rlkit.plan`` never imports
this layer.
"""

from rlkit import display

_PLAN = "rlkit.plan.topology.ParallelPlan"
display.register(_PLAN, "widget", "rlkit.widgets.plan_view:PlanView")            # plan.show()
display.register(_PLAN, "html", "rlkit.widgets.plan_view:plan_html")              # static fallback
display.register(_PLAN, "mimebundle", "rlkit.widgets.plan_view:plan_mimebundle")  # Jupyter: widget + HTML
