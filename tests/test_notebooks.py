"""The notebooks and tutorials run top to bottom in a real kernel (nbval): the plan views, GRPO on a real
local Ray, GRPO on the real SmolLM2-135M-Instruct (shortened to 2 steps by its parameter;
tests/test_real_model.py holds the full run's gain), and every tutorial in tutorials/, whose last cell
asserts what the run measured against rlkit's prediction."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


NOTEBOOKS = sorted(p.relative_to(ROOT).as_posix() for folder in ("notebooks", "tutorials")
                   for p in (ROOT / folder).glob("[0-9]*.ipynb"))


def test_the_notebooks_are_all_here():
    names = [Path(n).stem for n in NOTEBOOKS]
    assert {"01_parallel_plan", "02_grpo", "03_real_model"} <= set(names)
    tutorials = [Path(n).stem for n in NOTEBOOKS if n.startswith("tutorials/")]
    # 01 .. 11: 08 is agentic RL (multi-turn episodes with a tool), 09 asynchronous RL, 10 the training backends,
    # 11 expert parallelism and routing replay
    assert [t[:2] for t in tutorials] == [f"{i:02d}" for i in range(1, 12)], tutorials


# tests/test_browser.py runs these with run-all in JupyterLab and fails on any cell error: where it can
# run (a chromium is installed), running them here too would only double their time in the suite
IN_THE_BROWSER = {"notebooks/01_parallel_plan.ipynb", "notebooks/02_grpo.ipynb", "tutorials/01_data_parallel.ipynb"}


def _here() -> list[str]:
    """The notebooks this file runs: all but those the browser test runs, where it can run (under make test,
    always: RLKIT_REQUIRE_BROWSER). Notebook 02 runs there at its default length, where it checks the rise."""
    from test_browser import _chromium

    return [n for n in NOTEBOOKS if n not in IN_THE_BROWSER or _chromium() is None]


# The notebooks run two at a time, each in its own kernel with its own Ray: much of one notebook's time is
# waiting (a kernel, Ray and its workers starting, processes joining), which the other one fills.
# RLKIT_NOTEBOOK_PARALLEL=1 runs them one by one.
PARALLEL = int(os.environ.get("RLKIT_NOTEBOOK_PARALLEL", "2"))


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", str(ROOT / name), "-p", "no:cacheprovider",
                           "-q", "-o", "addopts="], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, RLKIT_NOTEBOOK_STEPS="2"))


@pytest.fixture(scope="module")
def started():
    """Every notebook of this file, started ``PARALLEL`` at a time (the real-model notebook, the longest,
    first): name -> its future."""
    names = sorted(_here(), key=lambda n: not n.startswith("notebooks/"))
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        futures = {name: pool.submit(_run, name) for name in names}
        yield futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("name", _here())
def test_notebook_runs_top_to_bottom(name, started):
    cells = json.loads((ROOT / name).read_text())["cells"]
    assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code")  # committed without outputs
    proc = started[name].result(timeout=1800)   # the run itself is bounded at 900 s; this, its wait in line
    assert proc.returncode == 0, _first_failure(proc.stdout) + proc.stdout[-2000:] + proc.stderr[-2000:]


def _first_failure(out: str) -> str:
    """nbval's report of the first cell that failed (the later ones often fail only because it did)."""
    start = out.find("_ ", out.find("= FAILURES ="))
    return out[start:start + 4000] + "\n[...]\n" if start > 0 else ""
