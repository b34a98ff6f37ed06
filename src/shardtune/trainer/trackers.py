"""Experiment trackers beside TensorBoard (`train.report_to`): Weights & Biases and MLflow, optional extras
(`pip install 'shardtune[wandb]'`, `'shardtune[mlflow]'`).

Rank 0 alone logs (the same records as metrics.jsonl, at their step), after logging the resolved recipe as the
run's config (W&B config, MLflow params with dotted keys). Each tracker's run id is kept in the run directory
(IDS_FILE), so a resumed run continues the same tracker run instead of starting a new one.

Where they write is each library's own setting: WANDB_MODE / WANDB_PROJECT / WANDB_DIR (default: project
"shardtune", files under the run directory), MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME (default: a store in
<output_dir>/mlruns, experiment "shardtune").
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from shardtune.errors import UserError

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # name -> the module it needs
IDS_FILE = "trackers.json"
MLFLOW_BATCH = 100  # MLflow's limit of params (and metrics) per log_batch call


def tracker_problems(report_to: list[str]) -> list[str]:
    """One line per tracker asked for whose library is not installed (the extra to install is named), or whose
    MLflow server does not answer: MLflow retries a refused connection for ~4 minutes before it raises."""
    problems = [f"train.report_to: {name} is not installed: pip install 'shardtune[{name}]' (or remove {name} "
                "from train.report_to)" for name in report_to
                if name != "tensorboard" and importlib.util.find_spec(TRACKERS[name]) is None]
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in report_to and uri.startswith(("http://", "https://")):
        problems += [p for p in [_unreachable(uri)] if p]
    return problems


def _unreachable(uri: str) -> str | None:
    from urllib.parse import urlsplit

    url = urlsplit(uri)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=10).close()
    except OSError as e:
        return (f"train.report_to: MLflow's server MLFLOW_TRACKING_URI={uri} does not answer ({e.strerror or e}): "
                "start it, or unset MLFLOW_TRACKING_URI to log into the run directory's mlruns/")
    return None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class Trackers:
    """The W&B and MLflow runs of one training run (TensorBoard stays in trainer/metrics.py)."""

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any], *, resume: bool) -> None:
        self._ids_file = run_dir / IDS_FILE
        ids: dict[str, str] = json.loads(self._ids_file.read_text()) if resume and self._ids_file.is_file() else {}
        self._wandb = _start_wandb(run_dir, config, ids.get("wandb")) if "wandb" in names else None
        self._mlflow = _MlflowRun(run_dir, config, ids.get("mlflow")) if "mlflow" in names else None
        ids = {**({"wandb": self._wandb.id} if self._wandb else {}),
               **({"mlflow": self._mlflow.run_id} if self._mlflow else {})}
        if ids:
            self._ids_file.write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, record: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self._wandb is not None:
            self._wandb.log(values)  # `step` is a value too: every chart's x axis (define_metric below)
        if self._mlflow is not None:
            self._mlflow.log(values, int(record["step"]))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.close()
            self._mlflow = None


def _start_wandb(run_dir: Path, config: dict[str, Any], run_id: str | None) -> Any:
    import wandb

    try:
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardtune"), name=run_dir.name, config=config,
                         dir=os.environ.get("WANDB_DIR", str(run_dir)), id=run_id, resume="allow" if run_id else None)
    except wandb.errors.Error as e:  # no API key (a fresh machine), a server out of reach, a key refused
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(f"train.report_to: wandb could not start a run ({first}): run `wandb login` or export "
                        "WANDB_API_KEY, or set WANDB_MODE=offline to log into the run directory (`wandb sync` "
                        "uploads it later)") from None
    # Our own step as the x axis: a resumed run re-logs the steps after its checkpoint, which W&B's internal,
    # strictly increasing step would drop.
    run.define_metric("*", step_metric="step")
    return run


class _MlflowRun:
    def __init__(self, run_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._start(run_dir, config, run_id)
        except MlflowException as e:  # a server that went away after the launcher's check, a refused token
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise UserError(f"train.report_to: MLflow could not start a run ({first}): check MLFLOW_TRACKING_URI "
                            "and its credentials, or unset it to log into the run directory's mlruns/") from None

    def _start(self, run_dir: Path, config: dict[str, Any], run_id: str | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # The run directory's own store, a folder beside metrics.jsonl (`mlflow ui --backend-store-uri` reads
            # it). MLflow 3 asks for an opt-in to folder stores; a database store needs sqlalchemy, which the
            # light mlflow-skinny extra leaves out. Set MLFLOW_TRACKING_URI for a server or a database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "shardtune")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            params = [Param(k, json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                      for k, v in flatten(config).items()]
            for a in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(run_id, params=params[a : a + MLFLOW_BATCH])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items() if k != "step"])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
