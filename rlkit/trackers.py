"""Experiment trackers: a run's metrics, config and samples in TensorBoard, MLflow, Weights & Biases or
trackio, chosen with ``TrainerConfig(report_to=...)`` (TRL's name), each store in the run folder, offline.

``Trainer.fit`` opens them once per Trainer and logs its config (``Trainer._state_config()``); every step
then logs the metrics row under rlkit's own names ("reward/mean", "timing/generate", ... at the row's
"step") and the step's samples (``trainer.samples(last=1)``: step, prompt, completion, reward) as a table;
``Trainer.close`` closes them. Where each one writes, under ``trainer.run_dir``:

- ``tensorboard``: ``tensorboard/`` (event files: ``tensorboard --logdir <run_dir>/tensorboard``); the
  config and the samples are markdown in its Text tab (TensorBoard has no tables).
- ``mlflow``: ``mlruns/``, an MLflow file store (``file://<run_dir>/mlruns``), experiment "rlkit"
  (or ``$MLFLOW_EXPERIMENT_NAME``): metrics, the config as params and as ``config.json``, one table
  artifact per step (``samples/step_000001.json``, read with ``MlflowClient.load_table``). MLflow 3 keeps
  file stores in maintenance mode: rlkit sets ``MLFLOW_ALLOW_FILE_STORE=true``; do the same to read one
  (the UI, from the full ``mlflow`` package: ``mlflow ui --backend-store-uri file://<run_dir>/mlruns``).
- ``wandb``: ``wandb/`` (``WANDB_DIR=<run_dir>``, mode "offline"; its artifact staging and cache in
  ``wandb/data`` and ``wandb/cache``), project "rlkit" (or ``$WANDB_PROJECT``); ``wandb sync`` uploads
  the ``wandb/offline-run-*`` folders later, ``wandb leet <run_dir>/wandb`` shows them in a terminal.
- ``trackio``: ``trackio/`` (its SQLite store, project "rlkit"; the dashboard:
  ``TRACKIO_DIR=<run_dir>/trackio trackio show --project rlkit``). trackio fixes its folder when it is first
  imported in a process (``TRACKIO_DIR``): rlkit points it into the run folder of the first Trainer that
  imports it; a later Trainer in the same process with another run folder writes to that same store, and
  is warned with the path. trackio keeps one run per process: a second one finishes the first.

Resume (``Trainer.load``, a Trainer whose step is past 0, in the same run folder): the tracker runs are
continued, their ids kept in ``<run_dir>/trackers.json``. TensorBoard purges what the earlier run logged
after the checkpoint's step (a ``SessionLog.START`` at the next step); wandb continues its run id with
``resume_from="<id>?_step=<step>"`` (the server rewinds to the checkpoint when the offline runs are
synced); MLflow and trackio reopen the same run and append, and keep the points the earlier run logged
after the checkpoint beside the new ones (neither can delete points); rlkit's ``metrics.jsonl`` is the
truthful history either way. A fresh Trainer (step 0) starts new tracker runs.

Nothing here reaches a network: wandb runs with ``mode="offline"`` and ``WANDB_ERROR_REPORTING=false``;
MLflow's tracking URI is the local file store and ``MLFLOW_DISABLE_TELEMETRY=true``; trackio runs locally
(``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` ignored, the hub offline while it starts, so it does not look
up the user's name; ``HF_HUB_DISABLE_TELEMETRY=1``, ``GRADIO_ANALYTICS_ENABLED=False``).

>>> normalize("tensorboard"), normalize(["wandb", "mlflow"]), normalize("none"), normalize([])
(('tensorboard',), ('wandb', 'mlflow'), None, None)
>>> normalize("tensorbord")
Traceback (most recent call last):
...
rlkit.errors.TrainerError: report_to='tensorbord': choose one of ['tensorboard', 'mlflow', 'wandb', 'trackio', 'none'] (did you mean 'tensorboard'?)
>>> import tempfile
>>> trackers = Trackers.of(None, tempfile.mkdtemp())     # report_to off: logging does nothing
>>> trackers.log_metrics({"step": 1, "reward/mean": 0.5}); trackers.close(); len(trackers)
0
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import numbers
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlkit import atomic
from rlkit.errors import TrainerError

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
# tracker -> the module it needs (the pip extra is rlkit[<tracker>])
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}
IDS = "trackers.json"  # <run_dir>/trackers.json: the tracker runs to continue on resume
PROJECT = "rlkit"


def normalize(report_to: Any) -> tuple[str, ...] | None:
    """``report_to`` as a tuple of tracker names in the order given (None when off: None, "none", []);
    an unknown name is a ``TrainerError`` with the near miss."""
    from rlkit.checks import choice

    if report_to is None or (isinstance(report_to, (list, tuple)) and not report_to):
        return None
    options = (*TRACKERS, "none")
    if isinstance(report_to, str):
        choice("report_to", report_to, options, error=TrainerError)
        return None if report_to == "none" else (report_to,)
    if not isinstance(report_to, (list, tuple)) or not all(isinstance(n, str) for n in report_to):
        raise TrainerError(f"report_to={report_to!r} must be a tracker name or a list of them, e.g. "
                           f"report_to=['tensorboard'] (choose from {list(TRACKERS)}; None or 'none': off)")
    for i, name in enumerate(report_to):
        choice(f"report_to[{i}]", name, options, error=TrainerError)
    if "none" in report_to:
        raise TrainerError(f"report_to={list(report_to)!r}: 'none' turns tracking off, so it cannot be given with "
                           f"trackers; give report_to='none' alone, or the trackers alone")
    return tuple(dict.fromkeys(report_to))


def require_installed(names: Sequence[str] | None) -> None:
    """Each tracker's package can be imported here, or a ``TrainerError`` names the pip extra to install.

    >>> require_installed(())
    """
    for name in names or ():
        try:
            found = importlib.util.find_spec(PACKAGES[name]) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise _missing(name)


def _missing(name: str) -> TrainerError:
    return TrainerError(f"report_to={name!r} needs the {PACKAGES[name]} package, which is not installed here: "
                        f"pip install 'rlkit[{name}]' (or leave {name!r} out of report_to)")


class Trackers:
    """The open trackers of one run: ``log_config`` once, ``log_metrics`` and ``log_samples`` each step,
    ``close`` at the end. ``Trackers.of(names, run_dir, step)`` opens them (none: every call does nothing).

    >>> import tempfile
    >>> Trackers.of([], tempfile.mkdtemp()).where
    {}
    """

    def __init__(self, trackers: Sequence[Any] = ()):
        self.trackers = list(trackers)

    @classmethod
    def of(cls, names: Any, run_dir: str | os.PathLike, step: int = 0) -> Trackers:
        """Open the trackers ``names`` (a ``report_to`` value) for the run in ``run_dir``. ``step`` is the
        trainer's step: past 0 (a resumed Trainer) the runs recorded in ``<run_dir>/trackers.json`` are
        continued; at 0 new runs start. Raises ``TrainerError`` naming the pip extra of one not installed."""
        names = normalize(names) or ()
        require_installed(names)
        run_dir = Path(run_dir).absolute()
        earlier = _read_ids(run_dir) if step > 0 else {}
        opened: list[Any] = []
        try:
            for name in names:
                opened.append(_ADAPTERS[name](run_dir, step, earlier.get(name)))
        except BaseException:
            cls(opened).close()
            raise
        ids = {t.name: t.ids for t in opened if t.ids}
        if ids:
            atomic.write_text(run_dir / IDS, json.dumps({**_read_ids(run_dir), **ids}, indent=2))
        return cls(opened)

    @property
    def where(self) -> dict[str, str]:
        """Each tracker's store: a folder, or MLflow's tracking URI."""
        return {t.name: t.where for t in self.trackers}

    def log_config(self, config: dict[str, Any]) -> None:
        """The run's config (``Trainer._state_config()``), once."""
        for t in self.trackers:
            t.log_config(config)

    def log_metrics(self, row: dict[str, Any]) -> None:
        """One step's metrics row: every number in it under its own name, at ``row["step"]``."""
        step, values = _scalars(row)
        if self.trackers and values:
            for t in self.trackers:
                t.log_metrics(values, step)

    def log_samples(self, samples: Any, step: int) -> None:
        """The step's samples (a DataFrame: step, prompt, completion, reward) as a table."""
        if self.trackers and samples is not None and len(samples):
            table = samples.reset_index(drop=True)
            for t in self.trackers:
                t.log_samples(table, int(step))

    def close(self) -> None:
        """Flush and close every tracker; never raises (a tracker that fails to close is warned about)."""
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 (closing must not lose the trainer's own close)
                warnings.warn(f"rlkit: closing the {t.name} tracker failed: {type(e).__name__}: {e}", stacklevel=2)

    def __len__(self) -> int:
        return len(self.trackers)

    def __repr__(self) -> str:
        return f"Trackers({self.where})"


# ---- the adapters: one short class per tracker ------------------------------------------------------
class _TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, step: int, earlier: dict | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing(self.name) from e
        self.where, self.step, self.ids = str(run_dir / "tensorboard"), step, None
        # SessionLog.START at purge_step: TensorBoard's reader drops what earlier writers in this folder
        # logged at that step or later (a resumed run's steps after its checkpoint; a fresh run: all)
        self.writer = SummaryWriter(log_dir=self.where, purge_step=step + 1 if step > 0 else 0)

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, default=str)
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), self.step)
        self.writer.flush()

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, table: Any, step: int) -> None:
        self.writer.add_text("samples", markdown_table(table), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, step: int, earlier: dict | None):
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # read when mlflow is imported
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"   # MLflow 3: file stores are in maintenance mode
        try:
            from mlflow.entities import Metric, Param
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise _missing(self.name) from e
        self._Metric, self._Param = Metric, Param
        (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.where = (run_dir / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=self.where)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = None
        if earlier and earlier.get("run_id"):
            try:
                self.client.update_run(earlier["run_id"], status="RUNNING")
                self.run_id = earlier["run_id"]
            except MlflowException:  # that run is not in this store any more: a new one
                pass
        if self.run_id is None:
            run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"rlkit.run_dir": str(run_dir)})
            self.run_id = run.info.run_id
        self.ids = {"run_id": self.run_id}

    def log_config(self, config: dict[str, Any]) -> None:
        have = self.client.get_run(self.run_id).data.params  # params cannot change: a resumed run keeps its own
        params = [self._Param(k, v) for k, v in flatten(config).items() if k not in have]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, json.loads(json.dumps(config, default=str)), "config.json")

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_samples(self, table: Any, step: int) -> None:
        self.client.log_table(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    name = "wandb"

    def __init__(self, run_dir: Path, step: int, earlier: dict | None):
        os.environ["WANDB_ERROR_REPORTING"] = "false"  # no error reports to W&B's servers
        self.where = str(run_dir / "wandb")
        # set around each call (the mode and folders of this run only, not of the user's other wandb runs)
        self.env = {"WANDB_MODE": "offline", "WANDB_DIR": str(run_dir), "WANDB_DATA_DIR": f"{self.where}/data",
                    "WANDB_CACHE_DIR": f"{self.where}/cache"}
        Path(self.where).mkdir(parents=True, exist_ok=True)
        with _environ(self.env):
            try:
                import wandb
            except ImportError as e:
                raise _missing(self.name) from e
            self.wandb = wandb
            project = os.environ.get("WANDB_PROJECT") or PROJECT
            settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True,
                                      console="off", disable_git=True, save_code=False)
            where = dict(resume_from=f"{earlier['id']}?_step={step}") if earlier and earlier.get("id") else {}
            self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), mode="offline",
                                  reinit="create_new", settings=settings, **where)
        self.ids = {"id": self.run.id, "project": project}

    def log_config(self, config: dict[str, Any]) -> None:
        with _environ(self.env):
            self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        with _environ(self.env):
            self.run.log(values, step=step)

    def log_samples(self, table: Any, step: int) -> None:
        with _environ(self.env):
            self.run.log({"samples": self.wandb.Table(dataframe=table)}, step=step)

    def close(self) -> None:
        with _environ(self.env):
            self.run.finish()


