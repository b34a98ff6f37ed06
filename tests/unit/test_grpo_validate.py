"""`validate` (and `train`, before any worker starts) refuses grpo.reward_funcs that cannot run on the data: a
column the data does not have, a reward file or function that is not there. Reward files resolve against the cwd,
then the recipe's folder, in validate and in training alike."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.cli_helpers import run_cli

SHARDTUNE = str(Path(sys.executable).with_name("shardtune"))
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_validate_refuses_a_reward_column_the_data_lacks_through_the_executable(tmp_path: Path) -> None:
    done = subprocess.run([SHARDTUNE, "validate", "tiny-grpo-cpu", "grpo.reward_funcs=[exact_match:nope]",
                           f"train.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["error: grpo.reward_funcs[0] 'exact_match:nope': reads column 'nope', which the data does not "
                     "have (columns: answer): add it to the data or name another column"], done.stderr
    assert "Traceback" not in done.stderr


def test_validate_refuses_a_missing_reward_file_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["validate", "tiny-grpo-cpu", "grpo.reward_funcs=[missing.py:score]",
                            f"train.output_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "error: grpo.reward_funcs[0] 'missing.py:score': no file 'missing.py' (a relative path is tried in the "
        "current directory, then the recipe's folder)"]


def test_validate_refuses_a_missing_reward_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "my_rewards.py").write_text("def right(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["validate", "tiny-grpo-cpu", "grpo.reward_funcs=[my_rewards.py:wrong]",
                            f"train.output_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "error: grpo.reward_funcs[0] 'my_rewards.py:wrong': 'my_rewards.py' has no function 'wrong' "
        "(functions: right)"]


def test_train_refuses_a_reward_column_the_data_lacks_before_any_worker(tmp_path: Path) -> None:
    done = subprocess.run([SHARDTUNE, "train", "tiny-grpo-cpu", "grpo.reward_funcs=[exact_match:nope]",
                           "train.max_steps=1", f"train.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: grpo.reward_funcs[0] 'exact_match:nope': reads column 'nope', which the data does not have "
        "(columns: answer): add it to the data or name another column"]
    assert not (tmp_path / "run").exists()  # refused before the run folder (and the workers)
