"""Checkpoints that explain themselves: real checkpoints of a tiny in-process Trainer, damaged for real
(a file truncated, trainer.json cut in half, a shard deleted, another model's trainer.json or config
swapped in, a newer format), each failing with a CheckpointError that names the file and the fix, in the
driver before a worker starts where it can; and loading never changes a byte of the checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import settled_cpu_free, wait_cpu_free

import rlkit
from rlkit.errors import CheckpointError, RlkitError, WorkerError
from rlkit.models import tiny_lm
from rlkit.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECOPY = "Copy the checkpoint again from where trainer.save wrote it, or load an earlier checkpoint"


def _trainer(model: str, run_dir: Path) -> Trainer:
    return Trainer(model=model, dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                   prompts_per_step=2, run_dir=str(run_dir), lr=1e-2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoint A (tiny Qwen2 "test", one step) with its actor's weights, and checkpoint B of another
    model (tiny Llama "small": another architecture and other shapes)."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for name, model in (("a", tiny_lm("qwen2", size="test")), ("b", tiny_lm("llama", size="small"))):
        tr = _trainer(model, root / f"run_{name}")
        try:
            tr.fit(steps=1, view="none")
            out[name] = Path(tr.save(root / f"ckpt_{name}"))
            if name == "a":
                out["weights"] = {k: v.clone() for k, v in tr.workers.full_weights().items()}
        finally:
            tr.close()
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (hidden ones too), and the set of names."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a worker group starts: these checks belong in the driver, before any."""
    from rlkit.workers.rl_workers import RLWorkers

    def start(*a, **k):
        raise AssertionError("a worker group started before the checkpoint was checked")

    monkeypatch.setattr(RLWorkers, "start", classmethod(lambda cls, *a, **k: start()))


