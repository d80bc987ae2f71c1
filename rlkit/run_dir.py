"""The run folder: what a training run leaves on disk beside its checkpoints.

``config.json`` (what the run was made from), ``metrics.jsonl`` (one line per step: always the trainer's
own history, rewritten atomically, so a crash never leaves half a line), ``metrics.rolled_back.jsonl``
(rows a run logged after the checkpoint it was resumed from, kept aside instead of repeating step
numbers) and the plots (``reward.png``, ``dashboard.png``). Every write goes through ``rlkit.atomic``.

>>> import tempfile
>>> run = RunDir(tempfile.mkdtemp())
>>> run.write_metrics([{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.7}])
>>> run.roll_back(to_step=1, rows=[{"step": 1, "reward/mean": 0.5}])
>>> [r["step"] for r in run.read_metrics()], [r["step"] for r in run.read_metrics(rolled_back=True)]
([1], [2])
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlkit import atomic

METRICS, ROLLED_BACK, CONFIG = "metrics.jsonl", "metrics.rolled_back.jsonl", "config.json"


class RunDir:
    """A run's folder (created on the first write)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write_config(self, state: dict[str, Any]) -> None:
        """``config.json``: the run's model, algorithm, plan, rollout and config."""
        atomic.write_text(self.path / CONFIG, json.dumps(state, indent=2, default=str))

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """``metrics.jsonl`` := ``rows``, one JSON object a line (the whole history, atomically)."""
        atomic.write_text(self.path / METRICS, "".join(json.dumps(r) + "\n" for r in rows))

    def read_metrics(self, rolled_back: bool = False) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` (or of the rolled-back file); a torn line of an older rlkit's
        append is skipped."""
        path = self.path / (ROLLED_BACK if rolled_back else METRICS)
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
        return rows

    def roll_back(self, to_step: int, rows: list[dict[str, Any]]) -> None:
        """One truthful history on resume: ``metrics.jsonl`` becomes ``rows`` (the checkpoint's, up to
        ``to_step``); rows the earlier run logged after it move to ``metrics.rolled_back.jsonl``."""
        later = [r for r in self.read_metrics() if r.get("step", 0) > to_step]
        if later:
            kept = self.read_metrics(rolled_back=True)
            atomic.write_text(self.path / ROLLED_BACK, "".join(json.dumps(r) + "\n" for r in kept + later))
        self.write_metrics(rows)

    def save_plots(self, rows: list[dict[str, Any]]) -> list[str]:
        """``reward.png`` and ``dashboard.png`` of ``rows``; the paths written."""
        from rlkit.widgets.live import save_plots

        return save_plots(rows, self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"


__all__ = ["RunDir"]
