"""Quiet workers: fit in a terminal script shows no progress bars, no Ray log-dedup banner and no token-auth
notice. The same holds in a real notebook kernel, where worker errors still come through: checked by
tests/test_resources.py's kernel test, which starts Ray, builds a Trainer and fits there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

NOISE = ("%|", "Loading weights", "RAY_DEDUP_LOGS", "Token authentication", "it/s]")

FIT = """
import rlkit
cluster = rlkit.Cluster(num_cpus=2)
trainer = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat,
                        plan=rlkit.ParallelPlan(dp=2), rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                        prompts_per_step=2, run_dir="run", cluster=cluster)
print("ROWS", len(trainer.fit(steps=2, view="none")))
"""


def assert_quiet(stderr: str) -> None:
    """No progress bar, weight-loading bar, Ray log-dedup banner or token-auth notice in ``stderr``. The
    notebook-kernel half: tests/test_resources.py, whose kernel starts Ray, builds a Trainer and fits."""
    assert "\r" not in stderr, repr(stderr[-2000:])
    for noise in NOISE:
        assert noise not in stderr, (noise, stderr[-2000:])


SCRIPT = FIT.replace('run_dir="run"', 'run_dir=sys.argv[1]').replace("import rlkit", "import sys\nimport rlkit") + """
trainer.close()
cluster.shutdown()
"""


@pytest.mark.timeout(300)
def test_fit_in_a_terminal_script_has_no_progress_bars(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROWS 2" in proc.stdout
    assert_quiet(proc.stderr)
    assert_quiet(proc.stdout)
