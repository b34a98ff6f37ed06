"""`prepare --show N` (data/show.py): example N as the cache stores it, masked tokens between « », trained ones bare,
with each span's token count; preference pairs, cut documents, a mix and a number out of range. Through the
installed executable: tests/integration/test_data_tools.py."""
from __future__ import annotations

import json

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data import build_data
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.show import show_example
from shardtune.errors import UserError

TOK = build_char_tokenizer()
ROWS = [{"prompt": f"say {w}", "response": w} for w in ("alpha", "beta", "gamma", "delta")]


def _data(tmp_path, rows, **cfg):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_data(DataConfig(path=str(path), eval_fraction=0.0, **cfg), TOK, seed=0, output_dir=str(tmp_path))


def test_an_instruction_row_shows_its_masked_prompt_and_trained_response(tmp_path):
    data = _data(tmp_path, ROWS, format="instruction", seq_len=64)
    # <s> + "say gamma\n" (10) masked; "gamma" + </s> (6) trained
    assert show_example(data, TOK, 2) == "\n".join([
        "example 2: row 2 of 4 (counting from 0), in the train split",
        "document: 17 tokens: 6 trained, 11 masked (no loss, between « »)",
        "«<s>say gamma\n»gamma</s>",
        "spans (token positions): masked 0-10 (11), trained 11-16 (6)"])


def test_a_cut_document_says_how_much_and_a_text_row_masks_its_first_token(tmp_path):
    data = _data(tmp_path, [{"text": "x" * 30}], format="text", seq_len=16)
    lines = show_example(data, TOK, 0).splitlines()
    # 32 tokens (<s>, 30 x, </s>) cut to 16: the first token is never a target (no prediction across documents)
    assert lines[1] == ("document: 16 tokens: 15 trained, 1 masked (no loss, between « »); 16 more tokens past "
                        "data.seq_len=16 were cut off")
    assert lines[2] == "«<s>»" + "x" * 15


def test_a_pair_shows_chosen_and_rejected_with_the_template(tmp_path):
    rows = [{"prompt": "sky?", "chosen": "blue", "rejected": "green"}, {"prompt": "a", "chosen": "b", "rejected": "b"}]
    data = _data(tmp_path, rows, format="preference", seq_len=64, template="Q: {prompt} A:")
    lines = show_example(data, TOK, 0).splitlines()
    assert lines[0] == ("example 0: pair 0 of the 1 kept (counting from 0; 1 dropped: chosen identical to rejected), "
                        "in the train split")
    assert lines[2] == "«<s>Q: sky? A:»blue</s>" and lines[5] == "«<s>Q: sky? A:»green</s>"
    assert lines[1].startswith("chosen: 16 tokens: 5 trained, 11 masked")
    with pytest.raises(UserError, match=r"prepare --show 1: the data has 1 examples: give one of 0 to 0"):
        show_example(data, TOK, 1)


def test_a_mix_counts_its_datasets_rows_in_order(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name, rows in (("a", ROWS[:2]), ("b", ROWS[2:])):
        (tmp_path / name / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=[{"path": str(tmp_path / "a" / "d.jsonl")}, {"path": str(tmp_path / "b" / "d.jsonl")}],
                     format="instruction", seq_len=64, eval_fraction=0.0)
    data = build_data(cfg, TOK, seed=0, output_dir=str(tmp_path))
    lines = show_example(data, TOK, 3).splitlines()
    assert lines[0] == "example 3: dataset 2 of 2, row 1 of 2 (counting from 0), in the train split"
    assert lines[2:4] == ["«<s>say delta", "»delta</s>"]