class _Trackio:
    name = "trackio"

    def __init__(self, run_dir: Path, step: int, earlier: dict | None):
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
        wanted = run_dir / "trackio"
        try:
            if "trackio" in sys.modules:
                import trackio
            else:
                with _environ({"TRACKIO_DIR": str(wanted)}):  # trackio reads its folder once, on import
                    import trackio
            from trackio import utils
            from trackio.sqlite_storage import SQLiteStorage
        except ImportError as e:
            raise _missing(self.name) from e
        self.trackio, self.where = trackio, str(utils.TRACKIO_DIR)
        if Path(self.where).absolute() != wanted:
            warnings.warn(f"rlkit: trackio writes to {self.where}, not {wanted}: trackio fixes its folder when it is "
                          f"first imported in a process (TRACKIO_DIR); restart the kernel to put it in this run's "
                          f"folder", stacklevel=3)
        self.project, self.resume = PROJECT, bool(earlier and earlier.get("name"))
        if self.resume:
            self.run_name = earlier["name"]
        else:  # a name not yet in the store (a fresh Trainer in a run folder used before)
            taken = set(SQLiteStorage.get_runs(self.project))
            self.run_name = next(n for n in (run_dir.name, *(f"{run_dir.name}-{i}" for i in range(2, 10**6)))
                                 if n not in taken)
        self.run, self.ids = None, {"project": self.project, "name": self.run_name}

    def _start(self, config: dict[str, Any] | None) -> None:
        # trackio stores a run's config with its first record: the run starts with the config
        with _local_only():
            self.run = self.trackio.init(project=self.project, name=self.run_name, config=config,
                                         resume="allow" if self.resume else "never", embed=False,
                                         auto_log_cpu=False, auto_log_gpu=False)

    def log_config(self, config: dict[str, Any]) -> None:
        if self.run is None:
            self._start(json.loads(json.dumps(config, default=str)))

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        if self.run is None:
            self._start(None)
        self.run.log(values, step=step)

    def log_samples(self, table: Any, step: int) -> None:
        if self.run is None:
            self._start(None)
        self.run.log({"samples": self.trackio.Table(dataframe=table)}, step=step)

    def close(self) -> None:
        if self.run is None:
            return
        if self.trackio.context_vars.current_run.get() is self.run:
            self.trackio.finish()  # finishes it, and trackio's exit hook no longer does it again
        else:
            self.run.finish()


