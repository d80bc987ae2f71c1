"""The S3 round trip of a checkpoint (issue 44): a SmolLM2-135M-Instruct trainer saved to an S3-compatible server on
127.0.0.1 (moto's server mode, a process of its own) and loaded back, beside the same save and load on local disk.

    .venv/bin/python bench/bench_remote.py                  # SmolLM2-135M after one GRPO step (~3 min here)
    .venv/bin/python bench/bench_remote.py --model tiny     # a smoke run on the tiny Qwen2

Rows: ``save``/``load`` end to end (rlkit's calls, local and s3://; the s3 save stages the local save then uploads,
the s3 load downloads then loads locally), and the transfers alone (``rlkit.remote.upload`` of the saved folder,
``rlkit.remote.downloaded_version``), whose bytes / seconds is the MB/s column. moto keeps objects in memory and is
no network: the transfers measure rlkit + s3fs + HTTP on loopback, an upper bound of what a real store gives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto's server did not start")


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name of rlkit.models.pretrained, or 'tiny'")
    ap.add_argument("--steps", type=int, default=1, help="GRPO steps before the save (the optimizer state is saved)")
    args = ap.parse_args()

    proc, endpoint = start_moto()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    import fsspec
    import torch

    import rlkit
    from rlkit import remote
    from rlkit.models import pretrained, tiny_lm

    torch.set_num_threads(2)
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
    url, work = "s3://bench/run", Path(tempfile.mkdtemp(prefix="rlkit-bench-remote-"))
    model = tiny_lm("qwen2", size="test") if args.model == "tiny" else pretrained(args.model)
    rows: list[tuple[str, int, float]] = []
    try:
        tr = rlkit.Trainer(model=model, dataset=rlkit.tasks.repeat, prompts_per_step=2,
                           rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), run_dir=str(work / "run"))
        try:
            tr.fit(steps=args.steps, view="none")
            t = time.perf_counter()
            local = Path(tr.save(work / "ckpt"))
            rows.append(("save, local disk", size(local), time.perf_counter() - t))
            t = time.perf_counter()
            tr.save(url)
            rows.append(("save, s3:// (stage + upload)", size(local), time.perf_counter() - t))
            step = tr.step
        finally:
            tr.close()
        fs, root = remote.filesystem(url)
        t = time.perf_counter()
        remote.upload(local, fs, f"{root}/copy", sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                                                        if p.is_file()), "upload")
        rows.append(("upload alone", size(local), time.perf_counter() - t))
        t = time.perf_counter()
        with remote.downloaded_version(url) as down:
            rows.append(("download alone", size(down), time.perf_counter() - t))
        for name, where in (("load, local disk", str(local)), ("load, s3:// (download + load)", url)):
            t = time.perf_counter()
            back = rlkit.Trainer.load(where, dataset=rlkit.tasks.repeat)
            rows.append((name, size(local), time.perf_counter() - t))
            assert back.step == step, (back.step, step)
            back.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.model}, checkpoint after {args.steps} step(s) (weights + Adam state + trainer state), "
          f"moto server on 127.0.0.1")
    print(f"| {'what':<30} | {'bytes':>13} | {'seconds':>7} | {'MB/s':>6} |")
    print(f"|{'-' * 32}|{'-' * 15}|{'-' * 9}|{'-' * 8}|")
    for name, nbytes, secs in rows:
        print(f"| {name:<30} | {nbytes:>13,} | {secs:>7.2f} | {nbytes / secs / 1e6:>6.0f} |")


if __name__ == "__main__":
    main()
