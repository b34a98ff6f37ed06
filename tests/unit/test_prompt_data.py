"""data.format=prompt (GRPO): string prompts rendered with data.template as SFT renders them, conversational prompts
with the chat template and the generation prompt, the other columns kept for the rewards; through validate's sample
check (data_problems) and prepare's cache build (build_data), with one-line errors naming the file and row."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.check import data_problems
from shardtune.data.prompts import PromptRows
from shardtune.errors import UserError
from shardtune.templates import render_prompt

TOK = build_char_tokenizer()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
ROWS = [{"prompt": "reverse abc", "answer": "cba", "level": 1},
        {"prompt": CHAT, "answer": "4", "level": 2},
        {"prompt": "reverse xy", "answer": "yx", "level": 3}]


def _write(tmp_path: Path, rows: list[dict], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(**{"path": str(path), "format": "prompt", "seq_len": 256, "eval_fraction": 0, **kw})


def _string_ids(text: str, template: str = "plain") -> list[int]:
    return [TOK.bos_token_id] + TOK(render_prompt(template, text), add_special_tokens=False)["input_ids"]


def _chat_ids(messages: list[dict]) -> list[int]:
    return list(TOK.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("template", ["plain", "alpaca"])
def test_prepare_stores_prompt_ids_text_and_columns(tmp_path, template):
    path = _write(tmp_path, ROWS)
    cfg = _cfg(path, template=template)
    assert data_problems(cfg, TOK) == []
    data = build_data(cfg, TOK, seed=0, output_dir=str(tmp_path / "run"))
    assert data.manifest["stats"]["train"]["prompts"] == 3 and data.manifest["stats"]["train"]["target_tokens"] == 0
    rows = PromptRows(data.entry, "train", data.manifest)
    got = sorted(rows.take(range(len(rows))), key=lambda r: r.source_row)
    assert [r.source_row for r in got] == [0, 1, 2]
    assert got[0].ids == _string_ids("reverse abc", template) and got[0].prompt == "reverse abc"
    assert got[1].ids == _chat_ids(CHAT) and got[1].prompt == CHAT  # ends with the opened assistant turn
    without = list(TOK.apply_chat_template(CHAT, tokenize=True, return_dict=False))
    assert got[1].ids[: len(without)] == without and len(got[1].ids) > len(without)  # + the generation prompt
    assert [r.columns for r in got] == [{"answer": "cba", "level": 1}, {"answer": "4", "level": 2},
                                        {"answer": "yx", "level": 3}]


def test_sharegpt_prompts_reach_the_rewards_as_openai_messages_and_aliases_are_found(tmp_path):
    rows = [{"question": [{"from": "human", "value": "hi"}], "answer": "x"}] * 2
    data = build_data(_cfg(_write(tmp_path, rows)), TOK, seed=0, output_dir=str(tmp_path / "run"))
    row = PromptRows(data.entry, "train", data.manifest).get(0)
    assert row.prompt == [{"role": "user", "content": "hi"}] and row.columns == {"answer": "x"}


def test_long_prompts_keep_their_end_and_are_warned(tmp_path):
    long = "q" * 100 + " the end"
    path = _write(tmp_path, [{"prompt": long, "answer": "a"}])
    with pytest.warns(UserWarning, match="prompts are longer than data.seq_len=32 tokens"):
        assert data_problems(_cfg(path, seq_len=32), TOK) == []
    with pytest.warns(UserWarning, match="1 prompts longer than data.seq_len=32 tokens were truncated"):
        data = build_data(_cfg(path, seq_len=32), TOK, seed=0, output_dir=str(tmp_path / "run"))
    row = PromptRows(data.entry, "train", data.manifest).get(0)
    assert row.ids == _string_ids(long)[-32:]


@pytest.mark.parametrize(("bad", "problem"), [
    (None, "missing or null: every row needs a prompt"),
    ({"text": "x"}, "holds a dict, expected text or a list of messages: map data.prompt_field to the prompt column"),
    ([], "an empty message list: give the prompt's turns"),
])
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, bad, problem):
    path = _write(tmp_path, [ROWS[0], {"prompt": bad, "answer": "1"}, ROWS[2]])
    cfg = _cfg(path)
    assert data_problems(cfg, TOK) == [f"data.path: '{path}' line 2, column 'prompt' (data.prompt_field): {problem}"]
    with pytest.raises(UserError) as e:
        build_data(cfg, TOK, seed=0, output_dir=str(tmp_path / "run"))
    assert str(e.value) == f"data.path: '{path}' row 2, column 'prompt' (data.prompt_field): {problem}"


def test_missing_prompt_column_and_mixes_are_refused(tmp_path):
    path = _write(tmp_path, [{"text": "x", "answer": "1"}])
    (problem,) = data_problems(_cfg(path), TOK)
    assert problem.startswith(f"data.format=prompt: column 'prompt' (data.prompt_field) missing from data.path "
                              f"'{path}' (columns: answer, text): set data.prompt_field=COLUMN")
    with pytest.raises(ValueError, match=r"data.path\[0\].format: GRPO prompts come from one dataset, not a mix"):
        DataConfig(path=[{"path": str(path)}, {"path": str(path)}], format="prompt")


def test_conversational_prompts_without_a_chat_template_are_one_line(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = None
    path = _write(tmp_path, [ROWS[1]])
    with pytest.raises(UserError) as e:
        build_data(_cfg(path), tok, seed=0, output_dir=str(tmp_path / "run"))
    assert str(e.value) == (f"data.path: '{path}' row 1, column 'prompt' (data.prompt_field): message-list prompts "
                            "need a chat template: set model.chat_template=chatml (or plain, or a Jinja string), or "
                            "use string prompts")


def test_prepare_report_and_show_name_the_prompts_and_reward_columns(tmp_path):
    from shardtune.data.show import MASK_CLOSE, MASK_OPEN, show_example
    from shardtune.launcher.prepare import format_report

    data = build_data(_cfg(_write(tmp_path, ROWS)), TOK, seed=0, output_dir=str(tmp_path / "run"))
    assert data.manifest["reward_columns"] == ["answer", "level"]
    report = format_report(data, seconds=0.0).splitlines()
    assert report[1] == "source rows: 3 -> prompts: 3 train, 0 eval; columns for the reward functions: answer, level"
    tokens = len(_string_ids("reverse abc")) + len(_chat_ids(CHAT)) + len(_string_ids("reverse xy"))
    assert report[3] == (f"tokens: {tokens:,} train, 0 eval (prompts, no targets: completions are sampled); stored "
                         "as uint16")
    assert report[4] == "truncated prompts (longer than data.seq_len=256, each keeps its end): 0 (train 0, eval 0)"
    shown = show_example(data, TOK, 1).splitlines()
    assert shown[0] == "example 1: row 1 of 3 (counting from 0), in the train split"
    assert shown[2] == MASK_OPEN + TOK.decode(_chat_ids(CHAT)) + MASK_CLOSE
    assert shown[-1] == 'columns for the reward functions: {"answer": "4", "level": 2}'


def test_reward_columns_are_every_column_but_the_prompt(tmp_path):
    from shardtune.data.check import reward_columns
    from shardtune.trainer.rewards import check_reward_specs

    path = _write(tmp_path, [{"question": "2+2?", "answer": "4", "level": 1}])  # `question` is read as the prompt
    assert reward_columns(_cfg(path)) == ["answer", "level"]
    with pytest.raises(UserError, match=r"grpo.reward_funcs\[0\] 'exact_match:question': reads column 'question'"):
        check_reward_specs(["exact_match:question"], reward_columns(_cfg(path)))