def test_save_records_format_version_and_model_config(saved):
    state = json.loads((saved["a"] / "trainer.json").read_text())
    assert state["format"] == 1 and state["rlkit_version"] == rlkit.__version__ == "0.1.0"
    config = json.loads((saved["a"] / "model_config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("qwen2", 64, 4)
    names = sorted(p.name for p in (saved["a"] / "actor").iterdir())
    assert names == [".metadata", "__0_0.distcp", "extra_rank0.pt", "layout.json"]
    assert json.loads((saved["a"] / "actor" / "layout.json").read_text())["world_size"] == 1  # the saving plan


def test_load_restores_the_weights_and_never_writes_into_the_checkpoint(saved, tmp_path):
    ckpt = _copy(saved["a"], tmp_path)
    before = _hashes(ckpt)
    tr = Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    try:
        assert tr.step == 1 and tr.metrics["step"].tolist() == [1]
        weights = tr.workers.full_weights()
        assert weights.keys() == saved["weights"].keys()
        assert all(torch.equal(weights[k], saved["weights"][k]) for k in weights)
    finally:
        tr.close()
    assert _hashes(ckpt) == before


def test_a_checkpoint_without_format_fields_still_loads(saved, tmp_path):
    """Checkpoints written before the format number (no format / rlkit_version, no model_config.json)."""
    ckpt = _copy(saved["a"], tmp_path)
    state = json.loads((ckpt / "trainer.json").read_text())
    del state["format"], state["rlkit_version"]
    (ckpt / "trainer.json").write_text(json.dumps(state))
    (ckpt / "model_config.json").unlink()
    tr = Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    try:
        assert tr.step == 1
        w = tr.workers.full_weights()["model.norm.weight"]
        assert torch.equal(w, saved["weights"]["model.norm.weight"])
    finally:
        tr.close()


def _cut_half(f: Path) -> None:
    os.truncate(f, f.stat().st_size // 2)


def _swap_trainer_json(ckpt: Path, other: Path, old_format: bool = False) -> None:
    state = json.loads((other / "trainer.json").read_text())
    if old_format:  # a checkpoint from before the format number: only the shards can tell
        del state["format"], state["rlkit_version"]
        (ckpt / "model_config.json").unlink()
    (ckpt / "trainer.json").write_text(json.dumps(state))


def _set_format(ckpt: Path, fmt: int) -> None:
    state = json.loads((ckpt / "trainer.json").read_text())
    (ckpt / "trainer.json").write_text(json.dumps({**state, "format": fmt, "rlkit_version": "7.3.0"}))


DAMAGE = {
    "trainer.json cut in half": (
        lambda c, o: _cut_half(c / "trainer.json"),
        r"/ckpt/trainer\.json is not valid JSON \(.*; the file has \d+ bytes\): it was cut short or damaged"),
    "trainer.json missing": (
        lambda c, o: (c / "trainer.json").unlink(),
        r"/ckpt/trainer\.json is missing; it holds \['actor', 'model_config\.json'\]: it is not a trainer\.save "
        r"checkpoint, or a copy of one that was cut short"),
    "weight shard truncated": (
        lambda c, o: _cut_half(c / "actor" / "__0_0.distcp"),
        r"/ckpt/actor/__0_0\.distcp is truncated: [\d,]+ bytes where its index \(\.metadata\) needs [\d,]+"),
    "weight shard deleted": (
        lambda c, o: (c / "actor" / "__0_0.distcp").unlink(),
        r"/ckpt/actor/__0_0\.distcp is missing: a shard of the actor's weights and optimizer state"),
    "shard index truncated": (
        lambda c, o: _cut_half(c / "actor" / ".metadata"),
        r"/ckpt/actor/\.metadata cannot be read \(.*\): the index of the actor's shards is cut short"),
    "shard index deleted": (
        lambda c, o: (c / "actor" / ".metadata").unlink(),
        r"/ckpt/actor/\.metadata is missing"),
    "rank state truncated": (
        lambda c, o: _cut_half(c / "actor" / "extra_rank0.pt"),
        r"/ckpt/actor/extra_rank0\.pt is truncated or damaged \(rank 0's step and RNG state\)"),
    "rank state deleted": (
        lambda c, o: (c / "actor" / "extra_rank0.pt").unlink(),
        r"/ckpt/actor/extra_rank0\.pt is missing: rank 0's step and RNG state"),
    "actor folder deleted": (
        lambda c, o: shutil.rmtree(c / "actor"),
        r"/ckpt/actor is missing: the actor's weights and optimizer state are not in the checkpoint"),
    "model config cut in half": (
        lambda c, o: _cut_half(c / "model_config.json"),
        r"/ckpt/model_config\.json is not a whole JSON config"),
    "another model's trainer.json": (
        lambda c, o: _swap_trainer_json(c, o),
        r"/ckpt/model_config\.json describes another model than .*/ckpt/trainer\.json names \(.*tiny-llama-small.*\): "
        r"model_type 'qwen2' in the checkpoint, 'llama' in the model, hidden_size 64 in the checkpoint, 128 in "
        r"the model.*Load this checkpoint with the model it was trained from"),
    "another model's config": (
        lambda c, o: shutil.copyfile(o / "model_config.json", c / "model_config.json"),
        r"/ckpt/model_config\.json describes another model than .*/ckpt/trainer\.json names \(.*tiny-qwen2-test.*\): "
        r"model_type 'llama' in the checkpoint, 'qwen2' in the model"),
    "another model's trainer.json, an old checkpoint": (
        lambda c, o: _swap_trainer_json(c, o, old_format=True),
        r"/ckpt/actor holds the actor of another model than trainer\.json's \(.*tiny-llama-small.*\): "
        r".*model\.embed_tokens\.weight is \[512, 64\] in the checkpoint and \[512, 128\] in the model.*the "
        r"checkpoint has 12 tensor\(s\) the model lacks, e\.g\. model\.layers\.0\.self_attn\.k_proj\.bias"),
    "a newer format": (
        lambda c, o: _set_format(c, 2),
        r"/ckpt/trainer\.json is checkpoint format 2, written by rlkit 7\.3\.0; this rlkit \(0\.1\.0\) reads "
        r"formats up to 1: load it with rlkit 7\.3\.0 or newer \(pip install -U rlkit\)"),
}
NEEDS_RECOPY = {"trainer.json cut in half", "weight shard truncated", "weight shard deleted", "shard index truncated",
                "rank state truncated", "actor folder deleted", "model config cut in half"}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_names_the_file_and_the_fix(case, saved, tmp_path, no_workers):
    ckpt = _copy(saved["a"], tmp_path)
    damage, message = DAMAGE[case]
    damage(ckpt, saved["b"])
    before = _hashes(ckpt)
    with pytest.raises(CheckpointError, match=message) as err:
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    if case in NEEDS_RECOPY:
        assert str(err.value).endswith(RECOPY)
    assert err.value.__cause__ is None and (err.value.__suppress_context__ or err.value.__context__ is None)
    assert _hashes(ckpt) == before  # a failed load changes nothing either


def test_a_missing_checkpoint_folder(tmp_path, no_workers):
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*/nope: the folder does not exist; pass the "
                                              r"folder that trainer\.save\(\.\.\.\) returned"):
        Trainer.load(tmp_path / "nope", dataset=rlkit.tasks.repeat)
    model = tiny_lm("qwen2", size="test")
    with pytest.raises(CheckpointError, match=r"trainer\.json is missing; it is a model folder \(config\.json and "
                                              r"weights\), not a training checkpoint: start a run from it with "
                                              r"rlkit\.Trainer\(model="):
        Trainer.load(model, dataset=rlkit.tasks.repeat)


def test_a_shard_damaged_past_the_driver_checks_fails_on_the_rank_as_an_exception(saved, tmp_path):
    """Bytes zeroed inside the shard file (its length intact, so the driver's checks pass): the rank's
    DCP load fails with torch's CheckpointException (a BaseException), which ParallelModel.load turns
    into a CheckpointError (an Exception); Trainer.load reports it without the remote traceback."""
    ckpt = _copy(saved["a"], tmp_path)
    shard = ckpt / "actor" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    message = r"/ckpt/actor could not be read \(rank 0: .*\); the checkpoint is damaged or was saved from another"
    before = _hashes(ckpt)
    with pytest.raises(CheckpointError, match=message) as err:
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    assert "remote traceback" not in str(err.value) and _hashes(ckpt) == before
    tr = Trainer.load(saved["a"], dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "intact"))
    try:
        with pytest.raises(CheckpointError, match=message):  # the rank's own call: an Exception, not a BaseException
            tr.group.obj.actor.load(ckpt / "actor")
        _cut_half(shard)
        with pytest.raises(CheckpointError, match=r"/ckpt/actor/__0_0\.distcp is truncated: [\d,]+ bytes"):
            tr.group.obj.actor.load(ckpt / "actor")
        with pytest.raises(WorkerError, match=r"CheckpointError: .*/ckpt/actor/__0_0\.distcp is truncated") as werr:
            tr.workers.load(str(ckpt))  # through the worker group: caught as the Exception it now is
        assert isinstance(werr.value, RlkitError)
    finally:
        tr.close()


def test_a_ppo_checkpoint_checks_its_critic_too(tmp_path):
    """PPO's checkpoint has critic/ (a value head instead of lm_head): it loads, and its damage is named."""
    tr = Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, algorithm="ppo",
                 rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2,
                 run_dir=str(tmp_path / "run"))
    try:
        tr.fit(steps=1, view="none")
        ckpt = Path(tr.save(tmp_path / "ckpt"))
    finally:
        tr.close()
    assert sorted(p.name for p in ckpt.iterdir()) == ["actor", "critic", "model_config.json", "trainer.json"]
    resumed = Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))
    try:
        assert resumed.step == 1
    finally:
        resumed.close()
    _cut_half(ckpt / "critic" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"/ckpt/critic/__0_0\.distcp is truncated"):
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, run_dir=str(tmp_path / "resumed"))


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_dp2_checkpoint_on_ray_workers(tmp_path, ray_cluster):
    """Two ranks on Ray: rank 1's files checked in the driver; a shard damaged past those checks fails on
    both ranks (no rank left waiting in a collective) and arrives as one CheckpointError, not a traceback."""
    tr = Trainer(model=tiny_lm("qwen2", size="test"), dataset=rlkit.tasks.repeat, plan=rlkit.ParallelPlan(dp=2),
                 rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), prompts_per_step=2,
                 run_dir=str(tmp_path / "run"), cluster=ray_cluster)
    try:
        tr.fit(steps=1, view="none")
        ckpt = Path(tr.save(tmp_path / "ckpt"))
    finally:
        tr.close()
    assert sorted(p.name for p in (ckpt / "actor").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                  "extra_rank0.pt", "extra_rank1.pt", "layout.json"]
    gone = tmp_path / "gone" / "ckpt"
    shutil.copytree(ckpt, gone)
    (gone / "actor" / "extra_rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"/ckpt/actor/extra_rank1\.pt is missing: rank 1's step and RNG state "
                                              r"\(the plan in trainer\.json has 2 ranks"):
        Trainer.load(gone, dataset=rlkit.tasks.repeat, cluster=ray_cluster)
    shard = ckpt / "actor" / "__1_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    before, free = _hashes(ckpt), settled_cpu_free(ray_cluster)
    with pytest.raises(CheckpointError, match=r"/ckpt/actor could not be read \(rank \d: .*\); the checkpoint is "
                                              r"damaged") as err:
        Trainer.load(ckpt, dataset=rlkit.tasks.repeat, cluster=ray_cluster, run_dir=str(tmp_path / "resumed"))
    assert "remote traceback" not in str(err.value) and _hashes(ckpt) == before
    assert wait_cpu_free(ray_cluster, at_least=free) == free  # the half-loaded workers were closed
