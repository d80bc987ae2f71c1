"""Resume keeps one truthful metrics history: save, more steps, a crash, load -> each step once in
metrics.jsonl, the steps after the checkpoint being the resumed run's; nothing half-written."""

from __future__ import annotations

import json
import math

import pytest

import rlkit
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

pytestmark = pytest.mark.ray


class Crash(RuntimeError):
    """The simulated crash (a callback raising mid-run)."""


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (isinstance(v, float) and math.isnan(v) and math.isnan(b[k])) or v == b[k] for k, v in a.items())


@pytest.mark.timeout(300)
def test_resume_after_a_crash_keeps_each_step_once(tmp_path, ray_cluster):
    run = tmp_path / "run"
    tr = Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, plan=rlkit.ParallelPlan(),
                 rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2, run_dir=str(run),
                 cluster=ray_cluster)
    try:
        tr.fit(steps=2, view="none")
        ckpt = tr.save(tmp_path / "ckpt")

        def crash_at_4(trainer, row):
            if row["step"] == 4:
                raise Crash("simulated crash after step 4")

        tr.callbacks = [crash_at_4]
        with pytest.raises(Crash):
            tr.fit(steps=3, view="none")
        crashed = _rows(run / "metrics.jsonl")
        assert [r["step"] for r in crashed] == [1, 2, 3, 4]  # the lost steps 3, 4 were logged
    finally:
        tr.close()

    resumed = Trainer.load(ckpt, dataset=rlkit.tasks.repeat, cluster=ray_cluster)
    try:
        assert resumed.run_dir == run and resumed.step == 2
        # rolled back to the checkpoint at once (a crash now would leave a truthful file too)
        assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2]
        resumed.fit(steps=2, view="none")
        rows = _rows(run / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each step exactly once, in order
        assert all(_same(a, b) for a, b in zip(rows[:2], crashed[:2]))  # before the checkpoint: as logged
        now = resumed.metrics.to_dict("records")
        assert all(_same(a, b) for a, b in zip(rows, now))  # the file is the trainer's history
        # after the checkpoint: the resumed run's rows (its own timings), not the crashed run's
        assert [r["timing/step"] for r in rows[2:]] == [r["timing/step"] for r in now[2:]]
        assert [r["timing/step"] for r in rows[2:]] != [r["timing/step"] for r in crashed[2:]]
        # the crashed run's later rows are kept aside, not mixed in
        assert [r["step"] for r in _rows(run / "metrics.rolled_back.jsonl")] == [3, 4]
        assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]  # no half-written temp files
    finally:
        resumed.close()
