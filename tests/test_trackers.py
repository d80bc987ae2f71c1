"""report_to: a real Trainer (the tiny model, one rank in this process) fits a few steps with each tracker,
then the tracker's own reader reads its store back from the run folder: every metric of every step equals
``trainer.metrics``, the config is there once, the samples are there as a table. A tracker whose package
is missing fails in the driver, before any worker starts, naming the pip extra. Resume continues the
tracker runs. Nothing here reaches a network (wandb offline, MLflow and trackio local, TensorBoard files).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import rlkit
from rlkit.errors import TrainerError
from rlkit.trackers import PACKAGES, TRACKERS

STEPS = 2


@pytest.fixture(scope="module")
def model():
    return rlkit.models.tiny_lm("qwen2", size="test")


def _trainer(model, run_dir, report_to):
    return rlkit.Trainer(model=model, dataset=rlkit.tasks.repeat, rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4),
                         prompts_per_step=2, report_to=report_to, run_dir=str(run_dir))


def _fit(model, run_dir, report_to, steps=STEPS):
    """Fit ``steps`` and close; returns what the tracker should hold: rows, samples per step, config."""
    trainer = _trainer(model, run_dir, report_to)
    try:
        trainer.fit(steps, view="none")
        config = json.loads(json.dumps(trainer._state_config(), default=str))
    finally:
        trainer.close()
    rows = trainer.metrics.to_dict("records")
    samples = trainer.samples()
    per_step = {s: samples[samples.step == s].to_dict("records") for s in range(1, steps + 1)}
    assert all(len(v) == 4 for v in per_step.values())  # 2 prompts x n=2, each step
    return rows, per_step, config


def _metric_keys(rows):
    return sorted({k for r in rows for k in r if k != "step"})


def _same(got, want):
    """Equal numbers; NaN equals NaN (a tracker may store NaN)."""
    got = float(got)
    return (math.isnan(got) and math.isnan(want)) or got == want


def _leaves(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same_samples(got, want):
    """Rows read back (dicts) equal the trainer's samples of that step."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert int(g["step"]) == w["step"] and g["prompt"] == w["prompt"] and g["completion"] == w["completion"]
        assert _same(g["reward"], w["reward"])


# ---- TensorBoard ----------------------------------------------------------------------------------------
def _tb(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _markdown_rows(text):
    """The rows of the markdown table rlkit writes for TensorBoard's Text tab (``\\|`` escaped, ``<br>``)."""
    rows = []
    for line in text.splitlines()[2:]:
        cells, cur, i, body = [], "", 0, line[1:-1]
        while i < len(body):
            if body[i] == "\\" and i + 1 < len(body):
                cur, i = cur + body[i + 1], i + 2
                continue
            if body[i] == "|":
                cells.append(cur)
                cur = ""
            else:
                cur += body[i]
            i += 1
        cells.append(cur)
        rows.append([c[1:-1].replace("<br>", "\n") for c in cells])
    return rows


def test_tensorboard(model, tmp_path):
    run_dir = tmp_path / "run"
    rows, samples, config = _fit(model, run_dir, "tensorboard")
    acc = _tb(run_dir)
    assert sorted(acc.Tags()["scalars"]) == _metric_keys(rows)
    for key in _metric_keys(rows):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows], key
        for e, r in zip(events, rows):  # TensorBoard keeps scalars as float32
            assert _same(e.value, float(np.float32(r[key]))), (key, r["step"], e.value, r[key])
    (cfg,) = acc.Tensors("config/text_summary")  # once
    text = cfg.tensor_proto.string_val[0].decode()
    assert cfg.step == 0 and json.loads("\n".join(line[4:] for line in text.splitlines())) == config
    tables = acc.Tensors("samples/text_summary")
    assert [t.step for t in tables] == [1, 2]
    for t in tables:
        got = _markdown_rows(t.tensor_proto.string_val[0].decode())
        _same_samples([dict(zip(["step", "prompt", "completion", "reward"], r)) for r in got], samples[t.step])