_ADAPTERS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB, "trackio": _Trackio}


# ---- helpers ------------------------------------------------------------------------------------------
def _scalars(row: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A metrics row's step and its numbers (the step itself is the axis, not a metric)."""
    values = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, numbers.Real)}
    return int(row["step"]), values


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as text (JSON for non-strings).

    >>> flatten({"model": "m", "config": {"lr": 0.001, "run_dir": None}})
    {'model': 'm', 'config.lr': '0.001', 'config.run_dir': 'null'}
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        name = _mlflow_key(f"{prefix}{key}")
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[name] = text[:6000]  # MLflow's longest param value
    return out


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", key)[:250]


def markdown_table(table: Any) -> str:
    """A DataFrame as a markdown table (TensorBoard's Text tab renders it); ``\\``, ``|`` and line breaks
    in a cell are escaped (``\\\\``, ``\\|``, ``<br>``).

    >>> import pandas as pd
    >>> print(markdown_table(pd.DataFrame({"prompt": ["a|b"], "reward": [0.5]})))
    | prompt | reward |
    | --- | --- |
    | a\\|b | 0.5 |
    """
    def cell(value: Any) -> str:
        text = str(value).replace("\\", "\\\\").replace("|", "\\|")
        return text.replace("\r\n", "<br>").replace("\n", "<br>")

    cols = list(table.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def _read_ids(run_dir: Path) -> dict[str, Any]:
    try:
        ids = json.loads((run_dir / IDS).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _local_only() -> Iterator[None]:
    """trackio starts locally: no Space or server from the environment, and the hub offline (trackio looks
    up the user's hub name when it starts a run, a request to the hub whenever a token is saved)."""
    from huggingface_hub import constants

    saved = {k: os.environ.pop(k) for k in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL") if k in os.environ}
    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = offline
        os.environ.update(saved)


__all__ = ["PACKAGES", "TRACKERS", "Trackers", "flatten", "markdown_table", "normalize", "require_installed"]
