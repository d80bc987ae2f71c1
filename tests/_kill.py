"""A worker killed mid-run, for the tests of how a run reports it: ``fit_until_killed`` SIGKILLs one worker
process after a step and returns the ``WorkerError`` the run stops with and the call it names."""

from __future__ import annotations

import os
import re
import signal

import pytest

from rlkit.errors import WorkerError


def fit_until_killed(trainer, group, after_step: int = 1, steps: int = 4) -> tuple[WorkerError, str]:
    """Fit ``trainer`` with rank 0 of ``group`` killed at the end of step ``after_step``; the error and the
    call (phase) it died in."""
    victim = group.apply(lambda w: os.getpid())[0]

    def kill(_trainer, row):
        if row["step"] == after_step:
            os.kill(victim, signal.SIGKILL)

    trainer.callbacks.append(kill)
    with pytest.raises(WorkerError, match=r"worker process died during '(\w+)'") as info:
        trainer.fit(steps=steps, view="none")
    return info.value, re.search(r"died during '(\w+)'", str(info.value)).group(1)
