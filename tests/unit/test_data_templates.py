"""Prompt and chat templates (templates.py): what the model is trained on and later asked with."""
from __future__ import annotations

import pytest

from shardtune.data.char_tokenizer import build_char_tokenizer
from shardtune.templates import (
    PROMPT_TEMPLATES,
    chat_template_source,
    check_prompt_template,
    render_chat,
    render_prompt,
    resolve_chat_template,
)

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("name", sorted(PROMPT_TEMPLATES))
def test_bundled_prompt_templates_separate_prompt_from_response(name):
    for text in (render_prompt(name, "Name a fruit"), render_prompt(name, "Name a fruit", "red")):
        assert "Name a fruit" in text and text.endswith("\n")  # the response never follows the prompt directly
    assert "red" in render_prompt(name, "Name a fruit", "red") and "red" not in render_prompt(name, "Name a fruit")


def test_custom_template_gets_a_separator_and_keeps_braces():
    assert render_prompt("Q: {prompt}", "x") == "Q: x\n"
    assert render_prompt("Q: {prompt} A:", "x") == "Q: x A:"
    assert render_prompt("{prompt} [{input}] =>", '{"a": 1}', "y") == '{"a": 1} [y] =>'
    assert render_prompt("Q: {prompt} A:", "x", "y") == "Q: x\n\ny A:"  # no {input}: it follows the prompt
    assert render_prompt("plain", "P", "use {prompt} here") == "P\n\nuse {prompt} here\n"  # data is never re-filled
    assert render_prompt("{prompt} [{input}] =>", "x") == "x [] =>"  # a row without input leaves no placeholder
    assert check_prompt_template("no placeholder") is not None and check_prompt_template("alpaca") is None


def test_chat_template_by_name_or_jinja_renders_like_hf():
    tok = build_char_tokenizer()
    tok.chat_template = chat_template_source("chatml")
    assert render_chat(MESSAGES, "chatml") == tok.apply_chat_template(MESSAGES, tokenize=False)
    assert render_chat(MESSAGES[:2], "chatml", add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    jinja = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    assert render_chat(MESSAGES, jinja) == "be brief|hi|yo|"
    with pytest.raises(ValueError, match="chatml"):
        chat_template_source("nosuch")
    assert resolve_chat_template("own", None) == "own" and resolve_chat_template(None, None) is None
    assert resolve_chat_template("own", "chatml") == chat_template_source("chatml")  # an explicit setting wins
