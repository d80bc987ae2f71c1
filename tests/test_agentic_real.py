"""Agentic RL on the real SmolLM2-135M-Instruct (slow: ~11 minutes on 2 idle CPU cores, +4 for the SFT warm start the first time; issue 24's proof).

bench/bench_agentic.py's recipe, replayed with its seed and step budget: the model gets 3-digit x 2-digit
products wrong on its own, a short SFT warm start teaches it the calculator's call format weakly, and GRPO
with the tool raises the held-out accuracy on top of it. The margins are half of what bench/README.md reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_agentic import RECIPE, proof_run  # noqa: E402

pytestmark = [pytest.mark.slow]

# measured by bench/bench_agentic.py (bench/README.md, "Agentic RL (multi-turn with tools)")
# (2026-12-05, seed 0, 12 GRPO steps, 32 held-out questions): 0/32 without the tool, 25/32 after SFT, 29/32 after RL
MEASURED = {"no_tool": 0.0, "sft": 0.781, "rl": 0.906}


@pytest.mark.timeout(3600)  # anti-hang only: ~11-15 min here (more on a busy machine)
def test_grpo_with_a_calculator_raises_held_out_accuracy_over_the_sft_warm_start():
    out = proof_run(RECIPE, zero_shot=False)
    no_tool, sft, rl = out["no_tool"], out["sft"], out["rl"]
    print({k: out[k] for k in ("no_tool", "sft", "rl", "seconds")})
    print(out["metrics"].to_string())
    assert no_tool["exact"] <= 0.1, no_tool  # the model cannot multiply these on its own
    gain = MEASURED["rl"] - MEASURED["sft"]
    assert rl["exact"] >= sft["exact"] + gain / 2, (sft, rl)  # RL on top of SFT: at least half the measured gain
    assert rl["episode/tool_calls"] >= sft["episode/tool_calls"], (sft, rl)  # by calling the tool more
    assert rl["episode/well_formed_calls"] >= 0.9, rl  # and calling it correctly
