"""Ctrl-C keeps what was trained, a second Ctrl-C aborts and says so, and a driver that dies frees its
workers: real SIGINTs sent to a real driver process (tests/_interrupt_driver.py), in-process and on Ray, and
a real `ray start` head whose CPUs must come back after the driver is killed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("_interrupt_driver.py")
ROOT = Path(__file__).resolve().parents[1]


def start_driver(args: list[str], log: Path) -> subprocess.Popen:
    """tests/_interrupt_driver.py with ``args`` in this Python (also used by tests/test_vllm.py)."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(DRIVER), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True)


def wait_for(what: str, check, bound_s: float = 180.0) -> None:
    """A bounded wait against a hang (not a timing check): fails naming what it waited for."""
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {bound_s:.0f} s for {what}")
        time.sleep(0.1)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def driver_result(proc: subprocess.Popen, log: Path) -> dict:
    out, _ = proc.communicate(timeout=300)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{out[-2000:]}\n{log.read_text()[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("where", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_ctrl_c_stops_fit_at_a_step_and_the_trainer_goes_on(tmp_path, where):
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    proc = start_driver(["once", str(run_dir), where], log)
    try:
        wait_for("3 logged steps", lambda: steps_logged(run_dir) >= 3 or proc.poll() is not None)
        proc.send_signal(signal.SIGINT)  # what Jupyter's "interrupt kernel" and a terminal's Ctrl-C send
        res = driver_result(proc, log)
    finally:
        proc.kill()
    n = res["stopped_at"]
    assert 3 <= n < 500 and res["first_rows"] == n  # stopped early, each completed step kept
    assert res["steps"] == list(range(1, n + 3)) and res["step"] == n + 2  # fit went on from step n
    assert res["file_steps"] == list(range(1, n + 3))  # one history: no step twice, none missing
    assert "stopping at the end of this step" in log.read_text()
    assert res["engine_gap"] < 1e-4  # the engine samples what the actor scores after the interrupted run


def test_a_second_ctrl_c_aborts_at_once_and_says_the_trainer_must_be_rebuilt(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    marker = run_dir / "in_reward"
    proc = start_driver(["twice", str(run_dir)], log)
    try:
        wait_for("the slow reward of step 2", lambda: marker.exists() or proc.poll() is not None)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # the reward sleeps 5 s: both signals land in it
        proc.send_signal(signal.SIGINT)
        res = driver_result(proc, log)
    finally:
        proc.kill()
    assert res["aborted"], res
    assert "aborted by a second Ctrl-C in step 2" in res["message"] and "Trainer.load" in res["message"]
    assert "this Trainer was closed" in res["later"]
    assert res["step"] == 1 and res["file_steps"] == [1]  # step 1 kept, the aborted step 2 not logged


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FreeCPUs:
    """A second driver on the head that reports its free CPUs twice a second (one connection, not one per
    reading: a new driver takes ~10 s to connect on a busy 2-core machine)."""

    CODE = ("import sys, time, ray; ray.init(address=sys.argv[1], logging_level='ERROR')\n"
            "while True:\n    print(ray.available_resources().get('CPU', 0.0), flush=True); time.sleep(0.5)")

    def __init__(self, address: str, env: dict):
        import threading

        self.last = -1.0
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, address], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.last = float(line)
            except ValueError:
                pass

    def close(self) -> None:
        self.proc.kill()


@pytest.mark.ray
def test_a_killed_driver_frees_its_workers_on_a_real_head(tmp_path):
    """A notebook kernel that dies (restart, crash, kill -9) must not leave its workers holding a
    cluster's devices: Ray ends the actors and placement groups a driver owned. Bound: 60 s."""
    import shutil

    from test_cluster import _kill_session

    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}
    if not (Path.home() / ".ray" / "auth_token").exists() and "RAY_AUTH_TOKEN" not in env:
        subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rlki", dir="/tmp")  # short: Ray's unix socket paths are <= 107 bytes
    head = subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                             "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats", "--block",
                             f"--temp-dir={temp_dir}"], env=env, start_new_session=True,
                            stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    driver = free = None
    try:
        wait_for("the head's port", lambda: _can_connect(port) or head.poll() is not None, 60)
        assert head.poll() is None, (tmp_path / "head.log").read_text()[-2000:]
        free = FreeCPUs(address, env)
        wait_for("2 free CPUs on the new head", lambda: free.last == 2.0, 120)
        driver = subprocess.Popen([sys.executable, str(DRIVER), "die", str(tmp_path / "run"), address], cwd=ROOT,
                                  env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                  stderr=open(tmp_path / "driver.log", "w"), text=True)
        ready = driver.stdout.readline()
        assert ready.startswith("READY"), (tmp_path / "driver.log").read_text()[-3000:]
        wait_for("the driver's ranks to show as busy", lambda: free.last == 0.0, 30)  # its 2 ranks hold both CPUs
        driver.kill()  # SIGKILL: no Python handler, no atexit: the kernel just dies
        driver.wait(30)
        t0 = time.monotonic()
        wait_for("the dead driver's 2 CPUs to come back", lambda: free.last == 2.0, 60)
        print(f"the dead driver's 2 CPUs were free again {time.monotonic() - t0:.1f} s after the kill")
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if free is not None:
            free.close()
        _kill_session(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _can_connect(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
