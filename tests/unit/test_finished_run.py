"""A run directory's earlier run is not trained over without a word (launcher/finished_run.py): a finished run
without a checkpoint is refused under train.resume=auto (the executable's exit 2: tests/integration/test_checkpoint.py),
train.resume=none starts over saying so, a checkpoint resumes, and a run that died without one starts over with a
notice."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.load import load_recipe_config, to_recipe
from shardtune.errors import UserError
from shardtune.launcher.finished_run import check_finished_run


def recipe(run_dir: Path, *overrides: str):
    return to_recipe(load_recipe_config("tiny-cpu", [f"train.output_dir={run_dir}", *overrides]))


def finished(run_dir: Path, *, final: bool = True) -> Path:
    """What a run with train.save_every=0 leaves: metrics.jsonl, summary.json and (train.save_final) final/."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (run_dir / "summary.json").write_text("{}")
    if final:
        (run_dir / "final").mkdir()
    return run_dir


@pytest.mark.parametrize("final", [True, False], ids=["final", "save_final=false"])
def test_a_finished_run_without_a_checkpoint_is_refused(tmp_path, final):
    run_dir = finished(tmp_path / "run", final=final)
    with pytest.raises(UserError) as e:
        check_finished_run(recipe(run_dir))
    shown = "final/, summary.json, metrics.jsonl" if final else "summary.json, metrics.jsonl"
    assert str(e.value) == (f"train.output_dir: '{run_dir}' holds a finished run ({shown}) and no checkpoint to "
                            "resume: training again would replace it: use a new train.output_dir, or set "
                            "train.resume=none to start over there")


def test_resume_none_starts_over_saying_so(tmp_path, capsys):
    run_dir = finished(tmp_path / "run")
    check_finished_run(recipe(run_dir, "train.resume=none"))
    assert capsys.readouterr().err == (f"train.output_dir: '{run_dir}' holds an earlier run (final/, summary.json, "
                                       "metrics.jsonl); starting over at step 0 (train.resume=none): its records "
                                       "are replaced\n")


def test_a_run_that_died_without_a_checkpoint_starts_over_with_a_notice(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    check_finished_run(recipe(run_dir))
    assert capsys.readouterr().err == (f"train.output_dir: '{run_dir}' holds an earlier run (metrics.jsonl); "
                                       "starting over at step 0 (it left no checkpoint to resume): its records are "
                                       "replaced\n")


def test_a_checkpoint_resumes_and_a_new_directory_says_nothing(tmp_path, capsys):
    run_dir = finished(tmp_path / "run")
    ckpt = run_dir / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 1}))
    check_finished_run(recipe(run_dir))  # resumes: checkpoint/resume_check.py judges the recipe
    check_finished_run(recipe(tmp_path / "new"))
    check_finished_run(recipe(finished(tmp_path / "empty") / "none", "train.resume=none"))
    assert capsys.readouterr().err == ""
