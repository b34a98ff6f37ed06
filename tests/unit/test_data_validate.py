"""`validate` reads the data: every problem from the "first try" report is one line naming file, line or key, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.sample import read_sample
from shardtune.errors import UserError
from tests.unit.cli_helpers import run_cli

TOK = build_char_tokenizer()
ALPACA = [{"instruction": f"Name fruit {i}", "input": "" if i % 2 else "red", "output": "apple"} for i in range(30)]


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def _files(tmp_path: Path) -> dict[str, Path]:
    files = {"empty.jsonl": "", "blank.txt": "\n\n", "alpaca.jsonl": _jsonl(ALPACA),
             "truncated.jsonl": _jsonl(ALPACA[:9]) + _jsonl(ALPACA[9:])[:30] + "\n" + _jsonl(ALPACA[10:]),
             "not_object.jsonl": _jsonl(ALPACA[:2]) + "[1, 2]\n",
             "null_output.jsonl": _jsonl(ALPACA[:3] + [{"instruction": "x", "output": None}]),
             "latin1.txt": None}
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / name
        if text is None:
            out[name].write_bytes("caf\xe9\n".encode("latin-1"))
        else:
            out[name].write_text(text)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text(_jsonl(ALPACA))
    (tmp_path / "mixed" / "b.txt").write_text("a line\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    return out


# (overrides relative to tmp_path, what the one line must contain)
CASES = [
    (["data.path=empty.jsonl"], ["empty.jsonl' is empty"]),
    (["data.path=blank.txt", "data.format=text"], ["blank.txt' is empty"]),
    (["data.path=truncated.jsonl", "data.format=instruction"], ["truncated.jsonl' line 10, column", "invalid JSON"]),
    (["data.path=not_object.jsonl"], ["line 3", "JSON object"]),
    (["data.path=null_output.jsonl"], ["line 4, column 'output' (data.response_field)", "null"]),
    (["data.path=latin1.txt", "data.format=text"], ["latin1.txt' line 1", "UTF-8"]),
    (["data.path=mixed"], ["mixes file types (.jsonl, .txt)", "as a mix"]),
    (["data.path=alpaca.jsonl", "data.format=text"], ["'text' (data.text_field)", "data.prompt_field",
                                                       "columns: input, instruction, output"]),
    (["data.path=alpaca.jsonl", "data.format=chat"], ["data.messages_field"]),
    (["data.path=alpaca.jsonl", "data.response_field=answer"], ["'answer' (data.response_field)"]),
    (["data.path=alpaca.jsonl", "data.seq_len=100000"], ["data.seq_len=100000", "max_position_embeddings=512"]),
    (["data.path=alpaca.jsonl", "train.warmup_steps=300"], ["train.warmup_steps=300 >= train.max_steps=300"]),
    (["data.path=alpaca.jsonl", "data.seq_len=16", "data.template=alpaca"], ["has a target token within data.seq_len=16"]),
    (["data.path=alpaca.jsonl", "data.template=nothing"], ["override data.template=nothing", "{prompt}"]),
    (["data.path=alpaca.jsonl", "model.chat_template=nosuch"], ["model.chat_template", "chatml", "Jinja"]),
    (["data.path=alpaca.jsonl", "data.chat_style=gpt"], ["data.chat_style", "sharegpt"]),
    (["data.path=alpaca.jsonl", "train.epochs=2"], ["train.epochs", "train.max_steps", "null"]),
    (["data.path=alpaca.jsonl", "model.path=model", "model.config=null", "model.tokenizer=builtin:char"],
     ["model.path", "config"]),
]


@pytest.mark.parametrize("overrides,needles", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_data_problem_is_one_line_exit_2(tmp_path, monkeypatch, capsys, overrides, needles):
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["validate", "tiny-cpu", *overrides], capsys)
    lines = _errors(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_good_data_validates(tmp_path, monkeypatch, capsys):
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["validate", "tiny-cpu", "data.path=alpaca.jsonl", "data.template=alpaca",
                              "data.seq_len=512"], capsys)
    assert code == 0 and out.startswith("ok: tiny-cpu"), err


def test_several_problems_one_line_each(tmp_path, monkeypatch, capsys):
    files = _files(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    for name in ("empty.jsonl", "truncated.jsonl", "alpaca.jsonl"):
        (folder / name).write_text(files[name].read_text())
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["validate", "tiny-cpu", "data.path=folder", "train.warmup_steps=400",
                            "train.max_steps=10"], capsys)
    lines = _errors(err)
    assert code == 2 and len(lines) == 3, err
    assert "warmup" in lines[0] and "empty.jsonl" in lines[1] and "truncated.jsonl' line 10" in lines[2]


def test_sample_reads_only_the_head_of_a_big_file(tmp_path):
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        f.write(_jsonl(ALPACA) * 2000)  # ~4.7 MB: more than one sample; the cut line at the end is not an error
        f.write("{broken\n")  # past the sample: `prepare` finds it, validate's sample does not read it
    sample = read_sample(big)
    assert len(sample.rows) == 64 and sample.rows[0] == (1, ALPACA[0])
    with pytest.raises(UserError, match=r"big.jsonl' line 60001, column 2: invalid JSON"):  # the load names it
        build_data(DataConfig(path=str(big), format="instruction", cache_dir=str(tmp_path / "c")), TOK, seed=0)
    array = tmp_path / "array.json"
    array.write_text(json.dumps(ALPACA[:3], indent=2))
    rows = read_sample(array).rows
    assert [r for _, r in rows] == ALPACA[:3] and rows[1][0] == 7  # line numbers of a pretty-printed array
    with pytest.raises(UserError, match="line 1, column"):
        (tmp_path / "bad.json").write_text('[{"a": 1,]')
        read_sample(tmp_path / "bad.json")


def test_recipe_file_errors_point_at_the_line_or_the_command_line(tmp_path, capsys):
    tab = tmp_path / "tab.yaml"
    tab.write_text("train:\n\tlr: 1\n")
    code, _, err = run_cli(["validate", str(tab)], capsys)
    assert code == 2 and "line 2, column 1" in err and "tabs" in err and len(_errors(err)) == 1, err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  config: configs/models/tiny-llama.json\ndata:\n  path: builtin:reverse\n")
    code, _, err = run_cli(["validate", str(recipe), "train.lr=-1"], capsys)
    assert code == 2 and err.startswith("error: override train.lr=-1: train.lr: must be > 0"), err
    assert str(recipe) not in err
    recipe.write_text(recipe.read_text() + "train:\n  lr: -1\n")  # the same value in the file: the file is named
    code, _, err = run_cli(["validate", str(recipe)], capsys)
    assert code == 2 and str(recipe) in err and "train.lr" in err, err
