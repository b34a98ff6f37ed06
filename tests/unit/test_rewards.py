"""GRPO reward functions (trainer/rewards.py): built-ins, TRL-style functions from a file or a module, the weighted
total as TRL's GRPOTrainer sums it, and the one-line errors."""
from __future__ import annotations

import math
import textwrap

import pytest

from shardtune.errors import UserError
from shardtune.trainer.rewards import as_completions, check_reward_specs, load_reward_funcs, score


def _score(specs, completions, columns=None, weights=None, **kw):
    funcs = load_reward_funcs(specs)
    prompts = kw.pop("prompts", ["p"] * len(completions))
    return score(funcs, weights, prompts, completions, columns or {}, **kw)


def test_exact_match_strips_and_reads_the_named_column():
    total, per = _score(["exact_match"], [" 42\n", "41"], {"answer": ["42 ", "42"]})
    assert per == {"exact_match": [1.0, 0.0]} and total == [1.0, 0.0]
    _, per = _score(["exact_match:solution"], ["a", "b"], {"solution": ["b", "b"]})
    assert per["exact_match:solution"] == [0.0, 1.0]


def test_numeric_match_compares_the_last_numbers():
    completions = ["so it is 1,234", "3.50 then 7", "no number", "-2"]
    answers = ["reasoning... #### 1234", "7.0", "5", "-2"]
    _, per = _score(["numeric_match"], completions, {"answer": answers})
    assert per["numeric_match"] == [1.0, 1.0, 0.0, 1.0]


def test_format_regex_and_think_format_match_the_whole_completion():
    _, per = _score(["format:<answer>\\d+</answer>"], ["<answer>12</answer> ", "x <answer>12</answer>"])
    assert per["format:<answer>\\d+</answer>"] == [1.0, 0.0]
    _, per = _score(["think_format"], ["<think>a\nb</think>\n42", "42", "<think>a</think><think>b</think>x"])
    assert per["think_format"] == [1.0, 0.0, 0.0]


def test_length_penalty_counts_completion_tokens():
    _, per = _score(["length_penalty:4"], ["a", "b", "c"], completion_ids=[[1] * 3, [1] * 6, [1] * 100])
    assert per["length_penalty:4"] == [-0.0, -0.5, -1.0]


def test_conversational_completions_are_read_as_their_content():
    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = as_completions(prompts, ["42", "7"])
    assert completions == [[{"role": "assistant", "content": "42"}], [{"role": "assistant", "content": "7"}]]
    assert as_completions(["q"], ["42"]) == ["42"]  # string prompts: string completions, as TRL passes them
    _, per = _score(["exact_match"], completions, {"answer": ["42", "42"]}, prompts=prompts)
    assert per["exact_match"] == [1.0, 0.0]


