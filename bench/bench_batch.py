"""The typed Batch's operations, against the same data as a plain dict and (when tensordict is installed) as a
tensordict ``@tensorclass``: the measurement behind rlkit.batch's choice of a dataclass of its own.

    .venv/bin/python bench/bench_batch.py                       # Batch and dict
    python -m venv /tmp/td && /tmp/td/bin/pip install torch==2.13.0 tensordict && \\
        PYTHONPATH=. /tmp/td/bin/python bench/bench_batch.py     # also @tensorclass

64 samples x 128 columns (P = 64, R = 64), 9 tensor fields and 2 list fields, the shapes of one step of
the tiny-model loop. Each operation is timed over 2,000 calls, best of 5 rounds, in microseconds.
"""

from __future__ import annotations

import functools
import pickle
import time

import torch

from rlkit.batch import Batch, cat, split, take

B, P, R = 64, 64, 64

try:  # the same fields as a tensordict @tensorclass (at module level: pickle finds it by name)
    from tensordict import tensorclass

    @tensorclass(nocast=True)
    class TC:
        input_ids: torch.Tensor
        attention_mask: torch.Tensor
        response_mask: torch.Tensor
        rollout_logprobs: torch.Tensor
        policy_version: torch.Tensor
        ref_logprobs: torch.Tensor
        old_logprobs: torch.Tensor
        advantages: torch.Tensor
        returns: torch.Tensor
        uid: list
        completion: list
except ImportError:
    TC = None


def _fields() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    t = {"input_ids": torch.randint(0, 100, (B, P + R), generator=g), "attention_mask": torch.ones(B, P + R, dtype=torch.long),
         "response_mask": torch.ones(B, R), "rollout_logprobs": torch.randn(B, R, generator=g),
         "policy_version": torch.zeros(B, dtype=torch.long), "ref_logprobs": torch.randn(B, R, generator=g),
         "old_logprobs": torch.randn(B, R, generator=g), "advantages": torch.randn(B, R, generator=g),
         "returns": torch.randn(B, R, generator=g)}
    return t, {"uid": [i // 4 for i in range(B)], "completion": [f"sample {i}" for i in range(B)]}


def _time(fn, calls: int = 2000, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    tensors, lists = _fields()
    cases = {"Batch": Batch(**tensors, **lists), "dict": {**tensors, **lists}}
    if TC is not None:
        cases["@tensorclass"] = TC(**tensors, **lists, batch_size=[B])
    else:
        print("(tensordict is not installed here: its column is left out)")
    index = list(range(0, B, 4))
    ops = {
        "split in 4": lambda b: split(b, 4) if not hasattr(b, "batch_size") else b.split(B // 4),
        "take 16 rows": lambda b: take(b, index) if not hasattr(b, "batch_size") else b[torch.tensor(index)],
        "cat 4 parts": None,
        "pickle round trip": lambda b: pickle.loads(pickle.dumps(b)),
        "read a field": lambda b: b["advantages"] if isinstance(b, dict) else b.advantages,
    }
    print(f"| operation | {' | '.join(cases)} |")
    print("|---|" + "---:|" * len(cases))
    for name, op in ops.items():
        cells = []
        for b in cases.values():
            if name == "cat 4 parts":
                parts = ops["split in 4"](b)
                join = torch.cat if hasattr(b, "batch_size") else cat
                args = (parts,)
            else:
                join, args = op, (b,)
            cells.append(f"{_time(functools.partial(join, *args), calls=200 if 'pickle' in name else 2000):.1f}")
        print(f"| {name} (us) | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
