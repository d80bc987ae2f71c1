"""Run N local ranks of ``python -m rlkit.parallel`` (or any module) on 127.0.0.1 with a hard timeout.

The ranks get the env torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): no
elastic agent to import, and every process is killed if the run overruns. For tests and benchmarks on
one machine; real jobs use torchrun or a Ray worker group.

The ranks are forked from one process that imported torch and the module's imports once (a fork
server): importing them is ~3.5 s of CPU per process here, most of a small run's cost. The fork happens
before any thread or process group exists; where the imports started a thread, each rank is a fresh
``python -m`` process instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
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
           module: str = "rlkit.parallel", fork: bool = True) -> Launch:
    """Run ``python -m <module> *args --json <tmp_path>/report.json`` on ``nprocs`` local ranks.

    Logs go to ``<tmp_path>/rank<i>.log``; the report is the JSON rank 0 wrote (None if none). ``fork``:
    the ranks forked from one process that imported once (default), else each a fresh ``python -m``.

    >>> res = launch(2, ["--dp", "2", "--model", "tiny-qwen2"], "/tmp/run")   # doctest: +SKIP
    >>> res.returncodes, res.report["max_dgrad"] < 1e-6                      # doctest: +SKIP
    ([0, 0], True)
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    out, codes_file = tmp_path / "report.json", tmp_path / "returncodes.json"
    codes_file.unlink(missing_ok=True)
    env = dict(os.environ, WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    argv = [*args, "--json", str(out)]
    logs = [tmp_path / f"rank{r}.log" for r in range(nprocs)]
    t0 = time.perf_counter()
    if fork:  # one server process; the ranks are its children, in its process group
        spec = tmp_path / "launch.json"
        spec.write_text(json.dumps({"nprocs": nprocs, "module": module, "argv": argv, "logs": [str(f) for f in logs],
                                    "codes": str(codes_file), "cwd": os.getcwd()}))
        with open(tmp_path / "launch.log", "w") as err:
            procs = [subprocess.Popen([sys.executable, "-m", "rlkit.parallel.launch", str(spec)], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)]
    else:
        procs = []
        for rank, log in enumerate(logs):
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=dict(env, **_rank_env(rank)),
                                              start_new_session=True, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:  # only the processes started here (and a server's ranks): by their process groups
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    if fork:
        codes = json.loads(codes_file.read_text()) if codes_file.exists() else [-signal.SIGKILL] * nprocs
    else:
        codes = [p.returncode for p in procs]
    texts = [f.read_text(errors="replace") if f.exists() else "" for f in logs]
    if fork and not any(texts):  # the server failed before any rank ran: its own traceback
        texts = [(tmp_path / "launch.log").read_text(errors="replace")] * nprocs
    report = json.loads(out.read_text()) if out.exists() else None
    return Launch(codes, report, texts, time.perf_counter() - t0)


def _rank_env(rank: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank)}


def _run_rank(spec: dict, rank: int) -> int:
    """In a forked rank: output to its log, its env, then the module as ``__main__``; the exit code."""
    fd = os.open(spec["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(_rank_env(rank))
    sys.argv = [spec["module"], *spec["argv"]]
    code: int = 0
    try:
        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _serve(spec_path: str) -> int:
    """The fork server: import once, fork the ranks (fresh processes where the imports started a
    thread), wait for them all, write their exit codes."""
    spec = json.loads(Path(spec_path).read_text())
    module = spec["module"]
    sys.path.insert(0, spec["cwd"])  # what ``python -m`` puts first
    import torch  # noqa: F401  (the cost the ranks share)

    try:  # the module's own imports, under its real name (its main runs only as __main__)
        found = importlib.util.find_spec(module)
        importlib.import_module(module + ".__main__" if found and found.submodule_search_locations else module)
    except BaseException:
        pass  # a rank imports it again and reports what failed
    forking = threading.active_count() == 1
    pids, procs = [], []
    for rank in range(spec["nprocs"]):
        if forking:
            pid = os.fork()
            if pid == 0:  # the rank: it never returns into this loop, whatever happens
                code = 1
                try:
                    code = _run_rank(spec, rank)
                finally:
                    os._exit(code)
            pids.append(pid)
        else:
            with open(spec["logs"][rank], "w") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", module, *spec["argv"]], stdout=log,
                                              stderr=subprocess.STDOUT, env=dict(os.environ, **_rank_env(rank))))
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids] + [p.wait() for p in procs]
    Path(spec["codes"]).write_text(json.dumps(codes))
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
