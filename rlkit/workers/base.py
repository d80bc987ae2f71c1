"""The one dispatch protocol of a worker group, shared by the Ray ``WorkerGroup`` and the in-process
``LocalWorkerGroup``.

A group hosts one worker object per rank of a plan and runs its methods:

    call(m, ...)        every rank; a list of results in rank order
    call_rank0(m, ...)  rank 0 only; its result
    call_dp(m, batch)   the batch split by DP rank (TP and PP ranks of a DP group get the same chunk);
                        results from the last pipeline stage's tp=0 rank of each DP group, joined in DP
                        order, padding removed
    apply(fn, ...)      fn(worker, ...) on every rank (handy in notebooks)

``m`` is a method name, or the method itself (``RLWorker.update_actor``): then an editor's
go-to-definition leads from the call to the code that runs. Each has an ``*_async`` variant returning a
future with ``done()`` and ``result(timeout)``. A subclass implements the four ``*_async`` methods,
``shutdown`` and ``_where``; everything else is here.

>>> method_name(BaseWorkerGroup.call), method_name("update_actor")
('call', 'update_actor')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlkit.batch import cat, is_batch_like, rows, truncate
from rlkit.errors import WorkerError


def method_name(method: str | Callable[..., Any]) -> str:
    """The name a worker method is called by: the string itself, or the function's ``__name__``."""
    if isinstance(method, str):
        return method
    name = getattr(method, "__name__", None)
    if not callable(method) or not name or name == "<lambda>":
        raise TypeError(f"{method!r} is not a worker method: pass its name or the method (e.g. "
                        f"RLWorker.update_actor); run a function on the workers with group.apply(fn, ...)")
    return name


def bound_method(obj: Any, name: str) -> Callable[..., Any]:
    """``obj``'s method ``name``, or an AttributeError listing the methods it has.

    >>> bound_method([], "append")([1]) is None
    True
    """
    fn = getattr(obj, name, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{type(obj).__name__} has no method {name!r}; "
                             f"methods: {[m for m in dir(obj) if not m.startswith('_')]}")
    return fn


def join_dp_results(parts: list, padded_size: int, n: int) -> Any:
    """``call_dp``'s result from one value per DP rank: per-sample results (one row per row of the
    rank's chunk of a ``padded_size`` batch) joined in DP order and cut back to the ``n`` real rows;
    anything else (a scalar loss, a dict of stats) as the list of the ranks' values.

    >>> join_dp_results([[1, 2], [3, 4]], padded_size=4, n=3), join_dp_results([0.5, 0.7], 4, 4)
    ([1, 2, 3], [0.5, 0.7])
    """
    per_dp = padded_size // len(parts)
    if all(is_batch_like(p) and rows(p) == per_dp for p in parts):
        return truncate(cat(parts), n)
    return parts


class BaseWorkerGroup:
    """The dispatch surface and lifecycle both worker groups share (see the module docstring).

    Subclasses set ``plan``, ``name``, ``world_size``, ``info`` (one dict per rank: ip, node_id, pid) and
    ``_owner`` (a weak reference or None), and implement ``call_async``, ``call_rank0_async``,
    ``call_dp_async``, ``apply_async``, ``shutdown`` and ``_where``.
    """

    plan: Any
    name: str
    world_size: int
    info: list[dict[str, Any]]
    _owner: Any = None
    _closed: bool = False
    _broken: str | None = None
    _lost: bool = False  # torn down because a rank's process died (WorkerError.lost)

    # ---- implemented by subclasses -------------------------------------------------------------
    def call_async(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def call_rank0_async(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def call_dp_async(self, method: str | Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def apply_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def shutdown(self, polite: bool = True, timeout_s: float = 10) -> None:
        raise NotImplementedError

    def _where(self) -> str:
        """How ``repr`` says where the workers run."""
        raise NotImplementedError

    def ship_code(self, obj: Any) -> None:
        """Make sure the ranks can unpickle ``obj`` (a function or class sent in a call's arguments).
        Workers in this process share its modules: nothing to do."""

    # ---- the blocking forms ----------------------------------------------------------------------
    def call(self, method: str | Callable[..., Any], *args: Any, timeout: float | None = None,
             **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank; results in rank order."""
        return self.call_async(method, *args, **kwargs).result(timeout)

    def call_rank0(self, method: str | Callable[..., Any], *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> Any:
        """``method`` on rank 0 only (the others are not called: no collectives inside it)."""
        return self.call_rank0_async(method, *args, **kwargs).result(timeout)

    def call_dp(self, method: str | Callable[..., Any], batch: Any, *args: Any, timeout: float | None = None,
                **kwargs: Any) -> Any:
        """``method(chunk, *args, **kwargs)`` with ``batch`` split by DP rank; see ``call_dp_async``."""
        return self.call_dp_async(method, batch, *args, **kwargs).result(timeout)

    def apply(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(worker, *args, **kwargs)`` on every rank, ``worker`` being that rank's object."""
        return self.apply_async(fn, *args, **kwargs).result(timeout)

    # ---- state and lifecycle ---------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken:
            raise WorkerError(f"this group was torn down: {self._broken}; make a new {type(self).__name__}",
                              lost=self._lost)
        if self._closed:
            raise WorkerError(f"this group was shut down; make a new {type(self).__name__}")

    def owner_gone(self) -> bool:
        """True when this group was made for an owner object (a Trainer) that no longer exists."""
        return self._owner is not None and self._owner() is None

    def table(self):
        """One row per rank: rank, dp/tp/pp coordinates, node, ip, pid."""
        import pandas as pd

        return pd.DataFrame([{"rank": r, **self.plan.coords(r), "node": i["node_id"][:8], "ip": i["ip"],
                              "pid": i["pid"]} for r, i in enumerate(self.info)])

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "shut down" if self._closed else "running"
        return f"{type(self).__name__}({self.name!r}, {self.plan.describe()}, {state}{self._where()})"


__all__ = ["BaseWorkerGroup", "bound_method", "join_dp_results", "method_name"]
