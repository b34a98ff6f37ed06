"""train.report_to=[tensorboard,wandb,mlflow] on 2 forked ranks (forked.py): W&B in offline mode and MLflow's folder store get the
recipe as config and metrics.jsonl's records, from rank 0 only, and a resumed run continues the same tracker runs.
A tracker that is not installed is one line naming the extra (validate and train)."""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from shardtune.config.load import load_recipe
from tests.integration import forked
from tests.integration.runs import FAST, metrics
from tests.unit.cli_helpers import run_cli

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def train(run: Path, *extra: str) -> forked.Run:
    """2 forked ranks (forked.py: the launcher's checks and the worker; the trackers live in the worker)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for key in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(key, None)  # the defaults: both stores inside the run directory
    return forked.train("tiny-cpu", f"train.output_dir={run}", *FAST, "train.save_every=2",
                        "train.report_to=[tensorboard,wandb,mlflow]", *extra, env=env)


def test_wandb_and_mlflow_get_the_recipe_and_metrics_and_resume_the_same_run(tmp_path):
    run = tmp_path / "run"
    first = train(run, "train.max_steps=2")
    assert first.code == 0, first.err[-3000:]
    ids = json.loads((run / "trackers.json").read_text())
    again = train(run, "train.max_steps=4")  # resumes from step 2
    assert again.code == 0, again.err[-3000:]
    assert "resumed from" in again.out
    assert json.loads((run / "trackers.json").read_text()) == ids
    lines = metrics(run)
    assert [r["step"] for r in lines] == [1, 2, 3, 4]

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("shardtune")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [ids["mlflow"]]  # one run
    history = client.get_metric_history(ids["mlflow"], "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in lines]
    params = client.get_run(ids["mlflow"]).data.params
    lr = str(load_recipe("tiny-cpu").train.lr)
    assert params["train.lr"] == lr and params["train.max_steps"] == "2"  # the recipe the run started with

    offline = sorted((run / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    assert len(offline) == 2  # one file per process, one W&B run id
    history = [r for f in offline for r in wandb_records(f) if r.WhichOneof("record_type") == "history"]
    logged = [{i.key or "".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in history]
    assert [(h["step"], h["loss"]) for h in logged] == [(r["step"], r["loss"]) for r in lines]
    config = {i.key or "".join(i.nested_key): json.loads(i.value_json) for r in wandb_records(offline[0])
              if r.WhichOneof("record_type") == "run" for i in r.run.config.update}
    assert config["train"]["lr"] == float(lr) and config["train"]["report_to"] == ["tensorboard", "wandb", "mlflow"]


def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file: a 7-byte header (":W&B", magic, version), then LevelDB's log format
    (32 KiB blocks of chunks: crc32c, length, type FULL/FIRST/MIDDLE/LAST) holding protobuf `Record`s."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, out, pending = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(Record.FromString(pending))
    return out


def test_a_tracker_not_installed_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import and find_spec see nothing
    for command in ("validate", "train"):
        code, _, err = run_cli([command, "tiny-cpu", "train.report_to=wandb", f"train.output_dir={tmp_path}"], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "pip install 'shardtune[wandb]'" in lines[0], err


def test_wandb_without_credentials_is_one_line_naming_the_fixes(tmp_path, monkeypatch):
    """A fresh machine: no `wandb login`, no WANDB_API_KEY, online mode. wandb.init's UsageError was a traceback
    (an internal error of rank 0); it is the UserError rank 0 hands the launcher, naming login, the key and
    offline mode."""
    from shardtune.errors import UserError
    from shardtune.trainer.trackers import Trackers

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    for key in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(UserError, match=r"train\.report_to: wandb could not start a run \(No API key") as e:
        Trackers(["wandb"], tmp_path / "run", {"train": {"lr": 1e-4}}, resume=False)
    assert all(fix in str(e.value) for fix in ("wandb login", "WANDB_API_KEY", "WANDB_MODE=offline"))


def test_an_mlflow_server_that_does_not_answer_is_one_line(tmp_path, monkeypatch):
    """Checked before any worker starts (validate and train's launcher): MLflow itself retries a refused connection
    for ~4 minutes, then raised in rank 0 (an internal error). A server lost after that check is the worker's
    UserError."""
    import socket

    from shardtune.errors import UserError
    from shardtune.trainer.trackers import Trackers, tracker_problems

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    assert tracker_problems(["mlflow"]) == [
        f"train.report_to: MLflow's server MLFLOW_TRACKING_URI=http://127.0.0.1:{port} does not answer (Connection "
        "refused): start it, or unset MLFLOW_TRACKING_URI to log into the run directory's mlruns/"]
    assert tracker_problems(["wandb"]) == []  # only asked-for trackers are checked
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(UserError, match=r"train\.report_to: MLflow could not start a run \(API request to"):
        Trackers(["mlflow"], tmp_path / "run", {"train": {"lr": 1e-4}}, resume=False)
