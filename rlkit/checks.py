"""Field checks for rlkit's config objects: each names the field, the bad value and the fix.

``TrainerConfig``, ``Rollout`` and ``RewardModel`` validate every field on construction with these, so
nonsense (``lr=-1``, ``lr=nan``, ``loss_agg="token_mean"``) fails in the cell that wrote it, before any
worker starts. Each takes the error class to raise, so a caller's own error type reaches the user.

>>> choice("loss_agg", "token_mean", ("token-mean", "seq-mean-token-mean"))
Traceback (most recent call last):
...
rlkit.errors.RlkitError: loss_agg='token_mean': choose one of ['token-mean', 'seq-mean-token-mean'] (did you mean 'token-mean'?)
>>> number("lr", float("nan"), gt=0)
Traceback (most recent call last):
...
rlkit.errors.RlkitError: lr=nan must be a finite number > 0
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

from rlkit.errors import RlkitError


def integer(name: str, value: Any, *, ge: int = 1, hint: str = "", error: type[Exception] = RlkitError,
            none_ok: bool = False) -> None:
    """``value`` is an int (not a bool) >= ``ge`` (or None when ``none_ok``)."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < ge:
        what = "a positive integer" if ge == 1 else f"an integer >= {ge}"
        raise error(f"{name}={value!r} must be {what}{' or None' if none_ok else ''}{_hint(hint)}")


def number(name: str, value: Any, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
           lt: float | None = None, hint: str = "", error: type[Exception] = RlkitError,
           none_ok: bool = False) -> None:
    """``value`` is a finite real number within the stated bounds (or None when ``none_ok``)."""
    if value is None and none_ok:
        return
    bounds = [f"{op} {v:g}" for op, v in ((">", gt), (">=", ge), ("<", lt), ("<=", le)) if v is not None]
    want = " and ".join(["a finite number " + bounds[0], *bounds[1:]]) if bounds else "a finite number"
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt) and (le is None or value <= le))
    if not ok:
        raise error(f"{name}={value!r} must be {want}{' or None' if none_ok else ''}{_hint(hint)}")


def boolean(name: str, value: Any, *, error: type[Exception] = RlkitError) -> None:
    """``value`` is True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise error(f"{name}={value!r} must be True or False")


def choice(name: str, value: Any, options: Sequence[Any], *, error: type[Exception] = RlkitError) -> None:
    """``value`` is one of ``options``; a near miss (a typo) is named."""
    if value in options:
        return
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
    raise error(f"{name}={value!r}: choose one of {list(options)}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def _hint(hint: str) -> str:
    return f"; {hint}" if hint else ""


__all__ = ["boolean", "choice", "integer", "number"]
