"""`validate` samples token lengths (data/lengths.py): rows data.seq_len would cut are one warning with their count,
how many lose trained tokens, and the fix; nothing for rows that fit or for data.long_docs=split. Through the
installed executable: tests/integration/test_data_tools.py."""
from __future__ import annotations

import warnings

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.check import data_problems
from shardtune.data.formats import encode_batch, encode_row
from shardtune.data.lengths import long_rows_warning
from tests.unit.test_data_formats import TOOL_CHAT, TOOL_TEMPLATE

TOK = build_char_tokenizer()


def _tool_rows(n: int, long_every: int = 2) -> list[dict]:
    """Issue 59's tool-call chats: a long tool output puts the final answer past data.seq_len in every other row."""
    out = []
    for i in range(n):
        turns = [dict(t) for t in TOOL_CHAT]
        turns[2]["content"] = "x" * (400 if i % long_every == 0 else 10)
        out.append({"messages": turns})
    return out


def _warning(cfg: DataConfig, rows: list[dict], tok=TOK) -> str | None:
    encoded = encode_batch({k: [r[k] for r in rows] for k in rows[0]}, cfg, tok)
    return long_rows_warning(cfg, rows, encoded, tok, "'d.jsonl'")


def test_tool_call_rows_cut_past_the_final_answer_are_counted():
    tok = build_char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    rows = _tool_rows(20)
    assert len(encode_row(rows[0], DataConfig(format="chat"), tok)[0]) == 466  # the long rows' tokens
    msg = _warning(DataConfig(format="chat", seq_len=256), rows, tok)
    assert msg == ("data.path 'd.jsonl': 10 of the first 20 rows are longer than data.seq_len=256 tokens (longest "
                   "466); 10 of them have trained tokens past it (e.g. a final answer) that would not be trained on "
                   "(data.long_docs=truncate keeps a row's first 256 tokens): raise data.seq_len, or set "
                   "data.long_docs=split to train on every token in pieces (`shardtune prepare` counts every row)")
    assert _warning(DataConfig(format="chat", seq_len=512), rows, tok) is None  # every row fits
    assert _warning(DataConfig(format="chat", seq_len=256, long_docs="split"), rows, tok) is None  # nothing is lost


def test_a_long_prompt_cut_before_its_response_and_preference_pairs():
    rows = [{"prompt": "p" * 100, "response": "r"}, {"prompt": "short", "response": "r"}]
    msg = _warning(DataConfig(format="instruction", seq_len=64), rows)
    assert msg.startswith("data.path 'd.jsonl': 1 of the first 2 rows are longer than data.seq_len=64 tokens "
                          "(longest 104); 1 of them have trained tokens past it"), msg
    pairs = [{"prompt": "q" * 20, "chosen": "c" * 60, "rejected": "r"}, {"prompt": "q", "chosen": "c", "rejected": "r"}]
    msg = _warning(DataConfig(format="preference", seq_len=64), pairs)
    assert "1 of the first 2 rows are longer than data.seq_len=64 tokens (longest 83); 1 of them" in msg, msg
    assert "a pair keeps its prompt's end" in msg and msg.endswith(": raise data.seq_len (`shardtune prepare` counts "
                                                                  "every row)")


def test_validate_warns_once_per_file_and_still_passes(tmp_path):
    import json

    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _tool_rows(40)))
    tok = build_char_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert data_problems(DataConfig(path=str(path), format="chat", seq_len=256), tok) == []
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1 and "20 of the first 40 rows are longer than data.seq_len=256" in texts[0], texts


@pytest.mark.parametrize("fmt", ["text", "instruction"])
def test_rows_that_fit_say_nothing(fmt):
    rows = [{"text": "abc", "prompt": "a", "response": "b"}] * 3
    assert _warning(DataConfig(format=fmt, seq_len=8), rows) is None
