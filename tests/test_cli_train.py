"""`rlkit train`: bad configs end in exit 2 and one clean line (no traceback); a real short run works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def train_error(capsys, *argv: str) -> str:
    """Run `rlkit train ARGV` in this process; assert exit 2 and return its single stderr line."""
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlkit train: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.json"
    path.write_text(text)
    return str(path)


def test_unknown_config_key(tmp_path, capsys):
    err = train_error(capsys, "--config", write(tmp_path, json.dumps({"steps": 3, "stepz": 3})))
    assert "unknown config keys ['stepz']" in err and "'steps'" in err  # names the key and the known ones


@pytest.mark.parametrize("text, expect", [
    ('{"steps": 3,', "Expecting property name"),          # invalid JSON
    ("[1, 2]", "holds a JSON list"),                      # valid JSON, not an object
    ('{"dp": "two"}', "config key 'dp' is 'two'; it must be a JSON integer"),
    ('{"model": 5}', "config key 'model' is 5; it must be a JSON string"),
])
def test_bad_config_file(tmp_path, capsys, text, expect):
    path = write(tmp_path, text)
    err = train_error(capsys, "--config", path)
    assert path in err or "config key" in err
    assert expect in err


def test_missing_config_file(tmp_path, capsys):
    err = train_error(capsys, "--config", str(tmp_path / "nope.json"))
    assert "cannot read --config" in err and "nope.json" in err


def test_unknown_task_names_it_and_the_choices(capsys):
    err = train_error(capsys, "--task", "nope")
    assert "task='nope'" in err and "['arithmetic', 'chat-arithmetic', 'repeat']" in err


def test_bad_plan_value(capsys, tmp_path):
    # a config value the plan rejects: still one line, naming the value
    err = train_error(capsys, "--config", write(tmp_path, '{"dp": 0}'))
    assert "dp=0" in err


def test_exit_code_of_the_real_command(tmp_path):
    """The same through `python -m rlkit`: the process's exit status is 2 and stderr is one line."""
    bad = write(tmp_path, json.dumps({"stepz": 3}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "rlkit", "train", "--config", bad], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "'stepz'" in proc.stderr


def test_real_short_run(tmp_path):
    """3 GRPO steps of the default tiny model on the repeat task (~25 s: Ray start + model load)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "rlkit", "train", "--dp", "1", "--steps", "3", "--n", "4", "--max-new-tokens", "8",
           "--prompts-per-step", "4", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["step", "reward/mean"]))
    rows = [line.split() for line in lines[header + 1:] if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(0.0 <= float(r[1]) <= 1.0 for r in rows)  # the repeat task's reward is in [0, 1]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["response_length/mean"] <= 8 for m in metrics)  # max_new_tokens reached the rollout
    assert f"run directory: {run_dir}" in proc.stdout
