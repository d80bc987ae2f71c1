"""This machine's roofline: matmul FLOP/s at the shapes SmolLM2-135M computes, and memory bandwidth (issue 43).

    .venv/bin/python bench/roofline.py                 # all of torch's threads (2 here)
    .venv/bin/python bench/roofline.py --threads 1

Matmuls: ``x (M, K) @ w (K, N)`` in fp32 and bf16, at SmolLM2-135M's projections (hidden 576, MLP 1536,
vocab 49152) for a training micro-batch of ``--tokens`` tokens and for one decode step of ``--batch``
sequences. Each shape runs ``--repeat`` times after a warm-up; the table has the median's GFLOP/s
(``2 M K N / t``). The peak is the best shape: the roof the phases of a step are held against.

Memory: a copy of a ``--mib`` tensor (read + write), a sum over it (read), and the same sizes once per
dtype. GB/s counts the bytes the operation must move.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

HIDDEN, MLP, VOCAB, KV = 576, 1536, 49152, 192  # SmolLM2-135M: 9 heads x 64, 3 KV heads x 64


def shapes(tokens: int, batch: int) -> list[tuple[str, int, int, int]]:
    """(what, M, K, N) per projection, for a training micro-batch and for one decode step."""
    out = []
    for phase, m in (("train", tokens), ("decode", batch)):
        out += [(f"{phase}: q / o proj", m, HIDDEN, HIDDEN), (f"{phase}: k / v proj", m, HIDDEN, KV),
                (f"{phase}: MLP up / gate", m, HIDDEN, MLP), (f"{phase}: MLP down", m, MLP, HIDDEN),
                (f"{phase}: vocab head", m, HIDDEN, VOCAB)]
    return out


def timed(fn, repeat: int) -> float:
    """The median of ``repeat`` timed calls after two warm-ups, in seconds."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_table(tokens: int, batch: int, repeat: int) -> pd.DataFrame:
    rows = []
    for what, m, k, n in shapes(tokens, batch):
        row = {"shape": what, "M x K x N": f"{m} x {k} x {n}"}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            t = timed(lambda x=x, w=w: x @ w, repeat)
            row[f"{str(dtype).split('.')[-1]} GFLOP/s"] = 2 * m * k * n / t / 1e9
        rows.append(row)
    return pd.DataFrame(rows)


def memory_table(mib: int, repeat: int) -> pd.DataFrame:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(mib * 2**20 // dtype.itemsize, dtype=dtype)
        b = torch.empty_like(a)
        copy = timed(lambda a=a, b=b: b.copy_(a), repeat)
        total = timed(lambda a=a: a.sum(), repeat)
        rows.append({"dtype": str(dtype).split(".")[-1], "MiB": mib, "copy GB/s (read + write)": 2 * a.nbytes / copy / 1e9,
                     "sum GB/s (read)": a.nbytes / total / 1e9})
    return pd.DataFrame(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of a training micro-batch")
    p.add_argument("--batch", type=int, default=32, help="sequences of a decode step")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    mm = matmul_table(a.tokens, a.batch, a.repeat)
    print(mm.round(1).to_string(index=False))
    for col in ("float32 GFLOP/s", "bfloat16 GFLOP/s"):
        best = mm.loc[mm[col].idxmax()]
        print(f"peak {col.split()[0]}: {best[col]:.1f} GFLOP/s ({best['shape']})")
    mem = memory_table(a.mib, a.repeat)
    print(mem.round(2).to_string(index=False))


if __name__ == "__main__":
    main()
