"""TRL's two dataset layouts without the usual column, against TRL 1.16 itself: conversational prompt/completion for
SFT (the loss on the completion only, whatever the prompt holds) and preference rows with an implicit prompt (the
turns chosen and rejected share). `prepare` takes both files (through `main()`; the installed executable's one line:
tests/integration/test_installed_executable.py)."""
from __future__ import annotations

import json

import pytest

from shardtune.config.schema import DataConfig
from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.data.fields import resolve_fields
from shardtune.data.formats import IGNORE, encode_batch
from shardtune.data.pair_encoding import encode_pair, split_shared_prompt
from shardtune.templates import CHAT_TEMPLATES
from tests.unit.cli_helpers import run_cli

trl_data = pytest.importorskip("trl.data_utils")


def chatml_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    return tok


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


PROMPT_COMPLETION = [
    {"prompt": [msg("system", "be short"), msg("user", "hi"), msg("assistant", "hello"), msg("user", "sky?")],
     "completion": [msg("assistant", "blue")]},
    {"prompt": [msg("user", "2+2?")], "completion": [msg("assistant", "4")]},
]
IMPLICIT = [
    {"chosen": [msg("user", "sky?"), msg("assistant", "blue")],
     "rejected": [msg("user", "sky?"), msg("assistant", "green")]},
    {"chosen": [msg("system", "s"), msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")],
     "rejected": [msg("system", "s"), msg("user", "a"), msg("assistant", "b"), msg("user", "c"),
                  msg("assistant", "e"), msg("user", "f"), msg("assistant", "g")]},
]


def test_prompt_completion_trains_on_the_completion_as_trl_renders_it():
    tok = chatml_tokenizer()
    cfg = resolve_fields(DataConfig(format="chat", path="x.jsonl"), ["prompt", "completion"])
    encoded = encode_batch({k: [r[k] for r in PROMPT_COMPLETION] for k in ("prompt", "completion")}, cfg, tok)
    for row, (ids, labels) in zip(PROMPT_COMPLETION, encoded):
        text = trl_data.apply_chat_template(row, tok)  # {"prompt": str, "completion": str}
        prompt_ids = tok(text["prompt"], add_special_tokens=False)["input_ids"]
        assert ids == tok(text["prompt"] + text["completion"], add_special_tokens=False)["input_ids"]
        assert labels == [IGNORE] * len(prompt_ids) + ids[len(prompt_ids):]
        assert tok.decode([t for t in labels if t != IGNORE]) == text["completion"]  # not the prompt's assistant turn


def test_implicit_prompt_is_the_shared_opening_as_trl_extracts_it():
    tok = chatml_tokenizer()
    cfg = resolve_fields(DataConfig(format="preference", path="x.jsonl"), ["chosen", "rejected"])
    assert cfg.prompt_field == ""
    explicit = DataConfig(format="preference", path="x.jsonl")
    for row in IMPLICIT:
        trl_row = trl_data.extract_prompt(row)
        assert split_shared_prompt(row["chosen"], row["rejected"]) == (trl_row["prompt"], trl_row["chosen"],
                                                                        trl_row["rejected"])
        assert encode_pair(row, cfg, tok) == encode_pair(trl_row, explicit, tok)


def test_prepare_takes_both_layouts_and_refuses_pairs_with_nothing_shared(tmp_path, capsys):
    def args(rows: list[dict], *extra: str) -> list[str]:
        path = tmp_path / "rows.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return ["prepare", *extra, f"data.path={path}", "model.chat_template=chatml", "data.eval_fraction=0",
                f"train.output_dir={tmp_path / 'run'}"]

    code, out, err = run_cli(args(PROMPT_COMPLETION * 4, "tiny-cpu", "data.format=chat"), capsys)  # in-process
    assert code == 0 and "format: chat (prompt=prompt, response=completion" in out, err[-2000:]
    code, out, err = run_cli(args(IMPLICIT * 4, "tiny-dpo-cpu"), capsys)
    assert code == 0 and "preference pairs: 8 train" in out, err[-2000:]
    unrelated = {"chosen": [msg("user", "a"), msg("assistant", "b")], "rejected": [msg("user", "c")]}
    code, _, err = run_cli(args([unrelated] * 2, "tiny-dpo-cpu"), capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "share no opening turn" in lines[0], err
