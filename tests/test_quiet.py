"""Quiet workers: fit in a real notebook kernel (and in a terminal script) shows no progress bars, no
Ray log-dedup banner and no token-auth notice, while worker output and errors still come through."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import test_resources  # tests/ is on sys.path under pytest

run_cell = test_resources.run_cell
kernel = test_resources.kernel  # the real-kernel fixture

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


def _assert_quiet(stderr: str) -> None:
    assert "\r" not in stderr, repr(stderr[-2000:])
    for noise in NOISE:
        assert noise not in stderr, (noise, stderr[-2000:])


@pytest.mark.timeout(400)
def test_fit_in_a_notebook_kernel_has_no_progress_bars_or_ray_banners(kernel):
    res = run_cell(kernel, FIT)
    assert not res["error"], res["error"]
    assert "ROWS 2" in res["stdout"]
    _assert_quiet(res["stderr"])
    # worker errors still arrive, with their traceback (Ray's forwarding of plain worker prints into a
    # kernel is asynchronous and was seen to miss a 60 s window in CI, so it is not asserted here)
    res = run_cell(kernel, "try:\n    trainer.group.call_rank0('no_such_method')\nexcept rlkit.WorkerError as e:\n"
                           "    print('CAUGHT', type(e).__name__, 'no_such_method' in str(e))")
    assert "CAUGHT WorkerError True" in res["stdout"], res


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
    _assert_quiet(proc.stderr)
    _assert_quiet(proc.stdout)
