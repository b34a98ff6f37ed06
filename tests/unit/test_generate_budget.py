"""`generate`/`chat` stay within the positions the model was built for (max_position_embeddings, 512 for the tiny
Llama): a budget past them is clamped, with one warning a session (a random tiny model decoded a 100,000-token
budget for minutes past its positions); a prompt that fills them is one line, and a chat session goes on after it."""
from __future__ import annotations

import io

import pytest

from shardtune.errors import UserError
from shardtune.launcher.generate import Sampling, chat_loop, complete, new_tokens
from tests.unit.test_generate_turn_end import loaded


def test_a_budget_past_the_positions_is_clamped_with_one_warning(capsys):
    run, s = loaded("instruction", "plain"), Sampling(max_new_tokens=100_000)
    assert new_tokens(run, 500, s) == 12 and new_tokens(run, 10, s) == 502
    assert capsys.readouterr().err.count("warning: --max-new-tokens 100,000 goes past the model's 512 positions") == 1
    assert new_tokens(run, 500, Sampling(max_new_tokens=12)) == 12  # within: untouched, silent
    assert capsys.readouterr().err == ""
    with pytest.raises(UserError, match="the prompt is 512 tokens and the model reads at most 512"):
        new_tokens(run, 512, s)


def test_a_reply_stops_at_the_last_position():
    run = loaded("instruction", "plain")
    text = "x" * 505  # one character a token (builtin:char), plus the template's
    prompt = len(run.tok(text, add_special_tokens=False)["input_ids"])
    reply = complete(run, text, Sampling(max_new_tokens=100_000))
    assert len(run.tok(reply, add_special_tokens=False)["input_ids"]) <= 512 - prompt


def test_a_chat_goes_on_after_a_prompt_too_long(capsys):
    run = loaded("instruction", "plain")
    out = io.StringIO()
    chat_loop(run, Sampling(max_new_tokens=2), stdin=io.StringIO("x" * 600 + "\nabc\n"), stdout=out)
    assert "the prompt is" in capsys.readouterr().err
    assert len(out.getvalue().splitlines()) == 1  # the second line's reply