# ---- MLflow ---------------------------------------------------------------------------------------------
def _mlflow_run(run_dir, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when asked to
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("rlkit").experiment_id])
    return client, run


def test_mlflow(model, tmp_path, monkeypatch):
    import mlflow

    run_dir = tmp_path / "run"
    rows, samples, config = _fit(model, run_dir, "mlflow")
    client, run = _mlflow_run(run_dir, monkeypatch)
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and sorted(run.data.metrics) == _metric_keys(rows)
    for key in _metric_keys(rows):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [r["step"] for r in rows], key
        assert all(_same(m.value, r[key]) for m, r in zip(history, rows)), key
    # the config: once as config.json, and as params (one per leaf, dotted)
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/config.json") == config
    params = run.data.params
    assert sorted(params) == sorted(_leaves(config))
    assert float(params["config.lr"]) == config["config"]["lr"] and params["model"] == config["model"]
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == [
        "samples/step_000001.json", "samples/step_000002.json"]
    for step in (1, 2):
        table = client.load_table(run.info.experiment_id, f"samples/step_{step:06d}.json", run_ids=[run_id])
        _same_samples(table.to_dict("records"), samples[step])


# ---- Weights & Biases -------------------------------------------------------------------------------------
def _wandb_records(wandb_file):
    """The records of a .wandb transaction log, as wandb's own reader prints them (`wandb leet inspect`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_wandb(model, tmp_path):
    run_dir = tmp_path / "run"
    rows, samples, config = _fit(model, run_dir, "wandb")
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (wandb_file,) = offline.glob("run-*.wandb")
    records = _wandb_records(wandb_file)
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows):
        for key in _metric_keys(rows):
            assert _same(h[key], r[key]), (key, r["step"], h[key], r[key])
    configs = [r["config"]["update"] for r in records if r["type"] == "config" and "model" in r["config"]["update"]]
    assert configs == [config]  # once
    # samples: the table each step's history row points to, in the run's files
    for h in history:
        table = json.loads((offline / "files" / h["samples.path"]).read_text())
        assert table["columns"] == ["step", "prompt", "completion", "reward"]
        _same_samples([dict(zip(table["columns"], d)) for d in table["data"]], samples[h["_step"]])


# ---- trackio --------------------------------------------------------------------------------------------
def test_trackio(model, tmp_path):
    run_dir = tmp_path / "run"
    rows, samples, config = _fit(model, run_dir, "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    names = json.loads((run_dir / "trackers.json").read_text())["trackio"]["name"]
    logs = SQLiteStorage.get_logs("rlkit", names)
    metrics = [g for g in logs if "samples" not in g]
    assert [g["step"] for g in metrics] == [r["step"] for r in rows]
    for g, r in zip(metrics, rows):
        assert sorted(k for k in g if k not in ("step", "timestamp")) == _metric_keys(rows)
        assert all(_same(g[k], r[k]) for k in _metric_keys(rows)), r["step"]
    stored = SQLiteStorage.get_run_config("rlkit", names)
    assert {k: v for k, v in stored.items() if not k.startswith("_")} == config
    tables = [g for g in logs if "samples" in g]
    assert [g["step"] for g in tables] == [1, 2]
    for g in tables:
        assert g["samples"]["_type"] == "trackio.table"
        _same_samples(g["samples"]["_value"], samples[g["step"]])


# ---- resume: the same tracker runs go on ------------------------------------------------------------------
def test_trackio_writes_into_the_first_runs_folder(model, tmp_path):
    """trackio fixes its folder when a process first imports it: in a fresh process (a new kernel) that is the
    first Trainer's run folder, and a second run folder in the same process gets a warning naming where trackio
    writes instead. A process of its own, so no earlier test's import decides it."""
    script = f"""
import warnings
import rlkit
from pathlib import Path
first, second = Path({str(tmp_path / "a")!r}), Path({str(tmp_path / "b")!r})
for run_dir in (first, second):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = rlkit.Trainer(model={model!r}, dataset=rlkit.tasks.repeat, prompts_per_step=2, report_to="trackio",
                           rollout=rlkit.Rollout(engine="hf", n=2, max_new_tokens=4), run_dir=str(run_dir))
        try:
            tr.fit(1, view="none")
        finally:
            tr.close()
    said = [str(w.message) for w in caught if "trackio writes to" in str(w.message)]
    print(run_dir.name, (run_dir / "trackio" / "rlkit.db").exists(), len(said), said[0].split(",")[0] if said else "")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln[:2] in ("a ", "b ")]  # trackio prints lines of its own
    assert lines[0] == "a True 0 ", lines
    assert lines[1] == f"b False 1 rlkit: trackio writes to {tmp_path / 'a' / 'trackio'}", lines


def test_resume_continues_the_tracker_runs(model, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    trainer = _trainer(model, run_dir, ["tensorboard", "mlflow", "wandb"])
    try:
        trainer.fit(2, view="none")
        ckpt = trainer.save(tmp_path / "ckpt")
        trainer.fit(1, view="none")  # step 3, after the checkpoint: rolled back by the resume below
        lost = trainer.metrics.iloc[-1]["reward/mean"]
    finally:
        trainer.close()
    ids = json.loads((run_dir / "trackers.json").read_text())
    resumed = rlkit.Trainer.load(ckpt, dataset=rlkit.tasks.repeat)
    try:
        assert resumed.step == 2 and resumed.run_dir == run_dir
        resumed.fit(1, view="none")
        rows = resumed.metrics.to_dict("records")
    finally:
        resumed.close()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert json.loads((run_dir / "trackers.json").read_text()) == ids  # the same runs
    # TensorBoard: the earlier step 3 is purged; the resumed run's step 3 is read
    acc = _tb(run_dir)
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == [float(np.float32(r["reward/mean"])) for r in rows]
    assert [t.step for t in acc.Tensors("config/text_summary")] == [0, 2]  # once per Trainer
    # MLflow: one run, continued and finished; its step 3 holds both points, the resumed one last
    client, run = _mlflow_run(run_dir, monkeypatch)
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.step for m in history] == [1, 2, 3, 3]
    assert _same(history[2].value, lost) and _same(history[3].value, rows[2]["reward/mean"])
    # wandb: a second offline run of the same id, rewound to the checkpoint's step (resume_from)
    first, second = sorted((run_dir / "wandb").glob("offline-run-*"))
    records = _wandb_records(next(second.glob("run-*.wandb")))
    (start,) = [r["run"] for r in records if r["type"] == "run"]
    assert start["run_id"] == ids["wandb"]["id"] and start["branch_point"] == {
        "metric": "_step", "run": ids["wandb"]["id"], "value": 2}
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["_step"] for h in history] == [3] and _same(history[0]["reward/mean"], rows[2]["reward/mean"])


# ---- a tracker that is not installed ------------------------------------------------------------------
@pytest.mark.parametrize("name", TRACKERS)
def test_missing_tracker_fails_before_any_worker_with_the_pip_extra(name, model, tmp_path, monkeypatch):
    from rlkit.workers.rl_workers import RLWorkers

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker started for a config that could never run")

    monkeypatch.setattr(RLWorkers, "start", no_workers)
    monkeypatch.setitem(sys.modules, PACKAGES[name], None)  # `import <package>` fails: not installed
    with pytest.raises(TrainerError) as e:
        _trainer(model, tmp_path / "run", ["tensorboard", name] if name != "tensorboard" else name)
    assert f"report_to={name!r} needs the {PACKAGES[name]} package" in str(e.value)
    assert f"pip install 'rlkit[{name}]'" in str(e.value)
    assert not (tmp_path / "run").exists()
