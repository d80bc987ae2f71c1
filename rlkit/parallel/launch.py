"""Run N local ranks of ``python -m rlkit.parallel`` (or any module) on 127.0.0.1 with a hard timeout.

Plain subprocesses with the env torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK): no elastic agent to import, and every process is killed if the run overruns. For
tests and benchmarks on one machine; real jobs use torchrun or a Ray worker group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlkit.parallel.dist import free_port


@dataclass
class Launch:
    returncodes: list[int]
    report: dict | None
    logs: list[str]
    seconds: float

    def log(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{text[-3000:]}" for r, text in enumerate(self.logs))


def launch(nprocs: int, args: list[str], tmp_path: str | Path, timeout: float = 240.0,
           module: str = "rlkit.parallel") -> Launch:
    """Run ``python -m <module> *args --json <tmp_path>/report.json`` on ``nprocs`` local ranks.

    Logs go to ``<tmp_path>/rank<i>.log``; the report is the JSON rank 0 wrote (None if none).

    >>> res = launch(2, ["--dp", "2", "--model", "tiny-qwen2"], "/tmp/run")   # doctest: +SKIP
    >>> res.returncodes, res.report["max_dgrad"] < 1e-6                      # doctest: +SKIP
    ([0, 0], True)
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "report.json"
    port = free_port()
    procs, files = [], []
    t0 = time.perf_counter()
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
        f = open(tmp_path / f"rank{rank}.log", "w+")
        files.append(f)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args, "--json", str(out)],
                                      env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # only the processes started here, by handle
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = []
    for f in files:
        f.seek(0)
        logs.append(f.read())
        f.close()
    report = json.loads(out.read_text()) if out.exists() else None
    return Launch([p.returncode for p in procs], report, logs, time.perf_counter() - t0)
