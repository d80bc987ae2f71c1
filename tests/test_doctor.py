"""`rlkit doctor` reports this machine correctly and fails clearly when something is broken."""

import subprocess
import sys


def test_doctor_reports_cpu_and_gloo():
    out = subprocess.run([sys.executable, "-m", "rlkit", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import torch

    for line in ("rlkit ", "torch ", "transformers ", "ray ", "vllm "):
        assert line in out.stdout
    assert "gloo          ok   available" in out.stdout
    if not torch.cuda.is_available():
        assert "CPU only" in out.stdout and "nccl" in out.stdout and "needs CUDA" in out.stdout


def test_doctor_fails_on_broken_dependency(tmp_path):
    # A real broken install: a 'ray' package that raises on import shadows the real one.
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('libfoo.so: cannot open shared object')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "rlkit", "doctor"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 1
    assert "ray           FAIL import failed: ImportError: libfoo.so" in out.stdout
    assert "broken: ray" in out.stderr and "make setup" in out.stderr
