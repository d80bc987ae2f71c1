"""How an object shows itself when the code that draws it lives in a higher layer.

``rlkit.plan`` is pure math and may not import ``rlkit.widgets``, yet a ``ParallelPlan`` as the last
line of a notebook cell should show the rank-grid widget. So the plan asks this registry for its view,
and the widgets layer registers which function draws it (``rlkit/widgets/__init__.py``, imported by
``rlkit/__init__.py``, so before any plan object exists). A view is registered by names only, the
type's ``"module.Class"`` and the function's ``"module:function"``: nothing is imported until a view
is asked for, so ``import rlkit.plan`` never loads ipywidgets or matplotlib.

>>> register("fractions.Fraction", "text", "builtins:str")
>>> from fractions import Fraction
>>> view(Fraction(1, 3), "text"), view(Fraction(1, 3), "html")   # no "html" view registered: None
('1/3', None)
"""

from __future__ import annotations

import importlib
from typing import Any

# (type as "module.Class", kind) -> the function that draws it, as "module:function"
_VIEWS: dict[tuple[str, str], str] = {}


def register(type_name: str, kind: str, target: str) -> None:
    """Draw the ``kind`` view (e.g. "widget", "html", "mimebundle") of objects of type ``type_name``
    (``"module.Class"``, subclasses included) with ``target`` (``"module:function"``), called as
    ``function(obj, **kwargs)``. Registering again replaces the earlier target.

    >>> register("fractions.Fraction", "text", "builtins:repr")
    >>> from fractions import Fraction
    >>> view(Fraction(1, 3), "text")
    'Fraction(1, 3)'
    """
    if ":" not in target:
        raise ValueError(f"target={target!r} must name a function as 'module:function'")
    _VIEWS[(type_name, kind)] = target


def view(obj: Any, kind: str, **kwargs: Any) -> Any:
    """The ``kind`` view of ``obj`` drawn by the function registered for its type (or the nearest
    base class), its module imported now; None when no view of that kind is registered.

    >>> view(3, "widget") is None
    True
    """
    for cls in type(obj).__mro__:
        target = _VIEWS.get((f"{cls.__module__}.{cls.__qualname__}", kind))
        if target is not None:
            module, _, name = target.partition(":")
            return getattr(importlib.import_module(module), name)(obj, **kwargs)
    return None
