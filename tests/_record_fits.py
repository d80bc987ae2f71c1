"""Same-numbers check for refactors: record every metrics row the in-process Trainers of a pytest run log.

    PYTHONPATH=tests RLKIT_RECORD_FITS=/tmp/before.jsonl python -m pytest -p _record_fits tests/test_trainer.py ...
    (check out the refactor)
    PYTHONPATH=tests RLKIT_RECORD_FITS=/tmp/after.jsonl  python -m pytest -p _record_fits tests/test_trainer.py ...
    python tests/_record_fits.py /tmp/before.jsonl /tmp/after.jsonl

Each line is ``{"test": nodeid, "fit": k, "row": {...}}`` (the k-th Trainer made in that test). The
comparison leaves out what measures the machine, not the run (times, rates, memory, bytes moved by a sync
are kept: they are counted, not timed) and prints how many fits and values were compared and each one that
differs. Fits in subprocesses (notebooks, the CLI) are not seen.
"""

from __future__ import annotations

import json
import os
import re
import sys

_MACHINE = re.compile(r"(^timing/|seconds|per_s|^memory/|rss|_time$|^time/)")


def pytest_configure(config):
    out = os.environ.get("RLKIT_RECORD_FITS")
    if not out:
        return
    from rlkit.trainer import Trainer

    state = {"test": None, "trainers": {}}
    original = Trainer.update

    def update(self, batch):
        row = original(self, batch)
        fits = state["trainers"]
        k = fits.setdefault(id(self), len(fits))
        with open(out, "a") as f:
            f.write(json.dumps({"test": state["test"], "fit": k, "row": row}, default=str) + "\n")
        return row

    Trainer.update = update
    config._record_fits_state = state


def pytest_runtest_setup(item):
    state = getattr(item.config, "_record_fits_state", None)
    if state is not None:
        state["test"], state["trainers"] = item.nodeid, {}


def _load(path: str) -> dict[tuple, list[dict]]:
    fits: dict[tuple, list[dict]] = {}
    for line in open(path):
        rec = json.loads(line)
        fits.setdefault((rec["test"], rec["fit"]), []).append(rec["row"])
    return fits


def compare(before: str, after: str) -> int:
    a, b = _load(before), _load(after)
    fits = values = 0
    bad = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            bad.append(f"{key}: only in {'after' if key in b else 'before'}")
            continue
        ra, rb = a[key], b[key]
        if len(ra) != len(rb):
            bad.append(f"{key}: {len(ra)} rows before, {len(rb)} after")
            continue
        fits += 1
        for i, (x, y) in enumerate(zip(ra, rb)):
            keys = {k for k in set(x) | set(y) if not _MACHINE.search(k)}
            for k in sorted(keys):
                values += 1
                u, v = x.get(k), y.get(k)
                if u != v and not (isinstance(u, float) and isinstance(v, float) and u != u and v != v):  # NaN
                    bad.append(f"{key} row {i} {k}: {u!r} -> {v!r}")
    print(f"{fits} fits, {sum(len(v) for v in a.values())} rows, {values} values compared; {len(bad)} differ")
    for line in bad[:50]:
        print("  ", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(compare(sys.argv[1], sys.argv[2]))
