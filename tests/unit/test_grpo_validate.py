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
    file = tmp_path.resolve() / "my_rewards.py"  # resolved at load, as data.path is: the line names the file read
    assert err.strip().splitlines() == [
        f"error: grpo.reward_funcs[0] '{file}:wrong': '{file}' has no function 'wrong' (functions: right)"]


def test_train_refuses_a_reward_column_the_data_lacks_before_any_worker(tmp_path: Path) -> None:
    done = subprocess.run([SHARDTUNE, "train", "tiny-grpo-cpu", "grpo.reward_funcs=[exact_match:nope]",
                           "train.max_steps=1", f"train.output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: grpo.reward_funcs[0] 'exact_match:nope': reads column 'nope', which the data does not have "
        "(columns: answer): add it to the data or name another column"]
    assert not (tmp_path / "run").exists()  # refused before the run folder (and the workers)


REWARD_FILE = "def match(completions, answer, **kwargs):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"


def _recipe_beside_its_reward_file(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of tiny-grpo-cpu in its own folder, with my_rewards.py beside it, and another folder to run from."""
    folder, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "my_rewards.py").write_text(REWARD_FILE)
    recipe = folder / "grpo.yaml"
    recipe.write_text((RECIPES / "tiny-grpo-cpu.yaml").read_text()
                      .replace("reward_funcs: [exact_match]", "reward_funcs: [my_rewards.py:match]")
                      .replace("output_dir: runs/tiny-grpo-cpu", f"output_dir: {tmp_path / 'run'}"))
    assert "my_rewards.py:match" in recipe.read_text()
    return recipe, elsewhere


def test_a_reward_file_beside_the_recipe_validates_from_another_cwd(tmp_path: Path) -> None:
    recipe, elsewhere = _recipe_beside_its_reward_file(tmp_path)
    done = subprocess.run([SHARDTUNE, "validate", str(recipe), "--print"], capture_output=True, text=True,
                          cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    # --print is the recipe.yaml train writes and the workers read: the file's absolute path, as for data.path
    assert f"- {recipe.parent.resolve() / 'my_rewards.py'}:match\n" in done.stdout


def test_training_loads_a_reward_file_beside_the_recipe_from_another_cwd(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from shardtune.config.load import load_recipe, load_recipe_config, to_recipe, to_yaml
    from shardtune.trainer.rewards import load_reward_funcs, score

    recipe, elsewhere = _recipe_beside_its_reward_file(tmp_path)
    monkeypatch.chdir(elsewhere)
    saved = tmp_path / "recipe.yaml"  # what the workers load, as train writes it
    saved.write_text(to_yaml(load_recipe_config(str(recipe))))
    for r in (load_recipe(str(recipe)), load_recipe(str(saved)), to_recipe(load_recipe_config(str(saved)))):
        (f,) = load_reward_funcs(r.grpo.reward_funcs)  # as trainer/grpo.py loads them, without a recipe folder
        assert f.columns == ("answer",)
        assert score([f], None, ["p", "q"], ["cba", "x"], {"answer": ["cba", "y"]})[0] == [1.0, 0.0]
