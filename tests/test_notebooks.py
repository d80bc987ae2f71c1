"""The notebooks run top to bottom in a real kernel (nbval): the plan views, GRPO on a real local Ray, and
GRPO on the real SmolLM2-135M-Instruct (shortened to 2 steps by its parameter; tests/test_real_model.py
holds the full run's gain)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["01_parallel_plan", "02_grpo", "03_real_model"])
def test_notebook_runs_top_to_bottom(name):
    nb = ROOT / "notebooks" / f"{name}.ipynb"
    cells = json.loads(nb.read_text())["cells"]
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")  # committed without outputs
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", str(nb), "-p", "no:cacheprovider",
                           "-q", "-o", "addopts="], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, RLKIT_NOTEBOOK_STEPS="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
