"""Ctrl-C that keeps what was trained: the first one asks a loop to stop at its next safe point, a second
one aborts at once.

Jupyter's "interrupt kernel" and a terminal's Ctrl-C both send SIGINT. Python turns it into a
``KeyboardInterrupt`` wherever the program happens to be: inside an optimizer step, a weight load, a
collective, leaving the model half-updated. Inside ``StopOnInterrupt`` the first SIGINT only sets
``requested`` (and says so); the loop checks it between steps, so the trainer keeps its weights and stays
usable. A second SIGINT while it winds down raises ``KeyboardInterrupt`` as usual.

>>> import os, signal
>>> with StopOnInterrupt(quiet=True) as stop:
...     os.kill(os.getpid(), signal.SIGINT)      # what Ctrl-C sends
...     stop.requested
True
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class StopOnInterrupt:
    """Within the block, the first SIGINT sets ``requested`` instead of raising; the next one raises
    ``KeyboardInterrupt``. Outside the main thread (where signals cannot be caught) it changes nothing.

    ``message``: what the first Ctrl-C prints (to stderr) unless ``quiet``.
    """

    def __init__(self, message: str = "rlkit: stopping at the end of this step (Ctrl-C again to abort now)",
                 quiet: bool = False):
        self.message, self.quiet = message, quiet
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if not self.quiet:
            print(self.message, file=sys.stderr, flush=True)

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


__all__ = ["StopOnInterrupt"]