def test_weighted_total_is_trls_nansum_and_all_none_is_nan(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text(textwrap.dedent("""
        def maybe(completions, **kwargs):
            return [None if c == "skip" else 0.5 for c in completions]
    """))
    monkeypatch.chdir(tmp_path)
    total, per = _score(["exact_match", "r.py:maybe"], ["42", "skip"], {"answer": ["42", "1"]}, weights=[2.0, -1.0])
    assert per["exact_match"] == [1.0, 0.0]
    assert per["r.py:maybe"][0] == 0.5 and math.isnan(per["r.py:maybe"][1])
    assert total == [2.0 - 0.5, 0.0]  # the None is left out of row 1's sum, as torch.nansum does
    total, _ = _score(["r.py:maybe"], ["skip", "x"])
    assert math.isnan(total[0]) and total[1] == 0.5


def test_trl_reward_function_from_a_file_runs_unchanged(tmp_path, monkeypatch):
    """The shape of TRL's own reward functions: completions conversational, a data column, **kwargs for the rest
    (completion_ids, trainer_state, log_metric...)."""
    (tmp_path / "rewards.py").write_text(textwrap.dedent("""
        def accuracy_reward(completions, solution, **kwargs):
            assert kwargs["trainer_state"].global_step == 3 and kwargs["completion_ids"] == [[1], [2]]
            kwargs["log_metric"]("seen", 1.0)
            return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]
    """))
    monkeypatch.chdir(tmp_path)
    completions = [[{"role": "assistant", "content": "x"}], [{"role": "assistant", "content": "y"}]]
    total, per = _score(["rewards.py:accuracy_reward"], completions, {"solution": ["x", "x"]}, step=3,
                        completion_ids=[[1], [2]], prompts=[[{"role": "user", "content": "q"}]] * 2)
    assert per == {"rewards.py:accuracy_reward": [1.0, 0.0]} and total == [1.0, 0.0]


def test_file_is_found_in_the_recipe_folder_after_the_cwd(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "r.py").write_text("def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    (f,) = load_reward_funcs(["r.py:one"], recipe_dir=recipe)
    assert f.fn(completions=["a"]) == [1.0]


def test_module_function_spec():
    (f,) = load_reward_funcs(["shardtune.trainer.rewards:last_number"])
    assert f.fn("x 3") == 3.0


def _error(fn_src, specs, completions, columns=None, tmp_path=None, **kw) -> str:
    (tmp_path / "bad.py").write_text(textwrap.dedent(fn_src))
    with pytest.raises(UserError) as e:
        _score(specs, completions, columns, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_raising_function_names_itself_the_row_and_the_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = """
        def boom(completions, **kw):
            return [1 / len(c) for c in completions]
    """
    msg = _error(src, ["bad.py:boom"], ["ok", "", "x"], tmp_path=tmp_path, rows=[7, 8, 9])
    assert msg == "reward function 'bad.py:boom' raised ZeroDivisionError at data row 9: division by zero"
    msg = _error(src, ["bad.py:boom"], ["ok", ""], tmp_path=tmp_path)
    assert msg == "reward function 'bad.py:boom' raised ZeroDivisionError at completion 1: division by zero"


def test_wrong_length_and_non_number_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error("def short(completions, **kw):\n    return [1.0]\n", ["bad.py:short"], ["a", "b"], tmp_path=tmp_path)
    assert msg == ("reward function 'bad.py:short' returned 1 values for 2 completions: return one number per "
                   "completion")
    msg = _error("def word(completions, **kw):\n    return [1.0, 'high']\n", ["bad.py:word"], ["a", "b"],
                 tmp_path=tmp_path, rows=[4, 5])
    assert msg == ("reward function 'bad.py:word' returned 'high' (str) at data row 6: return a number (or None "
                   "where it does not apply)")
    msg = _error("def scalar(completions, **kw):\n    return 1.0\n", ["bad.py:scalar"], ["a", "b"], tmp_path=tmp_path)
    assert msg == "reward function 'bad.py:scalar' returned float, not a list: return one number per completion (2)"


@pytest.mark.parametrize(("spec", "expected"), [
    ("nope.py:f", "grpo.reward_funcs[0] 'nope.py:f': no file 'nope.py' (a relative path is tried in the current "
                  "directory, then the recipe's folder)"),
    ("bad.py:missing", "grpo.reward_funcs[0] 'bad.py:missing': 'bad.py' has no function 'missing' (functions: "
                       "helper)"),
    ("no_such_module_x:f", "grpo.reward_funcs[0] 'no_such_module_x:f': cannot import module 'no_such_module_x' "
                           "(ModuleNotFoundError: No module named 'no_such_module_x'): check the name, or give "
                           "path/to/file.py:function"),
    ("accuracy", "grpo.reward_funcs[0] 'accuracy': not a built-in (exact_match, numeric_match, format, "
                 "think_format, length_penalty), path/to/file.py:function or package.module:function"),
    ("format", "grpo.reward_funcs[0] 'format': format needs format:REGEX"),
    ("format:(", "grpo.reward_funcs[0] 'format:(': not a regular expression (missing ), unterminated subpattern "
                 "at position 0)"),
    ("length_penalty:-3", "grpo.reward_funcs[0] 'length_penalty:-3': the token count must be an integer > 0, e.g. "
                          "length_penalty:256"),
])
def test_bad_spec_is_one_line(spec, expected, tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text("def helper(completions, **kw):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        load_reward_funcs([spec])
    assert str(e.value) == expected


def test_a_spec_listed_twice_is_refused():
    with pytest.raises(UserError) as e:
        load_reward_funcs(["exact_match", "think_format", "exact_match"])
    assert str(e.value) == "grpo.reward_funcs[2] 'exact_match': listed twice: give it once (a weight scales it)"


def test_validate_check_refuses_a_missing_reward_column(tmp_path, monkeypatch):
    (tmp_path / "r.py").write_text("def acc(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert [f.columns for f in check_reward_specs(["exact_match", "r.py:acc"], ["prompt", "answer", "solution"])] == \
        [("answer",), ("solution",)]
    with pytest.raises(UserError) as e:
        check_reward_specs(["think_format", "exact_match:label"], ["prompt", "answer"])
    assert str(e.value) == ("grpo.reward_funcs[1] 'exact_match:label': reads column 'label', which the data does not "
                            "have (columns: answer, prompt): add it to the data or name another column")
    with pytest.raises(UserError) as e:
        check_reward_specs(["r.py:acc"], ["prompt"])
    assert "reads column 'solution'" in str(e.value)


def test_trls_own_reward_function_runs_unchanged_and_agrees_with_the_builtin():
    pytest.importorskip("trl.rewards")
    prompts = [[{"role": "user", "content": "q"}]] * 4
    texts = ["<think>\nwhy\n</think>\n42", "42", "<think>a</think><think>b</think>x", "<think>x</think>"]
    total, per = _score(["trl.rewards:think_format_reward", "think_format"], as_completions(prompts, texts),
                        prompts=prompts, completion_ids=[[1]] * 4, step=1)
    assert per["trl.rewards:think_format_reward"] == per["think_format"] == [1.0, 0.0, 0.0, 1.0]
    assert total == [2.0, 0.0, 0.0, 2.0]
