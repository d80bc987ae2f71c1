"""An environment for the multi-turn tests: its messages, and so the episodes' shape, are the test's whatever
the model writes."""

from __future__ import annotations

from rlkit.agent import EnvStep


class Countdown:
    """The user counts down from the row's start, one number per assistant turn; each turn earns 0.25 and the
    episode ends at 0."""

    def reset(self, row):
        self.left = int(row["start"])
        return [{"role": "user", "content": f"count down from {self.left}"}]

    def step(self, message):
        self.left -= 1
        return EnvStep([{"role": "user", "content": str(self.left)}], done=self.left <= 0, reward=0.25)
