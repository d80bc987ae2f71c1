"""The notebooks run top to bottom in a real kernel (nbval): the plan views, and GRPO on a real local Ray."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["01_parallel_plan", "02_grpo"])
def test_notebook_runs_top_to_bottom(name):
    nb = ROOT / "notebooks" / f"{name}.ipynb"
    cells = json.loads(nb.read_text())["cells"]
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")  # committed without outputs
    proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", str(nb), "-p", "no:cacheprovider",
                           "-q", "-o", "addopts="], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
