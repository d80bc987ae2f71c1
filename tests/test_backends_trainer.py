"""Trainer.save -> Trainer.load -> fit on the Megatron-Core and DeepSpeed backends: the resumed run equals the
uninterrupted one exactly (same rewards, losses and grad norms), and every Trainer of the process gets a fresh
world (one rank, in-process: each Trainer's close destroys its torch.distributed world, and the libraries' own
cached groups of the old world are dropped, not reused). DeepSpeed runs ZeRO-3, which replaces
torch.nn.functional.linear process-wide while it trains: each close puts torch's back."""

from __future__ import annotations

import pytest
import torch
from _require import need_module

import rlkit

torch.set_num_threads(1)
COLS = ["reward/mean", "actor/loss", "actor/grad_norm"]
TORCH_LINEAR = torch.nn.functional.linear  # taken at collection, before any test of the suite ran a backend


@pytest.mark.parametrize("backend", ["megatron", rlkit.Backend("deepspeed", zero_stage=3)], ids=["megatron", "deepspeed"])
def test_save_load_resumes_exactly_and_a_second_trainer_gets_a_fresh_world(tmp_path, backend):
    name = backend if isinstance(backend, str) else backend.name
    need_module("megatron.core" if name == "megatron" else "deepspeed", "RLKIT_REQUIRE_BACKENDS")
    kw = dict(rollout=rlkit.Rollout(engine="hf", n=4, max_new_tokens=8), prompts_per_step=4, lr=2e-3, seed=0,
              padding_free=False, backend=backend)
    first = rlkit.Trainer(model=rlkit.models.tiny_lm("qwen2", size="small"), dataset=rlkit.tasks.repeat,
                          run_dir=str(tmp_path / "a"), **kw)
    try:
        first.fit(steps=2, view="none")
        first.save(tmp_path / "ckpt")
        uninterrupted = first.fit(steps=2, view="none")[COLS].to_numpy()[-2:]
        # ZeRO-3 patched it in this process (what the close below must undo); the others never touch it
        assert (torch.nn.functional.linear is not TORCH_LINEAR) == (name == "deepspeed")
    finally:
        first.close()
    assert torch.nn.functional.linear is TORCH_LINEAR
    resumed = rlkit.Trainer.load(tmp_path / "ckpt", rlkit.tasks.repeat, run_dir=str(tmp_path / "b"))
    try:
        assert resumed.config.backend.name == name
        again = resumed.fit(steps=2, view="none")[COLS].to_numpy()[-2:]
    finally:
        resumed.close()
    assert torch.nn.functional.linear is TORCH_LINEAR
    assert (again == uninterrupted).all(), (again, uninterrupted)
